"""`LazyArray`: a tensor of a model file that is not read yet, the common ground of the safetensors `LazyTensor` and
the GGUF `GGUFTensor`. The loader (`checkpoint._placed_dense`) treats both alike: it checks `shape` / `ndim` /
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
