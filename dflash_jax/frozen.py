"""The one `replace` of the package's frozen dataclasses (weights, caches, loop states, NVFP4 values, configs).

A mixin rather than a decorator: the class stays a plain `@dataclasses.dataclass(frozen=True)` (registered as a
pytree where it is one), and `x.replace(field=value)` reads the same on every kind of value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

_T = TypeVar("_T")


class Replaceable:
    """`x.replace(**changes)` is `dataclasses.replace(x, **changes)`: a copy with those fields changed."""

    __slots__ = ()

    def replace(self: _T, **changes: Any) -> _T:
        return dataclasses.replace(self, **changes)


__all__ = ["Replaceable"]
