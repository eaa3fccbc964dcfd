"""DFlash / DFlash2 drafters as llama.cpp `dflash` GGUF files, checked against gguf-py as the oracle.

gguf-py (0.19.0) is independent of our code: its `GGUFReader` reads what `save_gguf` writes, its `GGUFWriter` writes
the engine-layout files our loader must read, and `gguf.quants.dequantize` is the reference NVFP4 (type 40) decoder.
NVFP4 blocks for GGUFWriter files are packed here by a per-element loop straight from the layout description (value j
of a 16-value sub-block in the low nibble of byte j, value j + 8 in its high nibble), not by `io/gguf_nvfp4.py`.
"""

import shutil

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import cli
from dflash_jax.io import gguf_nvfp4 as g4
from dflash_jax.io.errors import GGUFDrafterError
from dflash_jax.io.gguf_drafter import gguf_name
from dflash_jax.models import drafter as drafter_mod
from dflash_jax.models.drafter import draft_proposal
from dflash_jax.params import abstract_drafter, is_linear_name, named_leaves
from dflash_jax.quant import nvfp4
from dflash_jax.quant.nvfp4 import NVFP4Array
from random_models import make_target, nontrivial_dflash2, random_params

Q = gguf.GGMLQuantizationType
CFG = dj.TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
DFLASH = dj.DrafterConfig(model=CFG.replace(num_hidden_layers=2, eos_token_id=3), block_size=8, mask_token_id=127,
                          target_layer_ids=(0, 2), num_target_layers=4,
                          layer_types=("sliding_attention", "full_attention"), sliding_window=16,
                          output_multiplier=0.5, final_logit_softcapping=8.0)
DFLASH2 = dj.DrafterConfig(model=CFG.replace(num_hidden_layers=2), block_size=8, mask_token_id=126,
                           target_layer_ids=(1, 3), num_target_layers=4, kind="dflash2", is_causal=False,
                           input_embedding_scale=1.5, conv_group_size=16, selector_rank=16, selector_top_k=8)
CONFIGS = {"dflash": DFLASH, "dflash2": DFLASH2}
ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")


def _drafter(kind: str) -> dj.Drafter:
    cfg = CONFIGS[kind]
    params = random_params(abstract_drafter(cfg), 1, std=0.05)
    if kind == "dflash2":
        params = nontrivial_dflash2(params, 2)
    return dj.Drafter(params=params, config=cfg)


def _quantized(kind: str) -> dj.Drafter:
    q = dj.quantize_nvfp4(_drafter(kind))
    # one W4A4 leaf, so `.input_scale` travels too
    named = named_leaves(q.params)
    leaf = named["layers.1.mlp.up_proj"]
    named["layers.1.mlp.up_proj"] = leaf.replace(input_scale=jnp.float32(0.0123))
    from dflash_jax.params import from_named
    return q.replace(params=from_named(abstract_drafter(q.config), named))


@pytest.fixture(scope="module")
def target():
    return make_target(CFG, 0)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.standard_normal((2, 12, 2 * CFG.hidden_size)), jnp.float32)
    block = np.full((2, 8), 127)
    block[:, 0] = rng.integers(0, 120, 2)
    return feats, jnp.asarray(block)


def _outputs(drafter, target, inputs):
    p = draft_proposal(target, drafter, *inputs)
    return np.asarray(p.logits), np.asarray(dj.draft_tokens(target, drafter, *inputs))


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.astype(np.float32).view(np.uint32)


def _assert_same_params(a: dj.Drafter, b: dj.Drafter):
    na, nb = named_leaves(a.params), named_leaves(b.params)
    assert na.keys() == nb.keys()
    for name in na:
        x, y = na[name], nb[name]
        assert type(x) is type(y), name
        if isinstance(x, NVFP4Array):
            assert x.shape == y.shape, name
            for f in ("packed", "block_scale", "global_scale"):
                np.testing.assert_array_equal(_bits(getattr(x, f)), _bits(getattr(y, f)), err_msg=f"{name}.{f}")
            assert (x.input_scale is None) == (y.input_scale is None), name
            if x.input_scale is not None:
                np.testing.assert_array_equal(_bits(x.input_scale), _bits(y.input_scale), err_msg=name)
        else:
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=name)


