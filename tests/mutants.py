"""A small mutation check: plant known bugs in a copy of the package and see whether the test suite kills them.

    python tests/mutants.py                 # every planted bug against its relevant tests (stop at the first failure)
    python tests/mutants.py --all-failures  # the same, listing every failing test (slower)
    python tests/mutants.py --list
    python tests/mutants.py key-reuse eos-whole-block

Each bug is a source-text patch (`old` -> `new`, `old` must occur exactly once) applied to a temporary copy of
`dflash_jax/`; `alt` lists the same bug written against other versions of the code (tried in order when `old` is
absent, so the list survives a refactoring landing). The copy's tests/ and checkpoints/ are symlinks to the real
ones. The relevant tests then run against the mutant with `-x`: the bug is KILLED when they fail (or a fixture that
runs the mutated code raises in a test's setup), SURVIVED when they pass, and a patch that no longer applies (the
code moved) is reported as STALE, which fails the script like a survivor: keep this list in step with the code. The tests chosen for a bug are the ones meant to catch it (e.g. the
statistical proof, not the bit-identity test of the re-derived sampler), so a kill shows that those tests have the
power to see the bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str  # inside dflash_jax/
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, node ids, -k expressions)
    required: bool = False  # a bug the suite must kill: it breaks the sampled law, EOS or the NVFP4 scales
    alt: tuple[tuple[str, str, str], ...] = ()  # (file, old, new) for other versions of the code


# NVFP4-only tamperings planted in the model code (layers.py): dense weights pass through untouched, so only the
# tests that run NVFP4 forwards can see them.
_REUSE = '''

def _planted(w):
    from dflash_jax.quant.nvfp4 import NVFP4Array
    if isinstance(w, NVFP4Array):  # block 0's scale applied to every block of the row
        return w.replace(block_scale=jnp.broadcast_to(w.block_scale[..., :1], w.block_scale.shape))
    return w
'''
_SHIFT = '''

def _planted(w):
    from dflash_jax.quant.nvfp4 import NVFP4Array
    if isinstance(w, NVFP4Array):  # the block scales of row r applied to row r + 1
        return w.replace(block_scale=jnp.roll(w.block_scale, 1, axis=0))
    return w
'''
_SQUARE = '''

def _planted(w):
    from dflash_jax.quant.nvfp4 import NVFP4Array
    if isinstance(w, NVFP4Array):  # the tensor scale applied twice
        return w.replace(global_scale=w.global_scale * w.global_scale)
    return w
'''

AUDIT_TESTS = ("tests/test_quantize.py", "-k", "audit")
# The EOS test of `_commit` since EOS ids became a traced argument (changing them no longer recompiles).
_EOS_TRACED = "is_eos = (new_tokens[:, :, None] == budget.eos[None, None, :]).any(axis=-1)"
SAMPLING = "tests/test_sampling.py"
PROOF = "speculative_output_has_target_distribution or sampled_eos"
TREE_TESTS = ("tests/test_tree.py", "-k", "greedy_tree_equals or verify_equals")

MUTANTS = [
    Mutant("q-temperature", "draft probabilities q computed at temperature 1 whatever is requested",
           "decode/draft_step.py",
           "return drafts, logits, PrefixQ(q, jnp.zeros(drafts.shape, bool)), keys",
           "return drafts, logits, PrefixQ(processed_probs(drafted * sp.temperature, sp), jnp.zeros(drafts.shape, "
           "bool)), keys",
           (SAMPLING, "-k", PROOF), required=True,
           alt=(("decode/sampling.py", "q = processed_probs(d_logits, sp)  # [B, D, V]",
                 "q = processed_probs(d_logits, dataclasses.replace(sp, temperature=1.0))  # [B, D, V]"),)),
    Mutant("eos-whole-block", "EOS searched in the whole verified block instead of the committed prefix",
           "decode/programs.py",
           "is_eos = jnp.isin(new_tokens, jnp.asarray(eos_ids, jnp.int32)) & (j < n[:, None])",
           "is_eos = jnp.isin(new_tokens, jnp.asarray(eos_ids, jnp.int32))",
           ("tests/test_eos.py", "-k", "not control"), required=True,
           alt=(("decode/programs.py", _EOS_TRACED + " & (j < n[:, None])", _EOS_TRACED),
                ("decode/loop.py", _EOS_TRACED + " & (j < n[:, None])", _EOS_TRACED))),
    Mutant("key-reuse", "the drafting key reused for acceptance", "decode/programs.py",
           "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling, **q_kw)",
           "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, s.key, sampling, **q_kw)",
           (SAMPLING, "-k", PROOF), required=True,
           alt=(("decode/programs.py",
                 "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling)",
                 "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, s.key, sampling)"),
                ("decode/loop.py",
                 "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling, **q_kw)",
                 "n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, s.key, sampling, **q_kw)"))),
    Mutant("scale-reuse", "an MLP applies block 0's NVFP4 scale to every block", "models/layers.py",
           "linear_many(x, (p.gate_proj, p.up_proj))", "linear_many(x, (p.gate_proj, _planted(p.up_proj)))", AUDIT_TESTS,
           required=True),
    Mutant("scale-shift", "v_proj's NVFP4 block scales shifted by one row", "models/layers.py",
           "qy, ky, vy = linear_many(h, (attn.q_proj, attn.k_proj, attn.v_proj))",
           "qy, ky, vy = linear_many(h, (attn.q_proj, attn.k_proj, _planted(attn.v_proj)))",
           AUDIT_TESTS, required=True,
           alt=(("models/layers.py", "v = linear(h, attn.v_proj).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)",
                 "v = linear(h, _planted(attn.v_proj)).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)"),)),
    Mutant("residual-from-p", "after a rejection, the token drawn from p instead of normalize(max(p - q, 0))",
           "decode/sampling.py",
           "final = _categorical(uniforms[:, D:], residual_probs(p_at, jnp.where(was_proposed, q_at, 0.0)))",
           "final = _categorical(uniforms[:, D:], p_at)",
           (SAMPLING, "-k", PROOF), required=True),
    Mutant("bonus-row", "after a full block, the bonus drawn from verify row D - 1", "decode/sampling.py",
           "p_at = p_row(n_acc)",
           "p_at = p_row(jnp.where(n_acc == D, D - 1, n_acc))",
           (SAMPLING, "-k", PROOF), required=True),
    Mutant("bonus-batch-row", "after a full block, the bonus drawn from the NEIGHBOURING sequence's verify row",
           "decode/sampling.py",
           "p_at = p_row(n_acc)",
           "p_at = p_row(n_acc)\n"
           "    p_at = jnp.where((n_acc == D)[:, None], jnp.roll(p_at, 1, axis=0), p_at)",
           (SAMPLING, "-k", PROOF)),
    # -- draft trees: each must break greedy tree == autoregressive and the verify pass against cache-free forwards
    Mutant("tree-positions-by-index", "tree nodes at committed length + node index instead of + depth",
           "decode/tree.py", "    return start[:, None] + tree.depths",
           "    return start[:, None] + jnp.arange(tree.depths.shape[1], dtype=jnp.int32)[None, :]",
           TREE_TESTS),
    Mutant("tree-sibling-visible", "a tree node sees its earlier siblings too", "decode/tree.py",
           "    return (anc[..., None] == jnp.arange(T, dtype=jnp.int32)).any(axis=2)",
           "    sib = (anc[:, :, None, 1] == anc[:, None, :, 1]) & jnp.tril(jnp.ones((T, T), bool), -1)\n"
           "    return (anc[..., None] == jnp.arange(T, dtype=jnp.int32)).any(axis=2) | sib",
           TREE_TESTS),
    Mutant("tree-compaction-off-by-one", "the accepted path's K/V written one slot past its positions",
           "models/target.py",
           "k=write_kv_run(entry.k, take(new.k), start, n),\n"
           "                              v=write_kv_run(entry.v, take(new.v), start, n))",
           "k=write_kv_run(entry.k, take(new.k), start + 1, n),\n"
           "                              v=write_kv_run(entry.v, take(new.v), start + 1, n))",
           TREE_TESTS),
    Mutant("tree-hybrid-predecessor", "a hybrid tree node's recurrent state from the node before it, not its parent",
           "models/deltanet.py", "    o = tree_rule(d.q, d.k, d.v, d.g, d.beta, state, mask)",
           "    o = tree_rule(d.q, d.k, d.v, d.g, d.beta, state, jnp.tril(jnp.ones_like(mask)))",
           ("tests/test_tree.py", "-k", "greedy_tree_equals and hybrid or verify_equals and hybrid")),
    # -- more planted bugs of the same families ------------------------------------------------------------------
    Mutant("scale-square", "the target's o_proj NVFP4 tensor scale applied twice", "models/target.py",
           "x = x + linear(attend(q, k, v, mask), layer.self_attn.o_proj)",
           "x = x + linear(attend(q, k, v, mask), _planted(layer.self_attn.o_proj))",
           AUDIT_TESTS, alt=(("models/layers.py", "x = x + linear(a, layer.self_attn.o_proj)",
                              "x = x + linear(a, _planted(layer.self_attn.o_proj))"),
                             ("models/layers.py", "x = x + finish(linear(a, layer.self_attn.o_proj))",
                              "x = x + finish(linear(a, _planted(layer.self_attn.o_proj)))"))),
    Mutant("accept-ratio-inverted", "accept while u * p(x) < q(x)", "decode/sampling.py",
           "ok = (u * q_x < p_x) & proposed", "ok = (u * p_x < q_x) & proposed", (SAMPLING, "-k", PROOF)),
    Mutant("pmin-cut-residual", "at a p_min cut, the token drawn from the residual as if the slot were rejected",
           "decode/sampling.py", "residual_probs(p_at, jnp.where(was_proposed, q_at, 0.0))",
           "residual_probs(p_at, q_at)",
           (SAMPLING, "-k", PROOF)),
    Mutant("eos-not-emitted", "the EOS token itself dropped from the output", "decode/programs.py",
           "n = jnp.where(hit, first_eos + 1, n)", "n = jnp.where(hit, first_eos, n)",
           ("tests/test_eos.py", "-k", "not control"),
           alt=(("decode/programs.py", "n = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, n)",
                 "n = jnp.where(hit, jnp.argmax(is_eos, axis=1), n)"),
                ("decode/loop.py", "n = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, n)",
                 "n = jnp.where(hit, jnp.argmax(is_eos, axis=1), n)"))),
    Mutant("argmax-last-tie", "the CPU kernel's argmax keeps the last of equal maxima, not the first",
           "quant/cpu_argmax.h", "const I16v gt = v > best;", "const I16v gt = v >= best;",
           ("tests/test_cpu_kernel.py", "-k", "argmax")),
    Mutant("attention-chunks-unscaled", "the CPU kernel's row attention adds a row's 64-key chunks without "
           "rescaling each to the row's maximum", "quant/cpu_attention.h",
           "const float w = f16_exp(f16_splat(c[0] - M))[0];", "const float w = 1.f;",
           ("tests/test_q8_dot.py", "-k", "fixed_order")),
    Mutant("kernel-residual-from-p", "the CPU kernel's residual draw ignores q: the token after a rejection drawn "
           "from p itself", "quant/cpu_sample.h", "const F16 sq = f16_splat(S * q_on);",
           "const F16 sq = f16_splat(0.f * q_on);",
           (SAMPLING, "-k", "cpu_kernel_reads or speculative_output_has_target_distribution")),
    Mutant("bf16-one-accumulator", "the bfloat16 products' odd blocks summed into the even blocks' accumulator by "
           "the AVX512-BF16 build (a chain other than the one every build computes)", "quant/cpu_bf16_dot.h",
           "hi[i] = _mm512_dpbf16_ps(hi[i], vb, reinterpret_cast<const __m512bh&>(x1));",
           "lo[i] = _mm512_dpbf16_ps(lo[i], vb, reinterpret_cast<const __m512bh&>(x1));",
           ("tests/test_bf16_dot.py", "-k", "instructions_chain")),
    Mutant("bf16-even-first", "the bfloat16 products' plain C++ build adds a pair's even product first, unlike "
           "the instruction", "quant/cpu_bf16_dot.h",
           "s = flush_subnormal(std::fma(bf16_value(w[2 * j + 1]), bf16_value(x[2 * j + 1]), s));",
           "s = flush_subnormal(std::fma(bf16_value(w[2 * j]), bf16_value(x[2 * j]), s));",
           ("tests/test_cpu_kernel.py", "-k", "every_build")),
    Mutant("budget-overshoot", "a block may overshoot max_new_tokens", "decode/programs.py",
           "n = jnp.minimum(n, max_new - state.n_out)  # a block may overshoot the budget: cut inside it",
           "n = n", ("tests/test_eos.py", "-k", "budget"),
           alt=(("decode/programs.py", "n = jnp.minimum(n, budget.max_new - state.n_out)", "n = n"),
                ("decode/loop.py", "n = jnp.minimum(n, budget.max_new - state.n_out)", "n = n"))),
]

# Patches whose `new` calls `_planted`: the helper appended to the patched file.
HELPERS = {"scale-reuse": _REUSE, "scale-shift": _SHIFT, "scale-square": _SQUARE}


def apply(m: Mutant, pkg: Path) -> str | None:
    """Patch the copy with the first of (file, old, new), *alt whose `old` occurs exactly once; returns None, or why
    no version applies."""
    why = []
    for file, old, new in ((m.file, m.old, m.new), *m.alt):
        path = pkg / file
        text = path.read_text()
        n = text.count(old)
        if n == 1:
            path.write_text(text.replace(old, new) + HELPERS.get(m.name, ""))
            return None
        why.append(f"`old` occurs {n} times in {file}")
    return "; ".join(why)


def run_one(m: Mutant, timeout: int, all_failures: bool = False) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tmp = Path(tmp)
        shutil.copytree(REPO / "dflash_jax", tmp / "dflash_jax", ignore=shutil.ignore_patterns("__pycache__"))
        for link in ("tests", "checkpoints", "notebooks"):
            if (REPO / link).exists():
                (tmp / link).symlink_to(REPO / link)
        shutil.copy(REPO / "pyproject.toml", tmp / "pyproject.toml")
        why = apply(m, tmp / "dflash_jax")
        if why:
            return "STALE", 0.0, why
        env = dict(os.environ, PYTHONPATH=str(tmp), PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", *([] if all_failures else ["-x"]), "-q", "-p", "no:cacheprovider",
               "-rfE", *m.tests]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", time.perf_counter() - t0, ""
        dt = time.perf_counter() - t0
        # a failed test, or a test whose setup (a fixture running the mutated code) raised: both saw the bug; an ERROR
        # without a test id (a module that no longer collects) says nothing about it
        tail = [line.split(" - ")[0] for line in proc.stdout.splitlines()
                if line.startswith("FAILED") or (line.startswith("ERROR") and "::" in line.split(" - ")[0])]
        if proc.returncode == 0:
            return "SURVIVED", dt, proc.stdout.splitlines()[-1] if proc.stdout else ""
        if proc.returncode == 1 and tail:
            return "KILLED", dt, f"{len(tail)} failed: " + ", ".join(t.split("::")[-1] for t in tail)
        return "ERROR", dt, (proc.stdout + proc.stderr)[-2000:]


def main() -> int:
    ap = argparse.ArgumentParser(description="plant known bugs and run the relevant tests against each")
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per mutant")
    ap.add_argument("--all-failures", action="store_true",
                    help="run every selected test (no -x) and list all that fail (slower)")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:22s} {'[required] ' if m.required else ''}{m.what}  ->  {' '.join(m.tests)}")
        return 0
    results = []
    for m in chosen:
        status, dt, detail = run_one(m, args.timeout, args.all_failures)
        results.append((m, status))
        print(f"{m.name:22s} {status:8s} {dt:7.0f}s  {detail}", flush=True)
    killed = sum(s == "KILLED" for _, s in results)
    required = [(m, s) for m, s in results if m.required]
    print(f"\nkilled {killed} / {len(results)} planted bugs; required bugs killed "
          f"{sum(s == 'KILLED' for _, s in required)} / {len(required)}")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
