"""The image metrics' JAX half: a jitted function cannot raise, so bad images score NaN."""

from __future__ import annotations

from keras import ops


def is_traced(x) -> bool:
    """True for a JAX tracer (inside `jax.jit`), whose values are unknown until run time."""
    import jax

    return isinstance(x, jax.core.Tracer)


def check_range(y_true, y_pred, low: float, high: float, metric: str, fix: str):
    """Per image, whether both batches lie in [low, high] and are not [0, 1] images declared
    as 0..255; the metric turns the others into NaN."""
    del metric, fix
    axes = (1, 2, 3)
    in_range = ((ops.min(y_true, axis=axes) >= low) & (ops.max(y_true, axis=axes) <= high)
                & (ops.min(y_pred, axis=axes) >= low) & (ops.max(y_pred, axis=axes) <= high))
    if high - low > 1:
        in_range = in_range & (ops.maximum(ops.max(y_true, axis=axes),
                                           ops.max(y_pred, axis=axes)) > low + 1)
    return in_range
