"""NVFP4 between llama.cpp's GGUF block layout (ggml type 40) and our `NVFP4Array` (ModelOpt's layout), exactly.

GGUF (gguf-py `quants.NVFP4`, ggml `block_nvfp4`): 64 weights of one row in 36 bytes. Bytes 0-3 are four unsigned E4M3
block scales (bias 7), one per 16-value sub-block; bytes 4-35 are four groups of 8 bytes, one per sub-block, with
value j of the sub-block in the LOW nibble and value j + 8 in the HIGH nibble of byte j. The codes are the E2M1 codes
(bit 3 the sign) that ModelOpt writes; llama.cpp's converter copies ModelOpt's E4M3 block scales with the sign bit
cleared and stores the per-tensor `weight_scale_2` as a separate F32 tensor `<name>.scale` of shape {1} (and
`input_scale` as `<name>.input_scale`).

Ours (`quant/nvfp4.py`): `packed` uint8 [..., K/2] with values 2i / 2i+1 in the low / high nibble of byte i,
`block_scale` float8_e4m3fn [..., K/16], `global_scale` f32 scalar. Both layouts hold the same codes and the same
scale bytes, so the conversion is a permutation of nibbles: no value is rounded either way.

UE4M3 byte 0x7F decodes to 0 in ggml (it is NaN in E4M3FN); it is read as +0.0, so a block with that byte dequantizes
to zeros exactly as the engine's does. A scale byte with the sign bit set is not unsigned E4M3 and is refused.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

GGML_TYPE_NVFP4 = 40
QK_NVFP4 = 64  # values per GGUF block
SUB_BLOCK = 16  # values per block scale (= nvfp4.BLOCK_SIZE)
BLOCK_BYTES = 4 + QK_NVFP4 // 2  # 36
UE4M3_ZERO_ALIAS = 0x7F  # ggml decodes this byte to 0


class NVFP4LayoutError(ValueError):
    pass


def gguf_row_bytes(k: int) -> int:
    """Bytes of one GGUF NVFP4 row of k values."""
    return (k // QK_NVFP4) * BLOCK_BYTES


def check_row_length(name: str, k: int) -> None:
    if k <= 0 or k % QK_NVFP4:
        raise NVFP4LayoutError(f"{name}: GGUF NVFP4 (type 40) needs rows of a multiple of {QK_NVFP4} values, got {k}")


def to_gguf_blocks(packed: np.ndarray, block_scale: np.ndarray, name: str = "tensor") -> np.ndarray:
    """(packed uint8 [R, K/2], block_scale e4m3fn [R, K/16]) -> uint8 [R, K/64 * 36] in ggml's block_nvfp4 layout."""
    packed = np.asarray(packed)
    scale_bytes = np.asarray(block_scale).view(np.uint8) if np.asarray(block_scale).dtype != np.uint8 \
        else np.asarray(block_scale)
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise NVFP4LayoutError(f"{name}: packed codes must be uint8 [rows, K/2], got {packed.dtype}{list(packed.shape)}")
    rows, k = packed.shape[0], packed.shape[1] * 2
    check_row_length(name, k)
    if scale_bytes.shape != (rows, k // SUB_BLOCK):
        raise NVFP4LayoutError(f"{name}: block scales have shape {list(scale_bytes.shape)}, expected "
                               f"[{rows}, {k // SUB_BLOCK}]")
    bad = (scale_bytes & 0x80) != 0
    if bad.any():
        raise NVFP4LayoutError(f"{name}: {int(bad.sum())} block scale(s) are negative (sign bit set); GGUF NVFP4 "
                               "block scales are unsigned E4M3")
    if (scale_bytes == UE4M3_ZERO_ALIAS).any():
        raise NVFP4LayoutError(f"{name}: a block scale is NaN (E4M3 0x7F), which GGUF would read as 0")
    nsb = k // QK_NVFP4
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, nsb, 4, 2, 8)  # [R, nsb, sub, half, j]
    qs = codes[:, :, :, 0, :] | (codes[:, :, :, 1, :] << 4)  # [R, nsb, 4, 8]: value j low, j + 8 high
    out = np.concatenate([scale_bytes.reshape(rows, nsb, 4), qs.reshape(rows, nsb, 32)], axis=-1)  # [R, nsb, 36]
    return np.ascontiguousarray(out.reshape(rows, nsb * BLOCK_BYTES))


def from_gguf_blocks(raw: np.ndarray, k: int, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """uint8 [R, K/64 * 36] (or the same bytes flat) -> (packed uint8 [R, K/2], block_scale e4m3fn [R, K/16])."""
    check_row_length(name, k)
    raw = np.asarray(raw, dtype=np.uint8)
    row = gguf_row_bytes(k)
    if raw.size % row:
        raise NVFP4LayoutError(f"{name}: {raw.size} bytes is not a whole number of NVFP4 rows of {k} values "
                               f"({row} bytes each)")
    rows, nsb = raw.size // row, k // QK_NVFP4
    blocks = raw.reshape(rows, nsb, BLOCK_BYTES)
    scale_bytes = blocks[:, :, :4].reshape(rows, k // SUB_BLOCK)
    bad = (scale_bytes & 0x80) != 0
    if bad.any():
        r, b = (int(i[0]) for i in np.nonzero(bad))
        raise NVFP4LayoutError(f"{name}: block scale byte 0x{int(scale_bytes[r, b]):02X} (row {r}, block {b}) has the "
                               "sign bit set; GGUF NVFP4 block scales are unsigned E4M3")
    scale_bytes = np.where(scale_bytes == UE4M3_ZERO_ALIAS, np.uint8(0), scale_bytes)
    qs = blocks[:, :, 4:].reshape(rows, nsb, 4, 8)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(rows, k)  # [R, K] in value order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [R, K/2]: value 2i low, 2i+1 high
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale_bytes).view(ml_dtypes.float8_e4m3fn)
