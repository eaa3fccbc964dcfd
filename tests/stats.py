"""Goodness-of-fit checks with a stated false-alarm rate, for the sampling and EOS tests.

One check = the likelihood-ratio (G) test of observed counts against an EXACT law (the target's, computed by
enumeration): G = 2 sum obs log(obs / expected), compared with a chi-square quantile. Cells whose expected count is
below MIN_EXPECTED are pooled into one cell (smallest cells first); a sample in a cell of probability 0 fails the
check outright. G rather than Pearson's X^2: deep in the tail (where the Bonferroni level puts the thresholds) X^2
is dominated by upward fluctuations of rare cells and exceeds its chi-square quantile ~1.8x too often, while G's
tail follows chi-square's to within ~1.2x (10^7 simulated null runs, tests/stats_power.py).

False alarms. Every check of a test run is made at level ALPHA = RUN_ALPHA / CHECK_BUDGET (Bonferroni): if the sampler
is exact, the probability that ANY check of a run fails is at most RUN_ALPHA = 0.1%. The thresholds are chi-square
quantiles at ALPHA / TAIL_SAFETY, a margin for the chi-square approximation's error deep in the tail, which
tests/stats_power.py measures by simulating the null. Each test module that makes checks has a share of
the budget (SHARES) and ends with a test asserting it stayed within it, so adding checks cannot silently raise the
rate. Seeds are fixed, so a passing run stays passing; the rate says how unlikely a seed is to fail a correct sampler.

Power: tests/stats_power.py computes the smallest total-variation bias of a marginal that a check detects with 90%
probability (worst direction) for the sample sizes used, and prints the table quoted in the test modules' docstrings.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats as _st

RUN_ALPHA = 1e-3  # family-wise false-alarm rate of one run of the whole suite
CHECK_BUDGET = 432  # the most checks one run may make (sum of SHARES)
ALPHA = RUN_ALPHA / CHECK_BUDGET  # per-check level: 2.3e-6
MIN_EXPECTED = 20.0  # cells expected to hold fewer samples are pooled
# The thresholds are chi-square quantiles at ALPHA / TAIL_SAFETY: G's tail is still slightly heavier than chi-square's
# that far out (~1.2x on skewed 8-cell laws), and the halved level keeps the real per-check rate under ALPHA
# (tests/stats_power.py simulates it).
TAIL_SAFETY = 2.0
# checks each module may make under the null ("test_sampling" counts test_dflash2_sampling's too: ~310 in all)
SHARES = {"test_sampling": 352, "test_hybrid": 32, "test_tree": 48}
assert sum(SHARES.values()) <= CHECK_BUDGET

_COUNTS: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    n: int  # samples
    stat: float  # G statistic (inf: a sample where the law has probability 0)
    df: int
    threshold: float  # chi-square quantile at 1 - ALPHA / TAIL_SAFETY
    tv: float  # total variation between the histogram and the exact law (for reading, not for deciding)

    @property
    def ok(self) -> bool:
        return self.stat <= self.threshold

    @property
    def ratio(self) -> float:
        return self.stat / self.threshold if self.threshold > 0 else (0.0 if self.stat == 0 else np.inf)

    @property
    def pvalue(self) -> float:
        return 0.0 if not np.isfinite(self.stat) else (1.0 if self.df == 0 else float(_st.chi2.sf(self.stat, self.df)))

    def __str__(self) -> str:
        return (f"{self.name}: G={self.stat:.1f} (df {self.df}, threshold {self.threshold:.1f}, "
                f"p={self.pvalue:.2g}) TV={self.tv:.4f}")


def threshold(df: int, alpha: float = ALPHA) -> float:
    return float(_st.chi2.isf(alpha / TAIL_SAFETY, df)) if df > 0 else 0.0


def pooled(probs: np.ndarray, n: int, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Cell index -> group index: cells of positive probability whose expected count is < min_expected are merged
    (smallest first) until the merged group reaches it; zero-probability cells get group -1."""
    probs = np.asarray(probs, np.float64)
    group = np.full(probs.shape, -1, np.int64)
    live = np.flatnonzero(probs > 0)
    big = [i for i in live if probs[i] * n >= min_expected]
    small = sorted((i for i in live if probs[i] * n < min_expected), key=lambda i: probs[i])
    for g, i in enumerate(big):
        group[i] = g
    if small:
        g = len(big)
        mass = 0.0
        for i in small:
            group[i] = g
            mass += probs[i]
        if mass * n < min_expected and big:  # the pool is still tiny: merge it into the smallest big cell
            smallest_big = min(big, key=lambda i: probs[i])
            group[group == g] = group[smallest_big]
    return group


