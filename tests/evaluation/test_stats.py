"""The intervals every reported reward carries, against published values."""
import pytest

from rcgrpo.evaluation.stats import Rate, difference, newcombe, rate, wilson


def test_wilson_interval():
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)  # never below 0 (or above 1)
    assert wilson(10, 10)[1] == pytest.approx(1.0) and wilson(0, 0) == (0.0, 1.0)


def test_newcombe_interval_of_a_difference():
    # Newcombe (1998), Statistics in Medicine 17:873, table II: 56/70 - 48/80.
    assert newcombe(56, 70, 48, 80) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    d, (lo, hi) = difference(Rate(9, 10), Rate(3, 10))
    assert d == pytest.approx(0.6) and lo < d < hi and lo > 0


def test_rate_counts_full_rewards_only():
    r = rate([1.0, 0.0, 1.0, 0.5])
    assert (r.k, r.n, r.mean) == (2, 4, 0.5) and str(r).startswith("0.500 [")
