"""Statistics for comparing runs: standard errors, paired bootstrap intervals, the exact McNemar test and the
paired sign-flip permutation test, computed by `scipy.stats` (no torch, so scripts can use it without a model).

Conventions (what lm-evaluation-harness and the usual paired analyses do):
- the standard error of a mean is the sample standard deviation (n - 1) over sqrt(n); one value has none;
- a mean of other means ("mean_of": LongBench category averages) is stratified: each component keeps its own
  samples, the components weigh equally, se = sqrt(sum se_c^2) / k;
- paired statistics work on per-sample differences, grouped in strata with weights that sum to 1 (one stratum of
  weight 1 for a plain mean): the difference is sum_s w_s * mean(d_s);
- a mean against a line: one-sided t bounds (`one_sided_bounds`) and the matching one-sided p values
  (`one_sided_p`); paired ratios against a line (the bench's goals over rounds: a time over a reference's, a speed-up)
  the same on their logs (`ratio_test`: the geometric mean, so a ratio and its inverse give mirrored verdicts);
- a family of tests is corrected by Holm's step-down method (`holm`); the power of a paired comparison
  (`required_n`, `min_detectable_diff`) is the usual normal approximation at alpha = 0.05 (two-sided), 80 % power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

RESAMPLES = 10_000  # bootstrap resamples and random sign flips
SEED = 0  # fixed, so a report is reproducible run to run
EXACT_FLIPS_UP_TO = 16  # 2^16 = 65,536 sign patterns: cheap to enumerate exactly
ALPHA = 0.05
POWER = 0.80  # the power `required_n` and `min_detectable_diff` plan for
NO_DIFFERENCE = "no difference observed"  # said in words where a sample size would be infinite
_BATCH_CELLS = 2_000_000  # resamples x samples per scipy batch (bounds the memory of one step to ~16 MB)


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
    # What the power of the comparison needs (see `required_n`): for "mcnemar", the discordant pairs (a right and b
    # wrong, a wrong and b right); for "sign-flip", sd_d = sqrt(n) * the standard error of the (weighted)
    # difference, the per-sample standard deviation of the differences for one stratum.
    n10: int = 0
    n01: int = 0
    sd_d: float = 0.0


def mean_se(values: Sequence[float]) -> MeanSE:
    """Mean, standard error (sample sd with n - 1, over sqrt(n); None for n < 2) and n of `values`."""
    x = np.asarray(values, dtype=float)
    n = int(x.size)
    if n == 0:
        return MeanSE(None, None, 0)
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    return MeanSE(mean, se, n)


def one_sided_bounds(values: Sequence[float], alpha: float = ALPHA) -> tuple[float, float] | None:
    """(lower, upper): the mean of `values` less and plus t(1 - alpha, n - 1) standard errors (`mean_se`), each a
    one-sided 1 - alpha bound: a claim that the mean is over a line holds at that level when `lower` is over it, that it
    is under a line when `upper` is under it. None for n < 2 (no standard error)."""
    m = mean_se(values)
    if m.se is None:
        return None
    half = float(stats.t.ppf(1 - alpha, m.n - 1)) * m.se
    return m.mean - half, m.mean + half  # type: ignore[operator]


def one_sided_p(values: Sequence[float], line: float) -> tuple[float, float] | None:
    """(p_under, p_over): one-sided t-test p values (n - 1 degrees of freedom) that the mean of `values` is under
    `line` and that it is over it; p_under <= alpha exactly when `one_sided_bounds`' upper bound is within the line,
    p_over <= alpha when its lower bound is over it. None for n < 2. With no spread (se 0) the mean decides: p 0 on its
    side of the line, 1 on the other."""
    m = mean_se(values)
    if m.se is None:
        return None
    if m.se == 0:
        return (0.0 if m.mean <= line else 1.0), (0.0 if m.mean > line else 1.0)  # type: ignore[operator]
    t = (m.mean - line) / m.se  # type: ignore[operator]
    return float(stats.t.cdf(t, m.n - 1)), float(stats.t.sf(t, m.n - 1))


@dataclass(frozen=True)
class RatioTest:
    """Paired ratios against a line: their geometric mean, its one-sided 1 - alpha bounds (lower, upper) and the
    one-sided p values that the ratio is under the line and over it."""
    mean: float
    lower: float
    upper: float
    p_under: float
    p_over: float


def ratio_test(ratios: Sequence[float], line: float, alpha: float = ALPHA) -> RatioTest | None:
    """`ratios` (each > 0) against `line` on the log scale: `one_sided_bounds` and `one_sided_p` of their logs
    against log(line), back on the ratio scale. A ratio is multiplicative (1.2x and 1/1.2x are the same distance from
    1), so its logs are what a t test averages: the bounds stay positive and the test of b/a mirrors that of a/b.
    None for fewer than two ratios."""
    logs = [math.log(r) for r in ratios]
    bounds, ps = one_sided_bounds(logs, alpha), one_sided_p(logs, math.log(line))
    if bounds is None or ps is None:
        return None
    return RatioTest(math.exp(float(np.mean(logs))), math.exp(bounds[0]), math.exp(bounds[1]), *ps)


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


def _mean_difference(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return a.mean(axis=axis) - b.mean(axis=axis)


def bootstrap_ci(strata: Sequence[Stratum], resamples: int = RESAMPLES, seed: int = SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the paired difference: scipy's paired bootstrap of mean(a) - mean(b) within every
    stratum (each resample draws as many pairs as the stratum holds, with replacement), the strata's resampled
    differences summed with their weights, then the percentiles of that sum."""
    kept = _strata(strata)
    if all(np.all(s.a - s.b == (s.a - s.b)[0]) for s in kept):
        d = weighted_diff(kept)  # every resample gives the same value (scipy calls such a distribution degenerate)
        return d, d
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for s in kept:
        if len(s.a) == 1:  # one pair: every resample is that pair (scipy refuses a one-observation sample)
            total += s.weight * float(s.a[0] - s.b[0])
            continue
        res = stats.bootstrap((s.a, s.b), _mean_difference, paired=True, vectorized=True, n_resamples=resamples,
                              batch=max(1, _BATCH_CELLS // len(s.a)), method="percentile", random_state=rng)
        total += s.weight * res.bootstrap_distribution
    lo, hi = np.percentile(total, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar test on the discordant pairs (b: only the first right, c: only the second): the
    two-sided binomial test of b successes in b + c trials at 0.5 (= min(1, 2 * P(X <= min(b, c)))); p = 1 without
    discordant pairs."""
    if b + c == 0:
        return 1.0
    return float(stats.binomtest(b, b + c, 0.5).pvalue)


def mcnemar_min_discordant(alpha: float = ALPHA) -> int:
    """The fewest discordant pairs, all in one direction, the exact McNemar test can call significant (6 at
    alpha = 0.05: p = 2/64 = 0.031; 2/32 = 0.0625 is not)."""
    k = 1
    while mcnemar_exact(k, 0) >= alpha:
        k += 1
    return k


def sign_flip_p(strata: Sequence[Stratum], resamples: int = RESAMPLES, seed: int = SEED,
                exact_up_to: int = EXACT_FLIPS_UP_TO) -> float:
    """Two-sided paired permutation test (scipy's permutation_test, permutation_type="samples": each pair's two
    values swap, i.e. each sample's difference is negated): under "no difference" every sign pattern is as likely.
    stat = sum_i w_i (a_i - b_i) with w_i = w_s / n_s (the stratified difference). Exact over all 2^n patterns when
    n <= exact_up_to (p = the share of patterns with |stat| >= |observed|, the null being symmetric), else
    `resamples` random patterns, where scipy's p = 2 * min over the two tails of (count + 1) / (resamples + 1)."""
    kept = _strata(strata)
    a = np.concatenate([s.a for s in kept])
    b = np.concatenate([s.b for s in kept])
    w = np.concatenate([np.full(len(s.a), s.weight / len(s.a)) for s in kept])
    n = a.size

    def statistic(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum(w * (x - y), axis=axis)

    if n == 1:  # both sign patterns give the observed |stat| (scipy refuses a one-observation sample)
        return 1.0
    exact = n <= exact_up_to
    res = stats.permutation_test((a, b), statistic, permutation_type="samples", vectorized=True,
                                 n_resamples=np.inf if exact else resamples, alternative="two-sided",
                                 batch=max(1, _BATCH_CELLS // n), random_state=np.random.default_rng(seed))
    return float(res.pvalue)


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
        n10, n01 = int(np.sum((a == 100) & (b == 0))), int(np.sum((a == 0) & (b == 100)))
        return PairedResult(n, mean_a, mean_b, weighted_diff(kept), lo, hi, mcnemar_exact(n10, n01), "mcnemar",
                            n10=n10, n01=n01)
    return PairedResult(n, mean_a, mean_b, weighted_diff(kept), lo, hi, sign_flip_p(kept, resamples, seed),
                        "sign-flip", sd_d=_sd_of_difference(kept))


def _sd_of_difference(kept: list[Stratum]) -> float:
    """sqrt(n) * se of sum_s w_s mean(d_s), se^2 = sum_s w_s^2 var(d_s) / n_s (sample variances, n - 1): for one
    stratum the standard deviation of the differences. 0 where a stratum has a single sample (no variance)."""
    n = sum(len(s.a) for s in kept)
    var = sum(s.weight ** 2 * float(np.var(s.a - s.b, ddof=1)) / len(s.a) for s in kept if len(s.a) > 1)
    return math.sqrt(n * var)


def resolved(r: PairedResult, alpha: float = ALPHA) -> int:
    """+1 when the comparison resolves a > b (the 95 % interval lies above 0 and p < alpha), -1 for a < b, 0 when
    not resolved. Both are required: with a handful of discordant pairs the percentile bootstrap can exclude 0
    where the exact test cannot call it (4 of 20 samples one way: interval [5, ...], McNemar p = 0.125)."""
    if r.p_value >= alpha:
        return 0
    return 1 if r.ci_low > 0 else -1 if r.ci_high < 0 else 0


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p values (Holm 1979, "A simple sequentially rejective multiple test procedure",
    Scand. J. Statist. 6: 65-70), in the input order: sort p ascending, p_(i) * (m - i + 1) for rank i = 1..m, a
    running maximum so the adjusted values keep the order of the raw ones, capped at 1. Rejecting where adjusted
    p < alpha controls the family-wise error rate at alpha for any dependence between the tests."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p_values[i])))
        out[i] = running
    return out


def _z(alpha: float, power: float) -> tuple[float, float]:
    return float(stats.norm.ppf(1 - alpha / 2)), float(stats.norm.ppf(power))


def mcnemar_n(p10: float, p01: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Connor (1987)'s sample size for McNemar's test: n = (z_{a/2} sqrt(psi) + z_b sqrt(psi - delta^2))^2 /
    delta^2, psi = p10 + p01 (discordant share), delta = p10 - p01; inf when delta = 0."""
    psi, delta = p10 + p01, p10 - p01
    if delta == 0:
        return math.inf
    za, zb = _z(alpha, power)
    return (za * math.sqrt(psi) + zb * math.sqrt(max(0.0, psi - delta * delta))) ** 2 / delta ** 2


def required_n(r: PairedResult, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """The samples the observed difference would need to be resolved at `alpha` (two-sided) with `power`: McNemar
    (Connor 1987) from the observed discordant shares for "mcnemar" comparisons, else the paired normal
    approximation n = ((z_{a/2} + z_b) sd_d / mean_d)^2. None where no difference was observed (infinite).
    Rounded up, and never below what the exact tests can resolve at all (the normal approximation ignores it at
    small n): k = 6 samples for the sign flips (2 / 2^6 = 0.031), and for McNemar k / psi samples, so that k
    discordant pairs are expected (k = `mcnemar_min_discordant`)."""
    k = mcnemar_min_discordant(alpha)
    if r.test == "mcnemar":
        need = mcnemar_n(r.n10 / r.n, r.n01 / r.n, alpha, power)
        if not math.isinf(need):
            need = max(need, k * r.n / (r.n10 + r.n01))
    else:
        if r.diff == 0:
            return None
        za, zb = _z(alpha, power)
        need = max(k, ((za + zb) * r.sd_d / r.diff) ** 2)
    return None if math.isinf(need) else math.ceil(need - 1e-9)


def min_detectable_diff(r: PairedResult, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest |difference| (score units; 0/100 scores in points) the comparison's n resolves at `alpha` with
    `power`: for "sign-flip", (z_{a/2} + z_b) sd_d / sqrt(n); for "mcnemar", the delta that solves Connor's formula
    for n at the observed discordant share psi (100 * delta points, by bisection: the required n falls as delta
    grows), and never below 100 * k / n, k = 6 discordant pairs all one way being the fewest the exact test
    resolves. None where it is undefined: no discordant pairs (psi = 0), fewer than k, or even every discordant
    pair one way (delta = psi) is too few."""
    za, zb = _z(alpha, power)
    if r.test != "mcnemar":
        return (za + zb) * r.sd_d / math.sqrt(r.n)
    psi = (r.n10 + r.n01) / r.n
    k = mcnemar_min_discordant(alpha)
    if r.n10 + r.n01 < k or mcnemar_n(psi, 0.0, alpha, power) > r.n:
        return None
    lo, hi = 0.0, psi  # mcnemar_n falls as delta grows: bisect for mcnemar_n(delta) = n
    for _ in range(100):
        mid = (lo + hi) / 2
        if mcnemar_n((psi + mid) / 2, (psi - mid) / 2, alpha, power) > r.n:
            lo = mid
        else:
            hi = mid
    return max(100 * hi, 100 * k / r.n)


def mc_floor(resamples: int = RESAMPLES) -> float:
    """The smallest two-sided p a Monte-Carlo test of `resamples` draws can give, 2 / (resamples + 1): a p at this
    floor says "at most this", not a measured value."""
    return 2 / (resamples + 1)


def cluster_bootstrap(d: Sequence[float], factors: Sequence[Sequence[object]], resamples: int = RESAMPLES,
                      seed: int = SEED, level: float = 0.95) -> tuple[float, float, float, float]:
    """(lo, hi, p, se) of the mean of paired differences `d` whose samples share clusters: each factor (e.g. the
    haystack window a sample was cut from, and its needle) labels every sample with a cluster. Each resample draws
    every factor's clusters with replacement, independently (Owen 2007, "The pigeonhole bootstrap", Ann. Appl.
    Stat. 1: 386-411), and weighs sample i by the product of its clusters' draw counts; the resampled statistic is
    the weighted mean. Two samples that share a cluster of any factor move together, so the spread counts their
    dependence (with crossed factors it errs on the wide side, which Owen shows). lo, hi: percentile interval at
    `level`; p: the two-sided p that inverts it, 2 * min(#{T* <= 0} + 1, #{T* >= 0} + 1) / (resamples + 1) capped at 1
    (never below `mc_floor`); se: the resampled statistics' standard deviation. Resamples that draw no sample (every
    weight 0) are drawn again."""
    x = np.asarray(d, dtype=float)
    if x.size == 0:
        raise ValueError("no paired samples")
    codes = [np.unique(np.asarray([str(v) for v in f]), return_inverse=True)[1] for f in factors]
    if any(c.size != x.size for c in codes):
        raise ValueError("every factor labels every sample")
    rng = np.random.default_rng(seed)
    stats_out: list[np.ndarray] = []
    need = resamples
    while need > 0:
        w = np.ones((need, x.size))
        for c in codes:
            g = int(c.max()) + 1
            w *= rng.multinomial(g, np.full(g, 1 / g), size=need)[:, c]
        total = w.sum(axis=1)
        ok = total > 0
        stats_out.append((w[ok] @ x) / total[ok])
        need -= int(ok.sum())
    t = np.concatenate(stats_out)
    lo, hi = np.percentile(t, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    p = min(1.0, 2 * (min(int(np.sum(t <= 0)), int(np.sum(t >= 0))) + 1) / (resamples + 1))
    return float(lo), float(hi), p, float(t.std(ddof=1))


def at_mc_floor(r: PairedResult, resamples: int = RESAMPLES) -> bool:
    """Whether r's p is a Monte-Carlo sign-flip p at its floor (random patterns, beyond the exact enumeration)."""
    return r.test == "sign-flip" and r.n > EXACT_FLIPS_UP_TO and r.p_value <= mc_floor(resamples) * (1 + 1e-9)


def p_text(r: PairedResult) -> str:
    """r's p in 3 digits, or "<= " its floor where `at_mc_floor`: a bound, never a measured value."""
    return f"<= {r.p_value:.3g}" if at_mc_floor(r) else f"{r.p_value:.3g}"