def chi2_check(name: str, samples: np.ndarray, probs: np.ndarray) -> Check:
    """samples: int cell ids [N] in 0..len(probs)-1; probs: the exact law."""
    probs = np.asarray(probs, np.float64).reshape(-1)
    samples = np.asarray(samples).reshape(-1)
    assert samples.min() >= 0 and samples.max() < probs.size, (samples.min(), samples.max(), probs.size)
    return chi2_counts(name, np.bincount(samples, minlength=probs.size), probs)


def chi2_counts(name: str, counts: np.ndarray, probs: np.ndarray) -> Check:
    """counts [K] observed per cell; probs [K] the exact law."""
    probs = np.asarray(probs, np.float64).reshape(-1)
    probs = probs / probs.sum()
    counts = np.asarray(counts, np.float64).reshape(-1)
    n = int(counts.sum())
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    group = pooled(probs, n)
    if counts[group < 0].sum() > 0:  # a token the law never produces
        return Check(name, n, np.inf, 0, 0.0, tv)
    k = int(group.max()) + 1
    obs = np.bincount(group[group >= 0], weights=counts[group >= 0], minlength=k)
    exp = np.bincount(group[group >= 0], weights=probs[group >= 0], minlength=k) * n
    stat = float(2.0 * np.sum(np.where(obs > 0, obs * np.log(np.maximum(obs, 1.0) / exp), 0.0))) if k > 1 else 0.0
    return Check(name, n, stat, k - 1, threshold(k - 1), tv)


def binomial_check(name: str, successes: int, trials: int, prob: float) -> Check:
    """A success count against an exact probability (two-sided, as a 1-df chi-square)."""
    return chi2_counts(name, np.array([trials - successes, successes]), np.array([1.0 - prob, prob]))


def report(label: str, checks: list[Check]) -> None:
    worst = max(checks, key=lambda c: c.ratio)
    print(f"\n[{label}] {len(checks)} checks, N={checks[0].n}; worst {worst}")


def assert_matches(module: str, label: str, checks: list[Check]) -> None:
    """Every check passes (these count against the module's share of the false-alarm budget)."""
    _COUNTS[module] = _COUNTS.get(module, 0) + len(checks)
    report(label, checks)
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, f"{label}: checks over the threshold (per-check level {ALPHA:.1e}):\n  " + "\n  ".join(bad)


def assert_fails(label: str, checks: list[Check], margin: float = 1.0) -> None:
    """A negative control: some check must fail (statistic over `margin` x the threshold)."""
    report("NEGATIVE CONTROL " + label, checks)
    worst = max(checks, key=lambda c: c.ratio)
    assert worst.ratio > margin, f"negative control {label} not detected: worst {worst}"


def count(module: str) -> int:
    return _COUNTS.get(module, 0)


def assert_within_budget(module: str) -> None:
    print(f"\n[{module}] {count(module)} statistical checks under the null (share {SHARES[module]}, per-check level "
          f"{ALPHA:.1e}, run false-alarm rate <= {RUN_ALPHA:.1e})")
    assert count(module) <= SHARES[module], (count(module), SHARES[module])
