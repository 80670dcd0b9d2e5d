"""Batch and cluster arithmetic shared by the runtime, the planner and the train steps.

Pure Python (no TensorFlow, no JAX), so every backend and the planner can use it.
"""

from __future__ import annotations

import json
import math
import numbers
import random


def nearest_multiples(size: int, divisor: int) -> str:
    """The multiples of `divisor` on either side of `size`, for error messages.

    Example:
        >>> nearest_multiples(100, 24)
        '96 or 120'
    """
    below = size // divisor * divisor
    return f"{below} or {below + divisor}" if below else f"{below + divisor}"


def divisors(n: int) -> list[int]:
    """Every divisor of `n` (an int >= 1), ascending, made from its prime factors: no scan of
    the numbers up to `n` (a global batch of 10**12 has 169 divisors, found in microseconds).

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    found = [1]
    for prime, power in _prime_factors(n).items():
        found = [d * prime**e for d in found for e in range(power + 1)]
    return sorted(found)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is at most `at_most` (at least 1).

    Example:
        >>> largest_divisor(96, 20)
        16
    """
    return max(d for d in divisors(n) if d <= max(at_most, 1))


def _prime_factors(n: int) -> dict[int, int]:
    """`{prime: power}` of `n`: small primes by trial division, the rest by Pollard's rho."""
    factors: dict[int, int] = {}
    for prime in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % prime == 0:
            factors[prime] = factors.get(prime, 0) + 1
            n //= prime
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
        else:
            d = _pollard_rho(m)
            pending += [d, m // d]
    return factors


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact below 3.3 × 10**24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in bases:
        return True
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_rho(n: int) -> int:
    """A proper divisor of the composite odd `n` (Pollard's rho, Floyd's cycle finding)."""
    rng = random.Random(n)  # the same numbers every time: a deterministic result
    while True:
        c, x = rng.randrange(1, n), rng.randrange(2, n)
        y, d = x, 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(abs(x - y), n)
        if d != n:
            return d


def split_batch(global_batch_size: int, num_replicas: int, accumulation_steps: int, *,
                in_a_step: bool = False) -> int:
    """Rows of one micro-batch on one replica: global batch / (replicas × accumulation steps).

    The one check, with the one message, that the runtime, the planner and both train steps
    make of a global batch (`in_a_step`: the batch a train step received, which may be the
    partial last batch of an epoch).

    Raises:
        ValueError: `global_batch_size` is not a multiple of replicas × accumulation steps;
            the message names the nearest sizes that are.

    Example:
        >>> split_batch(96, 8, 3)
        4
    """
    divisor = num_replicas * accumulation_steps
    if global_batch_size % divisor:
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be divisible by replicas × "
            f"accumulation_steps ({num_replicas} × {accumulation_steps} = {divisor}). "
            f"Try {nearest_multiples(global_batch_size, divisor)}." + (
                " If this is the last batch of an epoch, batch the data with "
                "`drop_remainder=True`." if in_a_step else ""))
    return global_batch_size // divisor


def check_accumulation_steps(value) -> int | str:
    """`value` as an int (or "auto"), or raises: the one check of an `accumulation_steps`.

    Raises:
        ValueError: not a positive integer and not "auto".

    Example:
        >>> check_accumulation_steps(4), check_accumulation_steps("auto")
        (4, 'auto')
    """
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`accumulation_steps` must be a positive integer; received {value!r} "
            f"of type {type(value).__name__}. Pass the number of micro-batches each "
            "global batch is split into, e.g. `accumulation_steps=4`, or \"auto\" to "
            "take it from the memory plan.")
    if value < 1:
        raise ValueError(
            f"`accumulation_steps` must be >= 1; received {value}. Use 1 for no "
            "accumulation, or k > 1 to split each global batch into k micro-batches.")
    return int(value)


def check_count(name: str, value: int) -> None:
    """Raises unless `value` is an int >= 1 (`name` is the argument's name, for the message)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")


def workers_in_tf_config(tf_config: str | None) -> int:
    """Chief + worker tasks in a `TF_CONFIG` JSON string (evaluators do not train in sync).

    Example:
        >>> workers_in_tf_config('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {}}')
        2
    """
    if not tf_config:
        return 1
    try:
        cluster = json.loads(tf_config).get("cluster", {})
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(
            f"TF_CONFIG is not a JSON object ({error}): {tf_config[:200]!r}. Expected e.g. "
            '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
            '"task": {"type": "worker", "index": 0}}; unset TF_CONFIG to train on one machine.'
        ) from error
    return max(1, len(cluster.get("chief", [])) + len(cluster.get("worker", [])))
