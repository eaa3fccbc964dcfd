"""z-lab DFlash2 drafter folders: loading, the exact tensor names, save_hf / orbax round trips (dense and ModelOpt
NVFP4), and bad input (missing or mis-shaped conv / selector tensors, bad DFlash2 config values), each refused with
an error that names the problem. No forward passes: numpy + file I/O.

The config below is written by hand after z-lab's fixture tests/fixtures/dflash2-config.json (scaled down), the
tensor names after tests/fixtures/dflash2-safetensors-header.json: per layer `attention_conv.base_kernel` [2, Kc, H],
`attention_conv.kernel_projection.weight` [2*Kc*H/G, H] (same under `mlp_conv`), and the selector's
`candidate_selector.{predecessor,successor}_codebook` [V, r] (no `.weight`) and `hidden_projection.weight` [r, H].
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.zlab_config import drafter_config_from_hf
from dflash_jax.quant.nvfp4 import NVFP4Array
from dflash_jax.params import named_leaves
from dflash_jax.quant.quantize import quantize_nvfp4
from dflash_jax.io.safetensors_io import read_header, read_safetensors, write_safetensors
from helpers import assert_bit_exact, edit_config, write_hf_folder

BF16 = np.dtype(ml_dtypes.bfloat16)
H, I, NH, NKV, HD, LAYERS, V, KC, G, R, TOPK = 32, 64, 4, 2, 8, 2, 96, 2, 16, 8, 4
TAPS = [1, 3, 5]


def _config() -> dict:
    return {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "is_causal": False,
        "dflash_config": {"block_size": 8, "conv_group_size": G, "conv_kernel_size": KC,
                          "final_logit_softcapping": 20.0, "mask_token_id": 95,
                          "output_multiplier": 0.19611613513818404, "selector_rank": R, "selector_top_k": TOPK,
                          "target_layer_ids": TAPS},
        "dtype": "bfloat16", "eos_token_id": 1, "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
        "initializer_range": 0.02, "intermediate_size": I, "layer_types": ["sliding_attention"] * LAYERS,
        "max_position_embeddings": 131072, "max_window_layers": LAYERS, "model_type": "qwen3",
        "num_attention_heads": NH, "num_hidden_layers": LAYERS, "num_key_value_heads": NKV, "num_target_layers": 8,
        "pad_token_id": 3, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 16, "tie_word_embeddings": False, "transformers_version": "5.15.0", "use_cache": False,
        "use_sliding_window": True, "vocab_size": V,
    }


def _tensors(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(BF16)

    t = {"fc.weight": w(H, len(TAPS) * H), "hidden_norm.weight": w(H), "norm.weight": w(H),
         "candidate_selector.hidden_projection.weight": w(R, H),
         "candidate_selector.predecessor_codebook": w(V, R), "candidate_selector.successor_codebook": w(V, R)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": w(H), p + "post_attention_layernorm.weight": w(H),
            p + "self_attn.q_proj.weight": w(NH * HD, H), p + "self_attn.k_proj.weight": w(NKV * HD, H),
            p + "self_attn.v_proj.weight": w(NKV * HD, H), p + "self_attn.o_proj.weight": w(H, NH * HD),
            p + "self_attn.q_norm.weight": w(HD), p + "self_attn.k_norm.weight": w(HD),
            p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H), p + "mlp.down_proj.weight": w(H, I),
            p + "attention_conv.base_kernel": w(2, KC, H), p + "attention_conv.kernel_projection.weight":
                w(2 * KC * H // G, H),
            p + "mlp_conv.base_kernel": w(2, KC, H), p + "mlp_conv.kernel_projection.weight": w(2 * KC * H // G, H),
        })
    assert len(t) == 15 * LAYERS + 6  # 81 for the 5-layer fixture
    return t


@pytest.fixture
def folder(tmp_path):
    return write_hf_folder(tmp_path, _config(), _tensors())


def _hf_name(param_name: str) -> str:
    return param_name if param_name.endswith(("base_kernel", "_codebook")) else param_name + ".weight"


def test_dflash2_folder_loads(folder):
    path, tensors = folder
    d = dj.load_drafter(path, param_dtype="bfloat16")
    c = d.config
    assert c.kind == "dflash2" and c.is_dflash2
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (8, 95, (1, 3, 5), 8)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (KC, G, R, TOPK)
    assert c.output_multiplier == 0.19611613513818404 and c.final_logit_softcapping == 20.0
    assert c.input_embedding_scale == 1.0 and c.is_causal is False and c.sliding_window == 16
    assert c.layer_attention(0) == (False, 16) and c.layer_attention(1) == (False, 16)
    assert c.model.rope_theta == 500000.0 and c.model.rms_norm_eps == 1e-5 and c.model.param_dtype == "bfloat16"
    leaves = named_leaves(d.params)
    assert {_hf_name(n) for n in leaves} == set(tensors)
    for n, leaf in leaves.items():
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint16), tensors[_hf_name(n)].view(np.uint16), n)


def test_save_hf_writes_zlab_names_and_round_trips_bit_exact(folder):
    path, tensors = folder
    d = dj.load_drafter(path, param_dtype="bfloat16")
    out = dj.save_hf(path / "again", d)
    assert set(read_header(out / "model.safetensors")[0]) == set(tensors)  # same names, codebooks without .weight
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                               "block_size", "mask_token_id", "target_layer_ids", "output_multiplier",
                               "final_logit_softcapping")} == {k: _config()["dflash_config"][k] for k in dc}
    assert cfg["layer_types"] == ["sliding_attention"] * LAYERS and cfg["sliding_window"] == 16
    assert cfg["use_sliding_window"] is True
    back = dj.load_drafter(out, param_dtype="bfloat16")
    assert back.config == d.config
    assert_bit_exact(d, back)


def test_codebooks_with_weight_suffix_load_identically(folder):
    path, tensors = folder
    for name in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{name}.weight"] = tensors.pop(f"candidate_selector.{name}")
    write_safetensors(path / "model.safetensors", tensors)
    d = dj.load_drafter(path, param_dtype="bfloat16")
    write_safetensors(path / "model.safetensors", _tensors())
    assert_bit_exact(d, dj.load_drafter(path, param_dtype="bfloat16"))


def test_codebook_stored_twice_is_refused(folder):
    path, tensors = folder
    tensors["candidate_selector.successor_codebook.weight"] = tensors["candidate_selector.successor_codebook"]
    write_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"successor_codebook.*stored twice"):
        dj.load_drafter(path)


@pytest.mark.parametrize("name", ["layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                                  "candidate_selector.predecessor_codebook",
                                  "candidate_selector.hidden_projection.weight"])
def test_missing_dflash2_tensor_is_named(folder, name):
    path, tensors = folder
    del tensors[name]
    write_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        dj.load_drafter(path)


@pytest.mark.parametrize("name,shape", [("layers.1.attention_conv.kernel_projection.weight", (2 * KC * H // 8, H)),
                                        ("layers.0.mlp_conv.base_kernel", (2, 3, H)),
                                        ("candidate_selector.successor_codebook", (V, R + 1)),
                                        ("candidate_selector.hidden_projection.weight", (R, 2 * H))])
def test_misshaped_dflash2_tensor_is_named(folder, name, shape):
    path, tensors = folder
    tensors[name] = np.zeros(shape, BF16)
    write_safetensors(path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \[{', '.join(map(str, shape))}\]"):
        dj.load_drafter(path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["dflash_config"].update(conv_group_size=12), "conv_group_size 12 does not divide the hidden size 32"),
    (lambda c: c["dflash_config"].update(selector_top_k=V + 1), f"selector_top_k {V + 1} is larger than the vocab"),
    (lambda c: c.update(sliding_window=0), "sliding_window must be an integer >= 1"),
    (lambda c: c.update(sliding_window=-4), "sliding_window must be an integer >= 1"),
    (lambda c: c["dflash_config"].pop("selector_rank"), r"missing \['selector_rank'\]"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size must be an integer >= 1"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types has 1 entries for 2 layers"),
])
def test_bad_dflash2_config_is_refused(folder, edit, match):
    path, _ = folder
    edit_config(path, edit)
    with pytest.raises(CheckpointError, match=match):
        dj.load_drafter(path)


def test_dflash2_tensors_in_a_dflash_folder_are_unexpected(folder):
    path, _ = folder
    edit_config(path, lambda c: c.update(architectures=["DFlashDraftModel"]))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['candidate_selector"):
        dj.load_drafter(path)


def test_dflash2_folder_is_not_a_target(folder):
    path, _ = folder
    with pytest.raises(CheckpointError, match="DFlash2DraftModel.*load_drafter"):
        dj.load_target(path)


def test_sliding_window_follows_use_sliding_window(folder):
    """HF Qwen3Config keeps sliding_window only with use_sliding_window true; z-lab's attention reads it after."""
    path, _ = folder
    edit_config(path, lambda c: c.update(use_sliding_window=False))
    with pytest.warns(UserWarning, match="sliding_window 16 is ignored"):
        c = dj.load_drafter(path).config
    assert c.sliding_window is None and c.layer_attention(0) == (False, None)
    edit_config(path, lambda c: (c.update(use_sliding_window=True, is_causal=None), c.pop("is_causal")))
    c = dj.load_drafter(path).config
    assert c.is_causal is None and c.layer_attention(0) == (True, 16)  # sliding => causal unless is_causal says


