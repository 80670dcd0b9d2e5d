"""Batch arithmetic: divisors from prime factors, against a scan of every number."""

import pytest

from tfmem.runtime.cluster import divisors, largest_divisor
from tfmem.training.recovery import halved


def _scanned(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_equal_a_scan_of_every_number():
    for n in range(1, 1500):
        assert divisors(n) == _scanned(n), n
    for n in (2**20, 3**9 * 7, 997 * 991, 720720, 1_000_003 * 2):
        assert divisors(n) == _scanned(n), n


@pytest.mark.parametrize("n, expected", [
    # 10**12 = 2**12 × 5**12: every 2**a × 5**b.
    (10**12, sorted(2**a * 5**b for a in range(13) for b in range(13))),
    # Two Mersenne primes: a product that a scan up to its square root could not reach.
    ((2**31 - 1) * (2**61 - 1), [1, 2**31 - 1, 2**61 - 1, (2**31 - 1) * (2**61 - 1)]),
    (2**61 - 1, [1, 2**61 - 1]),
])
def test_divisors_of_huge_batches_come_from_their_factors(n, expected):
    assert divisors(n) == expected


def test_largest_divisor_and_the_halved_micro_batch():
    assert [largest_divisor(96, bound) for bound in (0, 1, 5, 20, 48, 96, 500)] == [
        1, 1, 4, 16, 48, 96, 96]
    # 10**12's divisors are 2**a × 5**b: the largest below 10**6 is 2**8 × 5**5 = 800,000.
    assert largest_divisor(10**12, 10**6 - 1) == 800_000 == 2**8 * 5**5
    assert [halved(m) for m in (1, 2, 7, 12, 9, 10**12)] == [None, 1, 1, 6, 3, 5 * 10**11]
