"""AccumModel's train step on the Keras JAX backend (today's TPU VMs, `KERAS_BACKEND=jax`).

`AccumModel.train_step` calls `train_step(model, state, data)` here when
`keras.backend.backend() == "jax"`. It follows the contract of Keras's own
`JAXTrainer.train_step` — a pure function of
`state = (trainable_variables, non_trainable_variables, optimizer_variables,
metrics_variables)` and one *global* batch, returning `(logs, state)` — so `fit`, its
`jax.jit`, donation and `keras.distribution.DataParallel` sharding all apply unchanged.

Inside one step the global batch is split into `k = model.accumulation_steps` micro-batches
and a `jax.lax.scan` runs forward + backward on each (the compiled program does not grow
with `k`, and only one micro-batch of activations is alive at a time):

- **Gradients** are summed in float32 and the optimizer sees their mean once: one
  `optimizer.stateless_apply`, so `optimizer.iterations`, LR schedules and callbacks count
  real updates. With Keras's default loss reduction (`"sum_over_batch_size"`: the weighted sum
  divided by the number of samples) the mean of k equal micro-batch losses *is* the loss of the
  whole batch, sample weights included, so the update equals one plain step on the global batch.
- **Loss scaling** (`mixed_float16`, Keras wraps the optimizer in a `LossScaleOptimizer`):
  each micro-batch loss is multiplied by the current scale; the scaled sum is unscaled once by
  `LossScaleOptimizer.stateless_apply`. A non-finite value in any micro-batch makes the sum
  non-finite, so the whole window is skipped and the scale halved — never a partial window.
  `mixed_bfloat16` needs no scaling: gradients are still accumulated in float32.
- **BatchNorm** normalises each micro-batch by its own statistics (as any accumulation must);
  every float non-trainable variable (the moving mean/variance) ends the step at
  `old + mean_j(new_j - old)`, where `new_j` is what micro-batch `j` alone would have written:
  for a moving average that is `m * old + (1 - m) * mean_j(stat_j)`, one momentum step with the
  window's average statistics, not k steps. Variables nobody wrote stay bit-identical.
  Integer state (the seed of `Dropout`) is threaded through the micro-batches so each one draws
  fresh randomness.
- **Metrics** are updated once per micro-batch with that micro-batch's samples; Keras metrics
  accumulate totals and counts, so the logged values equal those of the whole batch.

Micro-batch `j` holds samples `j, j + k, j + 2k, …` of the global batch. Under data parallelism
each device holds a contiguous block of the global batch; the strided split gives every
micro-batch an equal share of every device's block, so no sample moves between devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import tree

Array = jax.Array


def train_step(model: keras.Model, state: tuple, data) -> tuple[dict, tuple]:
    """One optimizer update from `model.accumulation_steps` micro-batches of `data`.

    A drop-in for `keras.src.backend.jax.trainer.JAXTrainer.train_step`.

    Args:
        model: a compiled model with an int `accumulation_steps` attribute (an `AccumModel`).
        state: `(trainable_variables, non_trainable_variables, optimizer_variables,
            metrics_variables)`, as Keras's JAX trainer passes it.
        data: one global batch: `x`, `(x, y)` or `(x, y, sample_weight)`, any nesting.

    Returns:
        `(logs, state)` with the new state in the same layout.

    Raises:
        ValueError: the global batch size is not divisible by `accumulation_steps`.

    Example:
        >>> class Accum(keras.Model):  # what AccumModel does on the JAX backend
        ...     accumulation_steps = 4
        ...     def train_step(self, state, data):
        ...         return accumulation_jax.train_step(self, state, data)
    """
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    num_steps = model.accumulation_steps
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    micro_batches = _split((x, y, sample_weight), num_steps)

    # Integer state (seed generators) is carried from one micro-batch to the next; float state
    # (moving statistics) restarts from the step's value each time and its changes are averaged.
    is_float = [jnp.issubdtype(v.dtype, jnp.floating) for v in non_trainable]
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)

    def micro_step(carry, micro_batch):
        grad_sum, float_delta_sum, int_state, metrics_variables = carry
        micro_x, micro_y, micro_weight = micro_batch
        int_values = iter(int_state)
        non_trainable_in = [
            old if floating else next(int_values)
            for old, floating in zip(non_trainable, is_float)
        ]
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable_in,
            metrics_variables,
            micro_x,
            micro_y,
            micro_weight,
            training=True,
            optimizer_variables=optimizer_variables,
        )
        unscaled_loss, y_pred, non_trainable_out, metrics_variables = aux
        grad_sum = [total + g.astype(jnp.float32) for total, g in zip(grad_sum, grads)]
        float_delta_sum = [
            total + (new - old).astype(jnp.float32)
            for total, new, old in zip(
                float_delta_sum, _select(non_trainable_out, is_float, True),
                _select(non_trainable, is_float, True),
            )
        ]
        int_state = _select(non_trainable_out, is_float, False)
        # Keras metrics accumulate totals and counts, so k updates with the k micro-batches
        # leave them where one update with the global batch would.
        _, metrics_variables = model._update_metrics_variables(
            metrics_variables, unscaled_loss, micro_x, micro_y, y_pred, micro_weight
        )
        return (grad_sum, float_delta_sum, int_state, metrics_variables), None

    carry = (
        [jnp.zeros(v.shape, jnp.float32) for v in trainable],
        [jnp.zeros(v.shape, jnp.float32) for v in _select(non_trainable, is_float, True)],
        _select(non_trainable, is_float, False),
        list(metrics_variables),
    )
    (grad_sum, float_delta_sum, int_state, metrics_variables), _ = jax.lax.scan(
        micro_step, carry, micro_batches
    )

    # The mean of the k (possibly loss-scaled) micro-batch gradients; a LossScaleOptimizer
    # unscales it and skips the update if any micro-batch produced an inf or a NaN.
    grads = [(total / num_steps).astype(v.dtype) for total, v in zip(grad_sum, trainable)]
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )

    float_values = iter(
        (old + delta / num_steps).astype(old.dtype)
        for old, delta in zip(_select(non_trainable, is_float, True), float_delta_sum)
    )
    int_values = iter(int_state)
    non_trainable = [
        next(float_values) if floating else next(int_values) for floating in is_float
    ]

    logs = _metrics_result(model, metrics_variables)
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _select(values: list, flags: list[bool], wanted: bool) -> list:
    return [value for value, flag in zip(values, flags) if flag == wanted]


def _split(batch, num_steps: int):
    """Reshapes every `(B, ...)` leaf to `(num_steps, B // num_steps, ...)`, strided."""
    sizes = {leaf.shape[0] for leaf in tree.flatten(batch) if leaf is not None}
    for size in sizes:
        if size % num_steps:
            lower = size // num_steps * num_steps
            suggestions = " or ".join(str(n) for n in (lower, lower + num_steps) if n > 0)
            raise ValueError(
                f"The global batch size ({size}) must be divisible by accumulation_steps "
                f"({num_steps}), so that every micro-batch has the same size. "
                f"Batch the dataset by {suggestions} (with `drop_remainder=True` so the "
                "last batch keeps that size), or change accumulation_steps."
            )

    def split(leaf):
        if leaf is None:
            return None
        leaf = jnp.asarray(leaf)
        # (B, ...) -> (B/k, k, ...) -> (k, B/k, ...): micro-batch j takes rows j, j+k, ….
        strided = leaf.reshape((leaf.shape[0] // num_steps, num_steps) + leaf.shape[1:])
        return jnp.swapaxes(strided, 0, 1)

    return tree.map_structure(split, batch, none_is_leaf=True)


def _metrics_result(model: keras.Model, metrics_variables: list) -> dict:
    """The model's metric results for the given metric variable values."""
    mapping = list(zip(model.metrics_variables, metrics_variables))
    with keras.StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()
