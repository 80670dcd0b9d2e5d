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

- **Gradients** are summed in float32 (float64 for float64 weights) and the optimizer sees
  their mean once: one `optimizer.stateless_apply`, so `optimizer.iterations`, LR schedules
  and callbacks count real updates. A loss Keras divides by a count that differs between
  micro-batches (a mask, `ignore_class`, "mean_with_sample_weight") has its own sums, divided
  by its summed count (`tfmem.training.loss_terms`), so the update equals one plain step on
  the global batch.
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
  accumulate totals and counts, so the logged values equal those of the whole batch. The
  logged losses (`loss`, and a counted or summed loss's `<output>_loss`) move once, by the
  window's value.

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
import numpy as np
from jax.experimental import sparse as jax_sparse
from keras import tree

from tfmem import _keras_internals as internals
from tfmem.memory import probe_jax
from tfmem.runtime.cluster import split_batch
from tfmem.training import loss_terms, micro_batches, placement
from tfmem.runtime.precision import accumulator_dtype
from tfmem.training.accumulation_math import AccumulationState, average_statistic, mean


class AccumTrainer:
    """The JAX half of `AccumModel`: Keras's JAX trainer calls `train_step(state, data)`.

    The class it is mixed into is a `keras.Model` with the hooks that
    `tfmem.training.accumulation_math` lists: `accumulation_steps`,
    `check_accumulation_setup()` and `batch_norm_statistics()`.
    A step is pure: the micro-batch loop carries an `AccumulationState` (sums, the
    non-trainable values other than the BatchNorm statistics, the metric variables) through
    `_micro_step`, and `_update` turns it into the new Keras state.
    """

    def train_step(self, state, data):
        return train_step(self, state, data)

    def compile(self, *args, **kwargs):
        # A new optimizer, loss or metrics: the steps compiled for the old ones go.
        self._compiled_steps = {}
        return super().compile(*args, **kwargs)

    def make_train_function(self, force=False):
        """Keras's jitted step, or on a host-loop platform the loop over jitted micro-steps;
        the one the memory check compiled when it compiled this step (`compiled_step_memory`)."""
        if self.train_function is not None and not force:
            return
        if self.run_eagerly or not self.jit_compile:
            super().make_train_function(force)
            return
        key, step = self._step()
        self._compiled_steps[key] = step
        self.train_function = internals.jax_train_function(self, step)

    def compiled_step_memory(self, data, device: jax.Device | None = None) -> dict[str, int]:
        """XLA's memory analysis of the step `fit` runs, compiled for a batch shaped like `data`.

        The step is compiled through the jitted function `fit` then calls with the same
        `accumulation_steps` and segments, so `fit` runs this executable and does not compile
        it again. The in-graph loop is one program; the host loop's peak is the larger of its
        micro-step's and its update's, since between them only their arguments are alive.
        Nothing runs and no variable changes.

        Args:
            data: one global batch as `fit` sees it; arrays or `jax.ShapeDtypeStruct`s.
            device: compile the step a platform of an in-graph loop runs for this one
                device instead (`probe_jax.tpu_device`: a TPU, ahead of time on a machine
                without one); `fit` here does not run that program.

        Returns:
            As `probe_jax.compiled_step_memory`, per device; the host loop's the figures of
            its larger program.

        Raises:
            ValueError: `device` is of a platform whose loop runs on the host (a CPU).
        """
        if device is None:
            return self._step()[1].compiled_memory(data)
        if placement.loop_on_host(device.platform):
            raise ValueError(f"compiled_step_memory(device={device}): a step for a "
                             f"{device.platform} loops from the host; compile it where it "
                             "runs, without `device`")
        return GraphStep(self).compiled_memory(data, device)

    def _step(self):
        """`(key, step)`: the compiled step for the model's `accumulation_steps` and segments,
        kept from the memory check or the running train function, else a new one. Each
        setting has its own jitted functions, as their traces read the setting."""
        key = (self.accumulation_steps, self.rematerialized_segments)
        steps = getattr(self, "_compiled_steps", None)
        if steps is None:
            steps = self._compiled_steps = {}
        if key not in steps:
            steps[key] = HostLoopStep(self) if _loops_on_host(self) else GraphStep(self)
        return key, steps[key]


def _loops_on_host(model: keras.Model) -> bool:
    """Whether `fit` runs the micro-batch loop from the host (`HostLoopStep`)."""
    return not (model.run_eagerly or not model.jit_compile
                or model.accumulation_steps in (1, "auto")
                or not placement.loop_on_host(_platform()))


# Traces of a micro-step per step at most: the model's last layout, the one the compiled loss
# has once Keras builds it (on its first call), and that one's (`loss_terms.Layout`).
_TRACES = 3


def train_step(model: keras.Model, state: tuple, data) -> tuple[dict, tuple]:
    """One optimizer update from `model.accumulation_steps` micro-batches of `data`.

    A drop-in for `keras.src.backend.jax.trainer.JAXTrainer.train_step`: a pure function
    that `fit` compiles whole, with the micro-batch loop inside (`jax.lax.scan`).

    Args:
        model: a compiled `tfmem.AccumModel` (its `accumulation_steps` and checks are used).
        state: `(trainable_variables, non_trainable_variables, optimizer_variables,
            metrics_variables)`, as Keras's JAX trainer passes it.
        data: one global batch: `x`, `(x, y)` or `(x, y, sample_weight)`, any nesting.

    Returns:
        `(logs, state)` with the new state in the same layout.

    Raises:
        ValueError: the batch of a replica is not divisible by `accumulation_steps`; the
            optimizer accumulates too (`gradient_accumulation_steps`).

    Example:
        >>> # KERAS_BACKEND=jax: AccumModel.train_step(state, data) calls this.
        >>> model = tfmem.AccumModel.wrap(backbone, accumulation_steps=4)  # doctest: +SKIP
        >>> model.compile("sgd", "sparse_categorical_crossentropy")  # doctest: +SKIP
        >>> model.fit(images, labels, batch_size=256)  # 4 micro-batches of 64, 1 update
    """
    model.check_accumulation_setup()
    num_steps = model.accumulation_steps
    if num_steps == 1:
        # A window of one micro-batch is Keras's plain step: no loop, no float32 sums.
        return keras.Model.train_step(model, state, data)
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    is_averaged = _averaged_flags(model)
    statistics = _select(non_trainable, is_averaged, True)
    micro_batches = _split(_unpack(data), num_steps, _num_batch_shards())
    starts = _loss_metric_starts(model, metrics_variables)
    for attempt in range(_TRACES):  # again only when the trace finds the loss sums other parts
        layout = loss_terms.stored_layout(model)

        def body(carry, micro_batch):
            # Through a barrier with the carry, the weights vary with the loop, so XLA casts
            # them inside each micro-step rather than keeping cast copies of all of them alive
            # for the whole loop.
            weights, carry = jax.lax.optimization_barrier((trainable, carry))
            carry = _micro_step(model, is_averaged, weights, statistics, optimizer_variables,
                                carry, micro_batch, layout)
            return carry, None

        carry = _laid_out(AccumulationState(
            gradient_sums=[jnp.zeros(v.shape, accumulator_dtype(v.dtype)) for v in trainable],
            statistic_deltas=[jnp.zeros(v.shape, accumulator_dtype(v.dtype))
                              for v in statistics],
            loss_sum=jnp.zeros((), accumulator_dtype(model.compute_dtype)),
            carried=_select(non_trainable, is_averaged, False),
            metrics_variables=list(metrics_variables),
        ), layout)
        # A rolled loop (an XLA while loop) is what keeps one micro-batch of activations
        # alive: unrolled, XLA schedules the k micro-batches like one big batch (4
        # convolutions at 96×96, 8 micro-batches of 8: 620 MB of temporaries unrolled, 76 MB
        # rolled, even with an optimization barrier between them).
        try:
            carry, _ = jax.lax.scan(body, carry, micro_batches)
            break
        except loss_terms.LayoutChanged:
            if attempt == _TRACES - 1:
                raise
    return _update(model, is_averaged, trainable, statistics, optimizer_variables, carry,
                   starts, _num_rows(data))


class GraphStep:
    """`(state, data) -> (logs, state)`: `train_step` jitted as Keras's JAX trainer jits it
    (the state donated; under a `keras.distribution` the new state laid out like the old)."""

    def __init__(self, model: keras.Model):
        self.model = model
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, internals.jax_state_shardings(model))
        self.jitted = jax.jit(model.train_step, donate_argnums=0, out_shardings=out_shardings)

    def __call__(self, state, data):
        return self.jitted(state, data)

    def compiled_memory(self, data, device: jax.Device | None = None) -> dict[str, int]:
        """XLA's memory analysis of the step for a batch shaped like `data` (for `device`
        alone if given); a later call with such a batch runs the executable compiled here."""
        return probe_jax.compiled_step_memory(self.model, data, step=self.jitted,
                                              device=device)


