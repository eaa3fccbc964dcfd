"""Audit the NVFP4 scales of a model file: a llama.cpp `dflash` GGUF, an HF / ModelOpt folder or a `save` (orbax) folder.

Two questions, answered separately:

1. Does every scale reach the output? `quant.audit.audit_scales` on the loaded model's forward (the drafter's proposal
   against the given target, or a random one of the right shape; a target's own forward).
2. Is every per-tensor scale a value the ModelOpt recipe could have written? Under the recipe the tensor scale is
   amax(|W|) / (6 * 448) and the block scales are relative to it, so a tensor's largest block scale is 448 whatever the
   tensor scale is: the block scales cannot tell a wrong tensor scale, only the tensor scale itself can. A scale is
   flagged when it is missing, zero, negative, NaN or infinite; exactly 1.0 (the recipe gives 1.0 only when
   amax(|W|) is exactly 2688, which trained weights never hit; an all-zero tensor, whose scale we set to 1.0, is
   exempt); or more than `OUTLIER_DECADES` orders of magnitude away both from the same tensor kind in the other
   layers and from the other quantized tensors of its own layer (each compared with the median of the others).

A GGUF file is read raw for the table (a missing or mis-shaped `.scale` is a row, not an exception); question 1 then
needs a loadable file and is skipped with the reason when it is not.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.io import gguf_drafter as gd
from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.hf_folder import read_tensors
from dflash_jax.io.model_path import model_path
from dflash_jax.models.drafter import Drafter, draft_proposal
from dflash_jax.models.target import Target, target_forward
from dflash_jax.params import abstract_target, init_from_abstract, named_leaves
from dflash_jax.quant.audit import ScaleAudit, audit_scales
from dflash_jax.quant.nvfp4 import E2M1_MAX, E4M3_MAX, NVFP4Array

OUTLIER_DECADES = 2.0  # a factor of 100 from both reference medians
RECIPE_UNIT = E2M1_MAX * E4M3_MAX  # 2688: the amax at which the recipe's tensor scale is exactly 1.0


@dataclasses.dataclass
class ScaleRow:
    tensor: str  # the quantized weight's name in the file
    scale_name: str  # where its per-tensor scale lives in the file
    scale: float | None  # None: missing or unreadable
    kind: str  # role, e.g. "attn_q" / "self_attn.q_proj"
    layer: int | None
    block_scale_max: float | None = None
    all_zero: bool = False
    input_scale: float | None = None
    flags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FileAudit:
    path: str
    fmt: str  # "gguf" | "hf" | "orbax"
    rows: list[ScaleRow]
    graph: ScaleAudit | None = None
    graph_skipped: str | None = None  # why there is no graph check
    load_error: str | None = None  # the file does not load (its table is still shown)

    @property
    def flagged(self) -> list[ScaleRow]:
        return [r for r in self.rows if r.flags]

    @property
    def flagged_names(self) -> list[str]:
        return [r.scale_name for r in self.flagged]

    @property
    def ok(self) -> bool:
        return not self.flagged and (self.graph is None or self.graph.ok) and self.load_error is None

    def format(self) -> str:
        lines = [f"{self.path} ({self.fmt}): {len(self.rows)} NVFP4 tensors, {len(self.flagged)} per-tensor scales "
                 "flagged", ""]
        head = f"{'per-tensor scale':<44} {'value':>12} {'max block':>9} {'input':>10}  flags"
        lines += [head, "-" * len(head)]
        for r in self.rows:
            value = "missing" if r.scale is None else f"{r.scale:.4e}"
            block = "-" if r.block_scale_max is None else f"{r.block_scale_max:g}"
            inp = "-" if r.input_scale is None else f"{r.input_scale:.3e}"
            lines.append(f"{r.scale_name:<44} {value:>12} {block:>9} {inp:>10}  {'; '.join(r.flags) or 'ok'}")
        lines.append("")
        if self.graph is not None:
            g = self.graph
            lines.append(f"graph check (audit_scales): {len(g.checked)} NVFP4 leaves, {len(g.missing)} scales not "
                         f"reaching the output, {len(g.mismatched)} leaves differing from their dequantized forward"
                         + ("" if g.ok else ":\n  " + "\n  ".join(list(g.missing) + list(g.mismatched))))
        else:
            lines.append(f"graph check (audit_scales): skipped ({self.graph_skipped})")
        if self.ok:
            verdict = "OK"
        else:
            why = [", ".join(self.flagged_names)] if self.flagged else []
            why += ["scales not reaching the output"] if self.graph is not None and not self.graph.ok else []
            why += ["the file does not load"] if self.load_error else []
            verdict = "FLAGGED: " + "; ".join(why)
        lines.append("verdict: " + verdict)
        return "\n".join(lines)


# -- the table ---------------------------------------------------------------------------------------------------

def _split_gguf(name: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    return (m.group(2), int(m.group(1))) if m else (name, None)


def _split_hf(name: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.(.+)", name)
    return (m.group(2), int(m.group(1))) if m else (name, None)


def _value_flags(v: float | None, all_zero: bool) -> list[str]:
    if v is None:
        return ["missing"]
    if not math.isfinite(v):
        return ["NaN" if math.isnan(v) else "infinite"]
    if v == 0:
        return ["zero"]
    if v < 0:
        return ["negative"]
    if v == 1.0 and not all_zero:
        return [f"exactly 1.0 (the recipe gives 1.0 only for amax(|W|) = {RECIPE_UNIT:g})"]
    return []


def _outlier_flags(rows: list[ScaleRow]) -> None:
    """Flag a scale > OUTLIER_DECADES decades from the median of the same kind in other layers AND from the median of
    its layer's other quantized tensors (whichever of the two exists when only one does).

    Only scales not already flagged serve as references: a value that cannot be right must not make its neighbours
    look wrong. (In a one-layer drafter whose four attention scales were set to 1.0, the layer's three FFN scales
    would otherwise sit decades from the median of their six siblings, four of them 1.0.)"""
    good = [r for r in rows if not r.flags and r.scale is not None and math.isfinite(r.scale) and r.scale > 0]
    for r in good:
        same_kind = [math.log10(o.scale) for o in good if o is not r and o.kind == r.kind]
        siblings = [math.log10(o.scale) for o in good if o is not r and o.layer == r.layer]
        here = math.log10(r.scale)
        off = [abs(here - float(np.median(ref))) for ref in (same_kind, siblings) if ref]
        if off and min(off) > OUTLIER_DECADES:
            r.flags.append(f"outlier: {min(off):.1f} decades from the same kind in other layers and from its "
                           "siblings")


def _finish(rows: list[ScaleRow]) -> list[ScaleRow]:
    for r in rows:
        r.flags = _value_flags(r.scale, r.all_zero) + r.flags
    _outlier_flags(rows)
    return rows


def _gguf_rows(path: Path) -> list[ScaleRow]:
    g = gd.open_gguf(path)
    rows = []
    for name, info in g.tensors.items():
        if info.type_id != gd.NVFP4:
            continue
        base = gd._base(name)
        kind, layer = _split_gguf(base)
        row = ScaleRow(tensor=name, scale_name=base + ".scale", scale=None, kind=kind, layer=layer)
        raw = np.asarray(g.raw(name)).reshape(-1, 36)
        scale_bytes = np.where(raw[:, :4] == 0x7F, 0, raw[:, :4] & 0x7F).astype(np.uint8)  # as ggml reads them
        row.block_scale_max = float(scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).max())
        row.all_zero = not (raw[:, 4:] & 0x77).any()  # every code +-0
        s = g.tensors.get(base + ".scale")
        if s is not None:
            if s.type_id != gd.F32 or int(np.prod(s.shape)) != 1:
                row.flags.append(f"mis-shaped: {s.type_name} {list(s.shape)}, expected F32 {{1}}")
            else:
                row.scale = float(g.dequantize(base + ".scale").reshape(()))
        i = g.tensors.get(base + ".input_scale")
        if i is not None and i.type_id == gd.F32 and int(np.prod(i.shape)) == 1:
            row.input_scale = float(g.dequantize(base + ".input_scale").reshape(()))
        rows.append(row)
    return rows


def _hf_rows(path: Path) -> list[ScaleRow]:
    tensors = read_tensors(path)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_scale", ".weight_scale_2"))})
    rows = []
    for module in modules:
        kind, layer = _split_hf(module)
        row = ScaleRow(tensor=module + ".weight", scale_name=module + ".weight_scale_2", scale=None, kind=kind,
                       layer=layer)
        s2, bs, w = (tensors.get(module + k) for k in (".weight_scale_2", ".weight_scale", ".weight"))
        if s2 is not None:
            if np.asarray(s2).size != 1:
                row.flags.append(f"mis-shaped: {list(np.shape(s2))}, expected a scalar")
            else:
                row.scale = float(np.asarray(s2, np.float32).reshape(()))
        if bs is not None:
            row.block_scale_max = float(np.asarray(bs).astype(np.float32).max())
        if w is not None:
            row.all_zero = not (np.asarray(w) & 0x77).any()
        if module + ".input_scale" in tensors:
            row.input_scale = float(np.asarray(tensors[module + ".input_scale"], np.float32).reshape(()))
        rows.append(row)
    return rows


def _model_rows(model) -> list[ScaleRow]:
    rows = []
    for name, leaf in named_leaves(model.params).items():
        if not isinstance(leaf, NVFP4Array):
            continue
        kind, layer = _split_hf(name)
        rows.append(ScaleRow(tensor=name, scale_name=name + ".global_scale",
                             scale=float(np.asarray(leaf.global_scale, np.float32)), kind=kind, layer=layer,
                             block_scale_max=float(np.asarray(leaf.block_scale).astype(np.float32).max()),
                             all_zero=not (np.asarray(leaf.packed) & 0x77).any(),
                             input_scale=None if leaf.input_scale is None else float(np.asarray(leaf.input_scale))))
    return rows


# -- the graph check ---------------------------------------------------------------------------------------------

def _stand_in_target(cfg) -> Target:
    """A random target of the drafter's shape: it lends the embedding and LM head, which decide nothing about
    whether a drafter scale reaches the output."""
    m = cfg.model
    tcfg = TargetConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.hidden_size,
                       num_hidden_layers=cfg.num_target_layers, num_attention_heads=m.num_attention_heads,
                       num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
                       param_dtype="float32", compute_dtype="float32")
    return Target(params=init_from_abstract(abstract_target(tcfg), jax.random.key(0), jnp.float32, std=1.0),
                  config=tcfg)


def graph_check(model, target: Target | None = None, *, context: int = 8, seed: int = 0) -> ScaleAudit:
    """`audit_scales` on the model's forward with random inputs (drafter: features and a block; target: tokens)."""
    rng = np.random.default_rng(seed)
    if isinstance(model, Target):
        toks = jnp.asarray(rng.integers(0, model.config.vocab_size, (1, context)), jnp.int32)

        def fwd(params, toks):
            return target_forward(model.replace(params=params), toks)[0]
        return audit_scales(fwd, model.params, toks)
    cfg = model.config
    target = target if target is not None else _stand_in_target(cfg)
    H = cfg.model.hidden_size
    feats = jnp.asarray(rng.standard_normal((1, context, cfg.num_taps * H)), jnp.float32)
    block = np.full((1, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = rng.integers(0, cfg.model.vocab_size)

    def fwd(params, feats, block):
        return draft_proposal(target, model.replace(params=params), feats, block)
    return audit_scales(fwd, model.params, feats, jnp.asarray(block))


# -- the call ----------------------------------------------------------------------------------------------------

def audit_file(path: str | Path, *, target: Target | None = None, graph: bool = True, **load_kw) -> FileAudit:
    """The per-tensor scale table of a GGUF drafter, an HF / ModelOpt folder or a `save` folder, and (graph=True)
    `audit_scales` on the loaded model. target: the target a drafter runs with (default: a random stand-in of the
    right shape). load_kw: passed to the GGUF loader (vocab_size=, num_target_layers=)."""
    where = model_path(path)
    path = where.path
    kw = dict(param_dtype="float32", compute_dtype="float32")
    if where.format == "gguf":  # read raw for the table: the file may not load (the role would need it to)
        fmt, rows = "gguf", _gguf_rows(path)
        loader = lambda: gd.load_drafter_gguf(path, **kw, **load_kw)
        return _audited(FileAudit(path=str(path), fmt=fmt, rows=_finish(rows)), loader, graph, target)
    load = load_drafter if where.role == "drafter" else load_target
    if where.format == "saved":
        fmt, model = "orbax", load(path, **kw)
        rows, loader = _model_rows(model), lambda: model
    else:
        fmt, rows = "hf", _hf_rows(path)
        loader = lambda: load(path, **kw)
    return _audited(FileAudit(path=str(path), fmt=fmt, rows=_finish(rows)), loader, graph, target)


def _audited(out: FileAudit, loader, graph: bool, target: Target | None) -> FileAudit:
    """`out` with the graph check of the model `loader()` gives (or why there is none)."""
    if not graph:
        out.graph_skipped = "not requested"
        return out
    try:
        model = loader()
    except (ValueError, NotImplementedError) as e:
        out.load_error = str(e)
        out.graph_skipped = f"the file does not load: {e}"
        return out
    if not any(isinstance(x, NVFP4Array) for x in named_leaves(model.params).values()):
        out.graph_skipped = "no NVFP4 tensors"
        return out
    out.graph = graph_check(model, target if isinstance(model, Drafter) else None)
    return out


__all__ = ["audit_file", "FileAudit", "ScaleRow", "graph_check", "OUTLIER_DECADES"]
