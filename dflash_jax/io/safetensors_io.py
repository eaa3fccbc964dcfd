"""Reading and writing `.safetensors` files with numpy + ml_dtypes, treating every file read as hostile.

Writing goes through the `safetensors` library (`safetensors.numpy.save_file` takes ml_dtypes bfloat16 / float8
arrays). Reading does not: the library's numpy and flax readers fail on F8_E4M3 and BF16 (numpy has no such dtypes)
and torch is only a test oracle here, so the (simple) format is read directly: 8-byte little-endian header length, a
JSON header `{name: {dtype, shape, data_offsets}}`, then the data. Every header field is checked against the file
before any tensor is built, and errors name the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from dflash_jax.io.lazy_array import LazyArray

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


def read_header(path: str | Path) -> tuple[dict, int]:
    """Validated header {name: (dtype, shape, (begin, end))} and the data section's offset."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: file too small for a safetensors header ({size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out, ranges = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {info!r} ({e})") from None
        if any(s < 0 for s in shape):
            raise SafetensorsError(f"{path}: tensor {name!r} has a negative dimension {shape}")
        if not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"{path}: tensor {name!r} offsets [{begin}, {end}) outside the "
                                   f"{data_len}-byte data section")
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected:
            raise SafetensorsError(f"{path}: tensor {name!r} holds {end - begin} bytes but "
                                   f"{info['dtype']}{list(shape)} needs {expected}")
        out[name] = (dtype, shape, (begin, end))
        ranges.append((begin, end, name))
    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return out, data_start


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a file as numpy arrays (memory-mapped, read-only)."""
    header, data_start = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, (dtype, shape, (begin, end)) in header.items():
        out[name] = raw[data_start + begin: data_start + end].view(dtype).reshape(shape)
    return out


class LazyTensor(LazyArray):
    """One tensor of a safetensors file, not read yet: `read(index)` maps only this tensor's bytes, copies the slice
    `index` out and unmaps them again, so loading a checkpoint shard by shard never holds more than one slice (plus
    what was already placed) in host memory. `np.asarray(t)` reads it whole."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...], offset: int):
        self.path, self.dtype, self.shape, self.offset = Path(path), dtype, tuple(shape), int(offset)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self, index=()) -> np.ndarray:
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)[index]
        mm = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)
        try:
            return np.array(mm[index], copy=True)
        finally:
            del mm

    def __repr__(self):
        return f"LazyTensor({self.path.name}, {self.dtype}{list(self.shape)})"


def lazy_safetensors(path: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a file as a `LazyTensor` (the header is validated now; no data is read)."""
    header, data_start = read_header(path)
    return {name: LazyTensor(Path(path), dtype, shape, data_start + begin)
            for name, (dtype, shape, (begin, _)) in header.items()}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write tensors (numpy / ml_dtypes arrays, 0-d scalars stay 0-d) with `safetensors.numpy.save_file`."""
    from safetensors.numpy import save_file

    arrays = {}
    for name, value in tensors.items():
        arr = np.asarray(value)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"cannot write tensor {name!r} of dtype {arr.dtype}")
        # The writer copies from the array's data pointer: it must be C-contiguous. (np.require, not
        # np.ascontiguousarray, which turns 0-d scalars into shape [1].)
        arrays[name] = np.require(arr, requirements="C")
    save_file(arrays, str(path), metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
