"""Checkpoints: HF folders (single / sharded, bf16), validation errors, hostile safetensors files, orbax round trips
(dense + NVFP4), the ModelOpt NVFP4 export, and z-lab drafter folders.

Every error test asserts that the message names the offending tensor, shard or file. Tiny configs (in_features
multiples of 16 so every linear can be NVFP4), no forward passes: this file is numpy + file I/O.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.io.errors import CheckpointError
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.quant.nvfp4 import E2M1_GRID, NVFP4Array, dequantize, quantize
from dflash_jax.params import is_linear_name, map_named, named_leaves
from dflash_jax.io.safetensors_io import SafetensorsError, read_header, read_safetensors, write_safetensors
from helpers import assert_bit_exact, edit_config, write_hf_folder

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)


def tiny_cfg(**kw) -> TargetConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rope_theta=10000.0, param_dtype="float32",
                compute_dtype="float32", bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return TargetConfig(**base)


def drafter_cfg(**kw) -> DrafterConfig:
    return DrafterConfig(model=tiny_cfg(**kw), block_size=4, mask_token_id=63, target_layer_ids=(0, 2),
                         num_target_layers=4)


def _target(seed=0, **kw) -> dj.Target:
    return dj.init_target(tiny_cfg(**kw), jax.random.key(seed))


def _quantize_where(model, pred):
    """NVFP4 for the linear leaves whose name satisfies pred; everything else stays dense."""
    def leaf(name, x):
        return quantize(x) if is_linear_name(name.split(".")[-1]) and pred(name) else x
    return model.replace(params=map_named(leaf, model.params))


def _mixed_target(**kw) -> dj.Target:
    """Layer 0's linears and lm_head NVFP4, layer 1 dense (so exclude_modules is non-trivial)."""
    return _quantize_where(_target(**kw), lambda n: n.startswith("layers.0.") or n == "lm_head")


def _read(folder) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in read_safetensors(Path(folder) / "model.safetensors").items()}


def _write(folder, tensors):
    write_safetensors(Path(folder) / "model.safetensors", tensors)


# ---------------------------------------------------------------------------------------------------------------
# HF round trips
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_hf_round_trip_bit_exact(tmp_path, tied):
    t = _target(tie_word_embeddings=tied)
    dj.save_hf(tmp_path, t)
    names = set(read_header(tmp_path / "model.safetensors")[0])
    assert ("lm_head.weight" in names) == (not tied)
    assert "model.embed_tokens.weight" in names and "model.layers.1.self_attn.q_norm.weight" in names
    assert not (tmp_path / "hf_quant_config.json").exists()
    t2 = dj.load_target(tmp_path)
    assert t2.config == t.config
    assert_bit_exact(t, t2)


def test_hf_bf16_in_file(tmp_path):
    t = _target(seed=1)
    dj.save_hf(tmp_path / "a", t, dtype="bfloat16")
    header, _ = read_header(tmp_path / "a" / "model.safetensors")
    assert {dt for dt, _, _ in header.values()} == {BF16}
    assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    t16 = dj.load_target(tmp_path / "a", param_dtype="bfloat16")
    assert t16.config.param_dtype == "bfloat16" and t16.config.compute_dtype == "float32"
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), t.params)  # RNE rounding of the f32 weights
    assert_bit_exact(want, t16.params)
    # A bf16 model written in its own dtype comes back bit-exact too.
    dj.save_hf(tmp_path / "b", t16)
    assert_bit_exact(t16, dj.load_target(tmp_path / "b", param_dtype="bfloat16"))
    # By default parameters follow the compute dtype (float32 on CPU): the bf16 values widened exactly.
    t32 = dj.load_target(tmp_path / "a")
    assert t32.config.param_dtype == "float32" == t32.config.compute_dtype
    assert_bit_exact(jax.tree.map(lambda x: x.astype(jnp.float32), want), t32.params)