def _fold_zero(x: np.ndarray) -> np.ndarray:
    """float32 bits with -0.0 folded into +0.0: E2M1 code 8 is -0 in ModelOpt's grid (and ours), +0 in ggml's
    doubled-integer table; every other value must match bit for bit."""
    return (np.asarray(x, np.float32) + np.float32(0.0)).view(np.uint32)


def _pack_reference(packed: np.ndarray, block_scale: np.ndarray) -> np.ndarray:
    """ModelOpt (packed, block_scale) -> GGUF NVFP4 bytes by a per-element loop over the layout description."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    scale_bytes = np.asarray(block_scale).view(np.uint8)
    out = np.zeros((rows, k // 64 * 36), np.uint8)
    for r in range(rows):
        for v in range(k):
            code = (packed[r, v // 2] >> (4 * (v % 2))) & 0xF  # ModelOpt: value 2i low nibble, 2i+1 high
            blk, sub, j = v // 64, (v % 64) // 16, v % 16
            base = blk * 36
            out[r, base + sub] = scale_bytes[r, v // 16]
            out[r, base + 4 + sub * 8 + j % 8] |= code << (4 * (j // 8))
    return out


# -- NVFP4 repacking ---------------------------------------------------------------------------------------------

def test_repack_is_exact_both_ways_and_dequantizes_as_gguf_py():
    rng = np.random.default_rng(0)
    rows, k = 6, 192
    packed = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)  # every code, both nibbles
    scale_bytes = rng.integers(0, 0x7F, (rows, k // 16), dtype=np.uint8)  # zero, subnormal and normal UE4M3
    scale_bytes[0, :3] = (0, 1, 0x7E)
    block_scale = scale_bytes.view(ml_dtypes.float8_e4m3fn)
    raw = g4.to_gguf_blocks(packed, block_scale)
    np.testing.assert_array_equal(raw, _pack_reference(packed, block_scale))
    back_packed, back_scale = g4.from_gguf_blocks(raw, k)
    np.testing.assert_array_equal(back_packed, packed)
    np.testing.assert_array_equal(back_scale.view(np.uint8), scale_bytes)
    ref = gguf.quants.dequantize(raw, Q.NVFP4)  # [rows, k] float32
    q = NVFP4Array(packed=jnp.asarray(back_packed), block_scale=jnp.asarray(back_scale),
                   global_scale=jnp.float32(1.0), shape=(rows, k))
    ours = np.asarray(nvfp4.dequantize(q))
    assert int((_fold_zero(ours) != _fold_zero(ref)).sum()) == 0
    # the only difference before folding is the sign of zero (code 8)
    assert np.all((ours.view(np.uint32) == ref.view(np.uint32)) | ((ours == 0) & (ref == 0)))


def test_repack_reads_ggml_zero_alias_and_refuses_signed_scales():
    raw = np.zeros((1, 36), np.uint8)
    raw[0, :4] = (0x7F, 0x38, 0x38, 0x38)  # 0x7F is 0 for ggml (NaN in E4M3FN)
    raw[0, 4:] = 0x22
    _, scale = g4.from_gguf_blocks(raw, 64)
    assert scale.view(np.uint8)[0, 0] == 0
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, Q.NVFP4)[0, :16], 0.0)
    raw[0, 2] = 0xB8
    with pytest.raises(g4.NVFP4LayoutError, match="sign bit"):
        g4.from_gguf_blocks(raw, 64, name="blk.0.attn_q.weight")
    with pytest.raises(g4.NVFP4LayoutError, match="multiple of 64"):
        g4.to_gguf_blocks(np.zeros((2, 16), np.uint8), np.zeros((2, 2), ml_dtypes.float8_e4m3fn), name="x")


# -- ours -> GGUF -> ours ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("quant", ["dense", "nvfp4"])
def test_roundtrip_is_bit_exact_with_identical_logits(tmp_path, target, inputs, kind, quant):
    d = _quantized(kind) if quant == "nvfp4" else _drafter(kind)
    path = dj.save_gguf(tmp_path / "d.gguf", d)
    back = dj.load_drafter(path, param_dtype="float32", compute_dtype="float32")
    assert back.config == d.config
    _assert_same_params(d, back)
    (la, ta), (lb, tb) = _outputs(d, target, inputs), _outputs(back, target, inputs)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(ta, tb)


def test_drafter_read_back_runs_the_programs_of_the_one_in_memory(tmp_path, target):
    """A drafter read back from GGUF differs from the one in memory only where no program looks: its model config's
    tie_word_embeddings (which the file does not record; it describes the target) and whether its arrays are
    committed to the device (a read-back's are not). It runs the very programs the in-memory drafter compiled: the
    generation programs and `draft_logits`'s."""
    d = dj.quantize_nvfp4(_drafter("dflash"))
    d = jax.device_put(d.replace(config=d.config.replace(model=d.config.model.replace(tie_word_embeddings=True))),
                       jax.devices()[0])
    back = dj.load_drafter(dj.save_gguf(tmp_path / "d.gguf", d), param_dtype="float32", compute_dtype="float32")
    assert back.config.model.tie_word_embeddings is False and back.config != d.config
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    first = dj.generate(target, d, prompts, max_new_tokens=8)
    again = dj.generate(target, back, prompts, max_new_tokens=8)
    assert first.timings["compile_s"] > 0 and again.timings["compile_s"] == 0.0
    np.testing.assert_array_equal(first.tokens, again.tokens)
    width = len(d.config.target_layer_ids) * target.config.hidden_size
    features = jax.random.normal(jax.random.key(0), (2, 5, width), jnp.float32)  # [B, C, K*H]
    block = jnp.asarray([[9] + [d.config.mask_token_id] * (d.config.block_size - 1)] * 2, jnp.int32)
    before = drafter_mod._draft_jit._cache_size()
    logits = dj.draft_logits(target, d, features, block)
    assert drafter_mod._draft_jit._cache_size() == before + 1
    np.testing.assert_array_equal(dj.draft_logits(target, back, features, block), logits)
    assert drafter_mod._draft_jit._cache_size() == before + 1


def test_save_gguf_is_read_by_gguf_py(tmp_path):
    d = _quantized("dflash2")
    path = dj.save_gguf(tmp_path / "d.gguf", d)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == 8
    assert fields["dflash.target_layers"] == [2, 4]  # HF ids 1, 3 + 1
    assert fields["dflash.mask_token_id"] == 126
    assert fields["dflash.block_count"] == 2 and fields["dflash.embedding_length"] == 64
    assert fields["dflash.attention.head_count"] == 4 and fields["dflash.attention.head_count_kv"] == 2
    assert fields["dflash.attention.key_length"] == 16 and fields["dflash.feed_forward_length"] == 128
    assert fields["dflash.conv_kernel_size"] == 2 and fields["dflash.conv_group_size"] == 16
    assert fields["dflash.selector_rank"] == 16 and fields["dflash.selector_top_k"] == 8
    assert fields["dflash.attention.causal"] is False and fields["dflash.sample_from_anchor"] is False
    assert fields["dflash.embedding_scale"] == pytest.approx(1.5)
    tensors = {t.name: t for t in reader.tensors}
    per_layer = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight", "attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base",
                 "ffn_conv_proj.weight"]
    weights = ({"fc.weight", "enc.output_norm.weight", "output_norm.weight", "selector_predecessor.weight",
                "selector_successor.weight", "selector_hidden.weight"}
               | {f"blk.{i}.{n}" for i in range(2) for n in per_layer})
    linear = ("fc", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_conv_proj",
              "ffn_conv_proj", "selector_hidden")
    scales = {n[: -len(".weight")] + ".scale" for n in weights if n.split(".")[-2] in linear}
    assert len(scales) == 1 + 2 * 9 + 1
    assert set(tensors) == weights | scales | {"blk.1.ffn_up.input_scale"}
    named = named_leaves(d.params)
    for name, leaf in named.items():
        t = tensors[gguf_name(name)]
        assert list(reversed(t.shape.tolist())) == list(leaf.shape), name  # gguf-py lists ne (innermost first)
        if isinstance(leaf, NVFP4Array):
            assert t.tensor_type == Q.NVFP4, name
            s = tensors[gguf_name(name)[: -len(".weight")] + ".scale"]
            assert s.tensor_type == Q.F32 and s.shape.tolist() == [1]
            np.testing.assert_array_equal(np.asarray(s.data).view(np.uint32),
                                          np.asarray(leaf.global_scale, np.float32).reshape(1).view(np.uint32))
            # the type-40 data dequantizes, by gguf-py's decoder, to our codes x block scales bit for bit
            ref = gguf.quants.dequantize(np.asarray(t.data), Q.NVFP4).reshape(leaf.shape)
            ours = np.asarray(nvfp4.dequantize(leaf.replace(global_scale=jnp.float32(1.0))))
            assert int((_fold_zero(ours) != _fold_zero(ref)).sum()) == 0, name
        else:
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(leaf.shape), np.asarray(leaf), err_msg=name)
    assert np.asarray(tensors["blk.1.ffn_up.input_scale"].data)[0] == np.float32(0.0123)


