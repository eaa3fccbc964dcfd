"""GGUF files (llama.cpp's container), read directly over a `numpy.memmap`, treating every file as hostile.

Layout (little-endian; versions 2 and 3): magic `GGUF`, uint32 version, uint64 tensor count, uint64 key/value count;
the key/values (string key, uint32 value type, value; arrays are a uint32 element type, a uint64 count and the
elements); the tensor infos (string name, uint32 n_dims, n_dims uint64 dims innermost first, uint32 ggml type,
uint64 offset into the data section); padding to `general.alignment` (default 32); the data section. Every read is
bounds-checked, so a truncated or inconsistent file is an error that names the key or tensor being read.

Dequantization is tensor by tensor (and row-chunk by row-chunk) straight into the requested dtype, so loading never
holds a second full copy of the model in host memory: the file stays mapped, and only one tensor's output exists
at a time beside what was already placed. F32, F16, BF16, F64, Q8_0, Q4_0 and Q4_1 (the types of the embedded
SmolLM2 file) are decoded here; every other type gguf-py knows goes through `gguf.quants.dequantize` (pure numpy).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types -> struct format (numeric) ; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                  7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
VALUE_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
                    7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}

# ggml types decoded natively: id -> (name, block size in values, block size in bytes).
F32, F16, Q4_0, Q4_1, Q8_0, F64, BF16 = 0, 1, 2, 3, 8, 28, 30
NATIVE_TYPES = {F32: ("F32", 1, 4), F16: ("F16", 1, 2), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
                Q8_0: ("Q8_0", 32, 34), F64: ("F64", 1, 8), BF16: ("BF16", 1, 2)}

_ROW_CHUNK_BYTES = 16 << 20  # dequantize at most ~16 MB of packed rows at a time (bounds the temporaries)


class GGUFError(ValueError):
    pass


def _gguf_types() -> dict[int, tuple[str, int, int]]:
    """Every ggml type gguf-py knows: id -> (name, block values, block bytes)."""
    from gguf.constants import GGML_QUANT_SIZES

    out = {int(t): (t.name, int(bs), int(ts)) for t, (bs, ts) in GGML_QUANT_SIZES.items()}
    out.update(NATIVE_TYPES)
    return out


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]  # numpy order (outermost first): the reverse of GGUF's dims
    offset: int  # absolute byte offset in the file
    nbytes: int
    block_size: int
    type_size: int

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.block_size * self.type_size if self.shape else self.type_size


def _describe(what) -> str:
    return what() if callable(what) else what


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; `what` names the key / tensor being read."""

    def __init__(self, buf: np.ndarray, path: Path):
        # One memoryview over the map: slicing it is cheap, where slicing the np.memmap makes a new memmap object
        # per read (a tokenizer's ~100k strings took seconds that way).
        self.buf, self.pos, self.size, self.path = memoryview(buf), 0, int(buf.shape[0]), path

    def take(self, n: int, what) -> memoryview:
        """`what`: a description, or a callable making one (built only for the error message)."""
        if n < 0 or self.pos + n > self.size:
            what = what() if callable(what) else what
            raise GGUFError(f"{self.path}: truncated file: reading {what} needs bytes [{self.pos}, {self.pos + n}) "
                            f"but the file has {self.size}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what) -> str:
        n = self.scalar("<Q", (lambda: _describe(what) + " (string length)") if callable(what)
                        else what + " (string length)")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {_describe(what)} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            v = self.scalar(_SCALAR_FORMATS[vtype], what)
            return bool(v) if vtype == 7 else v
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            etype = self.scalar("<I", what + " (array element type)")
            count = self.scalar("<Q", what + " (array length)")
            if etype in _SCALAR_DTYPES:  # numeric arrays: one vectorised read
                dt = np.dtype(_SCALAR_DTYPES[etype]).newbyteorder("<")
                raw = self.take(count * dt.itemsize, f"{what} ({count} x {VALUE_TYPE_NAMES[etype]})")
                return np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="))
            if etype == 8:  # element names are made only for an error: a vocabulary holds ~10^5 strings
                return [self.string(lambda i=i: f"{what}[{i}]") for i in range(count)]
            if etype == 9:
                return [self.value(9, f"{what}[{i}]") for i in range(count)]
            raise GGUFError(f"{self.path}: {what}: unknown array element type {etype}")
        raise GGUFError(f"{self.path}: {what}: unknown metadata value type {vtype}")


class GGUFFile:
    """A parsed GGUF file: `version`, `metadata` {key: value} (numeric arrays as numpy arrays, string arrays as
    lists), `tensors` {name: TensorInfo} in file order, `alignment`, `data_offset`. Tensor data is read on demand
    (`raw`, `dequantize`) from the memory map; nothing is copied at open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path}: truncated file: {size} bytes is smaller than a GGUF header (24)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(self._map, self.path)
        magic = bytes(cur.take(4, "the magic"))
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        self.version = cur.scalar("<I", "the version")
        if self.version not in (2, 3):
            if self.version & 0xFFFF == 0 and self.version:  # a big-endian file reads as 0x0X000000
                raise GGUFError(f"{self.path}: big-endian GGUF files are not supported")
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors = cur.scalar("<Q", "the tensor count")
        n_kv = cur.scalar("<Q", "the metadata count")
        # No up-front plausibility check on the counts: every entry reads >= 12 bytes through the bounds-checked
        # cursor, so a corrupt count ends at the first read past the end, with an error naming that entry.
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, int] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"the type of metadata key {key!r}")
            if key in self.metadata:
                raise GGUFError(f"{self.path}: metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(vtype, f"metadata key {key!r}")
            self.value_types[key] = vtype
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: metadata key 'general.alignment' = {self.alignment} is not a power of 2")
        types = _gguf_types()
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"the name of tensor #{i}")
            what = f"tensor {name!r}"
            n_dims = cur.scalar("<I", f"the rank of {what}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: {what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            dims = [cur.scalar("<Q", f"the dimensions of {what}") for _ in range(n_dims)]
            type_id = cur.scalar("<I", f"the type of {what}")
            offset = cur.scalar("<Q", f"the data offset of {what}")
            if type_id not in types:
                raise GGUFError(f"{self.path}: {what} has unknown ggml tensor type id {type_id}")
            infos.append((name, dims, type_id, offset))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        data_len = size - self.data_offset
        for name, dims, type_id, offset in infos:
            what = f"tensor {name!r}"
            if name in self.tensors:
                raise GGUFError(f"{self.path}: {what} appears twice")
            type_name, block, type_size = types[type_id]
            if dims[0] % block:
                raise GGUFError(f"{self.path}: {what} ({type_name}) has row length {dims[0]}, not a multiple of "
                                f"its block size {block}")
            if offset % self.alignment:
                raise GGUFError(f"{self.path}: {what} data offset {offset} is not aligned to {self.alignment}")
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            if offset + nbytes > data_len:
                raise GGUFError(f"{self.path}: truncated file: {what} needs data bytes [{offset}, {offset + nbytes})"
                                f" but the data section has {max(data_len, 0)}")
            self.tensors[name] = TensorInfo(name, type_id, type_name, tuple(int(d) for d in reversed(dims)),
                                            self.data_offset + offset, nbytes, block, type_size)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise GGUFError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")

    # -- metadata ------------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """A metadata value that must exist (and, when `kind` is given, be of that Python kind)."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        value = self.metadata[key]
        if kind is not None and not _is_kind(value, kind):
            raise GGUFError(f"{self.path}: metadata key {key!r} has {VALUE_TYPE_NAMES.get(self.value_types[key])} "
                            f"value {_short(value)}, expected {_kind_name(kind)}")
        return value

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        return self.require(key, kind) if key in self.metadata else default

    # -- tensors -------------------------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only view of the map: uint8 [*outer, bytes per row]."""
        t = self.info(name)
        flat = self._map[t.offset:t.offset + t.nbytes]
        return flat.reshape(t.shape[:-1] + (t.row_bytes,))

    def dequantize(self, name: str, dtype=np.float32, rows: slice | None = None) -> np.ndarray:
        """The tensor (numpy shape) decoded into `dtype`, rows of the outermost axis limited to `rows`."""
        t = self.info(name)
        packed = self.raw(name).reshape(-1, t.row_bytes)  # [R, row bytes]
        out_shape = t.shape
        if rows is not None and len(t.shape) > 1:
            lead = t.shape[0]
            start, stop, step = rows.indices(lead)
            out_shape = (len(range(start, stop, step)),) + t.shape[1:]
            packed = packed.reshape(lead, -1, t.row_bytes)[start:stop:step].reshape(-1, t.row_bytes)
        out = np.empty((packed.shape[0], t.shape[-1]), dtype=dtype)
        chunk = max(1, _ROW_CHUNK_BYTES // max(t.row_bytes, 1))
        for r in range(0, packed.shape[0], chunk):
            block = np.asarray(packed[r:r + chunk])
            out[r:r + chunk] = _decode_rows(block, t, self.path)
        return out.reshape(out_shape)


def _decode_rows(block: np.ndarray, t: TensorInfo, path: Path) -> np.ndarray:
    """uint8 [rows, row bytes] -> float32 [rows, row length] for type `t.type_id`."""
    rows = block.shape[0]
    if t.type_id == F32:
        return block.view("<f4")
    if t.type_id == F16:
        return block.view("<f2").astype(np.float32)
    if t.type_id == BF16:
        return block.view("<u2").view(ml_dtypes.bfloat16).astype(np.float32)
    if t.type_id == F64:
        return block.view("<f8").astype(np.float32)
    if t.type_id in (Q8_0, Q4_0, Q4_1):
        blocks = block.reshape(-1, t.type_size)  # [n_blocks, bytes per block]
        d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)  # [n, 1]
        if t.type_id == Q8_0:  # d (f16), 32 x int8
            q = blocks[:, 2:].view(np.int8).astype(np.float32)
            return (q * d).reshape(rows, -1)
        # 4-bit: byte j holds value j in its low nibble and value j + 16 in its high one.
        qs = blocks[:, 4:] if t.type_id == Q4_1 else blocks[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, 32]
        if t.type_id == Q4_0:  # d, 16 bytes; x = (q - 8) d
            return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(rows, -1)
        m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)  # Q4_1: d, m, 16 bytes; x = q d + m
        return (d * q.astype(np.float32) + m).reshape(rows, -1)
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        return np.asarray(dequantize(block, GGMLQuantizationType(t.type_id)), np.float32).reshape(rows, -1)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {t.name!r} has ggml type {t.type_name} ({t.type_id}), which gguf-py "
                        "cannot dequantize") from None


def _is_kind(value, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is int and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return True
        if k is float and isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
            return True
        if k is list and isinstance(value, (list, np.ndarray)):
            return True
        if k not in (int, float, list) and isinstance(value, k):
            return True
    return False


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a bool",
                        list: "an array"}.get(k, k.__name__) for k in kinds)


def _short(value) -> str:
    text = repr(value if not isinstance(value, np.ndarray) else value.tolist())
    return text if len(text) < 80 else text[:77] + "..."


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` suffix, or a file starting with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


__all__ = ["GGUFFile", "GGUFError", "TensorInfo", "is_gguf", "NATIVE_TYPES"]