class HostLoopStep:
    """`(state, data) -> (logs, state)`: the k micro-steps of `train_step` run from the host.

    The same arithmetic as `train_step`, as three compiled programs instead of one: the float32
    zeros of the sums, a micro-step (forward + backward of micro-batch `j`, added into the
    sums, which are donated so XLA updates them in place), and the optimizer update. Between
    calls only the state, the batch and the sums are alive, so memory is what the in-graph loop
    holds; each call is a loop-free program that XLA compiles at full speed.

    Example:
        >>> # What `fit` runs on a CPU (`tfmem.training.placement`); any platform by hand:
        >>> logs, state = HostLoopStep(model)(state, (x, y))  # doctest: +SKIP
    """

    def __init__(self, model: keras.Model):
        self.model = model
        self.micro_step = jax.jit(self._micro_step, donate_argnums=0)
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, internals.jax_state_shardings(model))
        # The new state takes the buffers of the old: the fixed arrays and the threaded ones
        # (`carried`, `metrics_variables`); the sums have no output to go into.
        self.update = jax.jit(self._update, out_shardings=out_shardings,
                              donate_argnames=("fixed", "carried", "metrics_variables"))

    def __call__(self, state, data):
        model = self.model
        model.check_accumulation_setup()
        start, fixed, starts = self._window(state)
        # Host arrays (numpy, from Keras's iterator) moved once, not once per micro-step.
        data = jax.tree_util.tree_map(
            lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, data)
        for attempt in range(_TRACES):  # again only when the loss sums other parts
            carry = _committed(_laid_out(start, loss_terms.stored_layout(model)))
            try:
                for index in range(model.accumulation_steps):
                    carry = self.micro_step(carry, fixed, data, index)
                break
            except loss_terms.LayoutChanged:  # raised while tracing: nothing was donated yet
                if attempt == _TRACES - 1:
                    raise
        return self.update(fixed, starts=starts, num_rows=_num_rows(data), **carry._asdict())

    def _window(self, state, shapes_only=False):
        """The window's starting carry (zero sums), its fixed arrays and the loss metrics'
        values before it; with `shapes_only`, their shapes, dtypes and devices as
        `jax.ShapeDtypeStruct`s (the sums are not allocated)."""
        model = self.model
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        is_averaged = _averaged_flags(model)
        statistics = _select(non_trainable, is_averaged, True)
        # Every argument committed to its device, as the micro-step's outputs are: JAX compiles
        # a function again for arguments that differ only in being committed.
        if shapes_only:
            commit = copy = placed = _placed
            zeros = _placed_sums
        else:
            commit, zeros, placed = _committed, _zeros_like, _as_is
            copy = _copies
        # The loss metrics' values before the window (copies: the carry's are donated).
        starts = copy(commit(_loss_metric_starts(model, metrics_variables)))
        carry = AccumulationState(
            gradient_sums=zeros(trainable),
            statistic_deltas=zeros(statistics),
            loss_sum=placed(_replicated_zero(trainable, accumulator_dtype(model.compute_dtype))),
            carried=placed(_select(non_trainable, is_averaged, False)),
            metrics_variables=placed(list(metrics_variables)),
        )
        fixed = commit((trainable, statistics, optimizer_variables))
        return carry, fixed, starts

    def compiled_memory(self, data) -> dict[str, int]:
        """XLA's memory analysis of the larger of the two programs a step runs, for a batch
        shaped like `data` (nothing runs). Each program is lowered for arguments placed as a
        step's call places them, so the step's calls run the executables compiled here."""
        model = self.model
        start, fixed, starts = self._window(probe_jax.step_state(model), shapes_only=True)
        data = probe_jax.abstract_batch(data)
        for attempt in range(_TRACES):  # again only when the loss sums other parts
            carry = _laid_out(start, loss_terms.stored_layout(model), like=probe_jax.placed)
            try:
                micro_step = self.micro_step.lower(carry, fixed, data, 0)
                break
            except loss_terms.LayoutChanged:
                if attempt == _TRACES - 1:
                    raise
        programs = [
            micro_step.compile(),
            self.update.lower(fixed, starts=starts, num_rows=_num_rows(data),
                              **carry._asdict()).compile(),
        ]
        return max((probe_jax.memory_analysis(program) for program in programs),
                   key=lambda sizes: sizes["peak_bytes"])

    def _micro_step(self, carry, fixed, data, index):
        model = self.model
        num_steps = model.accumulation_steps
        micro_batches = _split(_unpack(data), num_steps, _num_batch_shards())
        # JAX's tree functions know the sparse micro-batches (`_SparseRows`) as nodes.
        micro_batch = jax.tree_util.tree_map(lambda leaf: leaf[index], micro_batches)
        trainable, statistics, optimizer_variables = fixed
        return _micro_step(model, _averaged_flags(model), trainable, statistics,
                           optimizer_variables, carry, micro_batch,
                           loss_terms.stored_layout(model))

    def _update(self, fixed, carried, metrics_variables, starts, num_rows, **sums):
        trainable, statistics, optimizer_variables = fixed
        carry = AccumulationState(carried=carried, metrics_variables=metrics_variables, **sums)
        return _update(self.model, _averaged_flags(self.model), trainable, statistics,
                       optimizer_variables, carry, starts, num_rows)


