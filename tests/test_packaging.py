"""Packaging: a non-editable install carries the shipped models, and the loader finds them (or an override).

Building a wheel is slow, so this reads what setuptools would package from pyproject.toml (its own config reader)
and checks it against the tree: every package directory is listed, and every file under checkpoints/ is package
data of `dflash_jax.checkpoints`. (A real `pip install .` in a fresh venv outside the checkout was run by hand; see
the README.)
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest

import dflash_jax as dj
from dflash_jax.io import shipped as defaults

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setuptools_config():
    from setuptools.config.pyprojecttoml import read_configuration
    return read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]


def test_every_package_directory_is_listed(setuptools_config):
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dflash_jax").rglob("__init__.py")}
    assert on_disk <= set(setuptools_config["packages"]), on_disk - set(setuptools_config["packages"])


def test_checkpoints_are_package_data(setuptools_config):
    assert setuptools_config["package-dir"]["dflash_jax.checkpoints"] == "checkpoints"
    assert "dflash_jax.checkpoints" in setuptools_config["packages"]
    patterns = setuptools_config["package-data"]["dflash_jax.checkpoints"]
    folder = ROOT / "checkpoints"
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    packaged = [f for f in files if any(fnmatch.fnmatch(f, p) or fnmatch.fnmatch(f, p.replace("**/", "")) for p in
                                        patterns)]
    assert packaged == files
    for needed in ("tokenizer.json", "target/dflash_jax.json", "drafter/dflash_jax.json"):
        assert needed in files
    assert any(f.startswith("target/params/") for f in files) and any(f.startswith("drafter/params/") for f in files)


def test_no_flax_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    deps = text[text.index("dependencies = ["):text.index("]", text.index("dependencies = ["))]
    assert "flax" not in deps
    assert "flax" in (ROOT / "ARCHITECTURE.md").read_text()  # the reason is written down (its "Dependencies")


def test_checkpoints_dir_order(tmp_path, monkeypatch):
    """$DFLASH_JAX_CHECKPOINTS first, then the installed copy (dflash_jax/checkpoints), then the source checkout."""
    monkeypatch.delenv(defaults.ENV_VAR, raising=False)
    assert defaults.checkpoints_dir() == ROOT / "checkpoints"  # this checkout (no installed copy)
    fake_pkg = tmp_path / "site" / "dflash_jax"
    (fake_pkg / "checkpoints").mkdir(parents=True)
    (fake_pkg / "checkpoints" / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(defaults, "__file__", str(fake_pkg / "io" / "shipped.py"))
    assert defaults.checkpoints_dir() == fake_pkg / "checkpoints"  # an installed wheel's package data
    other = tmp_path / "elsewhere"
    shutil.copytree(fake_pkg / "checkpoints", other)
    monkeypatch.setenv(defaults.ENV_VAR, str(other))
    assert defaults.checkpoints_dir() == other
    monkeypatch.setenv(defaults.ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="DFLASH_JAX_CHECKPOINTS"):
        defaults.checkpoints_dir()


def test_load_default_dtypes():
    target, drafter, _ = dj.load_default()
    assert target.config.param_dtype == target.config.compute_dtype == "float32"  # CPU: both float32
    assert drafter.config.model.param_dtype == "float32"
    t16, d16, _ = dj.load_default(compute_dtype="bfloat16")  # bf16 compute: parameters follow
    assert t16.config.param_dtype == "bfloat16" and t16.params.embed_tokens.dtype.name == "bfloat16"
    assert d16.params.fc.dtype.name == "bfloat16"