def _shard(folder, tensors, split=lambda name: "layers.1." in name, names=("model-00001-of-00002.safetensors",
                                                                          "model-00002-of-00002.safetensors")):
    folder = Path(folder)
    parts = ({}, {})
    for k, v in tensors.items():
        parts[int(split(k))][k] = v
    assert parts[0] and parts[1]
    for name, part in zip(names, parts):
        write_safetensors(folder / name, part, {"format": "pt"})
    weight_map = {k: names[i] for i, part in enumerate(parts) for k in part}
    total = sum(v.nbytes for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink(missing_ok=True)
    return weight_map


@pytest.fixture
def sharded(tmp_path):
    t = _target(seed=2)
    dj.save_hf(tmp_path, t)
    weight_map = _shard(tmp_path, _read(tmp_path))
    return t, tmp_path, weight_map


def test_sharded_folder_loads_identically(sharded):
    t, folder, _ = sharded
    assert not (folder / "model.safetensors").exists()
    assert_bit_exact(t, dj.load_target(folder))


def test_sharded_shard_missing(sharded):
    _, folder, _ = sharded
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        dj.load_target(folder)


def test_sharded_index_points_to_wrong_shard(sharded):
    _, folder, weight_map = sharded
    name = "model.layers.1.mlp.up_proj.weight"
    assert weight_map[name] == "model-00002-of-00002.safetensors"
    weight_map[name] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        dj.load_target(folder)


def test_sharded_index_lists_absent_tensor(sharded):
    _, folder, weight_map = sharded
    weight_map["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.extra.weight"):
        dj.load_target(folder)


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/tmp/model-00001-of-00002.safetensors",
                                   "sub/model-00001-of-00002.safetensors", "..", 7],
                         ids=["parent", "absolute", "subfolder", "dotdot", "not_a_string"])
def test_sharded_index_shard_path_traversal(sharded, shard):
    """A shard name must be a plain file name inside the folder: an index cannot make the loader read elsewhere."""
    _, folder, weight_map = sharded
    (folder.parent / "model-00001-of-00002.safetensors").write_bytes(
        (folder / "model-00001-of-00002.safetensors").read_bytes())  # the escape target exists and is valid
    weight_map["model.norm.weight"] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=re.escape(repr(shard)) + ".*must be a file name inside the folder"):
        dj.load_target(folder)


@pytest.mark.parametrize("index", [{"metadata": {"total_size": 1}}, {"weight_map": ["model.norm.weight"]},
                                   {"weight_map": None}], ids=["absent", "list", "null"])
def test_sharded_index_without_weight_map(sharded, index):
    _, folder, _ = sharded
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: no weight_map"):
        dj.load_target(folder)


def test_tied_lm_head_must_equal_the_embedding(tmp_path):
    """A tied target may carry lm_head.weight only as an exact copy of the embedding."""
    t = _target(tie_word_embeddings=True)
    dj.save_hf(tmp_path, t)
    tensors = _read(tmp_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    _write(tmp_path, tensors)
    assert_bit_exact(t, dj.load_target(tmp_path))  # an exact copy is accepted
    tensors["lm_head.weight"][5, 3] += 1e-3
    _write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true but lm_head.weight differs from "
                                              "model.embed_tokens.weight"):
        dj.load_target(tmp_path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][:32].copy()  # wrong shape
    _write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        dj.load_target(tmp_path)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma2", "mixtral"])