def _micro_step(model, is_averaged, trainable, statistics, optimizer_variables, carry,
                micro_batch, layout):
    """Forward + backward of one micro-batch, added into `carry`; returns the new carry.

    `layout` is the loss's layout the carry has (`loss_terms`); a trace that finds another
    stores it and raises `loss_terms.LayoutChanged`, and the caller traces again.
    """
    micro_x, micro_y, micro_weight = _assemble(micro_batch)
    # BatchNorm statistics restart from the step's value in every micro-batch and their changes
    # are averaged; all other state (seed generators, custom state) is carried from one
    # micro-batch to the next.
    non_trainable_in = _merge(is_averaged, statistics, carry.carried)
    found = []

    def group_losses(trainable):
        with loss_terms.recording(model) as record:
            loss, aux = model.compute_loss_and_updates(
                trainable, non_trainable_in, carry.metrics_variables, micro_x, micro_y,
                micro_weight, training=True, optimizer_variables=optimizer_variables)
        parts = loss_terms.split(aux[0], record, model.accumulation_steps)
        found.append(parts.layout)
        if parts.layout == loss_terms.SINGLE:
            losses = [loss]  # Keras's own, scaled
        else:
            mapping = list(zip(model.optimizer.variables, optimizer_variables))
            with keras.StatelessScope(state_mapping=mapping):
                losses = [model.optimizer.scale_loss(part) for part in parts.losses]
        return losses, (aux, parts.report, parts.term_sums)

    def first_loss(trainable):
        losses, rest = group_losses(trainable)
        return losses[0], rest

    def stacked_losses(trainable):
        losses, rest = group_losses(trainable)
        return jnp.stack(losses), rest

    if layout.num_groups == 1:
        (_, (aux, report, term_sums)), grads = jax.value_and_grad(
            first_loss, has_aux=True)(trainable)
        group_grads = [grads]
    else:  # one backward pass per gradient group, from one forward pass
        losses, vjp, (aux, report, term_sums) = jax.vjp(stacked_losses, trainable, has_aux=True)
        group_grads = [vjp(jnp.eye(layout.num_groups, dtype=losses.dtype)[group])[0]
                       for group in range(layout.num_groups)]
    if found[0] != layout:
        loss_terms.store_layout(model, found[0])
        raise loss_terms.LayoutChanged(found[0])
    unscaled_loss, y_pred, non_trainable_out, metrics_variables = aux
    gradient_sums, *group_gradient_sums = [
        [total + g.astype(total.dtype) for total, g in zip(sums, grads)]
        for sums, grads in zip((carry.gradient_sums, *carry.group_gradient_sums), group_grads)
    ]
    statistic_deltas = [
        total + (new - old).astype(total.dtype)
        for total, new, old in zip(
            carry.statistic_deltas, _select(non_trainable_out, is_averaged, True), statistics
        )
    ]
    # Keras metrics accumulate totals and counts, so k updates with the k micro-batches
    # leave them where one update with the global batch would.
    _, metrics_variables = internals.update_metrics_variables(
        model, metrics_variables, unscaled_loss, micro_x, micro_y, y_pred, micro_weight
    )
    return carry._replace(
        gradient_sums=gradient_sums,
        group_gradient_sums=group_gradient_sums,
        statistic_deltas=statistic_deltas,
        loss_sum=carry.loss_sum + report.astype(carry.loss_sum.dtype),
        term_sums=[[total + part.astype(total.dtype) for total, part in zip(sums, new)]
                   for sums, new in zip(carry.term_sums, term_sums)],
        carried=_select(non_trainable_out, is_averaged, False),
        metrics_variables=metrics_variables,
    )


