"""HF folders, both ways: Qwen3 / Qwen2 / Llama / Mistral / Qwen3.5 targets, z-lab DFlash / DFlash2 drafters, and
ModelOpt NVFP4 exports of either (safetensors + config.json; the configs are `hf_config` / `zlab_config`'s).

HF tensor names are derived from the parameter paths (see params.py), so the expected key set is exactly the
abstract tree's: a missing, unexpected, mis-shaped or non-finite tensor is an error that names it. Linear layers
quantized by ModelOpt (`weight` uint8 [out, in/2], `weight_scale` E4M3 [out, in/16], `weight_scale_2` f32 scalar,
optional `input_scale`) load as `NVFP4Array` leaves, so their scales can only ever be consumed together.
`params_from_hf` is also the path a GGUF file's tensors take, renamed to HF's (`gguf_model`, `gguf_drafter`).
"""

from __future__ import annotations

import fnmatch
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.hf_config import read_json_object, target_config_to_hf
from dflash_jax.io.lazy_array import LazyArray, RowsTaken
from dflash_jax.io.safetensors_io import SafetensorsError, lazy_safetensors, read_safetensors, write_safetensors
from dflash_jax.io.zlab_config import drafter_config_to_hf
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.parallel import sharding as shd
from dflash_jax.params import from_named, is_linear_name, linear_qkv_order, named_leaves
from dflash_jax.quant.nvfp4 import NVFP4Array

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")

# -- naming ------------------------------------------------------------------------------------------------------

def hf_prefix(kind: str, name: str) -> str:
    """Parameter name -> HF module name (without `.weight`)."""
    if kind == "target" and name != "lm_head":
        return "model." + name
    return name


_BIAS = re.compile(r"\.(q|k|v)_bias$")


def dense_keys(kind: str, name: str) -> tuple[str, ...]:
    """The HF tensor names a dense parameter may be stored under, the one `save_hf` writes first."""
    module = hf_prefix(kind, name)
    if _BIAS.search(name):  # `self_attn.q_bias` is HF's `self_attn.q_proj.bias`
        return (_BIAS.sub(r".\1_proj", module) + ".bias",)
    if name.endswith((".base_kernel", ".A_log", ".dt_bias")):  # HF parameters of their own, no `.weight`
        return (module,)
    if name.endswith("_codebook"):
        return (module, module + ".weight")
    return (module + ".weight",)


# A DeltaNet's in_proj_qkv rows and conv1d channels are held grouped by key head (`params.linear_qkv_order`, so that
# they shard at whole heads), HF stores them q | k | v: permuted on the way in and back on the way out.
_QKV_ROWS = (".linear_attn.in_proj_qkv", ".linear_attn.conv1d")


def qkv_order(kind: str, name: str, cfg) -> np.ndarray | None:
    """HF's row index of each held row of a DeltaNet q/k/v leaf, None for any other leaf."""
    if kind != "target" or cfg is None or not cfg.is_hybrid or not name.endswith(_QKV_ROWS):
        return None
    return linear_qkv_order(cfg)


def rows_taken(leaf, rows: np.ndarray):
    """A dense or NVFP4 leaf with its rows (out features) in the order `rows`; NVFP4 blocks run along the input
    features, so codes and block scales move row by row and the tensor scale stays."""
    if isinstance(leaf, NVFP4Array):
        return leaf.replace(packed=jnp.asarray(leaf.packed)[rows], block_scale=jnp.asarray(leaf.block_scale)[rows])
    return leaf[rows]


# -- HF tensors in ---------------------------------------------------------------------------------------------

