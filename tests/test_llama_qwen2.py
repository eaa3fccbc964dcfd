"""Llama, Qwen2 (and Mistral) targets: the one target with the family's switches (no q/k norm; Qwen2's q/k/v
biases; tied or untied head; Llama 3's RoPE scaling), against transformers 4.57.

HF oracle: tiny random `LlamaForCausalLM` / `Qwen2ForCausalLM` / `MistralForCausalLM` (torch CPU float32, eager
attention) written with `save_pretrained` and read by `dj.load_target`, so the HF loading path is what every case
exercises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.config import DrafterConfig, check_pair
from dflash_jax.io.hf_config import target_config_from_hf, target_config_to_hf
from dflash_jax.io.zlab_config import drafter_config_from_hf
from dflash_jax.models.layers import rope_inv_freq
from dflash_jax.params import named_leaves
from dflash_jax.parallel import sharding as S
from random_models import make_drafter
from dflash_jax.bench.mesh import xla_flags_with_devices

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
V = 96
NEW_TOKENS = 48
LOGIT_TOL = 2e-3  # max abs logit difference (observed ~1e-5)

CASES = {
    # name: (family, HF config overrides)
    "llama_tied_gqa4-2": ("llama", dict(tie_word_embeddings=True)),
    "llama_untied_gqa4-1_llama3rope": ("llama", dict(
        num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2_tied_gqa4-2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_untied_gqa4-1": ("qwen2", dict(num_key_value_heads=1)),
    "mistral_untied_gqa4-2": ("mistral", dict(sliding_window=None)),  # Llama's layers; the window must be off
}


def hf_model(family: str, seed: int = 0, **overrides):
    """A random HF model whose weights give O(1) activations (the std-0.02 init makes every layer ~identity), with
    norm weights away from 1 and, for Qwen2, non-zero biases (HF initialises them to zero)."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rope_theta=100_000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              attn_implementation="eager")
    kw.update(overrides)
    cls, cfg_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig)}[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5 * (3.0 if "embed" in name else 1.0))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: (HF model, folder written by save_pretrained)}."""
    out = {}
    for i, (name, (family, overrides)) in enumerate(CASES.items()):
        model = hf_model(family, seed=i, **overrides)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def load(folder) -> dj.Target:
    return dj.load_target(folder, param_dtype="float32", compute_dtype="float32")


# -- parity -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_features_match_transformers(folders, case):
    model, folder = folders[case]
    family, overrides = CASES[case]
    target = load(folder)
    cfg = target.config
    assert (cfg.model_type, cfg.qk_norm, cfg.attention_bias) == (family, False, family == "qwen2")
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert (target.params.lm_head is None) == cfg.tie_word_embeddings
    attn = target.params.layers[0].self_attn
    assert attn.q_norm is None and attn.k_norm is None
    assert hasattr(attn, "q_bias") == (family == "qwen2")
    tokens = np.random.default_rng(1).integers(0, V, (2, 40))  # 40 positions: past llama3's medium band
    layer_ids = (0, 1)  # HF's last hidden_states entry (layer 2's) is after the final norm
    logits, feats = dj.target_forward(target, tokens, layer_ids)
    chex.assert_shape(feats, (2, 40, 2 * cfg.hidden_size))
    with torch.no_grad():
        ref = model(torch.tensor(tokens), output_hidden_states=True)
    diff = float(np.abs(np.asarray(logits) - ref.logits.numpy()).max())
    print(f"\n[{case}] max |logits - HF| = {diff:.2e} (max |HF| {float(ref.logits.abs().max()):.2f})")
    assert diff <= LOGIT_TOL
    H = cfg.hidden_size
    for j, L in enumerate(layer_ids):  # feature id L is HF hidden_states[L + 1]
        np.testing.assert_allclose(np.asarray(feats[..., j * H:(j + 1) * H]), ref.hidden_states[L + 1].numpy(),
                                   atol=1e-4, rtol=0)


# Untied heads: a tiny random tied model greedily repeats one token (logits = its own embedding's echo), which would
# leave the comparisons below nothing to catch; ties are covered by the logits parity above.
DECODE_CASES = ["llama_untied_gqa4-1_llama3rope", "qwen2_untied_gqa4-1"]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_greedy_tokens_match_transformers_generate(folders, case):
    model, folder = folders[case]
    target = load(folder)
    prompts = np.random.default_rng(2).integers(0, V, (2, 7))
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompts), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(prompts.shape, dtype=torch.long))
    ref_new = ref[:, prompts.shape[1]:].numpy()
    assert ref_new.shape == (2, NEW_TOKENS)
    ours = dj.generate_autoregressive(target, prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(ours.tokens, ref_new)
    assert min(len(set(row.tolist())) for row in ref_new) > 3  # not a constant run: something to catch


@pytest.mark.parametrize("case", DECODE_CASES)
def test_greedy_speculative_equals_autoregressive(folders, case):
    """A random DFlash drafter (Qwen3 layers, as z-lab's for every target family) on a Llama / Qwen2 target: greedy
    speculative tokens == greedy autoregressive tokens."""
    target = load(folders[case][1])
    dcfg = DrafterConfig(model=target.config.drafter_stack(1), block_size=4, mask_token_id=V - 1,
                         target_layer_ids=(0, 2), num_target_layers=3)
    assert dcfg.model.qk_norm and not dcfg.model.attention_bias and dcfg.model.model_type == "qwen3"
    check_pair(dcfg, target.config)
    drafter = make_drafter(dcfg, seed=3)
    prompts = [[5, 17, 3, 60, 2, 9, 11], [40, 41, 7]]  # ragged rows
    spec = dj.generate(target, drafter, prompts, max_new_tokens=NEW_TOKENS)
    ar = dj.generate_autoregressive(target, prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    assert (spec.num_tokens == NEW_TOKENS).all()
    assert min(len(set(row.tolist())) for row in ar.tokens) > 3


# -- RoPE ---------------------------------------------------------------------------------------------------------

LLAMA3_ROPES = {
    "llama3.1-8b": dict(head_dim=128, rope_theta=500_000.0, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3.2-1b": dict(head_dim=64, rope_theta=500_000.0, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny_all_bands": dict(head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                           rope_scaling={"type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                         "high_freq_factor": 16.0, "original_max_position_embeddings": 1024}),
}


@pytest.mark.parametrize("case", list(LLAMA3_ROPES))
def test_llama3_rope_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = dict(vocab_size=V, hidden_size=4 * LLAMA3_ROPES[case]["head_dim"], intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, **LLAMA3_ROPES[case])
    hf_cfg = transformers.LlamaConfig(**kw)
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert attention_factor == 1.0  # nothing but the frequencies to match
    cfg = target_config_from_hf(hf_cfg.to_dict())
    assert cfg.rope_type == "llama3"
    ours = np.asarray(rope_inv_freq(cfg))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=0)
    base = np.asarray(rope_inv_freq(cfg.replace(rope_type="default", rope_scaling_factor=1.0)))
    assert (ours < base).any() and (ours == base).any()  # some bands stretched, some kept
    if case == "tiny_all_bands":  # and some blended: strictly between the two
        assert ((ours > base / 4.0 * (1 + 1e-6)) & (ours < base * (1 - 1e-6))).any()
    # Both layouts read the same: `rope_scaling` + top-level `rope_theta` (transformers 4.x) and `rope_parameters`
    # holding rope_theta (5.x); the one this transformers wrote is rewritten as the other.
    d = hf_cfg.to_dict()
    if "rope_scaling" in d and d["rope_scaling"]:
        params = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
        assert target_config_from_hf({**d, "rope_parameters": params}) == cfg
    else:
        params = dict(d.pop("rope_parameters"))
        d.pop("rope_scaling", None)
        theta = params.pop("rope_theta")
        assert target_config_from_hf({**d, "rope_scaling": params, "rope_theta": theta}) == cfg
    # And the config writes it back.
    assert target_config_from_hf(target_config_to_hf(cfg)) == cfg


# -- config keys --------------------------------------------------------------------------------------------------

def _llama_dict(**changes) -> dict:
    d = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2).to_dict()
    d.update(changes)
    return d


BAD_CONFIGS = {
    "attention_bias": (dict(attention_bias=True), NotImplementedError, "attention_bias=true.*'llama'.*o_proj"),
    "mlp_bias": (dict(mlp_bias=True), NotImplementedError, "mlp_bias=true"),
    "hidden_act": (dict(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
    "rope_type": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), NotImplementedError,
                  "rope_scaling.rope_type 'yarn'"),
    "llama3_missing": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
                       ValueError, "rope_scaling.low_freq_factor is required"),
    "rope_parameters": (dict(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                        NotImplementedError, "rope_parameters.rope_type 'dynamic'"),
    "partial_rotary_factor": (dict(partial_rotary_factor=0.5), NotImplementedError, "partial_rotary_factor"),
    "model_type": (dict(model_type="gemma"), NotImplementedError, "model_type 'gemma' is not supported"),
    "mistral_window": (dict(model_type="mistral", sliding_window=4096), NotImplementedError,
                       "sliding_window=4096 is not supported for mistral"),
    "mistral_default_window": (dict(model_type="mistral"), NotImplementedError,  # absent = HF's default, 4096
                               "sliding_window=4096"),
    "layer_types": (dict(layer_types=["full_attention", "sliding_attention"]), NotImplementedError,
                    "layer_types"),
    "qwen2_sliding": (dict(model_type="qwen2", use_sliding_window=True, max_window_layers=1), NotImplementedError,
                      "use_sliding_window"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_config_keys_are_named(case):
    changes, error, message = BAD_CONFIGS[case]
    with pytest.raises(error, match=message):
        target_config_from_hf(_llama_dict(**changes))


def test_qwen2_attention_bias_key_and_family_switches():
    """Qwen2 has q/k/v biases whatever `attention_bias` says (HF Qwen2 ignores the key); configs no HF family
    describes can exist but have no config.json form; a drafter must be Qwen3 layers."""
    d = _llama_dict(model_type="qwen2")
    assert target_config_from_hf(d).attention_bias
    assert target_config_from_hf({**d, "attention_bias": True}).attention_bias
    cfg = target_config_from_hf(_llama_dict())
    assert target_config_to_hf(cfg)["architectures"] == ["LlamaForCausalLM"]
    assert target_config_from_hf(target_config_to_hf(cfg.replace(model_type="qwen2", attention_bias=None))) \
        .attention_bias
    odd = cfg.replace(qk_norm=True)
    with pytest.raises(ValueError, match="'llama' with qk_norm=True.*no HF config.json form"):
        target_config_to_hf(odd)
    # Params of one family under another family's config: a clear error, not a None in the arithmetic.
    small = cfg.replace(vocab_size=V, num_hidden_layers=1, param_dtype="float32", compute_dtype="float32")
    llama = dj.init_target(small, jax.random.key(0))
    qwen2 = dj.init_target(small.replace(model_type="qwen2", attention_bias=None), jax.random.key(0))
    tokens = np.zeros((1, 3), np.int32)
    with pytest.raises(ValueError, match="attention_bias=True but the layer's params have no q/k/v biases"):
        dj.target_forward(llama.replace(config=qwen2.config), tokens)
    with pytest.raises(ValueError, match="attention_bias=False but the layer's params have q/k/v biases"):
        dj.target_forward(qwen2.replace(config=llama.config), tokens)
    with pytest.raises(ValueError, match="qk_norm=True but the layer's params have no q_norm"):
        dj.target_forward(llama.replace(config=odd.replace(vocab_size=V, num_hidden_layers=1)), tokens)
    with pytest.raises(ValueError, match="drafter's layers are Qwen3 layers"):
        DrafterConfig(model=cfg.replace(num_hidden_layers=1), block_size=4, mask_token_id=1, target_layer_ids=(0,),
                      num_target_layers=2)
    # A z-lab drafter config.json that copies a Llama target's model_type is still read as Qwen3 layers.
    dd = {**_llama_dict(num_hidden_layers=1), "architectures": ["DFlashDraftModel"], "block_size": 4,
          "num_target_layers": 2, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0]}}
    assert drafter_config_from_hf(dd).model.qk_norm


# -- saving, quantizing, sharding ---------------------------------------------------------------------------------

def test_save_hf_and_orbax_round_trips(folders, tmp_path):
    """save_hf writes a folder transformers loads as the same model (Qwen2ForCausalLM, biases and all); save / load
    (orbax) and save_hf / load_target give the parameters back bit for bit."""
    model, folder = folders["qwen2_untied_gqa4-1"]
    target = load(folder)
    dj.save_hf(tmp_path / "hf", target)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM"] and written["model_type"] == "qwen2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    tokens = torch.tensor(np.random.default_rng(4).integers(0, V, (1, 16)))
    with torch.no_grad():
        np.testing.assert_array_equal(hf(tokens).logits.numpy(), model(tokens).logits.numpy())
    for again in (load(tmp_path / "hf"), (dj.save(tmp_path / "orbax", target), load(tmp_path / "orbax"))[1]):
        assert again.config == target.config
        a, b = named_leaves(target.params), named_leaves(again.params)
        assert a.keys() == b.keys() and "layers.2.self_attn.v_bias" in a
        for name in a:
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def test_nvfp4_keeps_biases_dense(folders, tmp_path):
    """quantize_nvfp4 quantizes every projection weight of a Qwen2 target and leaves its biases dense; the ModelOpt
    folder save_hf writes loads back with the same codes, scales and biases."""
    target = load(folders["qwen2_tied_gqa4-2"][1])
    q = dj.quantize_nvfp4(target)
    leaves = named_leaves(q.params)
    assert isinstance(leaves["layers.0.self_attn.q_proj"], dj.NVFP4Array)
    for b in ("q_bias", "k_bias", "v_bias"):
        leaf = leaves[f"layers.0.self_attn.{b}"]
        assert not isinstance(leaf, dj.NVFP4Array)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(named_leaves(target.params)[f"layers.0.self_attn.{b}"]))
    dj.save_hf(tmp_path, q)
    back = named_leaves(load(tmp_path).params)
    np.testing.assert_array_equal(np.asarray(back["layers.1.self_attn.k_bias"]),
                                  np.asarray(leaves["layers.1.self_attn.k_bias"]))
    np.testing.assert_array_equal(np.asarray(back["layers.1.self_attn.k_proj"].packed),
                                  np.asarray(leaves["layers.1.self_attn.k_proj"].packed))
    tokens = np.random.default_rng(5).integers(0, V, (1, 12))
    dense, _ = dj.target_forward(target, tokens)
    quant, _ = dj.target_forward(q, tokens)
    err = float(np.abs(np.asarray(quant) - np.asarray(dense)).max() / np.abs(np.asarray(dense)).max())
    assert 0 < err < 0.5  # quantized (not bit-identical) and still the same model


def test_bias_sharding_rules(folders):
    """Biases shard like their projection's out axis: q_bias over the model axis with q_proj; k/v biases with
    k/v_proj (replicated when the KV heads are fewer than the model axis)."""
    target = load(folders["qwen2_tied_gqa4-2"][1])
    mesh = S.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    specs = {n: s.spec for n, s in named_leaves(S.param_shardings(target, mesh)).items()}
    assert specs["layers.0.self_attn.q_bias"] == jax.sharding.PartitionSpec("model")
    assert specs["layers.0.self_attn.q_proj"][0] == "model"
    assert specs["layers.0.self_attn.k_bias"] == jax.sharding.PartitionSpec(specs["layers.0.self_attn.k_proj"][0])


SHARDED_SCRIPT = """
import json, sys
import numpy as np, jax
import dflash_jax as dj
from dflash_jax.params import named_leaves
folder = sys.argv[1]
one = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
mesh = dj.make_mesh(data=1, model=2)
two = dj.load_target(folder, param_dtype="float32", compute_dtype="float32", mesh=mesh)
leaves = named_leaves(two.params)
tokens = np.random.default_rng(6).integers(0, 96, (2, 10))
a, _ = dj.target_forward(one, tokens)
b, _ = dj.target_forward(two, tokens)
print(json.dumps({"devices": len(jax.devices()),
                  "q_bias_spec": str(leaves["layers.0.self_attn.q_bias"].sharding.spec),
                  "k_bias_spec": str(leaves["layers.0.self_attn.k_bias"].sharding.spec),
                  "q_bias_shard": list(leaves["layers.0.self_attn.q_bias"].addressable_shards[0].data.shape),
                  "max_diff": float(np.abs(np.asarray(a) - np.asarray(b)).max())}))
"""


def test_sharded_loading_of_a_qwen2_folder(folders):
    """load_target(mesh=) on two virtual CPU devices: the q/k/v biases placed by the rules (q_bias and, with 2 KV
    heads, k_bias split over the model axis), logits equal to the one-device load."""
    folder = folders["qwen2_tied_gqa4-2"][1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags_with_devices(2))
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(folder)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 2
    assert res["q_bias_spec"] == res["k_bias_spec"] == str(jax.sharding.PartitionSpec("model"))
    assert res["q_bias_shard"] == [16]  # 4 heads x 8 over 2 devices
    assert res["max_diff"] <= 1e-5