def _laid_out(carry: AccumulationState, layout: loss_terms.Layout, like=jnp.zeros_like
              ) -> AccumulationState:
    """`carry` with zero sums (`like` of the first group's) for `layout`'s further gradient
    groups and tracked losses."""
    # Each zero an array of its own: the host loop's micro-step donates every one.
    return carry._replace(
        group_gradient_sums=[[like(total) for total in carry.gradient_sums]
                             for _ in range(layout.num_groups - 1)],
        term_sums=[[like(carry.loss_sum), like(carry.loss_sum)] for _ in layout.tracked],
    )



def _update(model, is_averaged, trainable, statistics, optimizer_variables, carry, starts,
            num_rows):
    """The optimizer update with the window's gradient, the averaged statistics and the
    window's loss logs: `(logs, state)`."""
    num_steps = model.accumulation_steps
    layout = loss_terms.stored_layout(model)
    # The mean of the k (possibly loss-scaled) micro-batch gradients (a counted loss's: their
    # sum over its summed count); a LossScaleOptimizer unscales it and skips the update if any
    # micro-batch produced an inf or a NaN.
    grads = loss_terms.window_gradient(
        layout, [carry.gradient_sums, *carry.group_gradient_sums], carry.term_sums, num_steps,
        mean)
    grads = [g.astype(v.dtype) for g, v in zip(grads, trainable)]
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable
    )
    averaged = [average_statistic(old, delta_sum, num_steps)
                for old, delta_sum in zip(statistics, carry.statistic_deltas)]
    non_trainable = _merge(is_averaged, averaged, carry.carried)
    metrics_variables = _log_losses(model, layout, carry, starts, num_rows)
    logs = _metrics_result(model, metrics_variables)
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _loss_metrics(model: keras.Model) -> list:
    """The loss tracker and the compiled losses' own `Mean`s (`<output>_loss`)."""
    return [internals.loss_tracker(model), *internals.compiled_loss_metrics(model)]