def test_modelopt_nvfp4_dflash2_folder_round_trip(folder):
    path, _ = folder
    d = dj.load_drafter(path, param_dtype="float32")
    q = quantize_nvfp4(d)
    leaves = named_leaves(q.params)
    for n, leaf in leaves.items():
        linear = n == "fc" or n.endswith(("_proj", "kernel_projection", "hidden_projection"))
        assert isinstance(leaf, NVFP4Array) == linear, n  # base kernels, codebooks and norms stay dense
    out = dj.save_hf(path / "nvfp4", q)
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["exclude_modules"] == []
    header = read_header(out / "model.safetensors")[0]
    for m in ("layers.0.attention_conv.kernel_projection", "candidate_selector.hidden_projection"):
        assert {m + s for s in (".weight", ".weight_scale", ".weight_scale_2")} <= set(header)
        assert header[m + ".weight"][0] == np.uint8 and header[m + ".weight_scale_2"][1] == ()
    assert "candidate_selector.predecessor_codebook" in header and "layers.1.mlp_conv.base_kernel" in header
    back = dj.load_drafter(out, param_dtype="float32")
    assert_bit_exact(q, back)
    # A ModelOpt export that kept the selector dense (excluded by a prefix wildcard) loads it dense.
    partial = quantize_nvfp4(d, exclude=("candidate_selector.*",))
    out2 = dj.save_hf(path / "partial", partial)
    assert json.loads((out2 / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"] == [
        "candidate_selector.hidden_projection"]
    back2 = dj.load_drafter(out2, param_dtype="float32")
    assert not isinstance(back2.params.candidate_selector.hidden_projection, NVFP4Array)
    assert isinstance(back2.params.layers[0].mlp_conv.kernel_projection, NVFP4Array)
    assert_bit_exact(partial, back2)


def test_orbax_round_trip_dflash2_dense_and_nvfp4(folder, tmp_path):
    path, _ = folder
    d = dj.load_drafter(path, param_dtype="bfloat16")
    for model, name in ((d, "dense"), (quantize_nvfp4(d), "nvfp4")):
        dj.save(tmp_path / name, model)
        back = dj.load_drafter(tmp_path / name, param_dtype="bfloat16")
        assert back.config == model.config
        assert_bit_exact(model, back)


@pytest.mark.parametrize("changes", [
    {},
    {"use_sliding_window": False},
    {"is_causal": None},
    {"layer_types": None, "max_window_layers": 1},
    {"layer_types": None, "max_window_layers": 1, "sliding_window": None},
    {"layer_types": None, "use_sliding_window": False},
    {"layer_types": ["full_attention", "sliding_attention"], "is_causal": True, "sliding_window": 5},
    {"layer_types": None, "max_window_layers": 0, "is_causal": None, "sliding_window": None},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "fixture")
def test_layer_rules_match_hf_qwen3config(changes):
    """Per layer (causal, window) as z-lab computes them from transformers' Qwen3Config (the oracle here):
    layer_type = config.layer_types[i]; causal = (layer_type == sliding) unless config.is_causal is set;
    window = config.sliding_window for sliding layers."""
    transformers = pytest.importorskip("transformers")
    import warnings
    d = _config()
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Qwen3Config(**{k: v for k, v in d.items() if k != "dflash_config"})
        ours = drafter_config_from_hf(d)
    is_causal = d.get("is_causal")  # z-lab: getattr(config, "is_causal", None)
    for i in range(LAYERS):
        layer_type = hf.layer_types[i]
        causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        window = hf.sliding_window if layer_type == "sliding_attention" else None
        assert ours.layer_attention(i) == (causal, window), (i, hf.layer_types, hf.sliding_window)
