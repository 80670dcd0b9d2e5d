"""Batch and cluster arithmetic shared by the runtime, the planner and the train steps.

Pure Python (no TensorFlow, no JAX), so every backend and the planner can use it.
"""

from __future__ import annotations

import json


def nearest_multiples(size: int, divisor: int) -> str:
    """The multiples of `divisor` on either side of `size`, for error messages.

    Example:
        >>> nearest_multiples(100, 24)
        '96 or 120'
    """
    below = size // divisor * divisor
    return f"{below} or {below + divisor}" if below else f"{below + divisor}"


def check_count(name: str, value: int) -> None:
    """Raises unless `value` is an int >= 1 (`name` is the argument's name, for the message)."""
    if isinstance(value, bool) or not isinstance(value, int):
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
