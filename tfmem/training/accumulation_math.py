"""The arithmetic of one accumulation window (docs/accumulation.md), shared by both backends'
train steps: the loop state (`AccumulationState`), the update's `mean` (a loss Keras divides
by a count that varies between micro-batches: `loss_terms`) and each BatchNorm statistic's
`average_statistic`. Written with `keras.ops`, so it runs in a TensorFlow graph and
in a JAX `jit` alike; sums are kept in `runtime.precision.accumulator_dtype`.

What a train step needs of the model it is mixed into (`AccumModel`):

* `accumulation_steps`: `k`, an integer >= 1 (or "auto" until `fit` chooses it);
* `check_accumulation_setup()`: raises `ValueError` when no step can run; called each step;
* `batch_norm_statistics()`: the variables averaged over the window (`average_statistic`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras


class AccumulationState(NamedTuple):
    """What the micro-batch loop carries from one micro-batch to the next.

    A `NamedTuple`, so a nest for `tf.while_loop` and a pytree for `jax.lax.scan`. A field a
    backend keeps elsewhere stays empty: TensorFlow updates its metrics and other layer state
    in place, and JAX logs the loss through its metric variables.

    Attributes:
        gradient_sums: per trainable variable, the sum of its micro-batch gradients (scaled by
            the loss scale, if any), in `accumulator_dtype`: those of the first gradient group
            (`loss_terms.Layout`; the only one unless a loss is divided by a varying count).
        statistic_deltas: per BatchNorm statistic, the sum of the changes each micro-batch
            made to it from the window's start, in `accumulator_dtype`.
        loss_sum: the sum of the micro-batch losses (the fixed group's part of them).
        carried: the other non-trainable values, threaded from one micro-batch to the next
            (JAX).
        metrics_variables: the metric variables' values (JAX).
        group_gradient_sums: per further gradient group, its `gradient_sums`.
        term_sums: per tracked loss (`loss_terms.Layout.tracked`), the sums of its
            numerators and counts.
    """

    gradient_sums: list
    statistic_deltas: list
    loss_sum: Any = ()
    carried: list | tuple = ()
    metrics_variables: list | tuple = ()
    group_gradient_sums: list | tuple = ()
    term_sums: list | tuple = ()


def mean(total, num_steps: int):
    """The mean of `num_steps` micro-batch values whose sum is `total`: `total / num_steps`."""
    return total / num_steps


def average_statistic(start, delta_sum, num_steps: int):
    """A BatchNorm statistic at the end of a window: `start` moved by the mean change.

    `start + mean(delta_sum)` is one momentum step with the window's average batch
    statistics (docs/accumulation.md), added in the wider of the two dtypes and rounded once
    to the statistic's. A statistic no micro-batch moved (`delta_sum == 0`: a frozen layer's)
    keeps its exact bits.

    Args:
        start: the statistic's value before the window.
        delta_sum: the sum of the micro-batches' changes to it (`AccumulationState`).
        num_steps: `k`, the number of micro-batches.

    Example:
        >>> float(average_statistic(np.float32(1.0), np.float32(0.5), 4))  # 1 + 0.5 / 4
        1.125
    """
    moved = keras.ops.cast(keras.ops.add(start, mean(delta_sum, num_steps)), start.dtype)
    return keras.ops.where(keras.ops.equal(delta_sum, 0), start, moved)