def test_unsupported_model_type(tmp_path, model_type):
    dj.save_hf(tmp_path, _target())
    edit_config(tmp_path, lambda c: c.update(model_type=model_type))
    with pytest.raises(NotImplementedError, match=f"model_type '{model_type}' is not supported"):
        dj.load_target(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_qwen3_tensors_under_another_family_are_refused(tmp_path, model_type):
    """A Qwen3 folder relabelled llama / qwen2 (families without q/k norm) fails on the tensors it does not expect
    (qwen2 first misses its q/k/v biases), naming them."""
    dj.save_hf(tmp_path, _target())
    edit_config(tmp_path, lambda c: c.update(model_type=model_type))
    expected = "unexpected tensors.*q_norm" if model_type == "llama" else "missing tensor.*q_proj.bias"
    with pytest.raises(CheckpointError, match=expected):
        dj.load_target(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Tensor validation errors (dense)
# ---------------------------------------------------------------------------------------------------------------

def _m_missing(t):
    del t["model.layers.1.mlp.up_proj.weight"]
    return "model.layers.1.mlp.up_proj.weight"


def _m_unexpected(t):
    t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"]
    return "model.layers.2.mlp.up_proj.weight"


def _m_shape(t):
    t["model.norm.weight"] = np.ones(33, np.float32)
    return r"model.norm.weight.*\[33\]"


def _m_nan(t):
    t["model.layers.0.self_attn.k_proj.weight"][3, 5] = np.nan
    return "model.layers.0.self_attn.k_proj.weight.*NaN"


def _m_inf(t):
    t["lm_head.weight"][0, 0] = -np.inf
    return "lm_head.weight.*Inf"


def _m_int(t):
    t["model.layers.0.input_layernorm.weight"] = np.ones(32, np.int32)
    return "model.layers.0.input_layernorm.weight.*int32"


def _m_bool(t):
    t["model.embed_tokens.weight"] = np.ones((64, 32), np.bool_)
    return "model.embed_tokens.weight.*bool"


@pytest.mark.parametrize("mutate", [_m_missing, _m_unexpected, _m_shape, _m_nan, _m_inf, _m_int, _m_bool],
                         ids=lambda f: f.__name__[3:])
def test_dense_tensor_errors_name_the_tensor(tmp_path, mutate):
    dj.save_hf(tmp_path, _target(seed=3))
    tensors = _read(tmp_path)
    pattern = mutate(tensors)
    _write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=pattern):
        dj.load_target(tmp_path)


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_a_path_that_is_no_model_says_what_one_can_be(tmp_path, kind):
    """A bare .safetensors file, an empty folder, a folder without a config and a missing path are refused before
    any reader runs (a bare .safetensors file once reached the config reader: "not valid JSON"), each error saying
    what the path is and what a target / drafter path can be."""
    load = dj.load_target if kind == "target" else dj.load_drafter
    model = _target() if kind == "target" else dj.init_drafter(drafter_cfg(), jax.random.key(1))
    dj.save_hf(tmp_path / "hf", model)
    can_be = f"a {kind} is an HF folder" if kind == "target" else "a drafter is a z-lab DFlash / DFlash2 folder"
    with pytest.raises(CheckpointError, match=r"bare \.safetensors file.*config\.json") as e:
        load(tmp_path / "hf" / "model.safetensors")
    assert can_be in str(e.value) and "JSON" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"an empty folder \(no config\.json, no dflash_jax\.json\)") as e:
        load(tmp_path / "empty")
    assert can_be in str(e.value)
    with pytest.raises(FileNotFoundError, match="no such file or folder") as e:
        load(tmp_path / "missing")
    assert can_be in str(e.value)
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="it holds model.safetensors but no config.json") as e:
        load(tmp_path / "hf")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="a file that is not GGUF") as e:
        load(tmp_path / "notes.txt")
    assert can_be in str(e.value)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        dj.load_target(tmp_path)
    dj.save_hf(tmp_path, _target())
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        dj.load_target(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Hostile safetensors files
# ---------------------------------------------------------------------------------------------------------------

def test_writer_round_trip_every_dtype_bit_exact(tmp_path):
    """The writer (safetensors.numpy.save_file) and our reader agree byte for byte on every dtype we use; 0-d
    scalars stay 0-d, strided views are written by value, and the metadata comes back."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((4, 32)).astype(np.float32)
    tensors = {
        "f32": base, "f16": base.astype(np.float16), "bf16": base.astype(ml_dtypes.bfloat16),
        "e4m3": base.astype(ml_dtypes.float8_e4m3fn), "e5m2": base.astype(ml_dtypes.float8_e5m2),
        "u8": rng.integers(0, 256, (3, 5)).astype(np.uint8), "i32": rng.integers(-9, 9, (7,)).astype(np.int32),
        "scalar": np.asarray(np.float32(0.125)), "empty": np.zeros((0, 3), np.float32),
        "strided": base[:, ::2], "fortran": np.asfortranarray(base), "bool": base > 0,
    }
    p = tmp_path / "x.safetensors"
    write_safetensors(p, tensors, {"format": "pt"})
    back = read_safetensors(p)
    assert set(back) == set(tensors)
    for name, arr in tensors.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape, name
        assert back[name].tobytes() == np.ascontiguousarray(arr).tobytes(), name
    assert back["scalar"].shape == ()
    raw = p.read_bytes()
    assert json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"] == {"format": "pt"}
    with pytest.raises(SafetensorsError, match="cannot write tensor 'c'"):
        write_safetensors(tmp_path / "y.safetensors", {"c": np.zeros(2, np.complex64)})


def _raw(path: Path, header, data: bytes = b"", n: int | None = None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if n is None else n) + text + data)


def _c_truncated(p):
    write_safetensors(p, {"a": np.arange(64, dtype=np.float32), "b": np.ones(16, np.float32)})
    p.write_bytes(p.read_bytes()[:-100])
    return "outside"


def _c_header_too_long(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, n=10_000)
    return "header length 10000"


def _c_header_huge(p):
    _raw(p, b"{}", n=2**62)
    return "header length"


def _c_tiny_file(p):
    p.write_bytes(b"\x01\x02")
    return "too small"


def _c_offsets_out_of_range(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, b"\0" * 16)
    return "'a'.*outside"


def _c_negative_offset(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\0" * 4)
    return "'a'.*outside"


def _c_overlap(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24)
    return "overlap"


def _c_length_mismatch(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\0" * 16)
    return "'a' holds 12 bytes"


def _c_invalid_json(p):
    _raw(p, b'{"a": {"dtype": "F32", ', b"\0" * 16)
    return "not valid JSON"


def _c_not_utf8(p):
    _raw(p, b"\xff\xfe\xfd", b"")
    return "not valid JSON"


def _c_header_not_object(p):
    _raw(p, b"[1, 2]", b"")
    return "not a JSON object"


def _c_unknown_dtype(p):
    _raw(p, {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    return "'a'.*malformed"


def _c_entry_not_object(p):
    _raw(p, {"a": "F32"}, b"")
    return "'a'.*malformed"


def _c_negative_dim(p):
    _raw(p, {"a": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 0]}}, b"")
    return r"'a' has a negative dimension \(-1, 4\)"


def _c_two_negative_dims(p):
    # (-2) x (-2) = 4 elements = 16 bytes: the byte count matches, only the sign check can refuse it.
    _raw(p, {"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, b"\0" * 16)
    return r"'a' has a negative dimension \(-2, -2\)"


CORRUPTIONS = [_c_truncated, _c_header_too_long, _c_header_huge, _c_tiny_file, _c_offsets_out_of_range,
               _c_negative_offset, _c_overlap, _c_length_mismatch, _c_invalid_json, _c_not_utf8,
               _c_header_not_object, _c_unknown_dtype, _c_entry_not_object, _c_negative_dim, _c_two_negative_dims]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__[3:])
def test_corrupt_safetensors_named_errors(tmp_path, corrupt):
    p = tmp_path / "x.safetensors"
    pattern = corrupt(p)
    with pytest.raises(SafetensorsError, match=pattern) as e:
        read_safetensors(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("corrupt", [_c_truncated, _c_header_too_long, _c_overlap, _c_invalid_json,
                                     _c_two_negative_dims],
                         ids=lambda f: f.__name__[3:])
def test_corrupt_file_in_folder_names_the_file(tmp_path, corrupt):
    dj.save_hf(tmp_path, _target())
    corrupt(tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        dj.load_target(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(e.value)


def test_corrupt_file_is_a_checkpoint_error(tmp_path):
    dj.save_hf(tmp_path, _target())
    _c_truncated(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError):
        dj.load_target(tmp_path)


@pytest.mark.parametrize("name,text", [("model.safetensors.index.json", "{bad"),
                                       ("model.safetensors.index.json", "[1]"),
                                       ("config.json", "{bad")], ids=["index_json", "index_list", "config_json"])
def test_malformed_json_files_name_the_file(tmp_path, name, text):
    dj.save_hf(tmp_path, _target())
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(name)):
        dj.load_target(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Wrong kind of model
# ---------------------------------------------------------------------------------------------------------------

def test_target_and_drafter_folders_not_interchangeable(tmp_path):
    t = _target()
    d = dj.init_drafter(drafter_cfg(), jax.random.key(1))
    dj.save_hf(tmp_path / "hf_t", t)
    dj.save_hf(tmp_path / "hf_d", d)
    dj.save(tmp_path / "ob_t", t)
    dj.save(tmp_path / "ob_d", d)
    with pytest.raises(CheckpointError, match="drafter"):
        dj.load_target(tmp_path / "hf_d")
    with pytest.raises(CheckpointError, match="DFlashDraftModel"):
        dj.load_drafter(tmp_path / "hf_t")
    with pytest.raises(CheckpointError, match="holds a drafter, not a target"):
        dj.load_target(tmp_path / "ob_d")
    with pytest.raises(CheckpointError, match="holds a target, not a drafter"):
        dj.load_drafter(tmp_path / "ob_t")
    # A drafter folder whose config lost its architectures: the tensor check still refuses it as a target.
    edit_config(tmp_path / "hf_d", lambda c: c.pop("architectures"))
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight"):
        dj.load_target(tmp_path / "hf_d")
    # And both still load as what they are.
    assert_bit_exact(d, dj.load_drafter(tmp_path / "hf_d"))
    assert_bit_exact(t, dj.load_target(tmp_path / "ob_t"))


# ---------------------------------------------------------------------------------------------------------------
# orbax
# ---------------------------------------------------------------------------------------------------------------

def test_orbax_round_trip_target_dense_and_nvfp4(tmp_path):
    t_dense = _target(seed=4, tie_word_embeddings=True)
    dj.save(tmp_path / "dense", t_dense)
    assert_bit_exact(t_dense, dj.load_target(tmp_path / "dense"))

    t = _mixed_target(seed=5)
    leaves = named_leaves(t.params)
    assert isinstance(leaves["layers.0.mlp.down_proj"], NVFP4Array) and isinstance(leaves["lm_head"], NVFP4Array)
    assert not isinstance(leaves["layers.1.mlp.down_proj"], NVFP4Array)
    dj.save(tmp_path / "q", t)
    t2 = dj.load_target(tmp_path / "q")
    assert t2.config == t.config
    assert_bit_exact(t, t2)  # includes float8_e4m3fn block scales byte for byte
    q2 = named_leaves(t2.params)["layers.0.self_attn.q_proj"]
    assert q2.block_scale.dtype == jnp.float8_e4m3fn and q2.global_scale.dtype == jnp.float32
    assert q2.global_scale.shape == () and q2.shape == (32, 32)


def test_orbax_round_trip_drafter_bf16_nvfp4(tmp_path):
    d = dj.init_drafter(drafter_cfg(param_dtype="bfloat16"), jax.random.key(6))
    d = _quantize_where(d, lambda n: n == "fc" or n.endswith("_proj") and "layers.1." in n)
    assert isinstance(d.params.fc, NVFP4Array) and d.params.layers[0].mlp.up_proj.dtype == jnp.bfloat16
    dj.save(tmp_path, d)
    d2 = dj.load_drafter(tmp_path, param_dtype="bfloat16")
    assert d2.config == d.config
    assert_bit_exact(d, d2)
    # Saving again into the same folder replaces the old params.
    d3 = dj.init_drafter(drafter_cfg(param_dtype="bfloat16"), jax.random.key(7))
    dj.save(tmp_path, d3)
    assert_bit_exact(d3, dj.load_drafter(tmp_path, param_dtype="bfloat16"))
    # Default: dense parameters in the compute dtype (float32 on CPU); NVFP4 leaves untouched.
    d4 = dj.load_drafter(tmp_path)
    assert d4.config.model.param_dtype == "float32" and d4.params.layers[0].mlp.up_proj.dtype == jnp.float32


def test_orbax_load_honours_param_dtype(tmp_path):
    dj.save(tmp_path, _target())
    t = dj.load_target(tmp_path, param_dtype="bfloat16")
    assert t.params.embed_tokens.dtype == jnp.bfloat16 and t.config.param_dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------------------------
# ModelOpt NVFP4 export (save_hf with NVFP4 leaves)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def nvfp4_folder(tmp_path):
    t = _mixed_target(seed=8)
    dj.save_hf(tmp_path, t)
    return t, tmp_path


def _quantized_modules(t) -> dict[str, tuple[int, int]]:
    return {("" if n == "lm_head" else "model.") + n: leaf.shape
            for n, leaf in named_leaves(t.params).items() if isinstance(leaf, NVFP4Array)}


def test_modelopt_export_layout(nvfp4_folder):
    t, folder = nvfp4_folder
    header, _ = read_header(folder / "model.safetensors")
    quantized = _quantized_modules(t)
    assert len(quantized) == 8  # 7 linears of layer 0 + lm_head
    for module, (out_f, in_f) in quantized.items():
        got = {k[len(module) + 1:]: (dt, shape) for k, (dt, shape, _) in header.items()
               if k.startswith(module + ".")}
        assert set(got) == {"weight", "weight_scale", "weight_scale_2"}, module
        assert got["weight"] == (np.dtype(np.uint8), (out_f, in_f // 2)), module
        assert got["weight_scale"] == (F8, (out_f, in_f // 16)), module
        dt, shape = got["weight_scale_2"]
        assert dt == np.float32 and int(np.prod(shape)) == 1, module  # and 0-d: see test_modelopt_weight_scale_2_is_0d
    dense_linears = sorted(("" if n == "lm_head" else "model.") + n for n, leaf in named_leaves(t.params).items()
                           if is_linear_name(n.split(".")[-1]) and not isinstance(leaf, NVFP4Array))
    assert len(dense_linears) == 7
    for module in dense_linears + ["model.embed_tokens", "model.norm", "model.layers.0.input_layernorm"]:
        assert header[module + ".weight"][0] == np.float32, module
        assert module + ".weight_scale" not in header

    hq = json.loads((folder / "hf_quant_config.json").read_text())
    q = hq["quantization"]
    assert q["quant_algo"] in ("NVFP4", "W4A16_NVFP4") and q["group_size"] == 16
    assert sorted(q["exclude_modules"]) == dense_linears
    assert not set(q["exclude_modules"]) & set(quantized)
    assert "producer" in hq
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == q["quant_algo"]
    assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                         "group_size": 16}
    assert sorted(qc["ignore"]) == dense_linears


def test_modelopt_weight_scale_2_is_0d(nvfp4_folder):
    _, folder = nvfp4_folder
    header, _ = read_header(folder / "model.safetensors")
    assert header["model.layers.0.mlp.up_proj.weight_scale_2"][1] == ()


def test_modelopt_export_reloads_bit_exact_and_dequantizes_like_modelopt(nvfp4_folder):
    t, folder = nvfp4_folder
    t2 = dj.load_target(folder)
    assert_bit_exact(t, t2)
    # Reference dequant straight from the file tensors (numpy, ModelOpt formula): e2m1[code] * f32(s) * s2.
    tensors = _read(folder)
    for module, (out_f, in_f) in _quantized_modules(t).items():
        w = tensors[module + ".weight"]
        codes = np.stack([w & 0xF, w >> 4], -1).reshape(out_f, in_f)
        step = tensors[module + ".weight_scale"].astype(np.float32) * np.float32(tensors[module + ".weight_scale_2"])
        ref = (E2M1_GRID[codes].reshape(out_f, in_f // 16, 16) * step[..., None]).reshape(out_f, in_f)
        leaf = named_leaves(t2.params)[module.removeprefix("model.")]
        np.testing.assert_array_equal(np.asarray(dequantize(leaf)), ref, err_msg=module)


def test_modelopt_0d_scalar_file_loads(nvfp4_folder):
    """A real ModelOpt export stores weight_scale_2 as a 0-d tensor; our reader takes it."""
    t, folder = nvfp4_folder
    tensors = _read(folder)
    header, data = {}, b""
    for k in sorted(tensors):
        a = tensors[k]
        shape = [] if k.endswith("weight_scale_2") else list(a.shape)
        dt = {np.dtype(np.uint8): "U8", F8: "F8_E4M3", np.dtype(np.float32): "F32"}[a.dtype]
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    _raw(folder / "model.safetensors", header, data)
    assert read_header(folder / "model.safetensors")[0]["lm_head.weight_scale_2"][1] == ()
    assert_bit_exact(t, dj.load_target(folder))


Q = "model.layers.0.self_attn.q_proj"  # [32, 32] NVFP4 in the fixture


def _q_no_s2(t):
    del t[Q + ".weight_scale_2"]
    return Q + ".*weight_scale_2"


def _q_scale_shape(t):
    t[Q + ".weight_scale"] = t[Q + ".weight_scale"][:, :1].copy()
    return Q + r".weight_scale.*\[32, 1\]"


def _q_scale_dtype(t):
    t[Q + ".weight_scale"] = t[Q + ".weight_scale"].astype(np.float32)
    return Q + ".weight_scale.*float32"


def _q_s2_dtype(t):
    t[Q + ".weight_scale_2"] = t[Q + ".weight_scale_2"].astype(np.float16)
    return Q + ".weight_scale_2.*float16"


def _q_s2_nonpositive(t):
    t[Q + ".weight_scale_2"] = np.zeros_like(t[Q + ".weight_scale_2"])
    return Q + ".weight_scale_2.*> 0"


def _q_scale_nan(t):
    s = t[Q + ".weight_scale"].copy()
    s[0, 0] = np.nan
    t[Q + ".weight_scale"] = s
    return Q + ".weight_scale.*NaN"


def _q_listed_without_scales(t):
    # A dense weight for a module that the config says is NVFP4 (not in exclude_modules).
    for s in (".weight", ".weight_scale", ".weight_scale_2"):
        del t[Q + s]
    t[Q + ".weight"] = np.zeros((32, 32), np.float32)
    return Q + ".*listed as NVFP4-quantized"


def _q_packed_too_small(t):
    t[Q + ".weight"] = t[Q + ".weight"][:, :8].copy()
    return Q + r".weight.*uint8 \[32, 16\].*\[32, 8\]"


def _q_packed_wrong_dtype(t):
    t[Q + ".weight"] = t[Q + ".weight"].astype(np.int8)
    return Q + ".weight.*int8"


def _q_embed_quantized(t):
    t["model.embed_tokens.weight_scale_2"] = np.float32(1.0).reshape(())
    return "model.embed_tokens.*only linear layers"


def _q_packed_without_any_weight(t):
    del t[Q + ".weight"]
    return Q + ".*without a packed weight"


QUANT_ERRORS = [_q_no_s2, _q_scale_shape, _q_scale_dtype, _q_s2_dtype, _q_s2_nonpositive, _q_scale_nan,
                _q_listed_without_scales, _q_packed_too_small, _q_packed_wrong_dtype, _q_embed_quantized,
                _q_packed_without_any_weight]


@pytest.mark.parametrize("mutate", QUANT_ERRORS, ids=lambda f: f.__name__[3:])
def test_nvfp4_errors_name_the_module(nvfp4_folder, mutate):
    _, folder = nvfp4_folder
    tensors = _read(folder)
    pattern = mutate(tensors)
    _write(folder, tensors)
    with pytest.raises(CheckpointError, match=pattern):
        dj.load_target(folder)


@pytest.mark.parametrize("value", [np.float32(-0.5), np.float32(0.0), np.float32(np.nan), np.float32(np.inf),
                                   np.float16(0.01), np.array([0.01, 0.02], np.float32)],
                         ids=["negative", "zero", "nan", "inf", "float16", "two_values"])
def test_nvfp4_bad_input_scale_names_the_module(nvfp4_folder, value):
    """W4A4 activation scale (ModelOpt input_scale): a finite positive float32 scalar, or the module is refused."""
    _, folder = nvfp4_folder
    tensors = _read(folder)
    tensors[Q + ".input_scale"] = np.float32(0.01).reshape(())
    _write(folder, tensors)
    assert float(named_leaves(dj.load_target(folder).params)["layers.0.self_attn.q_proj"].input_scale) == \
        np.float32(0.01)  # a good one loads
    tensors[Q + ".input_scale"] = np.asarray(value).reshape(np.shape(value))
    _write(folder, tensors)
    with pytest.raises(CheckpointError, match=re.escape(Q) + r".input_scale: must be a finite positive float32 "
                                                            "scalar"):
        dj.load_target(folder)


def test_nvfp4_in_features_not_a_multiple_of_16(tmp_path):
    """intermediate_size 40: down_proj has 40 inputs, which NVFP4 blocks of 16 cannot cover."""
    t = _target(intermediate_size=40)
    dj.save_hf(tmp_path, t)
    tensors = _read(tmp_path)
    m = "model.layers.0.mlp.down_proj"
    tensors[m + ".weight"] = np.zeros((32, 20), np.uint8)
    tensors[m + ".weight_scale"] = np.ones((32, 2), F8)
    tensors[m + ".weight_scale_2"] = np.float32(1.0).reshape(())
    _write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=re.escape(m) + ": in_features 40 is not a multiple of 16"):
        dj.load_target(tmp_path)


def test_nvfp4_missing_weight_scale_names_the_module(nvfp4_folder):
    _, folder = nvfp4_folder
    tensors = _read(folder)
    del tensors[Q + ".weight_scale"]
    _write(folder, tensors)
    with pytest.raises(CheckpointError, match=Q + ".*weight_scale"):
        dj.load_target(folder)


def test_nvfp4_config_errors(nvfp4_folder):
    _, folder = nvfp4_folder
    # Dense modules missing from exclude_modules are "quantized without scales" -> error naming the first one.
    edit_config(folder, lambda c: c["quantization"].update(exclude_modules=["lm_head"]), "hf_quant_config.json")
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.q_proj.*listed as NVFP4"):
        dj.load_target(folder)
    # Prefix wildcards as ModelOpt writes them.
    edit_config(folder, lambda c: c["quantization"].update(exclude_modules=["lm_head", "model.layers.1.*"]),
                 "hf_quant_config.json")
    dj.load_target(folder)
    edit_config(folder, lambda c: c["quantization"].update(group_size=32), "hf_quant_config.json")
    with pytest.raises(CheckpointError, match="group_size must be 16"):
        dj.load_target(folder)
    edit_config(folder, lambda c: c["quantization"].update(group_size=16, quant_algo="FP8"), "hf_quant_config.json")
    with pytest.raises(NotImplementedError, match="FP8"):
        dj.load_target(folder)
    # Without hf_quant_config.json the config.json quantization_config is used instead.
    (folder / "hf_quant_config.json").unlink()
    assert isinstance(named_leaves(dj.load_target(folder).params)["lm_head"], NVFP4Array)
    edit_config(folder, lambda c: c["quantization_config"].update(ignore=[], exclude_modules=[]))
    with pytest.raises(CheckpointError, match="listed as NVFP4"):
        dj.load_target(folder)


# ---------------------------------------------------------------------------------------------------------------
# z-lab style drafter folder
# ---------------------------------------------------------------------------------------------------------------

ZL_H, ZL_I, ZL_NH, ZL_NKV, ZL_HD, ZL_L, ZL_V = 32, 64, 4, 2, 8, 2, 96
ZL_LAYER_IDS = [1, 3, 5]


def _zlab_config() -> dict:
    """Written by hand after the Qwen3-8B-DFlash-b16 config.json on the Hugging Face hub, not by our own
    drafter_config_to_hf."""
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 16, "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": ZL_LAYER_IDS},
        "hidden_size": ZL_H, "num_hidden_layers": ZL_L, "num_attention_heads": ZL_NH,
        "num_key_value_heads": ZL_NKV, "head_dim": ZL_HD, "intermediate_size": ZL_I, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "layer_types": ["full_attention"] * ZL_L, "sliding_window": None, "use_sliding_window": False,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "vocab_size": ZL_V,
        "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }


def _zlab_tensors(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(BF16)

    t = {"fc.weight": w(ZL_H, len(ZL_LAYER_IDS) * ZL_H), "hidden_norm.weight": w(ZL_H), "norm.weight": w(ZL_H)}
    for i in range(ZL_L):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": w(ZL_H), p + "post_attention_layernorm.weight": w(ZL_H),
            p + "self_attn.q_proj.weight": w(ZL_NH * ZL_HD, ZL_H),
            p + "self_attn.k_proj.weight": w(ZL_NKV * ZL_HD, ZL_H),
            p + "self_attn.v_proj.weight": w(ZL_NKV * ZL_HD, ZL_H),
            p + "self_attn.o_proj.weight": w(ZL_H, ZL_NH * ZL_HD),
            p + "self_attn.q_norm.weight": w(ZL_HD), p + "self_attn.k_norm.weight": w(ZL_HD),
            p + "mlp.gate_proj.weight": w(ZL_I, ZL_H), p + "mlp.up_proj.weight": w(ZL_I, ZL_H),
            p + "mlp.down_proj.weight": w(ZL_H, ZL_I),
        })
    assert len(t) == 11 * ZL_L + 3
    return t


@pytest.fixture
def zlab_folder(tmp_path):
    return write_hf_folder(tmp_path, _zlab_config(), _zlab_tensors())


def test_zlab_drafter_folder_loads(zlab_folder):
    folder, tensors = zlab_folder
    d = dj.load_drafter(folder, param_dtype="bfloat16")
    c = d.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (16, 95, (1, 3, 5), 8)
    assert c.num_taps == 3 and c.model.hidden_size == ZL_H and c.model.head_dim == ZL_HD
    assert c.model.num_key_value_heads == ZL_NKV and c.model.rope_theta == 1e6
    assert c.model.param_dtype == "bfloat16" and c.model.compute_dtype == "float32"
    leaves = named_leaves(d.params)
    assert set(n + ".weight" for n in leaves) == set(tensors)  # no embed_tokens, no lm_head
    for n, leaf in leaves.items():
        assert leaf.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint16), tensors[n + ".weight"].view(np.uint16), n)
    # Round trip through our own writer keeps the same 11*L + 3 names.
    dj.save_hf(folder / "again", d)
    assert set(read_header(folder / "again" / "model.safetensors")[0]) == set(tensors)
    assert_bit_exact(d, dj.load_drafter(folder / "again", param_dtype="bfloat16"))


def test_zlab_top_level_keys_variant(zlab_folder):
    """block_size / target_layer_ids at the top level (dflash_config read first, then the top level)."""
    folder, _ = zlab_folder
    def edit(c):
        c["target_layer_ids"] = c["dflash_config"].pop("target_layer_ids")
        c["dflash_config"]["block_size"] = 8  # dflash_config wins over the top-level 16
    edit_config(folder, edit)
    c = dj.load_drafter(folder).config
    assert c.target_layer_ids == (1, 3, 5) and c.block_size == 8


@pytest.mark.parametrize("what", ["missing_fc", "extra_embed", "fc_width"])
def test_zlab_drafter_errors(zlab_folder, what):
    folder, tensors = zlab_folder
    if what == "missing_fc":
        del tensors["fc.weight"]
        pattern = "missing tensor 'fc.weight'"
    elif what == "extra_embed":
        tensors["embed_tokens.weight"] = np.zeros((ZL_V, ZL_H), BF16)
        pattern = "unexpected tensors.*embed_tokens.weight"
    else:  # checkpoint made for 2 taps, config says 3
        tensors["fc.weight"] = tensors["fc.weight"][:, :2 * ZL_H].copy()
        pattern = r"fc.weight.*\[32, 64\].*\[32, 96\]"
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=pattern):
        dj.load_drafter(folder)


_SAVE_ON_ANOTHER_DEVICE = """
import sys, jax
import dflash_jax as dj
from test_checkpoint import _mixed_target
t = _mixed_target(seed=9)
t = t.replace(params=jax.device_put(t.params, jax.devices()[5]))
dj.save(sys.argv[1], t)
"""


def test_orbax_folder_saved_on_a_device_this_host_lacks(tmp_path):
    """A folder records the device its arrays were saved from ("cpu:5" here; "cpu:0" for every shipped model, which
    a GPU host does not have). Loading places the arrays on this process's device instead of failing with orbax's
    'Device cpu:5 was not found' / 'Topology mismatch'."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])]))
    subprocess.run([sys.executable, "-c", _SAVE_ON_ANOTHER_DEVICE, str(tmp_path / "m")], env=env, check=True)
    t = dj.load_target(tmp_path / "m")
    assert_bit_exact(_mixed_target(seed=9), t)
    assert {d for leaf in jax.tree.leaves(t.params) for d in leaf.devices()} == {jax.local_devices()[0]}