def _loss_metric_starts(model: keras.Model, metrics_variables) -> list:
    """The values the loss metrics' variables have in `metrics_variables`."""
    positions = {id(v): i for i, v in enumerate(model.metrics_variables)}
    return [metrics_variables[positions[id(v)]]
            for metric in _loss_metrics(model) for v in metric.variables]


def _log_losses(model, layout, carry, starts, num_rows) -> list:
    """The metric variables with the loss tracker (and each tracked loss's own `Mean`) moved
    once by the window's value, from their values before the window, as one step on the whole
    batch moves them; the others as the micro-steps left them."""
    loss, term_values = loss_terms.window_values(
        layout, carry.loss_sum, carry.term_sums, model.accumulation_steps, mean)
    metrics = _loss_metrics(model)
    tracker, per_loss = metrics[0], metrics[1:]
    updates = [(tracker, loss)] + [(per_loss[index], value) for (index, _, _), value
                                   in zip(layout.tracked, term_values) if index < len(per_loss)]
    start_of = dict(zip([id(v) for metric in metrics for v in metric.variables], starts))
    restarted = {id(v) for metric, _ in updates for v in metric.variables}
    values = [start_of[id(v)] if id(v) in restarted else value
              for v, value in zip(model.metrics_variables, carry.metrics_variables)]
    mapping = list(zip(model.metrics_variables, values))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        for metric, value in updates:
            metric.update_state(value, sample_weight=num_rows)
    return [scope.get_current_value(v) if scope.get_current_value(v) is not None else value
            for v, value in mapping]


