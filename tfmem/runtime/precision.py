"""The mixed-precision policy for a runtime: the choice (pure) apart from setting it (global).

- TPU → "mixed_bfloat16": TPUs compute in bfloat16 natively, and bfloat16 has float32's
  exponent range, so no loss scaling is needed.
- GPU with CUDA compute capability ≥ 7.0 (V100, T4, A100, L4, H100) → "mixed_float16": their
  tensor cores run float16 several times faster than float32; Keras adds loss scaling.
- anything else (CPU, P100, K80) → "float32": float16 has no fast path there. bfloat16 on CPU
  halves activation memory but is usually slower; it is used only when asked for
  (`cpu_bfloat16=True`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tfmem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
_TENSOR_CORES = (7, 0)


def _decide(runtime: Runtime, cpu_bfloat16: bool) -> tuple[str, str]:
    """(policy, why) for a runtime; pure."""
    if runtime.kind == "tpu":
        return "mixed_bfloat16", f"{runtime.device_name or 'TPU'} computes in bfloat16 natively"
    if runtime.kind == "gpu":
        capability = runtime.compute_capability
        if capability is None:
            return "float32", f"{runtime.device_name}: compute capability unknown"
        shown = ".".join(map(str, capability))
        if tuple(capability) >= _TENSOR_CORES:
            return "mixed_float16", (
                f"{runtime.device_name} has compute capability {shown} >= 7.0 "
                "(float16 tensor cores)"
            )
        return "float32", (
            f"{runtime.device_name} has compute capability {shown} < 7.0 (no fast float16)"
        )
    if cpu_bfloat16:
        return "mixed_bfloat16", "bfloat16 on CPU was asked for (cpu_bfloat16=True)"
    return "float32", "CPU: reduced precision saves memory but is slower; pass cpu_bfloat16=True"


def policy_for(runtime: Runtime, *, cpu_bfloat16: bool = False) -> str:
    """The Keras mixed-precision policy name for a runtime (does not set anything).

    Args:
        runtime: from `tfmem.detect()`.
        cpu_bfloat16: on CPU, use "mixed_bfloat16" (less activation memory, usually slower).

    Example:
        >>> tfmem.policy_for(tfmem.detect())  # on a laptop
        'float32'
    """
    return _decide(runtime, cpu_bfloat16)[0]


def set_policy(
    runtime: Runtime | None = None, *, policy: str | None = None, cpu_bfloat16: bool = False
) -> str:
    """Sets Keras's global dtype policy for a runtime (or an explicit one) and logs why.

    Call it before building the model: layers read the global policy when they are created.

    Args:
        runtime: choose with `policy_for(runtime, cpu_bfloat16=...)`.
        policy: a policy name to set as is ("float32", "mixed_float16", "mixed_bfloat16").
        cpu_bfloat16: see `policy_for`.

    Returns:
        The policy name that was set.

    Example:
        >>> tfmem.set_policy(tfmem.detect())
        'float32'
        # INFO tfmem.precision: precision policy float32: CPU: reduced precision ...
    """
    import keras  # lazily, like the rest of tfmem's Keras-facing set-up

    if (runtime is None) == (policy is None):
        raise TypeError(
            "set_policy() needs exactly one of `runtime` (to choose the policy for it) or "
            f"`policy` (to set a given one); got runtime={runtime!r}, policy={policy!r}."
        )
    if policy is not None:
        if policy not in POLICIES:
            raise ValueError(f"`policy` must be one of {POLICIES}, got {policy!r}.")
        why = "asked for explicitly"
    else:
        policy, why = _decide(runtime, cpu_bfloat16)
    keras.mixed_precision.set_global_policy(policy)
    logger.info("precision policy %s: %s.", policy, why)
    return policy


def accumulator_dtype(dtype) -> str:
    """The dtype a sum of `dtype` values is kept in: float32, or float64 for float64 values.

    Half-precision gradients and statistics are summed in float32, so `k` micro-batches round
    no worse than one; a float64 model keeps its precision.

    Args:
        dtype: a dtype name, or a NumPy, TensorFlow or JAX dtype.

    Example:
        >>> accumulator_dtype("bfloat16"), accumulator_dtype("float64")
        ('float32', 'float64')
    """
    import keras  # lazily, like `set_policy`

    return "float64" if keras.backend.standardize_dtype(dtype) == "float64" else "float32"


def accumulator_nbytes(shape, dtype) -> int:
    """The bytes of the running sum of a `shape` value of `dtype` (`accumulator_dtype`).

    Example:
        >>> accumulator_nbytes((3, 4), "float16"), accumulator_nbytes((3, 4), "float64")
        (48, 96)
    """
    return math.prod(shape) * np.dtype(accumulator_dtype(dtype)).itemsize
