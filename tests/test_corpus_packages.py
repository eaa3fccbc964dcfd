"""The training corpus beyond the stdlib: pinned packages, filters, dedup, held-out split, and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_jax.train import corpus

ROOT = Path(__file__).resolve().parents[1]


def _corpus_extra_pins() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^corpus = \[(.*?)^\]", text, re.S | re.M).group(1)
    return dict(re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"', block))


def test_pyproject_pins_exactly_the_corpus_packages():
    assert _corpus_extra_pins() == corpus.CORPUS_PACKAGES


def test_pyproject_pins_exactly_the_prompt_packages_and_they_are_not_corpus_packages():
    from dflash_jax.train import prompt_sources

    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^prompts = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert dict(re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"', block)) == prompt_sources.PROMPT_PACKAGES
    assert not set(prompt_sources.PROMPT_PACKAGES) & set(corpus.CORPUS_PACKAGES)  # one pin per package


def test_missing_package_says_how_to_install():
    with pytest.raises(corpus.CorpusError, match=r"not installed.*pip install -e '\.\[corpus\]'"):
        corpus.package_sources({"surely-not-an-installed-distribution": "1.0"})


def test_wrong_version_is_refused():
    import importlib.metadata as md
    version = md.version("numpy")
    with pytest.raises(corpus.CorpusError, match=rf"numpy.*{re.escape(version)}.*pins 0\.0\.1"):
        corpus.package_sources({"numpy": "0.0.1"})


def test_empty_stdlib_is_refused(monkeypatch):
    monkeypatch.setattr(corpus, "stdlib_files", lambda root=None: [])
    with pytest.raises(corpus.CorpusError, match="corpus is empty"):
        corpus.build_corpus(packages=False)


def test_filters_drop_benchmarks_and_generated_tables():
    assert corpus._admissible("def f():\n    return 1\n") is None
    assert corpus._admissible("PROBLEMS = load('openai_humaneval')\n") == "benchmark"
    assert corpus._admissible("TABLE = '" + "x" * 1000 + "'\n") == "generated"
    assert corpus._admissible("\n\n   \n") == "empty"


def test_stdlib_only_corpus_keeps_the_stdlib_split():
    train, held, man = corpus.build_corpus(packages=False)
    std_train, std_held = corpus.split_files(corpus.stdlib_files())
    assert [f.rel for f in held] == [corpus.relpath(p) for p in std_held]
    train_rels = {f.rel for f in train}
    assert not train_rels & {f.rel for f in held}
    # Dropped training files are exact duplicates or edited copies of held-out files; nothing else is lost.
    assert len(train) + man["duplicates_dropped"] + len(man["near_copies_of_held_out_dropped"]) == len(std_train)
    held_texts = {f.text for f in held}
    assert not any(f.text in held_texts for f in train)


def test_edited_copies_of_held_out_files_are_not_trained_on():
    held = [corpus.SourceFile("pkg/held.py", "pkg", "".join(f"value_{i} = compute_something({i}, 'x')\n"
                                                          for i in range(40)))]
    near = corpus._NearCopies(held)
    edited = held[0].text.replace("value_3 ", "renamed ") + "def extra():\n    return 'a new line of code here'\n"
    assert near.of(edited) == "pkg/held.py"
    unrelated = "".join(f"other_{i} = different_function({i}, 'y')\n" for i in range(40))
    assert near.of(unrelated) is None


def test_package_corpus_when_installed():
    try:
        train, held, man = corpus.build_corpus(packages=True)
    except corpus.CorpusError as e:
        pytest.skip(f"the [corpus] extra is not installed here ({e})")
    assert man["train_chars"]["packages"] > 10 * man["train_chars"]["stdlib"] // 4
    assert set(man["packages"]) == set(corpus.CORPUS_PACKAGES)
    assert all(p["licence"] for p in man["packages"].values())
    rels = [f.rel for f in train] + [f.rel for f in held]
    assert len(rels) == len(set(rels))
    assert not {f.rel for f in train} & {f.rel for f in held}
    assert all(corpus.is_eval_file(f.rel) for f in held)
    assert not any(any(m in f.text for m in corpus.BENCHMARK_MARKERS) for f in train + held)
    assert not any("/tests/" in f.rel or "/_vendor/" in f.rel for f in train if f.origin != "stdlib")
    # setuptools ships an edited copy of the stdlib's distutils; the copy of a held-out module must be dropped
    assert "setuptools/setuptools/_distutils/cmd.py" not in {f.rel for f in train}
