"""kvbench.metrics.stats, pinned by hand: the standard error of a mean and of a mean of means, the paired bootstrap
interval, the exact McNemar test, the sign-flip permutation test, and which one a paired comparison uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvbench.metrics.stats import (MeanSE, PairedResult, Stratum, bootstrap_ci, holm, mcnemar_exact,
                                   mcnemar_min_discordant, mcnemar_n, mean_of, min_detectable_diff, required_n,
                                   mean_se, one_sided_bounds, one_sided_p, paired_compare, ratio_test, resolved,
                                   sign_flip_p)


def _one(a: list[float], b: list[float]) -> list[Stratum]:
    return [Stratum(np.array(a, float), np.array(b, float), 1.0)]


def test_standard_error_is_sample_sd_over_sqrt_n() -> None:
    # [0, 100, 100, 0, 100]: mean 60; squared deviations 3600 * 2 + 1600 * 3 = 12000; sd = sqrt(12000 / 4)
    # = sqrt(3000) = 54.77; se = sd / sqrt(5) = sqrt(600) = 24.49.
    r = mean_se([0, 100, 100, 0, 100])
    assert r.mean == 60.0 and r.n == 5
    assert r.se == pytest.approx(math.sqrt(600))
    assert round(r.se, 1) == 24.5
    assert mean_se([100.0]) == MeanSE(100.0, None, 1)  # one sample: no se
    assert mean_se([]) == MeanSE(None, None, 0)


def test_mean_of_means_adds_n_and_combines_se() -> None:
    # (mean 60, se sqrt(600), n 5) and (mean 40, se 10, n 4): mean (60 + 40) / 2 = 50, n = 9,
    # se = sqrt(600 + 100) / 2 = sqrt(700) / 2 = 13.23.
    r = mean_of([MeanSE(60.0, math.sqrt(600), 5), MeanSE(40.0, 10.0, 4)])
    assert r.mean == 50.0 and r.n == 9 and r.se == pytest.approx(math.sqrt(700) / 2)
    # A component of one sample has no se, so the mean of means has none either.
    assert mean_of([MeanSE(60.0, math.sqrt(600), 5), MeanSE(100.0, None, 1)]) == MeanSE(80.0, None, 6)


def test_bootstrap_interval_collapses_on_equal_differences() -> None:
    # Every difference is 10: every resample's mean is 10.
    assert bootstrap_ci(_one([100, 50, 70], [90, 40, 60])) == (10.0, 10.0)
    # Stratified: differences 10 (weight 0.5) and 30 (weight 0.5): every resample gives 0.5 * 10 + 0.5 * 30 = 20.
    st = [Stratum(np.array([20.0, 30.0]), np.array([10.0, 20.0]), 0.5), Stratum(np.array([30.0]), np.array([0.0]), 0.5)]
    assert bootstrap_ci(st) == (20.0, 20.0)


def test_bootstrap_percentiles_on_two_differences() -> None:
    # Differences [0, 100]: a resample's mean is 0 (prob 1/4), 50 (1/2) or 100 (1/4). A quarter of the 10,000
    # resamples sit at each end, far more than the 2.5 % each percentile cuts: the interval is exactly [0, 100].
    st = _one([100, 100], [100, 0])
    assert bootstrap_ci(st) == (0.0, 100.0)
    # [100, 0, 0, 100] differences (n = 4): the interval stays inside [min, max] and the seed fixes it.
    st = _one([100, 100, 0, 100], [0, 100, 0, 0])
    lo, hi = bootstrap_ci(st, seed=3)
    assert 0.0 <= lo <= hi <= 100.0
    assert bootstrap_ci(st, seed=3) == (lo, hi)


def test_bootstrap_resamples_with_the_right_distribution() -> None:
    # Differences [0, 0, 0, 100]: a resample's mean is 25 * B, B ~ Binomial(4, 1/4): P(0) = 0.32, P(75) = 0.047,
    # P(100) = 0.004. The lower 2.5 % lies in the 0s; above 75 lies 0.4 % < 2.5 % <= P(>= 75) = 5.1 %: [0, 75].
    assert bootstrap_ci(_one([0, 0, 0, 100], [0, 0, 0, 0])) == (0.0, 75.0)


def test_mcnemar_exact_by_hand() -> None:
    assert mcnemar_exact(6, 0) == 2 / 64 == 0.03125  # 2 * 0.5^6
    assert mcnemar_exact(5, 0) == 0.0625  # 2 * 0.5^5
    assert mcnemar_exact(3, 1) == 0.625  # 2 * P(X <= 1; 4, 0.5) = 2 * (1 + 4) / 16
    assert mcnemar_exact(1, 3) == 0.625  # symmetric
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair
    assert mcnemar_exact(2, 2) == 1.0  # 2 * P(X <= 2; 4) = 2 * 11/16 > 1: capped
    assert mcnemar_min_discordant() == 6  # 2 * 0.5^6 = 0.031 < 0.05 <= 2 * 0.5^5 = 0.0625


def test_sign_flip_exact_by_hand() -> None:
    # [1, 1, 1]: of the 8 sign patterns only +++ and --- reach |mean| >= 1: p = 2/8.
    assert sign_flip_p(_one([1, 1, 1], [0, 0, 0])) == 0.25
    # [1, -1]: the observed mean is 0, every pattern is as extreme: p = 1.
    assert sign_flip_p(_one([1, 0], [0, 1])) == 1.0
    # Stratified: differences 2 (weight 0.5, one sample) and 1 (weight 0.5): per-sample terms 1 and 0.5, observed
    # 1.5; patterns give |1.5|, |0.5|, |-0.5|, |-1.5|: p = 2/4.
    st = [Stratum(np.array([2.0]), np.array([0.0]), 0.5), Stratum(np.array([1.0]), np.array([0.0]), 0.5)]
    assert sign_flip_p(st) == 0.5


def test_sign_flip_random_above_16_samples() -> None:
    # 20 equal differences: only the two all-equal sign patterns (probability 2 / 2^20) reach the observed mean;
    # none of 10,000 random patterns does. scipy's two-sided p doubles the smaller tail, each tail counted as
    # (count + 1) / (resamples + 1): p = 2 * (0 + 1) / (10,000 + 1).
    assert sign_flip_p(_one([1.0] * 20, [0.0] * 20)) == 2 / 10001


def test_sign_flip_random_matches_the_exact_probability() -> None:
    # 12 differences of +1 and 8 of -1 (n = 20): a sign pattern sums to 2B - 20, B ~ Binomial(20, 1/2);
    # |2B - 20| >= 4 unless B is 9, 10 or 11: p = 1 - (167960 + 184756 + 167960) / 2^20 = 0.5034. 10,000 random
    # patterns estimate it within a few standard errors (sd 0.005).
    p = sign_flip_p(_one([1.0] * 12 + [0.0] * 8, [0.0] * 12 + [1.0] * 8))
    assert p == pytest.approx(1 - 520676 / 2 ** 20, abs=0.02)


def test_paired_compare_picks_mcnemar_for_0_100_scores() -> None:
    # a right on 6 samples where b is wrong, both wrong on 4: b = 6, c = 0, p = 2/64; diff = 60 - 0.
    r = paired_compare(_one([100] * 6 + [0] * 4, [0] * 10))
    assert (r.n, r.mean_a, r.mean_b, r.diff, r.p_value, r.test) == (10, 60.0, 0.0, 60.0, 0.03125, "mcnemar")
    assert 0 < r.ci_low <= r.ci_high <= 100
    assert resolved(r) == 1
    # Graded values: the sign-flip test ([1, 1, 1] differences: p = 0.25), never resolved at n = 3.
    g = paired_compare(_one([1.0, 2.0, 3.0], [0.0, 1.0, 2.0]))
    assert (g.diff, g.ci_low, g.ci_high, g.p_value, g.test) == (1.0, 1.0, 1.0, 0.25, "sign-flip")
    assert resolved(g) == 0
    # Two strata of 0/100 scores: stratified, so the permutation test, not McNemar.
    st = [Stratum(np.array([100.0]), np.array([0.0]), 0.5), Stratum(np.array([100.0]), np.array([100.0]), 0.5)]
    assert paired_compare(st).test == "sign-flip"
    with pytest.raises(ValueError, match="no paired samples"):
        paired_compare(_one([], []))


def test_holm_by_hand() -> None:
    # p = 0.01, 0.04, 0.03, 0.005 (m = 4). Sorted: 0.005 * 4 = 0.02, 0.01 * 3 = 0.03, 0.03 * 2 = 0.06,
    # 0.04 * 1 = 0.04 -> running maximum 0.02, 0.03, 0.06, 0.06; back in input order: 0.03, 0.06, 0.06, 0.02.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # Capped at 1: 0.5 * 2 = 1.0, 0.6 * 1 = 0.6 -> max(1.0, 0.6) = 1.0 for both.
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([]) == [] and holm([0.2]) == [0.2]


def _r(n: int, diff: float, test: str, n10: int = 0, n01: int = 0, sd_d: float = 0.0) -> PairedResult:
    return PairedResult(n, 0.0, 0.0, diff, 0.0, 0.0, 1.0, test, n10=n10, n01=n01, sd_d=sd_d)


def test_required_n_mcnemar_by_hand() -> None:
    # 5 of 15 discordant, all one way: p10 = 1/3, p01 = 0, psi = delta = 1/3. z_.975 = 1.959964, z_.8 = 0.841621:
    # 1.959964 * sqrt(1/3) = 1.131586, 0.841621 * sqrt(1/3 - 1/9) = 0.396743, (1.528329)^2 = 2.335790, / (1/9)
    # = 21.02 -> 22 samples.
    r = _r(15, -33.3, "mcnemar", n10=0, n01=5)
    assert mcnemar_n(0.0, 1 / 3) == pytest.approx(21.022, abs=1e-3)
    assert required_n(r) == 22  # above the exact test's floor: 6 discordant pairs at psi = 1/3 -> 18 samples
    # 5 of 5 discordant one way: Connor gives 1.959964^2 = 3.84 -> 4, but the exact test needs 6 discordant
    # pairs (p = 0.031; 5 give 0.0625): 6 / psi = 6 samples.
    assert required_n(_r(5, -100.0, "mcnemar", n01=5)) == 6
    # Even all 5 one way at n = 15 is below the 21 needed: no difference n = 15 can resolve at that discordance.
    assert min_detectable_diff(r) is None
    # No discordant pairs, or as many each way: nothing observed, no finite n.
    assert required_n(_r(15, 0.0, "mcnemar")) is None
    assert required_n(_r(15, 0.0, "mcnemar", n10=2, n01=2)) is None
    assert min_detectable_diff(_r(15, 0.0, "mcnemar")) is None


def test_min_detectable_diff_mcnemar_by_hand() -> None:
    # n = 20, 10 discordant (psi = 0.5). Connor's n at delta: (1.959964 sqrt(.5) + 0.841621 sqrt(.5 - d^2))^2 / d^2;
    # d = 0.415: (1.385904 + 0.841621 * 0.572517)^2 / 0.172225 = 3.488460 / 0.172225 = 20.26 > 20;
    # d = 0.42: (1.385904 + 0.841621 * 0.568859)^2 / 0.1764 = 3.476968 / 0.1764 = 19.71 < 20: 41.5 < mdd < 42 points.
    r = _r(20, 10.0, "mcnemar", n10=6, n01=4)
    d = min_detectable_diff(r)
    assert d is not None and 41.5 < d < 42.0
    assert mcnemar_n((0.5 + d / 100) / 2, (0.5 - d / 100) / 2) == pytest.approx(20.0, abs=1e-6)


def test_required_n_graded_by_hand() -> None:
    # Differences 0, 1, 2, 5: mean 2, sample variance (4 + 1 + 0 + 9) / 3 = 14/3, sd 2.160247;
    # n = ((1.959964 + 0.841621) * 2.160247 / 2)^2 = 3.026123^2 = 9.158 -> 10 samples;
    # minimum detectable difference at n = 4: 2.801585 * 2.160247 / 2 = 3.026.
    r = paired_compare(_one([0, 1, 2, 5], [0, 0, 0, 0]))
    assert r.test == "sign-flip" and r.sd_d == pytest.approx(math.sqrt(14 / 3))
    assert required_n(r) == 10
    # Differences 1, 1.1, 0.9: sd 0.1, mean 1: the approximation needs (2.801585 * 0.1)^2 = 0.08 -> the exact
    # sign-flip floor, 6 samples (2 / 2^6 = 0.031 < 0.05; 2 / 2^5 = 0.0625 is not).
    assert required_n(paired_compare(_one([1, 1.1, 0.9], [0, 0, 0]))) == 6
    assert min_detectable_diff(r) == pytest.approx(3.0261, abs=1e-4)
    assert required_n(paired_compare(_one([1.0, 2.0], [1.0, 2.0]))) is None  # zero difference
    # 0/100 scores go to McNemar with their discordant counts: 3 right only in a, 1 only in b.
    m = paired_compare(_one([100, 100, 100, 0, 0], [0, 0, 0, 100, 0]))
    assert (m.test, m.n10, m.n01) == ("mcnemar", 3, 1)


def test_a_single_pair_in_a_stratum_by_hand() -> None:
    # A pilot's shard can leave one sample in a component (code:click with n = 1). One pair alone: both sign
    # patterns give |stat| = 0.5, p = 1, and every resample is that pair: the interval is the difference itself.
    one = paired_compare([Stratum(np.array([1.0]), np.array([0.5]), 1.0)])
    assert (one.n, one.diff, one.ci_low, one.ci_high, one.p_value) == (1, 0.5, 0.5, 0.5, 1.0)
    # Two components of weight 1/2: one pair (d = 2) and two pairs (d = 1, 3). stat = 1 s1 + 0.25 s2 + 0.75 s3 over
    # the 8 sign patterns: |stat| >= 2 for (+,+,+) and (-,-,-) only, p = 2/8. The bootstrap resamples only the
    # second component: its mean difference is 1, 2 or 3 (1/4, 1/2, 1/4), so the sum is 1.5, 2 or 2.5 and the 95 %
    # percentile interval [1.5, 2.5].
    two = paired_compare([Stratum(np.array([2.0]), np.array([0.0]), 0.5),
                          Stratum(np.array([1.0, 3.0]), np.array([0.0, 0.0]), 0.5)])
    assert two.diff == 2.0 and two.p_value == 0.25 and (two.ci_low, two.ci_high) == (1.5, 2.5)


def test_one_sided_bounds_by_hand() -> None:
    # 1, 2, 3: mean 2, sd 1, se 1 / sqrt(3) = 0.57735; t(0.95, 2) = 2.91999 (tables): 2 -/+ 1.68585
    lower, upper = one_sided_bounds([1.0, 2.0, 3.0])
    assert lower == pytest.approx(0.31415, abs=1e-4) and upper == pytest.approx(3.68585, abs=1e-4)
    # alpha 0.10: t(0.90, 2) = 1.88562: 2 -/+ 1.08866
    assert one_sided_bounds([1.0, 2.0, 3.0], alpha=0.10)[0] == pytest.approx(0.91134, abs=1e-4)
    assert one_sided_bounds([4.0]) is None and one_sided_bounds([]) is None


def test_one_sided_p_by_hand() -> None:
    # 1, 2, 3 against the line 4: t = (2 - 4) / (1 / sqrt(3)) = -3.4641. With 2 degrees of freedom the t distribution's
    # CDF is 1/2 + t / (2 sqrt(2 + t^2)): 1/2 - 3.4641 / (2 sqrt(14)) = 1/2 - 0.46291 = 0.03709 under the line
    under, over = one_sided_p([1.0, 2.0, 3.0], 4.0)
    assert under == pytest.approx(0.5 - 3.4641016 / (2 * math.sqrt(14)), abs=1e-7) and round(under, 4) == 0.0371
    assert over == pytest.approx(1 - under)
    # the upper 95 % bound (3.686, above) is under 4: p under the line within 5 %, as it must be
    assert under <= 0.05 and one_sided_bounds([1.0, 2.0, 3.0])[1] <= 4.0
    assert one_sided_p([5.0, 5.0], 4.0) == (1.0, 0.0) and one_sided_p([3.0, 3.0], 4.0) == (0.0, 1.0)  # no spread
    assert one_sided_p([1.0], 4.0) is None


def test_ratio_test_is_the_t_test_of_the_logs_by_hand() -> None:
    # 2 and 8: logs ln 2 and 3 ln 2, mean 2 ln 2 = ln 4 (geometric mean 4; the arithmetic mean would be 5), sd
    # 2 ln 2 / sqrt(2) = 0.98026, se ln 2 = 0.69315; t(0.95, 1) = 6.31375 (tables): bounds exp(ln 4 -/+ 4.37636) =
    # 0.05028 and 318.2 (both positive, where the arithmetic mean's 5 -/+ 6.314 x 3 goes below 0). Against the line 4:
    # t = 0, p 1/2 either way.
    test = ratio_test([2.0, 8.0], 4.0)
    assert test.mean == pytest.approx(4.0) and (test.p_under, test.p_over) == pytest.approx((0.5, 0.5))
    assert test.lower == pytest.approx(4 * math.exp(-6.31375 * math.log(2)), rel=1e-5)
    assert round(test.lower, 4) == 0.0503
    assert test.upper == pytest.approx(4 * math.exp(6.31375 * math.log(2)), rel=1e-5)
    # the inverse ratios mirror it: geometric mean 1/4, bounds 1/318.2 and 1/0.05028
    inverse = ratio_test([0.5, 0.125], 0.25)
    assert (inverse.mean, inverse.lower, inverse.upper) == pytest.approx((0.25, 1 / test.upper, 1 / test.lower))
    # 1.1, 1.2, 1.3 against 1.0: logs 0.09531, 0.18232, 0.26236, mean 0.18000, sd 0.08355, se 0.04824, t = 3.7314:
    # p over the line 1/2 - 3.7314 / (2 sqrt(2 + 3.7314^2)) = 0.03245
    rising = ratio_test([1.1, 1.2, 1.3], 1.0)
    assert rising.p_over == pytest.approx(0.5 - 3.7314 / (2 * math.sqrt(2 + 3.7314 ** 2)), abs=1e-5)
    assert round(rising.p_over, 4) == 0.0325
    assert ratio_test([1.2], 1.0) is None


def test_a_monte_carlo_p_at_its_floor_is_written_as_a_bound() -> None:
    from kvbench.metrics.stats import at_mc_floor, mc_floor, p_text

    # 10,000 random sign patterns: the smallest p is (0 + 1) / 10,001 per tail, x 2 = 2 / 10,001 = 0.00019998
    floor = 2 / 10_001
    assert mc_floor() == floor
    mc = PairedResult(100, 0, 0, 1, 0.5, 1.5, floor, "sign-flip")
    assert at_mc_floor(mc) and p_text(mc) == "<= 0.0002"
    # Above the floor, an exact enumeration (n <= 16) or an exact McNemar p: a measured value
    assert p_text(PairedResult(100, 0, 0, 1, 0.5, 1.5, 0.0008, "sign-flip")) == "0.0008"
    assert not at_mc_floor(PairedResult(16, 0, 0, 1, 0.5, 1.5, floor, "sign-flip"))
    assert p_text(PairedResult(100, 0, 0, 1, 0.5, 1.5, 1e-9, "mcnemar")) == "1e-09"
