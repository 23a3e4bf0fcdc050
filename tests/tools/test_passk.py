"""pass@k is the unbiased estimator: checked against brute-force enumeration of every k-subset."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations

import pytest

from polarstream.tools.evaluate import pass_at_k


def brute_force(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct one."""
    subsets = list(combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_is_not_the_biased_plug_in_estimate():
    # 1 - (1 - c/n)^k, the plug-in estimate, overstates failure for small n: n=4, c=1, k=2 gives 7/16,
    # the unbiased value is 1 - C(3,2)/C(4,2) = 1/2.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 2) != pytest.approx(1 - (1 - 1 / 4) ** 2)


def test_edges_and_large_n():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # fewer than k failures: every k-subset holds a pass
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the pass rate
    # Exact integers: no overflow or cancellation where a float product of binomials would struggle.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)
