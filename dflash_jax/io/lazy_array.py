"""`LazyArray`: a tensor of a model file that is not read yet, the common ground of the safetensors `LazyTensor` and
the GGUF `GGUFTensor`. The loader (`hf_folder._placed_dense`) treats both alike: it checks `shape` / `ndim` /
`size`, reads the slice each device needs with `read(index)`, or the whole tensor with `np.asarray(t)`."""

from __future__ import annotations

import numpy as np


class LazyArray:
    """Subclasses set `shape` (numpy order) and `dtype` and define `read(index=()) -> np.ndarray`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def read(self, index=()) -> np.ndarray:
        raise NotImplementedError

    def __array__(self, dtype=None, copy=None):
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype)


class RowsTaken(LazyArray):
    """`base` with its rows (axis 0) taken in the order `rows`, not read yet: `read(index)` reads each run of
    consecutive source rows the slice needs as one slice of `base` (a DeltaNet's in_proj_qkv regrouped by key head:
    a device's shard of whole key heads is three runs, its q, k and v rows). `base`: a LazyArray or an ndarray."""

    def __init__(self, base, rows: np.ndarray):
        self.base, self.rows = base, np.asarray(rows, np.int64)
        self.shape, self.dtype = tuple(base.shape), np.dtype(base.dtype)
        assert self.rows.shape == self.shape[:1]

    def read(self, index=()) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        rest = index[1:]
        rows = self.rows[index[0] if index else slice(None)]
        rows = np.atleast_1d(rows)
        starts = np.flatnonzero(np.diff(rows, prepend=rows[:1] - 2) != 1)  # where a run of consecutive rows begins
        ends = np.append(starts[1:], len(rows))
        part = (lambda sl: self.base.read(sl)) if isinstance(self.base, LazyArray) else (lambda sl: np.asarray(
            self.base[sl]))
        out = np.concatenate([part((slice(int(rows[a]), int(rows[b - 1]) + 1),) + rest) for a, b in zip(starts, ends)])
        return out.reshape(out.shape[1:]) if index and np.ndim(self.rows[index[0]]) == 0 else out
