"""The embedded default models: they load from checkpoints/, stay exact, accept well, and export to HF formats."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.params import named_leaves
from dflash_jax.train import corpus


@pytest.fixture(scope="module")
def default():
    target, drafter, tok = dj.load_default()
    prompts = [tok.encode(t) for t in corpus.held_out_prompts(3, seed=7)]
    return target, drafter, tok, prompts


def test_shipped_files_and_size():
    from dflash_jax.io.shipped import checkpoints_dir
    root = checkpoints_dir()
    for part in ("tokenizer.json", "target/dflash_jax.json", "drafter/dflash_jax.json", "README.md",
                 "target/train_report.json", "drafter/train_report.json"):
        assert (root / part).exists(), part
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert size < 50 * 2 ** 20, size


def test_default_pair_matches(default):
    target, drafter, tok, _ = default
    assert tok.vocab_size == target.config.vocab_size
    assert drafter.config.mask_token_id == tok.mask_id
    assert drafter.config.block_size == 16
    assert 5e6 <= sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target.params)) <= 8e6


def test_default_generation_is_exact_and_accepts(default):
    target, drafter, tok, prompts = default
    kw = dict(max_new_tokens=64, eos_ids=(tok.eos_id,))
    ar = dj.generate_autoregressive(target, prompts, **kw)
    sp = dj.generate(target, drafter, prompts, **kw)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    # tau is a corruption detector (wrong taps, positions or scales drive it to ~1): keep a floor
    assert sp.tau > 2.0, sp.tau
    assert tok.decode(sp.token_lists()[0])  # decodes to text


@pytest.fixture(scope="module")
def drafter2():
    return dj.load_default(drafter="dflash2")[1]


def test_shipped_dflash2_drafter_is_exact_and_accepts(default, drafter2):
    """checkpoints/drafter2: the DFlash2 drafter for the same target (load_default(drafter="dflash2"))."""
    from dflash_jax.io.shipped import checkpoints_dir
    assert (checkpoints_dir() / "drafter2" / "train_report.json").exists()
    target, drafter, tok, prompts = default
    assert drafter2.config.kind == "dflash2" and drafter2.config.block_size == 16
    assert drafter2.config.target_layer_ids == drafter.config.target_layer_ids
    kw = dict(max_new_tokens=64, eos_ids=(tok.eos_id,))
    ar = dj.generate_autoregressive(target, prompts, **kw)
    sp = dj.generate(target, drafter2, prompts, **kw)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    assert sp.tau > 2.0, sp.tau  # a corruption detector, as for the DFlash drafter


def test_shipped_nvfp4_dflash2_audit_on_real_features(default, drafter2):
    """The shipped DFlash2 drafter, NVFP4, on real target features: every scale reaches the proposal (logits and
    selector scores; fc's tensor scale only through hidden_norm's eps, see audit.py), and dropping only the conv and
    selector tensor scales is named exactly."""
    from dflash_jax.models.drafter import draft_proposal
    from dflash_jax.quant.quantize import DFLASH2_PROJECTIONS, ablated_forward
    target, _, _, prompts = default
    q = dj.quantize_nvfp4(drafter2)
    ids = prompts[0][:24]
    _, feats = dj.target_forward(target, np.asarray([ids], np.int32), layer_ids=q.config.target_layer_ids)
    feats = np.asarray(feats)[:, :-1]
    block = np.full((1, q.config.block_size), q.config.mask_token_id, np.int32)
    block[0, 0] = ids[-1]

    def fwd(p, f, b):
        return draft_proposal(target, q.replace(params=p), f, b)

    audit = dj.audit_scales(fwd, q.params, feats, block)
    assert audit.ok, str(audit)
    # The ablated forward's outputs differ, so a localizing audit would run one op-by-op forward per NVFP4 leaf (20
    # here) to name the leaves; what is checked is which scales stop reaching the output, computed the same way
    # without it (test_audit.py: localize=False leaves `missing` unchanged; naming leaves is tested there).
    ablated = dj.audit_scales(ablated_forward(fwd, DFLASH2_PROJECTIONS), q.params, feats, block, localize=False)
    assert set(ablated.missing) == {f"layers[{i}].{c}.kernel_projection: global_scale" for i in range(2)
                                    for c in ("attention_conv", "mlp_conv")} | {
        "candidate_selector.hidden_projection: global_scale"}, str(ablated)


def test_hf_export_round_trip_and_transformers_parity(default, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    target, drafter, _, prompts = default
    dj.save_hf(tmp_path / "target", target)
    dj.save_hf(tmp_path / "drafter", drafter)
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.config.target_layer_ids)
    t2, d2 = dj.load_target(tmp_path / "target"), dj.load_drafter(tmp_path / "drafter")
    for a, b in ((target, t2), (drafter, d2)):
        for (n, x), y in zip(named_leaves(a.params).items(), named_leaves(b.params).values()):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=n)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32,
                                                       attn_implementation="eager")
    toks = np.asarray([prompts[0][:24]])
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.numpy()
    out, _ = dj.target_forward(target, toks)
    assert np.abs(np.asarray(out) - ref).max() <= 1e-4 * np.abs(ref).max()


def test_smollm2_drafter_is_stored_in_bfloat16():
    """checkpoints/smollm2/drafter (the default drafter) is stored in bfloat16 to keep checkpoints/ small, and loads
    on CPU as float32 holding exactly those bfloat16 values (checkpoints/README.md)."""
    from dflash_jax.io.shipped import checkpoints_dir
    folder = checkpoints_dir() / "smollm2" / "drafter"
    report = json.loads((folder / "train_report.json").read_text())
    assert report["command"].startswith("dflash-jax train-drafter --chat --target smollm2")
    assert json.loads((folder / "dflash_jax.json").read_text())["config"]["model"]["param_dtype"] == "bfloat16"
    drafter = dj.load_drafter(folder)
    assert drafter.config.block_size == 8 and drafter.config.num_target_layers == 30
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(drafter.params)) == report["params"]
    for leaf in jax.tree.leaves(drafter.params):
        x = np.asarray(leaf)
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, x.astype(jnp.bfloat16).astype(np.float32))