"""Statistics for comparing runs: standard errors, paired bootstrap intervals, the exact McNemar test and the
paired sign-flip permutation test. Plain numpy (no torch), so scripts can use it without loading a model.

Conventions (what lm-evaluation-harness and the usual paired analyses do):
- the standard error of a mean is the sample standard deviation (n - 1) over sqrt(n); one value has none;
- a mean of other means ("mean_of": LongBench category averages) is stratified: each component keeps its own
  samples, the components weigh equally, se = sqrt(sum se_c^2) / k;
- paired statistics work on per-sample differences, grouped in strata with weights that sum to 1 (one stratum of
  weight 1 for a plain mean): the difference is sum_s w_s * mean(d_s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 10_000  # bootstrap resamples and random sign flips
SEED = 0  # fixed, so a report is reproducible run to run
EXACT_FLIPS_UP_TO = 16  # 2^16 = 65,536 sign patterns: cheap to enumerate exactly
ALPHA = 0.05
TOLERANCE = 1e-12  # |stat| >= |observed| - TOLERANCE counts as "as extreme" (float sums of equal terms)
_CHUNK_CELLS = 2_000_000  # resamples x samples per numpy chunk (bounds the memory of one step to ~16 MB)


@dataclass(frozen=True)
class MeanSE:
    mean: float | None
    se: float | None
    n: int


@dataclass(frozen=True)
class Stratum:
    """Paired per-sample values of one component: a[i] and b[i] are the two runs' scores on the same sample."""

    a: np.ndarray
    b: np.ndarray
    weight: float


@dataclass(frozen=True)
class PairedResult:
    n: int
    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    p_value: float
    test: str  # "mcnemar" or "sign-flip"


def mean_se(values: Sequence[float]) -> MeanSE:
    """Mean, standard error (sample sd with n - 1, over sqrt(n); None for n < 2) and n of `values`."""
    x = np.asarray(values, dtype=float)
    n = int(x.size)
    if n == 0:
        return MeanSE(None, None, 0)
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    return MeanSE(mean, se, n)


def mean_of(parts: Sequence[MeanSE]) -> MeanSE:
    """A mean of k component means: n = sum of the components' n, se = sqrt(sum se_c^2) / k (the components are
    independent samples), None when any component has none."""
    if not parts or any(p.mean is None for p in parts):
        return MeanSE(None, None, sum(p.n for p in parts))
    k = len(parts)
    mean = sum(p.mean for p in parts) / k  # type: ignore[misc]
    ses = [p.se for p in parts]
    se = None if any(s is None for s in ses) else math.sqrt(sum(s * s for s in ses)) / k  # type: ignore[operator]
    return MeanSE(mean, se, sum(p.n for p in parts))


def _strata(strata: Sequence[Stratum]) -> list[Stratum]:
    kept = [s for s in strata if len(s.a)]
    total = sum(s.weight for s in kept)
    if not kept or total <= 0:
        raise ValueError("no paired samples")
    # Components without shared samples drop out; the others keep their relative weights.
    return [Stratum(np.asarray(s.a, float), np.asarray(s.b, float), s.weight / total) for s in kept]


def weighted_diff(strata: Sequence[Stratum]) -> float:
    return float(sum(s.weight * (s.a - s.b).mean() for s in _strata(strata)))


