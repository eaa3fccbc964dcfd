"""GGML block-quantized weights (llama.cpp's Q4_0 / Q4_1 / Q8_0) as one pytree value, the file's own bytes.

A GGUF model keeps its matrices in blocks of 32 along the input axis: Q4_1 = one float16 scale d, one float16 minimum
m and 32 four-bit codes (value d * q + m), Q8_0 = d and 32 int8 codes (value d * q); Q4_0 (value d * (q - 8)) is held
as Q4_1 with m = -8 d, which is exact in float16 and gives the same values. Keeping them as they are makes a decode
step stream ~0.6 bytes per weight instead of float32's 4; `quant/linear.py` is the only consumer (`linear` and
`embedding_rows`), and every scale of a block is applied there with its codes, as for `NVFP4Array`.

Layouts (rows = output features, as an HF weight [out, in]):
  q4_1: codes uint8 [N, K/2]: byte j of block b holds code j (low nibble) and code j + 16 (high nibble) of that
        block, as GGML stores them; scale, mins float16 [N, K/32].
  q8_0: codes int8 [N, K]; scale float16 [N, K/32]; mins None.
`dequantize` gives exactly the float32 values llama.cpp's (and `io.gguf`'s) dequantization gives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
KINDS = ("q4_1", "q8_0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GGMLArray:
    codes: jax.Array  # q4_1: uint8 [N, K/2]; q8_0: int8 [N, K]
    scale: jax.Array  # float16 [N, K/32]
    mins: Any  # q4_1: float16 [N, K/32]; q8_0: None
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # (N, K)
    kind: str = dataclasses.field(metadata=dict(static=True), default="q4_1")

    def replace(self, **fields: Any) -> "GGMLArray":
        return dataclasses.replace(self, **fields)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.float32  # the dtype its values dequantize to

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.codes, self.scale, self.mins) if a is not None)


def from_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GGMLArray:
    """A GGMLArray from a GGUF tensor's raw bytes [N, K/32 * block bytes] (`io.gguf.GGUFFile.raw`, rows in file
    order) of type Q4_0, Q4_1 or Q8_0."""
    N, K = shape
    if K % BLOCK:
        raise ValueError(f"GGML {type_name} tensor {list(shape)}: {K} input features is not a multiple of {BLOCK}")
    nb = K // BLOCK
    per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(type_name)
    if per_block is None:
        raise ValueError(f"GGML type {type_name} is not kept as blocks (Q4_0, Q4_1 and Q8_0 are)")
    blocks = np.asarray(raw, np.uint8).reshape(N, nb, per_block)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view("<f2").reshape(N, nb)
    if type_name == "Q8_0":
        codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(N, K)
        return GGMLArray(codes=jnp.asarray(codes), scale=jnp.asarray(d), mins=None, shape=(N, K), kind="q8_0")
    if type_name == "Q4_1":
        m = np.ascontiguousarray(blocks[:, :, 2:4]).view("<f2").reshape(N, nb)
        qs = blocks[:, :, 4:]
    else:  # Q4_0: d * (q - 8) == d * q + (-8 d), and -8 d is exact in float16 (a power-of-two multiple)
        with np.errstate(over="raise"):
            m = (d.astype(np.float32) * -8.0).astype(np.float16)
        qs = blocks[:, :, 2:]
    return GGMLArray(codes=jnp.asarray(np.ascontiguousarray(qs).reshape(N, K // 2)), scale=jnp.asarray(d),
                     mins=jnp.asarray(m.astype(np.float16)), shape=(N, K), kind="q4_1")


def _codes(w: GGMLArray, codes: jax.Array) -> jax.Array:
    """codes of rows [..., bytes] -> float32 codes [..., K] in element order."""
    if w.kind == "q8_0":
        return codes.astype(jnp.float32)
    lead, half = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(*lead, half // 16, 16)
    q = jnp.concatenate([c & 15, c >> 4], axis=-1)  # [..., nb, 32]: low nibbles are elements 0..15
    return q.reshape(*lead, half * 2).astype(jnp.float32)


def _values(w: GGMLArray, codes, scale, mins, dtype) -> jax.Array:
    q = _codes(w, codes)
    lead, K = q.shape[:-1], q.shape[-1]
    q = q.reshape(*lead, K // BLOCK, BLOCK)
    d = scale.astype(jnp.float32)[..., None]
    v = q * d if mins is None else q * d + mins.astype(jnp.float32)[..., None]  # d * q is exact: one rounding
    return v.reshape(*lead, K).astype(dtype)


def dequantize(w: GGMLArray, dtype=jnp.float32) -> jax.Array:
    """The dense [N, K] weight."""
    return _values(w, w.codes, w.scale, w.mins, dtype)


def take_rows(w: GGMLArray, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` [...] of the dense weight -> [..., K], decoding only those rows (an embedding lookup). Up to 16 rows
    (a step's tokens) are one dynamic slice each: XLA:CPU split a gather of a tree step's 3 rows across its thread
    pool, 14-26 us per table against ~1.5 us for the slices. Ids are in range (checked where they enter)."""
    flat = ids.reshape(-1)

    def take(a):
        if a is None:
            return None
        if flat.size > 16:
            return jnp.take(a, ids, axis=0)
        rows = [jax.lax.dynamic_slice_in_dim(a, jnp.clip(flat[i], 0, a.shape[0] - 1), 1) for i in range(flat.size)]
        return jnp.concatenate(rows).reshape(*ids.shape, a.shape[-1])
    return _values(w, take(w.codes), take(w.scale), take(w.mins), dtype)


def leading_rows(w: GGMLArray, n: int) -> GGMLArray:
    """The first n output rows (each row carries its own blocks)."""
    cut = lambda a: None if a is None else a[:n]  # noqa: E731
    return w.replace(codes=cut(w.codes), scale=cut(w.scale), mins=cut(w.mins), shape=(n, w.shape[1]))
