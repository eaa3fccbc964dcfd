"""False-alarm rate and power of the statistical checks (tests/stats.py), as quoted in tests/test_sampling.py.

    python tests/stats_power.py            # the table, and 10^7 simulated null runs (~25 s of CPU)
    python tests/stats_power.py --laws     # also simulate the null on the laws the tests really use (~1 minute)

1. False alarms: each check is made at ALPHA = RUN_ALPHA / CHECK_BUDGET; a run makes at most CHECK_BUDGET checks, so by
   Bonferroni P(any false alarm in a run) <= RUN_ALPHA. The chi-square tail the thresholds come from is checked here
   by simulating the null (multinomial samples from the exact law): at the real per-check level on skewed laws with
   10^7 replicates, and (--laws) at the moderate level 1e-3 on every law the generate checks use.
2. Power: the smallest total-variation (TV) bias eps of a marginal that one check detects with probability 90%.
   Against p + delta with sum|delta| = 2 eps, the G statistic is about noncentral chi-square with noncentrality
   lambda = N sum(delta^2 / p); its minimum over all directions is 4 N eps^2 (mass moved between two halves of the
   law, in proportion to p: the least favourable direction), so eps_90 = sqrt(lambda_90 / (4 N)) holds for EVERY
   direction. A shift between the two most likely tokens (p1, p2) has lambda = N eps^2 (1/p1 + 1/p2). Both are
   confirmed by simulating biased samples through the real check code.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from scipy import optimize
from scipy import stats as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats  # noqa: E402  (tests/stats.py)

POWER = 0.9
# (what, samples per check, cells of the law): the checks of tests/test_sampling.py
CHECKS = [("generate marginals (vocab 8)", 40_000, 8),
          ("accept_block units (vocab 6)", 40_000, 6),
          ("EOS: token-or-PAD per position (9 cells)", 20_000, 9)]


def lambda_for_power(df: int, power: float = POWER) -> float:
    crit = stats.threshold(df)
    return optimize.brentq(lambda lam: st.ncx2.sf(crit, df, lam) - power, 1e-6, 1e4)


def eps_worst(n: int, df: int) -> float:
    return float(np.sqrt(lambda_for_power(df) / (4 * n)))


def eps_two_tokens(n: int, df: int, p1: float, p2: float) -> float:
    return float(np.sqrt(lambda_for_power(df) / (n * (1 / p1 + 1 / p2))))


def worst_direction(p: np.ndarray, eps: float) -> np.ndarray:
    """p + delta, TV eps, delta proportional to p on the two halves (most likely tokens up, the rest down)."""
    order = np.argsort(-p)
    up = np.zeros(p.size, bool)
    mass = 0.0
    for i in order:  # greedily fill the "up" half to about 1/2 of the mass
        if mass + p[i] <= 0.5 or not up.any():
            up[i] = True
            mass += p[i]
    delta = np.where(up, p / p[up].sum(), -p / p[~up].sum()) * eps
    return p + delta


def simulated_power(p: np.ndarray, n: int, eps: float, two_tokens: bool, reps: int, rng) -> float:
    if two_tokens:
        i, j = np.argsort(-p)[:2]
        q = p.copy()
        q[i] += eps
        q[j] -= eps
    else:
        q = worst_direction(p, eps)
    counts = rng.multinomial(n, q, size=reps)
    return float(np.mean([not stats.chi2_counts("sim", c, p).ok for c in counts]))


def null_exceedance(p: np.ndarray, n: int, crit_of_df, reps: int, rng, chunk: int = 250_000) -> tuple[int, float]:
    """Simulated P(statistic > crit_of_df(df)) under the null, with the cell pooling of stats.py."""
    group = stats.pooled(p, n)
    k = int(group.max()) + 1
    pg = np.bincount(group[group >= 0], weights=p[group >= 0], minlength=k)
    crit = crit_of_df(k - 1)
    hits = 0
    done = 0
    while done < reps:
        m = min(chunk, reps - done)
        counts = rng.multinomial(n, pg, size=m).astype(np.float64)
        g = 2.0 * np.sum(np.where(counts > 0, counts * np.log(np.maximum(counts, 1.0) / (n * pg)), 0.0), axis=1)
        hits += int(np.sum(g > crit))
        done += m
    return hits, hits / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--laws", action="store_true", help="simulate the null on the laws of tests/test_sampling.py")
    ap.add_argument("--reps", type=int, default=2000, help="replicates per power simulation")
    ap.add_argument("--null-reps", type=int, default=10_000_000, help="null replicates per deep-tail law")
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    print(f"per-check level ALPHA = {stats.RUN_ALPHA:g} / {stats.CHECK_BUDGET} = {stats.ALPHA:.2e}; "
          f"false-alarm rate of one run <= {stats.CHECK_BUDGET} x ALPHA = {stats.RUN_ALPHA:.1e} (Bonferroni)")
    print(f"cells expected to hold < {stats.MIN_EXPECTED:g} samples are pooled\n")
    print(f"{'check':45s} {'N':>7s} {'df':>3s} {'thresh':>7s} {'TV90 worst':>10s} {'sim power':>9s} "
          f"{'TV90 2-token':>12s} {'sim power':>9s}")
    base = np.array([0.3, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02])  # the shape of the close target's law
    for what, n, cells in CHECKS:
        p = base[:cells] if cells <= base.size else np.append(base, [0.15] * (cells - base.size))
        p = p / p.sum()
        df = cells - 1
        e_w = eps_worst(n, df)
        p1, p2 = np.sort(p)[::-1][:2]
        e_2 = eps_two_tokens(n, df, p1, p2)
        s_w = simulated_power(p, n, e_w, False, args.reps, rng)
        s_2 = simulated_power(p, n, e_2, True, args.reps, rng)
        print(f"{what:45s} {n:7d} {df:3d} {stats.threshold(df):7.1f} {e_w:10.4f} {s_w:9.3f} {e_2:12.4f} {s_2:9.3f}")

    print(f"\nthe real per-check false-alarm rate (threshold at ALPHA / {stats.TAIL_SAFETY:g}), simulated under the "
          f"null; goal <= ALPHA = {stats.ALPHA:.1e}:")
    for p, n in [(np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.015, 0.004, 0.001]), 40_000),
                 (np.array([0.9, 0.05, 0.03, 0.015, 0.004, 0.0008, 0.0001, 0.0001]), 20_000)]:
        hits, rate = null_exceedance(p / p.sum(), n, stats.threshold, args.null_reps, rng)
        upper = (hits + 1.96 * np.sqrt(hits) + 2) / args.null_reps  # ~95% Poisson upper bound
        plain, _ = null_exceedance(p / p.sum(), n, lambda df: float(st.chi2.isf(stats.ALPHA, df)), args.null_reps,
                                   rng)
        print(f"  law {np.round(p, 4).tolist()} N={n}: {hits} exceedances in {args.null_reps:,} null runs = "
              f"{rate:.1e} (95% upper bound {upper:.1e}); at the unhalved chi-square quantile: "
              f"{plain / args.null_reps:.1e}")

    if args.laws:
        _check_real_laws(rng)


def _check_real_laws(rng) -> None:
    """Every law tests/test_sampling.py checks a generate run against: simulated null exceedance at level 1e-3."""
    import test_sampling as ts

    models = ts.build_models()
    enum = {k: ts._enumerate(t, ts.PROMPT) for k, (t, _) in models.items()}
    worst, total_hits, total_reps = 0.0, 0, 0
    alpha, reps = 1e-3, 100_000
    laws = 0
    for pair, kw in ts.PROOF:
        law = ts.exact_law(enum[pair], kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))
        for name, p in law.items():
            hits, rate = null_exceedance(p.reshape(-1), ts.N, lambda df: float(st.chi2.isf(alpha, df)), reps, rng)
            total_hits += hits
            total_reps += reps
            worst = max(worst, rate)
            laws += 1
    print(f"\n{laws} laws of the generate checks, {reps:,} null runs each, level {alpha:g}: overall exceedance "
          f"{total_hits / total_reps:.2e} (nominal {alpha:g}), worst single law {worst:.2e}")


if __name__ == "__main__":
    main()