def _num_rows(data) -> int:
    """The rows of the batch (of its first input), as Keras weighs a step's logged loss."""
    x, _, _ = _unpack(data)
    return next(leaf for leaf in tree.flatten(x) if leaf is not None).shape[0]


def _platform() -> str:
    """The platform the step runs on: the installed distribution's devices, else JAX's default."""
    distribution = keras.distribution.distribution()
    if distribution is not None:
        return distribution.device_mesh.backend_mesh.devices.flat[0].platform
    return jax.devices()[0].platform


def _unpack(data):
    return keras.utils.unpack_x_y_sample_weight(data)


def _averaged_flags(model: keras.Model) -> list[bool]:
    """For each non-trainable variable: whether it is a BatchNorm statistic (averaged)."""
    statistics = {id(v) for v in model.batch_norm_statistics()}
    return [id(v) in statistics for v in model.non_trainable_variables]


def _zeros_like(values: list) -> list:
    """Accumulator zeros shaped and placed like `values` (replicated where they are)."""
    return [jnp.zeros(v.shape, accumulator_dtype(v.dtype), device=v.sharding) for v in values]


def _placed(values):
    """`values` as `jax.ShapeDtypeStruct`s placed where each is (`_committed`'s, as shapes)."""
    return tree.map_structure(probe_jax.placed, values)


def _placed_sums(values: list) -> list:
    """`_zeros_like(values)` as `jax.ShapeDtypeStruct`s: nothing is allocated."""
    return [probe_jax.placed(v, accumulator_dtype(v.dtype)) for v in values]


def _as_is(values):
    return values


def _copies(values: list) -> list:
    return [jnp.copy(v) for v in values]


def _replicated_zero(values: list, dtype):
    """A scalar 0 on every device the first of `values` is on (replicated like the sums)."""
    sharding = getattr(values[0], "sharding", None) if values else None
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jnp.zeros((), dtype, device=sharding)


def _committed(values):
    """`values` with each array committed to the device(s) it is on (a no-op for most)."""
    return tree.map_structure(
        lambda v: v if getattr(v, "committed", True) else jax.device_put(v, v.sharding), values)


def _select(values: list, flags: list[bool], wanted: bool) -> list:
    return [value for value, flag in zip(values, flags) if flag == wanted]


