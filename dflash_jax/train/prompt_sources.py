"""More instruction requests than `chat_prompt_ids` can make: the same coding templates over the functions of the
corpus PACKAGES' train split (the `corpus` extra, and the `prompts` extra's packages read for prompts alone;
`train.instructions` uses the stdlib's alone, which caps the train split at 2,376 coding + 200 general requests).

Only what the held-out evaluation cannot see: package files of the train split (`corpus.build_corpus`, which also
drops edited copies of held-out files), and no function whose signature a held-out file defines or that the stdlib
train split already gives `chat_prompt_ids`. Packages not installed at the corpus's pinned version are skipped (and
listed), so the source is whatever the machine holds; its record names the packages it read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md

from dflash_jax.train import corpus, instructions


# Packages read for drafter prompts only (the `prompts` extra), beyond the corpus's own (`corpus.CORPUS_PACKAGES`):
# more documented functions, so more distinct requests, without changing what the code-5m target was trained on.
PROMPT_PACKAGES: dict[str, str] = {
    "aiohttp": "3.14.5", "arrow": "1.4.0", "astroid": "4.4.0", "babel": "2.19.0", "black": "26.10.1",
    "dask": "2026.8.0", "gitpython": "3.2.1", "httpx": "0.29.0", "hypothesis": "6.170.27", "ipython": "9.18.1",
    "isort": "9.0.2", "matplotlib": "3.11.2", "nltk": "3.10.4", "numpy": "2.4.6", "pandas": "3.1.1",
    "paramiko": "5.1.0", "pydantic": "2.14.4", "pylint": "4.1.5", "scikit-learn": "1.9.1", "scipy": "1.17.1",
    "sqlglot": "30.31.0", "starlette": "1.10.0", "statsmodels": "0.15.0", "tqdm": "4.70.1", "traitlets": "5.16.1",
    "xarray": "2026.9.0",
}


def installed_corpus_packages() -> tuple[dict[str, str], list[str]]:
    """({name: version} of the corpus and prompt packages installed at their pinned version, [the others])."""
    have, missing = {}, []
    for name, version in sorted({**corpus.CORPUS_PACKAGES, **PROMPT_PACKAGES}.items()):
        try:
            ok = md.distribution(name).version == version
        except md.PackageNotFoundError:
            ok = False
        if ok:
            have[name] = version
        else:
            missing.append(name)
    return have, missing


def _draw(seed: int, sig: str) -> int:
    return int(hashlib.sha1(f"{seed}:{sig}".encode()).hexdigest()[:15], 16)


def package_function_requests(seed: int, packages: dict[str, str]) -> list[str]:
    """One coding request per usable function of the packages' train files, in a seeded order; signatures of
    held-out files and of the stdlib train split are left out. A function's template and place depend only on the
    seed and its signature, so a source read with more packages installed repeats every request it made before
    (the queue then takes only the new ones)."""
    train, held, _ = corpus.build_corpus(packages=packages)
    std_train = [f.text for f in train if f.origin == "stdlib"]
    taken = {sig for sig, _ in instructions.function_requests(std_train)}
    taken |= {sig for sig, _ in instructions.function_requests([f.text for f in held])}
    funcs = [(s, w) for s, w in instructions.function_requests([f.text for f in train if f.origin != "stdlib"])
             if s not in taken]
    templates = instructions._CODE_TEMPLATES
    funcs.sort(key=lambda f: _draw(seed, f[0]))
    return [templates[_draw(seed + 1, s) % len(templates)].format(sig=s, what=w) for s, w in funcs]


def package_chat_ids(tok, *, seed: int, max_prompt_tokens: int) -> tuple[list[tuple[int, ...]], dict]:
    """(prompts through the chat template, at most max_prompt_tokens each; the source's record)."""
    packages, missing = installed_corpus_packages()
    if not packages:
        raise ValueError("no corpus package is installed at its pinned version: `pip install -e '.[corpus,prompts]'`")
    reqs = package_function_requests(seed, packages)
    ids = [tuple(p) for p in instructions.chat_prompts(tok, reqs)]
    kept = [p for p in ids if len(p) <= max_prompt_tokens]
    record = {"kind": "package_functions", "split": "train", "seed": seed, "max_prompt_tokens": max_prompt_tokens,
              "packages": packages, "not_installed": missing, "requests": len(reqs), "too_long": len(ids) - len(kept)}
    return kept, record
