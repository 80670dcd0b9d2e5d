"""Batch and cluster arithmetic shared by the runtime, the planner and the train steps.

Pure Python (no TensorFlow, no JAX), so every backend and the planner can use it.
"""

from __future__ import annotations

import json
import numbers


def nearest_multiples(size: int, divisor: int) -> str:
    """The multiples of `divisor` on either side of `size`, for error messages.

    Example:
        >>> nearest_multiples(100, 24)
        '96 or 120'
    """
    below = size // divisor * divisor
    return f"{below} or {below + divisor}" if below else f"{below + divisor}"


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
