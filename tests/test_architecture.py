"""The package layout (ARCHITECTURE.md): imports run one way, no cycles, and only `quant/linear.py` opens an
NVFP4Array for a matmul. Walks the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_jax"

# Higher may import lower; equal may import each other (inside one folder).
LAYERS = {
    "dflash_jax": 9, "dflash_jax.cli": 9, "dflash_jax.device_report": 9,
    "dflash_jax.bench": 8, "dflash_jax.train": 7, "dflash_jax.io": 6, "dflash_jax.decode": 5,
    "dflash_jax.models": 4, "dflash_jax.parallel": 3, "dflash_jax.quant": 2, "dflash_jax.params": 1,
    "dflash_jax.execution": 1,
    "dflash_jax.config": 0, "dflash_jax.quant.nvfp4": 0, "dflash_jax.quant.ggml": 0, "dflash_jax.frozen": 0,
    "dflash_jax.step_table": 0,
}
LAZY_OK = {"dflash_jax.cli"}  # start-up time: `dflash-jax --help` imports no JAX


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of ours in `path`."""
    tree = ast.parse(path.read_text())
    local = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dflash_jax":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in known else node.module, node.lineno, id(node) in local))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in local) for a in node.names
                    if a.name.split(".")[0] == "dflash_jax"]
    return out


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    mods = modules()
    return {m: imports_of(p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)  # raises ValueError (max of nothing) for a module outside every documented folder


def test_imports_run_one_way():
    bad = []
    for m, deps in graph().items():
        for dep, line, _ in deps:
            if dep == "dflash_jax" and m != "dflash_jax" and layer_of(m) < 9:
                bad.append(f"{m}:{line} imports the package root")
            elif layer_of(dep) > layer_of(m):
                bad.append(f"{m}:{line} (layer {layer_of(m)}) imports {dep} (layer {layer_of(dep)})")
    assert not bad, "imports against ARCHITECTURE.md:\n" + "\n".join(bad)


def test_no_import_cycle():
    edges = collections.defaultdict(set)
    g = graph()
    for m, deps in g.items():
        edges[m].update(d for d, _, _ in deps if d in g and d != m)
    state, cycles = {}, []

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_function_local_imports_outside_the_entry_points():
    bad = [f"{m}:{line} imports {dep} inside a function" for m, deps in graph().items() if m not in LAZY_OK
           for dep, line, local in deps if local]
    assert not bad, "\n".join(bad)


def test_only_linear_opens_nvfp4_weights_in_forward_passes():
    """The bug this project exists to prevent: a forward pass that multiplies codes or block scales itself can
    forget the tensor scale. Models and decode programs never touch the fields of an NVFP4Array (nor a GGMLArray's:
    its codes, block scales and minimums are applied together in quant/ too)."""
    fields = ("packed", "block_scale", "global_scale", "input_scale", "codes", "mins")
    bad = []
    for m, path in modules().items():
        if not (m.startswith("dflash_jax.models") or m.startswith("dflash_jax.decode")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in fields:
                bad.append(f"{m}:{node.lineno} reads .{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from dflash_jax.bench import speculative\n", "dflash_jax.bench.speculative"),
    ("from dflash_jax.models.target import Target\n", "dflash_jax.models.target"),
])
def test_the_walker_sees_imports(tmp_path, source, expected):
    """Negative control for the walker: it must resolve both import forms (else every test above passes vacuously)."""
    f = tmp_path / "x.py"
    f.write_text(source)
    assert [d for d, _, _ in imports_of(f, set(modules()))] == [expected]
    assert layer_of(expected) in LAYERS.values()