# -- engine-layout files written by gguf-py ----------------------------------------------------------------------

def _engine_file(path, drafter: dj.Drafter, *, types=None, meta_over=None, tensor_over=None, vocab_in_file=False):
    """A `dflash` GGUF as llama.cpp's converter lays it out, written by gguf-py's GGUFWriter. Returns the drafter
    those bytes hold (dense tensors as gguf-py rounds them). types: {param name: ggml type} for dense linears;
    meta_over / tensor_over: metadata / tensors to replace (None value = leave out)."""
    cfg, m = drafter.config, drafter.config.model
    w = gguf.GGUFWriter(str(path), "dflash")
    meta = {
        "dflash.block_count": (w.add_uint32, m.num_hidden_layers),
        "dflash.context_length": (w.add_uint32, m.max_position_embeddings),
        "dflash.embedding_length": (w.add_uint32, m.hidden_size),
        "dflash.feed_forward_length": (w.add_uint32, m.intermediate_size),
        "dflash.attention.head_count": (w.add_uint32, m.num_attention_heads),
        "dflash.attention.head_count_kv": (w.add_uint32, m.num_key_value_heads),
        "dflash.attention.key_length": (w.add_uint32, m.head_dim),
        "dflash.attention.value_length": (w.add_uint32, m.head_dim),
        "dflash.attention.layer_norm_rms_epsilon": (w.add_float32, m.rms_norm_eps),
        "dflash.rope.freq_base": (w.add_float32, m.rope_theta),
        "dflash.block_size": (w.add_uint32, cfg.block_size),
        "dflash.target_layers": (w.add_array, [i + 1 for i in cfg.target_layer_ids]),
        "dflash.target_hidden_size": (w.add_uint32, m.hidden_size),
        "tokenizer.ggml.mask_token_id": (w.add_uint32, cfg.mask_token_id),
    }
    if vocab_in_file:
        meta["tokenizer.ggml.tokens"] = (w.add_array, [f"t{i}" for i in range(m.vocab_size)])
    if cfg.is_causal is not None:
        meta["dflash.attention.causal"] = (w.add_bool, cfg.is_causal)
    if cfg.sliding_window is not None:
        meta["dflash.attention.sliding_window"] = (w.add_uint32, cfg.sliding_window)
        meta["dflash.attention.sliding_window_pattern"] = (w.add_array,
                                                           [t == "sliding_attention" for t in cfg.layer_types])
    if cfg.input_embedding_scale != 1.0:
        meta["dflash.embedding_scale"] = (w.add_float32, cfg.input_embedding_scale)
    if cfg.output_multiplier != 1.0:
        meta["dflash.logit_scale"] = (w.add_float32, cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        meta["dflash.final_logit_softcapping"] = (w.add_float32, cfg.final_logit_softcapping)
    if cfg.is_dflash2:
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            meta[f"dflash.{k}"] = (w.add_uint32, getattr(cfg, k))
    for key, value in (meta_over or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            add = w.add_bool if isinstance(value, bool) else w.add_array if isinstance(value, list) else w.add_uint32
            meta[key] = (add, value)
    for key, (add, value) in meta.items():
        add(key, value)
    held = {}
    tensors = {}
    for name, leaf in named_leaves(drafter.params).items():
        tname = gguf_name(name)
        if isinstance(leaf, NVFP4Array):
            base = tname[: -len(".weight")]
            tensors[tname] = (_pack_reference(np.asarray(leaf.packed), np.asarray(leaf.block_scale)), Q.NVFP4, None)
            tensors[base + ".scale"] = (np.asarray(leaf.global_scale, np.float32).reshape(1), Q.F32, None)
            if leaf.input_scale is not None:
                tensors[base + ".input_scale"] = (np.asarray(leaf.input_scale, np.float32).reshape(1), Q.F32, None)
            held[name] = leaf
            continue
        arr = np.asarray(leaf, np.float32)
        qtype = (types or {}).get(name, Q.F32)
        data = gguf.quants.quantize(arr, qtype)
        held[name] = jnp.asarray(gguf.quants.dequantize(data, qtype).reshape(arr.shape) if qtype != Q.F32 else arr)
        tensors[tname] = (data, qtype, None)
    for key, value in (tensor_over or {}).items():
        if value is None:
            tensors.pop(key, None)
        else:
            tensors[key] = value
    for tname, (data, qtype, byte_shape) in tensors.items():  # byte_shape: declared row bytes (gguf-py's raw_shape)
        w.add_tensor(tname, data, raw_shape=byte_shape, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from dflash_jax.params import from_named
    return drafter.replace(params=from_named(abstract_drafter(drafter.config), held))


def _mixed_types(drafter) -> dict:
    linears = [n for n in named_leaves(drafter.params) if is_linear_name(n)]
    cycle = (Q.F16, Q.BF16, Q.Q8_0, Q.F32)
    return {n: cycle[i % 4] for i, n in enumerate(linears)}


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_engine_layout_files_load_with_the_logits_of_their_drafter(tmp_path, target, inputs, kind):
    # dense F32 / F16 / BF16 / Q8_0 linears
    dense = _drafter(kind)
    made = _engine_file(tmp_path / "dense.gguf", dense, types=_mixed_types(dense), vocab_in_file=True)
    loaded = dj.load_drafter(tmp_path / "dense.gguf", num_target_layers=4, param_dtype="float32",
                             compute_dtype="float32")
    assert loaded.config == dense.config.replace(model=dense.config.model.replace(eos_token_id=None))
    _assert_same_params(made, loaded)
    np.testing.assert_array_equal(_outputs(made, target, inputs)[0], _outputs(loaded, target, inputs)[0])
    # NVFP4: the engine's type-40 blocks + `.scale` (+ `.input_scale`)
    q = _quantized(kind)
    made = _engine_file(tmp_path / "nvfp4.gguf", q)
    loaded = dj.load_drafter(tmp_path / "nvfp4.gguf", vocab_size=128, num_target_layers=4, param_dtype="float32",
                             compute_dtype="float32")
    _assert_same_params(q, loaded)
    (la, ta), (lb, tb) = _outputs(q, target, inputs), _outputs(loaded, target, inputs)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(ta, tb)


# -- bad input ---------------------------------------------------------------------------------------------------

class _Compiles:
    """Counts XLA compilations while active (a refused file must be refused before anything compiles)."""

    def __enter__(self):
        self.count = 0
        self._listener = lambda event, *a, **k: setattr(self, "count", self.count + ("backend_compile" in event))
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def _refused(path, match, **kw):
    with _Compiles() as c:
        with pytest.raises(GGUFDrafterError, match=match):
            dj.load_drafter(path, vocab_size=128, num_target_layers=4, **kw)
    assert c.count == 0


def _retype(src, dst, tensor: str, type_id: int):
    """A copy of `src` whose tensor info for `tensor` declares ggml type `type_id` (found with gguf-py's reader)."""
    data = bytearray(src.read_bytes())
    field = next(t for t in gguf.GGUFReader(src).tensors if t.name == tensor)
    key = len(tensor).to_bytes(8, "little") + tensor.encode()
    at = data.index(key) + len(key)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    assert n_dims == len(field.shape)
    at += 4 + 8 * n_dims  # the type follows the dims
    assert int.from_bytes(data[at:at + 4], "little") == int(field.tensor_type)
    data[at:at + 4] = type_id.to_bytes(4, "little")
    dst.write_bytes(bytes(data))


def test_bad_files_are_refused_naming_the_problem(tmp_path):
    with _Compiles() as c:  # the counter does see a compilation
        jax.jit(lambda x: x * 3 + 0.25)(jnp.ones(5))
    assert c.count > 0
    q = _quantized("dflash")
    good = dj.save_gguf(tmp_path / "good.gguf", q)
    raw = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(raw[: len(raw) - 100])
    _refused(tmp_path / "trunc.gguf", r"truncated file: tensor 'output_norm\.weight'")
    (tmp_path / "header.gguf").write_bytes(raw[:300])
    _refused(tmp_path / "header.gguf", "truncated file")

    fc = named_leaves(q.params)["fc"]
    _engine_file(tmp_path / "scale_shape.gguf", q, tensor_over={"fc.scale": (np.ones(2, np.float32), Q.F32, None)})
    _refused(tmp_path / "scale_shape.gguf", r"'fc\.scale'.*must be F32 of shape \{1\}, got F32 \[2\]")
    _engine_file(tmp_path / "no_scale.gguf", q, tensor_over={"blk.1.attn_v.scale": None})
    _refused(tmp_path / "no_scale.gguf", r"'blk\.1\.attn_v\.weight' has no per-tensor scale 'blk\.1\.attn_v\.scale'")
    # the E2M1 codes alone, without the four block-scale bytes of each 64-value block
    codes_only = np.ascontiguousarray(_pack_reference(np.asarray(fc.packed), np.asarray(fc.block_scale))
                                      .reshape(-1, 36)[:, 4:]).reshape(64, -1)
    _engine_file(tmp_path / "no_block_scales.gguf", q, tensor_over={"fc.weight": (codes_only, Q.NVFP4, (64, 72))})
    _refused(tmp_path / "no_block_scales.gguf", r"tensors 'fc\.weight' and 'fc\.scale' overlap")
    _retype(good, tmp_path / "unknown_type.gguf", "blk.0.attn_q.weight", 77)
    _refused(tmp_path / "unknown_type.gguf", r"tensor 'blk\.0\.attn_q\.weight' has unknown ggml tensor type id 77")
    for layers in ([0, 3], [2, 5]):
        _engine_file(tmp_path / "layers.gguf", q, meta_over={"dflash.target_layers": layers})
        _refused(tmp_path / "layers.gguf", r"dflash\.target_layers .* out of range: stored as HF layer id \+ 1")
    _engine_file(tmp_path / "anchor.gguf", q, meta_over={"dflash.sample_from_anchor": True})
    with pytest.raises(NotImplementedError, match="sample_from_anchor = true"):
        dj.load_drafter(tmp_path / "anchor.gguf", vocab_size=128, num_target_layers=4)
    with pytest.raises(GGUFDrafterError, match="no target depth"):  # the engine's files do not record it
        dj.load_drafter(tmp_path / "no_scale.gguf", vocab_size=128)


# -- the audit ---------------------------------------------------------------------------------------------------

def _patch_scales(src, dst, value, which):
    shutil.copy(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    for t in r.tensors:
        if t.name.endswith(".scale") and which(t.name):
            t.data[...] = value
    del r


def test_audit_names_exactly_the_attention_scales_set_to_one(tmp_path, capsys):
    # the graph check (audit_scales on the loaded drafter's forward) on a DFlash file; the table on a DFlash2 one
    graph = dj.audit_file(dj.save_gguf(tmp_path / "dflash.gguf", _quantized("dflash")))
    assert graph.ok and graph.graph.ok and len(graph.graph.checked) == 15
    good = dj.save_gguf(tmp_path / "good.gguf", _quantized("dflash2"))
    report = dj.audit_file(good, graph=False)
    assert report.ok and not report.flagged and len(report.rows) == 20
    is_attn = lambda n: n.split(".")[-2] in ATTN
    _patch_scales(good, tmp_path / "bug.gguf", 1.0, is_attn)
    report = dj.audit_file(tmp_path / "bug.gguf", graph=False)
    assert sorted(report.flagged_names) == sorted(f"blk.{i}.{a}.scale" for i in range(2) for a in ATTN)
    assert all("exactly 1.0" in r.flags[0] for r in report.flagged)
    assert cli.main(["audit", str(tmp_path / "bug.gguf"), "--no-graph"]) == 1
    assert "FLAGGED: blk.0.attn_q.scale" in capsys.readouterr().out
    assert cli.main(["audit", str(good), "--no-graph"]) == 0


def test_audit_of_a_one_layer_drafter_names_only_the_attention_scales(tmp_path):
    """The default SmolLM2 drafter has one layer: with its four attention scales at 1.0 the layer's FFN scales must
    not be called outliers against siblings that are mostly the broken 1.0s (flagged scales are no reference)."""
    cfg = DFLASH.replace(model=DFLASH.model.replace(num_hidden_layers=1), layer_types=None, sliding_window=None)
    q = dj.quantize_nvfp4(dj.Drafter(params=random_params(abstract_drafter(cfg), 3, std=0.05), config=cfg))
    good = dj.save_gguf(tmp_path / "one.gguf", q)
    assert dj.audit_file(good, graph=False).ok
    _patch_scales(good, tmp_path / "bug.gguf", 1.0, lambda n: n.split(".")[-2] in ATTN)
    report = dj.audit_file(tmp_path / "bug.gguf", graph=False)
    assert sorted(report.flagged_names) == sorted(f"blk.0.{a}.scale" for a in ATTN)
    # an outlier among the rest is still caught, its unflagged siblings being the references (with two of them
    # left, their median is dragged too: the audit then names the whole FFN, which is a place to look, not a miss)
    _patch_scales(tmp_path / "bug.gguf", tmp_path / "bug2.gguf", 3.0, lambda n: n == "blk.0.ffn_up.scale")
    report = dj.audit_file(tmp_path / "bug2.gguf", graph=False)
    assert "blk.0.ffn_up.scale" in report.flagged_names
    assert report.flagged[report.flagged_names.index("blk.0.ffn_up.scale")].flags[0].startswith("outlier")


@pytest.mark.parametrize("value,flag", [(0.0, "zero"), (-1e-4, "negative"), (np.nan, "NaN"), (np.inf, "infinite"),
                                        (3.0, "outlier")])
def test_audit_flags_impossible_scales(tmp_path, value, flag):
    good = dj.save_gguf(tmp_path / "good.gguf", _quantized("dflash"))
    _patch_scales(good, tmp_path / "bad.gguf", value, lambda n: n == "blk.1.ffn_gate.scale")
    report = dj.audit_file(tmp_path / "bad.gguf", graph=False)
    assert report.flagged_names == ["blk.1.ffn_gate.scale"]
    assert report.flagged[0].flags[0].startswith(flag)


def test_audit_reports_a_missing_scale_and_reads_folders(tmp_path):
    q = _quantized("dflash")
    _engine_file(tmp_path / "no_scale.gguf", q, tensor_over={"blk.0.attn_k.scale": None})
    report = dj.audit_file(tmp_path / "no_scale.gguf", vocab_size=128, num_target_layers=4)
    assert report.flagged_names == ["blk.0.attn_k.scale"] and report.flagged[0].flags == ["missing"]
    assert report.load_error is not None and not report.ok
    dj.save_hf(tmp_path / "hf", q)
    hf = dj.audit_file(tmp_path / "hf", graph=False)
    assert len(hf.rows) == 15 and not hf.flagged
    broken = dj.drop_global_scales(q)
    dj.save(tmp_path / "orbax", broken)
    ob = dj.audit_file(tmp_path / "orbax", graph=False)
    assert sorted(r.tensor for r in ob.flagged) == sorted(
        f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")


@pytest.mark.parametrize("dtype,qtype,np_dtype", [("bfloat16", Q.BF16, ml_dtypes.bfloat16), ("float16", Q.F16,
                                                                                               np.float16)])
def test_save_gguf_writes_dense_linears_in_half_precision(tmp_path, dtype, qtype, np_dtype):
    d = _drafter("dflash2")
    path = dj.save_gguf(tmp_path / "d.gguf", d, dtype=dtype)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    back = dj.load_drafter(path, param_dtype="float32", compute_dtype="float32")
    for name, leaf in named_leaves(d.params).items():
        half = is_linear_name(name) or name.endswith("_codebook")  # norms and conv base kernels stay F32
        assert types[gguf_name(name)] == (qtype if half else Q.F32), name
        want = np.asarray(leaf).astype(np_dtype).astype(np.float32) if half else np.asarray(leaf)
        np.testing.assert_array_equal(np.asarray(named_leaves(back.params)[name]), want, err_msg=name)


def test_metadata_read_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's conventions (ggml-org/llama.cpp common/speculative.cpp @ 001d906a, src/models/dflash.cpp @
    01b78a15): a stored target layer L is the hidden state entering target layer L, and L = the target's depth is
    the last layer's output; a sliding window of 0 is no sliding window (the pattern is not read)."""
    q = _quantized("dflash")  # sliding layer 0 (window 16), full layer 1; taps HF 0 and 2 of a 4-layer target
    _engine_file(tmp_path / "last.gguf", q, meta_over={"dflash.target_layers": [1, 4]})
    cfg = dj.load_drafter(tmp_path / "last.gguf", vocab_size=128, num_target_layers=4).config
    assert cfg.target_layer_ids == (0, 3)  # 4 = the 4-layer target's last layer output = HF layer id 3
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 16
    _engine_file(tmp_path / "window0.gguf", q, meta_over={"dflash.attention.sliding_window": 0})
    cfg = dj.load_drafter(tmp_path / "window0.gguf", vocab_size=128, num_target_layers=4).config
    assert cfg.layer_types is None and cfg.sliding_window is None
    assert [cfg.layer_attention(i)[1] for i in range(2)] == [None, None]


def test_bench_proposal_agreement(tmp_path, target):
    """`bench --gguf-roundtrip`'s proposal comparison: a drafter agrees with itself on every slot; the file with its
    attention `.scale` set to 1 proposes differently (on random weights nothing else holds its proposals in place)."""
    from dflash_jax.bench import gguf_replay as bench

    intact, broken = bench.gguf_roundtrip(_quantized("dflash"), tmp_path, name="d")
    prompts = [[5, 9, 17, 33], [7, 8]]
    same = bench.proposal_agreement(target, intact, intact, prompts, new_tokens=12, stride=4)
    assert same["slots"] == 28 and same["agree"] == 1.0 and same["intact_hits"] == same["broken_hits"]
    diff = bench.proposal_agreement(target, intact, broken, prompts, new_tokens=12, stride=4)
    assert diff["slots"] == 28 and diff["agree"] < 0.9
    assert "of 28 block slots (anchors every 4 tokens of the 12-token greedy answers)" in \
        bench.format_proposal_agreement(diff)