def bootstrap_ci(strata: Sequence[Stratum], resamples: int = RESAMPLES, seed: int = SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the paired difference: each of `resamples` resamples draws, within every stratum,
    as many per-sample differences as it holds (with replacement) and recomputes sum_s w_s * mean(d_s)."""
    kept = _strata(strata)
    if all(np.all(s.a - s.b == (s.a - s.b)[0]) for s in kept):
        d = weighted_diff(kept)  # every resample gives the same value: skip the float noise of resampled means
        return d, d
    rng = np.random.default_rng(seed)
    stats = np.zeros(resamples)
    for s in kept:
        d = s.a - s.b
        n = d.size
        values, counts = np.unique(d, return_counts=True)
        # Few distinct differences (0/100 scores: at most 3): a resample is known by how often it drew each
        # value, multinomial counts, the same distribution of resampled means at a cost of (distinct values) per
        # resample instead of n. Many distinct values: draw the n indices.
        grouped = values.size * 4 <= n
        step = max(1, _CHUNK_CELLS // (values.size if grouped else n))
        for start in range(0, resamples, step):
            m = min(step, resamples - start)
            if grouped:
                means = (rng.multinomial(n, counts / n, size=m) @ values) / n
            else:
                means = d[rng.integers(0, n, size=(m, n), dtype=np.int32)].mean(axis=1)
            stats[start:start + m] += s.weight * means
    lo, hi = np.percentile(stats, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 0.5), exactly (integers, then one division)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar test on the discordant pairs (b: only the first right, c: only the second):
    p = min(1, 2 * P(X <= min(b, c))), X ~ Binomial(b + c, 0.5); p = 1 without discordant pairs."""
    if b + c == 0:
        return 1.0
    return min(1.0, 2 * binom_cdf_half(min(b, c), b + c))


def mcnemar_min_discordant(alpha: float = ALPHA) -> int:
    """The fewest discordant pairs, all in one direction, the exact McNemar test can call significant:
    the smallest k with 2 * 0.5^k < alpha (6 at alpha = 0.05: 2/64 = 0.031; 2/32 = 0.0625 is not)."""
    k = 1
    while 2 * 0.5 ** k >= alpha:
        k += 1
    return k


def sign_flip_p(strata: Sequence[Stratum], resamples: int = RESAMPLES, seed: int = SEED,
                exact_up_to: int = EXACT_FLIPS_UP_TO) -> float:
    """Two-sided paired permutation test: under "no difference" each sample's difference is as likely negated.
    stat = sum_i w_i d_i with w_i = w_s / n_s (the stratified difference). Exact over all 2^n sign patterns
    when n <= exact_up_to (p = share with |stat| >= |observed|), else `resamples` random patterns with
    p = (count + 1) / (resamples + 1)."""
    kept = _strata(strata)
    d = np.concatenate([s.a - s.b for s in kept])
    w = np.concatenate([np.full(len(s.a), s.weight / len(s.a)) for s in kept])
    wd = w * d
    observed = abs(float(wd.sum()))
    n = d.size
    if n <= exact_up_to:
        patterns = ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1) * 2 - 1  # every +-1 vector
        stats = np.abs(patterns @ wd)
        return float(np.mean(stats >= observed - TOLERANCE))
    rng = np.random.default_rng(seed)
    # Few distinct terms: equal terms flip as a group, k of m terms +v and m - k negated sum to v * (2k - m) with
    # k ~ Binomial(m, 1/2), the same distribution as m independent signs at one draw per distinct term. Many:
    # one random bit per term.
    values, counts = np.unique(wd, return_counts=True)
    grouped = values.size * 4 <= n
    count = 0
    step = max(1, _CHUNK_CELLS // (values.size if grouped else n))
    for start in range(0, resamples, step):
        m = min(step, resamples - start)
        if grouped:
            stats = (2 * rng.binomial(counts, 0.5, size=(m, values.size)) - counts) @ values
        else:
            bits = np.unpackbits(rng.integers(0, 256, size=(m, (n + 7) // 8), dtype=np.uint8), axis=1)[:, :n]
            stats = (2.0 * bits - 1.0) @ wd
        count += int(np.sum(np.abs(stats) >= observed - TOLERANCE))
    return (count + 1) / (resamples + 1)


def is_binary(values: np.ndarray) -> bool:
    """All values 0 or 100 (right/wrong scores, where McNemar applies)."""
    return bool(np.all((values == 0) | (values == 100)))


def paired_compare(strata: Sequence[Stratum], resamples: int = RESAMPLES, seed: int = SEED) -> PairedResult:
    """diff = mean_a - mean_b (stratified when several strata), its 95 % paired bootstrap interval, and a p value:
    the exact McNemar test for one stratum of 0/100 scores, else the sign-flip permutation test."""
    kept = _strata(strata)
    n = sum(len(s.a) for s in kept)
    mean_a = float(sum(s.weight * s.a.mean() for s in kept))
    mean_b = float(sum(s.weight * s.b.mean() for s in kept))
    lo, hi = bootstrap_ci(kept, resamples, seed)
    if len(kept) == 1 and is_binary(kept[0].a) and is_binary(kept[0].b):
        a, b = kept[0].a, kept[0].b
        p, test = mcnemar_exact(int(np.sum((a == 100) & (b == 0))), int(np.sum((a == 0) & (b == 100)))), "mcnemar"
    else:
        p, test = sign_flip_p(kept, resamples, seed), "sign-flip"
    return PairedResult(n, mean_a, mean_b, weighted_diff(kept), lo, hi, p, test)


def resolved(r: PairedResult, alpha: float = ALPHA) -> int:
    """+1 when the comparison resolves a > b (the 95 % interval lies above 0 and p < alpha), -1 for a < b, 0 when
    not resolved. Both are required: with a handful of discordant pairs the percentile bootstrap can exclude 0
    where the exact test cannot call it (4 of 20 samples one way: interval [5, ...], McNemar p = 0.125)."""
    if r.p_value >= alpha:
        return 0
    return 1 if r.ci_low > 0 else -1 if r.ci_high < 0 else 0