def _merge(flags: list[bool], when_true: list, when_false: list) -> list:
    """The inverse of `_select`: interleaves the two lists back in `flags` order."""
    true_values, false_values = iter(when_true), iter(when_false)
    return [next(true_values) if flag else next(false_values) for flag in flags]


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
    rows = {}
    for name, leaf in micro_batches.named_tensors(batch):
        if not leaf.shape:
            raise micro_batches.scalar_error(name, num_steps)
        rows[name] = leaf.shape[0]
    if len(set(rows.values())) > 1:
        name = min(rows, key=rows.get)
        raise ValueError(micro_batches.rows_mismatch_message(
            f"their rows are {rows}", name, num_steps))
    for size in set(rows.values()):
        split_batch(size, num_shards, num_steps, in_a_step=True)

    def split(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, jax_sparse.BCOO):
            return _SparseRows.split(leaf, num_steps, num_shards)
        leaf = jnp.asarray(leaf)
        rows = leaf.shape[0] // (num_shards * num_steps)
        # (B, ...) -> (replicas, k, rows, ...) -> (k, replicas, rows, ...) -> (k, B/k, ...):
        # the replica axis stays whole, so a batch sharded over it keeps its shards.
        blocks = leaf.reshape((num_shards, num_steps, rows) + leaf.shape[1:])
        return jnp.swapaxes(blocks, 0, 1).reshape((num_steps, num_shards * rows) + leaf.shape[1:])

    return tree.map_structure(split, batch, none_is_leaf=True)


@jax.tree_util.register_pytree_node_class
class _SparseRows:
    """A sparse (BCOO) leaf cut into k micro-batches by rows, stacked on a leading axis.

    Every micro-batch keeps all `nse` stored entries (a scanned value needs one shape); those of
    other micro-batches' rows become padding: value 0 at an out-of-range index, which JAX's
    sparse operations skip.
    """

    def __init__(self, data, indices, shape):
        self.data, self.indices, self.shape = data, indices, shape

    def tree_flatten(self):
        return (self.data, self.indices), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(*children, shape)

    @classmethod
    def split(cls, leaf: jax_sparse.BCOO, num_steps: int, num_shards: int) -> "_SparseRows":
        rows = leaf.shape[0] // (num_shards * num_steps)  # per replica and micro-batch
        shape = (num_shards * rows,) + leaf.shape[1:]
        if leaf.n_batch:  # rows are a batch axis of the layout: split it like a dense axis
            parts = [
                jnp.swapaxes(a.reshape((num_shards, num_steps, rows) + a.shape[1:]), 0, 1)
                .reshape((num_steps, num_shards * rows) + a.shape[1:])
                for a in (leaf.data, leaf.indices)
            ]
            return cls(*parts, shape)
        row = leaf.indices[:, 0]
        replica, within = row // (num_steps * rows), row % (num_steps * rows)
        step = within // rows
        indices = leaf.indices.at[:, 0].set(replica * rows + within % rows)
        keep = step[None, :] == jnp.arange(num_steps)[:, None]  # (k, nse)
        padding = jnp.array(shape[: indices.shape[1]], indices.dtype)
        data = jnp.where(keep.reshape(keep.shape + (1,) * (leaf.data.ndim - 1)), leaf.data, 0)
        return cls(data, jnp.where(keep[..., None], indices, padding), shape)

    def to_bcoo(self) -> jax_sparse.BCOO:
        return jax_sparse.BCOO((self.data, self.indices), shape=self.shape)


def _assemble(micro_batch):
    """One micro-batch as the model takes it: sparse leaves become BCOO again."""
    return jax.tree_util.tree_map(
        lambda leaf: leaf.to_bcoo() if isinstance(leaf, _SparseRows) else leaf,
        micro_batch,
        is_leaf=lambda leaf: isinstance(leaf, _SparseRows),
    )


def _metrics_result(model: keras.Model, metrics_variables: list) -> dict:
    """The model's metric results for the given metric variable values."""
    mapping = list(zip(model.metrics_variables, metrics_variables))
    with keras.StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()
