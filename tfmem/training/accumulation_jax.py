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
  the moving statistics of every `BatchNormalization` layer end the step at
  `old + mean_j(new_j - old)`, where `new_j` is what micro-batch `j` alone would have written:
  `momentum * old + (1 - momentum) * mean_j(stat_j)`, one momentum step with the window's
  average statistics, not k steps (a frozen layer's statistics stay bit-identical). Other
  non-trainable state (the seed of `Dropout`, custom state) is threaded through the
  micro-batches, as k forward passes would update it, so each micro-batch draws fresh randomness.
  Under a `keras.distribution` the JAX program is global, so a micro-batch's statistics are
  those of all its rows on every device (TensorFlow's `MirroredStrategy` uses per-replica ones).
- **Metrics** are updated once per micro-batch with that micro-batch's rows; Keras metrics
  accumulate totals and counts, so the logged values equal those of the whole batch.

The split is the TensorFlow path's: each replica's rows of the global batch are cut into k
contiguous blocks, and micro-batch `j` is block `j` of every replica. Under
`keras.distribution.DataParallel` each device holds a contiguous block of the global batch,
so every micro-batch has the same share of every device's rows and no row moves between
devices; on one device, micro-batch `j` is simply rows `[j * B/k, (j + 1) * B/k)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import tree

from tfmem import _keras_internals as internals
from tfmem.runtime.cluster import nearest_multiples


class AccumTrainer:
    """The JAX half of `AccumModel`: Keras's JAX trainer calls `train_step(state, data)`."""

    def train_step(self, state, data):
        return train_step(self, state, data)


def train_step(model: keras.Model, state: tuple, data) -> tuple[dict, tuple]:
    """One optimizer update from `model.accumulation_steps` micro-batches of `data`.

    A drop-in for `keras.src.backend.jax.trainer.JAXTrainer.train_step`.

    Args:
        model: a compiled `tfmem.AccumModel` (its `accumulation_steps` and checks are used).
        state: `(trainable_variables, non_trainable_variables, optimizer_variables,
            metrics_variables)`, as Keras's JAX trainer passes it.
        data: one global batch: `x`, `(x, y)` or `(x, y, sample_weight)`, any nesting.

    Returns:
        `(logs, state)` with the new state in the same layout.

    Raises:
        ValueError: the batch of a replica is not divisible by `accumulation_steps`; the
            optimizer accumulates too (`gradient_accumulation_steps`); a loss reduction other
            than the mean.

    Example:
        >>> # KERAS_BACKEND=jax: AccumModel.train_step(state, data) calls this.
        >>> model = tfmem.AccumModel.wrap(backbone, accumulation_steps=4)  # doctest: +SKIP
        >>> model.compile("sgd", "sparse_categorical_crossentropy")  # doctest: +SKIP
        >>> model.fit(images, labels, batch_size=256)  # 4 micro-batches of 64, 1 update
    """
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    model._check_optimizer()
    num_steps = model.accumulation_steps
    if num_steps == 1:
        # A window of one micro-batch is Keras's plain step; skip the loop, whose body XLA:CPU
        # runs ~15× slower for convolutions (see the module docstring).
        return keras.Model.train_step(model, state, data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    micro_batches = _split((x, y, sample_weight), num_steps, _num_batch_shards())

    # BatchNorm statistics restart from the step's value in every micro-batch and their changes
    # are averaged; all other state (seed generators, custom state) is carried from one
    # micro-batch to the next.
    statistics = {id(v) for v in model._batch_norm_statistics()}
    is_averaged = [id(v) in statistics for v in model.non_trainable_variables]
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)

    def micro_step(carry, micro_batch):
        grad_sum, delta_sum, carried, metrics_variables = carry
        micro_x, micro_y, micro_weight = micro_batch
        carried_values = iter(carried)
        non_trainable_in = [
            old if averaged else next(carried_values)
            for old, averaged in zip(non_trainable, is_averaged)
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
        delta_sum = [
            total + (new - old).astype(jnp.float32)
            for total, new, old in zip(
                delta_sum, _select(non_trainable_out, is_averaged, True),
                _select(non_trainable, is_averaged, True),
            )
        ]
        carried = _select(non_trainable_out, is_averaged, False)
        # Keras metrics accumulate totals and counts, so k updates with the k micro-batches
        # leave them where one update with the global batch would.
        _, metrics_variables = internals.update_metrics_variables(
            model,
            metrics_variables, unscaled_loss, micro_x, micro_y, y_pred, micro_weight
        )
        return (grad_sum, delta_sum, carried, metrics_variables), None

    carry = (
        [jnp.zeros(v.shape, jnp.float32) for v in trainable],
        [jnp.zeros(v.shape, jnp.float32) for v in _select(non_trainable, is_averaged, True)],
        _select(non_trainable, is_averaged, False),
        list(metrics_variables),
    )
    # A rolled loop (an XLA while loop) is what keeps one micro-batch of activations alive:
    # unrolled, XLA schedules the k micro-batches like one big batch (4 convolutions at 96×96,
    # 8 micro-batches of 8: 620 MB of temporaries unrolled, 76 MB rolled, even with an
    # optimization barrier between them). On XLA:CPU the loop body's convolutions run about
    # 15× slower than outside a loop (README, section "jax"): CPU is for tests here.
    (grad_sum, delta_sum, carried, metrics_variables), _ = jax.lax.scan(
        micro_step, carry, micro_batches
    )

    # The compiled loss is built while the micro-step traces, so its reduction is checked here.
    model._check_loss_reductions()

    # The mean of the k (possibly loss-scaled) micro-batch gradients; a LossScaleOptimizer
    # unscales it and skips the update if any micro-batch produced an inf or a NaN.
    grads = [(total / num_steps).astype(v.dtype) for total, v in zip(grad_sum, trainable)]
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )

    averaged_values = iter(
        (old + delta / num_steps).astype(old.dtype)
        for old, delta in zip(_select(non_trainable, is_averaged, True), delta_sum)
    )
    carried_values = iter(carried)
    non_trainable = [
        next(averaged_values) if averaged else next(carried_values) for averaged in is_averaged
    ]

    logs = _metrics_result(model, metrics_variables)
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _select(values: list, flags: list[bool], wanted: bool) -> list:
    return [value for value, flag in zip(values, flags) if flag == wanted]


def _num_batch_shards() -> int:
    """How many blocks the installed `keras.distribution` cuts the batch axis into (1: none)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    return int(mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)])


def _split(batch, num_steps: int, num_shards: int):
    """Reshapes every `(B, ...)` leaf to `(num_steps, B // num_steps, ...)`.

    Micro-batch `j` is the `j`-th contiguous block of each of the `num_shards` replica blocks.
    """
    sizes = {leaf.shape[0] for leaf in tree.flatten(batch) if leaf is not None}
    for size in sizes:
        if size % (num_shards * num_steps):
            rows = size // num_shards if size % num_shards == 0 else size / num_shards
            nearest = nearest_multiples(int(rows), num_steps)
            raise ValueError(
                f"The batch each replica receives ({rows} rows = global batch {size} / "
                f"{num_shards} replicas) must be divisible by `accumulation_steps` "
                f"({num_steps}). Use a batch of {nearest} rows per replica (global batch = "
                "rows per replica × replicas, with `drop_remainder=True` so the last batch "
                "keeps that size), or change `accumulation_steps`."
            )

    def split(leaf):
        if leaf is None:
            return None
        leaf = jnp.asarray(leaf)
        rows = leaf.shape[0] // (num_shards * num_steps)
        # (B, ...) -> (replicas, k, rows, ...) -> (k, replicas, rows, ...) -> (k, B/k, ...):
        # the replica axis stays whole, so a batch sharded over it keeps its shards.
        blocks = leaf.reshape((num_shards, num_steps, rows) + leaf.shape[1:])
        return jnp.swapaxes(blocks, 0, 1).reshape((num_steps, num_shards * rows) + leaf.shape[1:])

    return tree.map_structure(split, batch, none_is_leaf=True)


def _metrics_result(model: keras.Model, metrics_variables: list) -> dict:
    """The model's metric results for the given metric variable values."""
    mapping = list(zip(model.metrics_variables, metrics_variables))
    with keras.StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()
