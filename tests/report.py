"""Figures the tests measure on the way (parity errors, tau, timings), printed once at the end of the run.

A test module asks for a named section, `STATS = report.section("generate")`, and fills the dict while its tests
assert; `tests/conftest.py`'s `pytest_terminal_summary` prints every non-empty section after the results. No test
prints them, so no test exists that cannot fail.
"""

from __future__ import annotations

from typing import Callable

_SECTIONS: dict[str, tuple[dict, Callable[[str, object], str]]] = {}


def _plain(key: str, value: object) -> str:
    return f"{key}: {value}"


def section(name: str, fmt: Callable[[str, object], str] = _plain) -> dict:
    """The dict of section `name` (one per name, shared by every module that asks); fmt(key, value) -> one line."""
    if name not in _SECTIONS:
        _SECTIONS[name] = ({}, fmt)
    return _SECTIONS[name][0]


def lines() -> list[str]:
    """'[section] key: value' for every figure recorded so far, sections in the order they were first asked for."""
    return [f"[{name}] {fmt(k, v)}" for name, (figures, fmt) in _SECTIONS.items() for k, v in figures.items()]