def read_tensors(path: Path, lazy: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder (one safetensors file, or an index and its shards), by name; any problem with
    the files is a CheckpointError naming the file."""
    try:
        return _read_tensors_unchecked(path, lazy)
    except (SafetensorsError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(str(e)) from e


def _read_tensors_unchecked(path: Path, lazy: bool = False) -> dict[str, np.ndarray]:
    read = lazy_safetensors if lazy else read_safetensors
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        tensors: dict[str, np.ndarray] = {}
        # Every name is checked before any file is opened (and before sorting, which mixed types would break).
        for shard in weight_map.values():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: shard name {shard!r} must be a file name inside the folder")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard} is missing")
            part = read(path / shard)
            for name, arr in part.items():
                if weight_map.get(name) != shard:
                    raise CheckpointError(f"{path / shard}: tensor {name!r} is not mapped to this shard in the index")
                tensors[name] = arr
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{index}: tensors listed but not found in their shards: {absent[:8]}")
        return tensors
    if single.exists():
        return read(single)
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_quant_config(path: Path, cfg_json: dict) -> dict | None:
    """The ModelOpt quantization section ({quant_algo, group_size, exclude_modules}) or None."""
    q = None
    hf_q = path / "hf_quant_config.json"
    if hf_q.exists():
        q = read_json_object(hf_q).get("quantization")
    elif cfg_json.get("quantization_config"):
        qc = cfg_json["quantization_config"]
        group = (qc.get("config_groups", {}).get("group_0", {}).get("weights", {}) or {}).get("group_size")
        q = {"quant_algo": qc.get("quant_algo"), "group_size": qc.get("group_size", group),
             "exclude_modules": qc.get("ignore", qc.get("exclude_modules", []))}
    if q is None:
        return None
    if q.get("quant_algo") not in NVFP4_ALGOS:
        raise NotImplementedError(f"{path}: quant_algo {q.get('quant_algo')!r} not supported (NVFP4, W4A16_NVFP4)")
    if int(q.get("group_size") or 16) != 16:
        raise CheckpointError(f"{path}: NVFP4 group_size must be 16, got {q.get('group_size')}")
    q["exclude_modules"] = list(q.get("exclude_modules") or [])
    return q


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(module, p) or module == p or module.startswith(p.rstrip("*") + ".")
               for p in patterns)


def _nvfp4_from_hf(module: str, t: dict[str, np.ndarray], shape: tuple[int, int]) -> NVFP4Array:
    out_f, in_f = shape
    w, s, s2 = t.get(module + ".weight"), t.get(module + ".weight_scale"), t.get(module + ".weight_scale_2")
    if s2 is None:
        raise CheckpointError(f"{module}: NVFP4 weight without weight_scale_2 (the per-tensor scale)")
    if s is None:
        raise CheckpointError(f"{module}: NVFP4 weight without weight_scale (the per-block scales)")
    if w is None:
        raise CheckpointError(f"{module}: NVFP4 scales without a packed weight")
    if w.dtype != np.uint8 or w.shape != (out_f, in_f // 2):
        raise CheckpointError(f"{module}.weight: packed NVFP4 weight must be uint8 [{out_f}, {in_f // 2}] "
                              f"for a [{out_f}, {in_f}] linear, got {w.dtype}{list(w.shape)}")
    if s.dtype != ml_dtypes.float8_e4m3fn or s.shape != (out_f, in_f // 16):
        raise CheckpointError(f"{module}.weight_scale: must be float8_e4m3fn [{out_f}, {in_f // 16}], "
                              f"got {s.dtype}{list(s.shape)}")
    if s2.dtype != np.float32 or s2.size != 1:
        raise CheckpointError(f"{module}.weight_scale_2: must be a float32 scalar, got {s2.dtype}{list(s2.shape)}")
    s2v = np.float32(s2.reshape(()))
    if not np.isfinite(s2v) or s2v <= 0:
        raise CheckpointError(f"{module}.weight_scale_2: must be finite and > 0, got {s2v}")
    if not np.all(np.isfinite(s.astype(np.float32))):
        raise CheckpointError(f"{module}.weight_scale: contains NaN")
    fields = dict(packed=jnp.asarray(w), block_scale=jnp.asarray(s), global_scale=jnp.asarray(s2v),
                  shape=(out_f, in_f))
    inp = t.get(module + ".input_scale")
    if inp is not None:
        if inp.dtype != np.float32 or inp.size != 1 or not np.isfinite(inp).all() or float(inp.reshape(())) <= 0:
            raise CheckpointError(f"{module}.input_scale: must be a finite positive float32 scalar, got "
                                  f"{inp.dtype}{list(inp.shape)}")
        fields["input_scale"] = jnp.asarray(np.float32(inp.reshape(())))
    return NVFP4Array(**fields)


def _placed_dense(key: str, arr: LazyArray, sharding, dtype, path: Path):
    """A global array with `sharding` whose every device shard is read from the file on its own (only that slice,
    only when that device's shard is built), converted to `dtype` and checked for NaN / Inf."""
    np_dtype = np.dtype(dtype)

    def shard(index):
        block = arr.read(index)
        block32 = np.asarray(block, np.float32)
        if not np.all(np.isfinite(block32)):
            raise CheckpointError(f"{path}: tensor {key!r} contains NaN or Inf")
        return block if block.dtype == np_dtype else block32.astype(np_dtype)

    return jax.make_array_from_callback(tuple(arr.shape), sharding, shard)


def params_from_hf(kind: str, path: Path, abstract, dtype, quant: dict | None, mesh=None, cfg=None, tensors=None):
    """The parameters of `abstract` (a target's or a drafter's) from HF-named tensors, each checked (name, shape,
    dtype, finite) and converted to `dtype`; NVFP4 ones from their ModelOpt tensors.

    mesh: place every parameter straight into its shards (`dflash_jax.parallel.sharding` rules for `cfg`), reading
    each device's slice from the file on its own, one tensor at a time. tensors: HF-named lazy tensors read from
    elsewhere (a GGUF file) instead of the folder's safetensors."""
    if mesh is not None:
        rules = shd.rules_for(cfg, mesh, what=kind)  # refuses a mesh that cannot split this model, before reading
        axes = {n: s.logical_axes for n, s in named_leaves(abstract).items()}
    if tensors is None:
        tensors = read_tensors(path, lazy=mesh is not None)
    used: set[str] = set()
    named = {}
    for name, spec in named_leaves(abstract).items():
        module = hf_prefix(kind, name)
        has_scales = (module + ".weight_scale") in tensors or (module + ".weight_scale_2") in tensors
        quantized_by_config = (quant is not None and is_linear_name(name)
                               and not _excluded(module, quant["exclude_modules"]))
        if has_scales or quantized_by_config:
            if not is_linear_name(name):
                raise CheckpointError(f"{module}: only linear layers may be NVFP4 (embeddings and norms stay dense)")
            if not has_scales:
                raise CheckpointError(f"{module}: listed as NVFP4-quantized by the quantization config but has "
                                      "no weight_scale / weight_scale_2")
            if len(spec.shape) != 2 or spec.shape[1] % 16:
                raise CheckpointError(f"{module}: in_features {spec.shape[-1]} is not a multiple of 16")
            order = qkv_order(kind, name, cfg)
            if mesh is None:
                leaf = _nvfp4_from_hf(module, tensors, spec.shape)
                named[name] = leaf if order is None else rows_taken(leaf, order)
            else:  # codes and scales are a quarter of a bf16 weight: read whole, then placed shard by shard
                host = {k: np.asarray(tensors[module + k]) for k in (".weight", ".weight_scale", ".weight_scale_2",
                                                                      ".input_scale") if module + k in tensors}
                leaf = _nvfp4_from_hf(module, {module + k: v for k, v in host.items()}, spec.shape)
                leaf = leaf if order is None else rows_taken(leaf, order)
                where = shd._leaf_sharding(name, axes[name], leaf, rules, mesh, kind)
                named[name] = jax.tree.map(shd.place, leaf, where)
            used.update(module + s for s in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale"))
            continue
        candidates = dense_keys(kind, name)
        present = [k for k in candidates if k in tensors]
        if not present:
            raise CheckpointError(f"{path}: missing tensor {candidates[0]!r} (expected shape {list(spec.shape)})")
        if len(present) > 1:
            raise CheckpointError(f"{path}: tensor {name!r} is stored twice, as {present}")
        key = present[0]
        arr = tensors[key]
        if tuple(arr.shape) != tuple(spec.shape):
            raise CheckpointError(f"{path}: tensor {key!r} has shape {list(arr.shape)}, expected {list(spec.shape)}")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {arr.dtype}, expected a float type")
        used.add(key)
        order = qkv_order(kind, name, cfg)
        if order is not None:  # lazily: a device's shard reads only its own q, k and v rows
            arr = RowsTaken(arr, order)
        if mesh is not None:
            named[name] = _placed_dense(key, arr, NamedSharding(mesh, rules.spec(axes[name])), dtype, path)
            continue
        arr32 = np.asarray(arr, dtype=np.float32)
        if not np.all(np.isfinite(arr32)):
            raise CheckpointError(f"{path}: tensor {key!r} contains NaN or Inf")
        named[name] = jnp.asarray(arr32, dtype=dtype)
    # A tied target may still carry a copy of the embedding as lm_head.weight; it must be that copy.
    if kind == "target" and "lm_head.weight" in tensors and "lm_head.weight" not in used:
        head = np.asarray(tensors["lm_head.weight"], np.float32)
        emb = tensors.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not np.array_equal(head, np.asarray(emb, np.float32)):
            raise CheckpointError(f"{path}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    extra = sorted(k for k in tensors if k not in used and not (kind == "target" and k == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:10]}{' ...' if len(extra) > 10 else ''} "
                              f"(is this a {kind} checkpoint of this architecture?)")
    return from_named(abstract, named)


# Tensors of a Qwen3.5 checkpoint that a text decoder does not run: the vision tower of the multimodal layout and
# the multi-token-prediction head (HF skips `mtp.*` on load as well).
_QWEN3_5_SKIPPED = ("model.visual.", "mtp.")


def qwen3_5_text_tensors(path: Path, tensors: dict) -> dict:
    """The text model's tensors under the text-only names (`model.layers...`): the multimodal layout
    (`Qwen3_5ForConditionalGeneration`) keeps them under `model.language_model.`; skipped tensors are noted."""
    out, skipped = {}, []
    for key, arr in tensors.items():
        if key.startswith(_QWEN3_5_SKIPPED):
            skipped.append(key)
        elif key.startswith("model.language_model."):
            out["model." + key[len("model.language_model."):]] = arr
        else:
            out[key] = arr
    if len(out) + len(skipped) != len(tensors):
        raise CheckpointError(f"{path}: a tensor is stored under both the text-only and the multimodal name")
    if skipped:
        kinds = sorted({k.split(".")[0] + ("." + k.split(".")[1] if k.startswith("model.") else "") for k in skipped})
        warnings.warn(f"{path}: {len(skipped)} tensors the text decoder does not use were skipped "
                      f"({', '.join(kinds)})", stacklevel=3)
    return out


# -- HF out ------------------------------------------------------------------------------------------------------

def _np_dense(x, dtype_name: str) -> np.ndarray:
    arr = np.asarray(jax.device_get(x), dtype=np.float32)
    return arr.astype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else arr.astype(np.dtype(dtype_name))


def save_hf(path: str | Path, model, *, dtype: str | None = None, quant_algo: str | None = None) -> Path:
    """Write an HF folder: a target (`Qwen3ForCausalLM`, `Qwen2ForCausalLM`, `LlamaForCausalLM`, ...; see
    `hf_config.target_config_to_hf`) or a z-lab DFlash / DFlash2 drafter (`DFlashDraftModel` / `DFlash2DraftModel`,
    tensor names as z-lab stores them).

    NVFP4 leaves are written in ModelOpt's export format with `hf_quant_config.json` and a `quantization_config`
    in config.json; dense leaves in `dtype` (default: the model's storage dtype). Loading the folder back with
    `load_target` / `load_drafter` gives bit-identical NVFP4 codes and scales.
    """

    if isinstance(model, Target):
        kind, cfg_json, model_cfg = "target", target_config_to_hf(model.config), model.config
    elif isinstance(model, Drafter):
        kind, cfg_json, model_cfg = "drafter", drafter_config_to_hf(model.config), model.config.model
    else:
        raise TypeError(f"save_hf() takes a Target or a Drafter, got {type(model).__name__}")
    dtype = dtype or model_cfg.param_dtype
    cfg_json["torch_dtype"] = dtype
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    quantized, excluded = [], []
    has_input_scale = False
    for name, leaf in named_leaves(model.params).items():
        module = hf_prefix(kind, name)
        order = qkv_order(kind, name, model_cfg)
        if order is not None:  # back to HF's q | k | v rows
            leaf = rows_taken(leaf, np.argsort(order))
        if isinstance(leaf, NVFP4Array):
            tensors[module + ".weight"] = np.asarray(leaf.packed)
            tensors[module + ".weight_scale"] = np.asarray(leaf.block_scale)
            tensors[module + ".weight_scale_2"] = np.asarray(leaf.global_scale, np.float32).reshape(())
            inp = getattr(leaf, "input_scale", None)
            if inp is not None:
                tensors[module + ".input_scale"] = np.asarray(inp, np.float32).reshape(())
                has_input_scale = True
            quantized.append(module)
        else:
            tensors[dense_keys(kind, name)[0]] = _np_dense(leaf, dtype)
            if is_linear_name(name):
                excluded.append(module)
    if quantized:
        algo = quant_algo or ("NVFP4" if has_input_scale else "W4A16_NVFP4")
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
        with open(path / "hf_quant_config.json", "w") as f:
            json.dump({"producer": {"name": "dflash_jax", "version": "0.1.0"}, "quantization": quant}, f, indent=1)
        group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        cfg_json["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
            "config_groups": {"group_0": {"weights": group, **({"input_activations": group} if has_input_scale
                                                                 else {}), "targets": ["Linear"]}},
            "ignore": excluded, "exclude_modules": excluded, "kv_cache_scheme": None,
            "producer": {"name": "dflash_jax", "version": "0.1.0"}}
    else:
        for stale in ("hf_quant_config.json",):
            if (path / stale).exists():
                (path / stale).unlink()
    with open(path / "config.json", "w") as f:
        json.dump(cfg_json, f, indent=1)
    write_safetensors(path / "model.safetensors", tensors, {"format": "pt"})
    return path


__all__ = ["params_from_hf", "read_tensors", "read_quant_config", "qwen3_5_text_tensors", "save_hf", "dense_keys",
           "hf_prefix", "qkv_order", "rows_taken", "NVFP4_ALGOS"]
