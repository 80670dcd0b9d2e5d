"""The TensorFlow backend's accumulating train step (semantics: `tfmem.training.accumulation`).

`AccumTrainer` is mixed into `AccumModel` when Keras runs on TensorFlow (`tfmem.backend`):
`k` micro-batches in one `tf.while_loop`, gradients summed in float32, one optimizer update
(written out one after another where the micro-step synchronizes the replicas by a merge call).
With `jit_compile=True` on a platform whose XLA runs loop bodies slowly (CPU), the loop stays
out of XLA and each micro-step is compiled on its own (`tfmem.training.placement`).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from tfmem import _keras_internals as internals
from tfmem.remat.backend_tf import zero_once_made
from tfmem.training import loss_terms, micro_batches
from tfmem.runtime.cluster import split_batch
from tfmem.training import placement
from tfmem.training import sparse_gradients
from tfmem.runtime.precision import accumulator_dtype
from tfmem.training.accumulation_math import AccumulationState, average_statistic, mean


class AccumTrainer:
    """The TensorFlow half of `AccumModel`: its `train_step` and first-batch build.

    The class it is mixed into is a `keras.Model` with the hooks that
    `tfmem.training.accumulation_math` lists: `accumulation_steps`,
    `check_accumulation_setup()` and `batch_norm_statistics()`.
    A step checks and splits the batch, runs `_micro_step` on each micro-batch over an
    `AccumulationState` (`_accumulate`), and applies the window's one update (`_update`).
    Metrics and other layer state (dropout seeds) are TensorFlow variables, updated in place.
    """

    def train_step(self, data):
        self.check_accumulation_setup()
        k = self.accumulation_steps
        if k == 1:
            # Nothing to accumulate: Keras's own step, without the float32 sums and the loop
            # (the planner counts accumulation buffers only for k > 1).
            return self._multi_worker_logs(super().train_step(data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = tf.nest.map_structure(_as_tensor, (x, y, sample_weight))
        leaves = micro_batches.named_tensors(batch)
        if not leaves:
            # No tensor to split: Keras's own step raises its error for the missing inputs.
            return self._multi_worker_logs(super().train_step(data))
        dynamic_batch, checks = _check_rows(leaves, k)
        if not _is_built(self):
            # The loop needs every weight before the first micro-batch, so build the model from
            # the batch's shapes, as Keras itself does before `fit` under a strategy.
            internals.symbolic_build(self, batch)
        # The loop reads only `split`, so no micro-batch runs before the batch is known to split.
        with tf.control_dependencies(checks):
            split = tf.nest.map_structure(lambda t: None if t is None else _split(t, k), batch)
        window = _window(self)
        carry, has_gradient, layout, rows = _accumulate(self, window, split, k,
                                                        self._xla_loop_on_host())
        _update(self, window, layout, carry, has_gradient, rows, dynamic_batch, checks)
        return self._multi_worker_logs(self.get_metrics_result())

    def make_train_function(self, force=False):
        if not self._xla_loop_on_host():
            return super().make_train_function(force)
        # Keras compiles the whole step with XLA when `jit_compile` is on; here only the
        # micro-step is (`_accumulate`), so the step function is built with XLA off.
        self.jit_compile = False
        try:
            return super().make_train_function(force)
        finally:
            self.jit_compile = True

    def _xla_loop_on_host(self) -> bool:
        """Whether `jit_compile` is on and XLA runs this platform's loop bodies slowly."""
        return (not self.run_eagerly and bool(self.jit_compile)
                and self.accumulation_steps not in (1, "auto")
                and placement.loop_on_host(_platform(self.distribute_strategy)))

    def _multi_worker_logs(self, logs: dict) -> dict:
        if _multi_worker(self.distribute_strategy):
            # Keras 3.15 reduces step logs across workers with
            # `strategy.reduce("MEAN", v, axis=0)`, which fails on scalars
            # (tensorflow/tensorflow#72388); a leading length-1 axis makes it the mean.
            logs = {name: tf.expand_dims(value, 0) for name, value in logs.items()}
        return logs

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3.15's TF trainer `strategy.reduce`s the first distributed batch
        # only to read its shapes; MultiWorkerMirroredStrategy cannot reduce a
        # nested (x, y) batch ("Attempt to convert a value (PerReplica ...)",
        # cf. keras-team/keras#20329), so plain `fit` fails there. One replica's
        # batch has the same shapes as that mean, so every strategy builds the same.
        strategy = internals.distribute_strategy(self)
        if strategy is None:
            return self._build_before_tracing(iterator, data_batch)
        if iterator is not None:
            data_batch = _first_local_batch(strategy, iterator)
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _build_before_tracing(self, iterator, data_batch) -> None:
        """Builds the model, its optimizer and metrics from the data's shapes (the dataset's
        element spec: no batch is read), so that the step traces once: without a strategy
        Keras 3.15 makes their variables while the step traces, and TensorFlow then traces it
        twice and keeps both graphs (docs/benchmarks.md, "The first step"). Ragged or sparse
        data, or a model that cannot be built on symbolic inputs, is left to Keras."""
        if iterator is not None:
            data_batch = internals.epoch_dataset(iterator).element_spec
        if data_batch is None or not _dense(data_batch):
            return
        try:
            internals.symbolic_build(self, data_batch)
        except internals.KerasInternalsError:
            raise
        except Exception:  # noqa: BLE001 - built while the step traces instead, as before
            return


class _Window(NamedTuple):
    """What stays fixed over a window's micro-batches."""

    variables: list  # the trainable variables, in `gradient_sums` order
    statistics: list  # the BatchNorm statistics, in `statistic_deltas` order
    starts: list  # their values before the window
    loss_metrics: list  # per compiled loss, `(metric, [(variable, value before the window)])`


def _window(model: keras.Model) -> _Window:
    variables = list(model.trainable_variables)
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
    statistics = model.batch_norm_statistics()
    loss_metrics = [(metric, [(v, tf.identity(v.value)) for v in metric.variables])
                    for metric in internals.compiled_loss_metrics(model)]
    return _Window(variables, statistics, [tf.identity(v.value) for v in statistics],
                   loss_metrics)


def _accumulate(model: keras.Model, window: _Window, split, k: int, xla_loop_on_host: bool
                ) -> tuple[AccumulationState, list, loss_terms.Layout, dict]:
    """Runs `_micro_step` on the `k` micro-batches of `split`, one after the other.

    Returns the final carry; per gradient group, per trainable variable, whether it got a
    gradient; the loss's `Layout`; and the rows of the gradients that are rows
    (`sparse_gradients`), by their position in `_all_sums`. All but the carry are properties of
    the graph, not of the values: they are read from the micro-step's trace (from its first
    call, when running eagerly), where a variable without a gradient has None for its sum. The
    carry is laid out as the model's last trace found; a trace that finds another layout is
    made again with it.
    """
    layout = loss_terms.stored_layout(model)
    carry = _laid_out(AccumulationState(
        gradient_sums=[tf.zeros(v.shape, accumulator_dtype(v.dtype)) for v in window.variables],
        statistic_deltas=[tf.zeros(s.shape, accumulator_dtype(s.dtype)) for s in window.starts],
        loss_sum=tf.zeros((), accumulator_dtype(model.compute_dtype)),
    ), layout)

    def micro_batch_at(i):
        return tf.nest.map_structure(lambda t: None if t is None else _micro_batch(t, i, k), split)

    def step(carry, micro_batch, traced_again_if_new=False):
        return _micro_step(model, window, carry, micro_batch, traced_again_if_new)

    if tf.executing_eagerly():  # `run_eagerly`: the loop runs in Python, as `tf.while_loop` would
        return _one_after_another(model, step, carry, micro_batch_at, k)
    # The micro-step is traced once, as a function that every iteration calls (TensorFlow
    # inlines it; micro-batch 0 only gives the argument types). On a host-loop platform
    # (`tfmem.training.placement`) the step runs without XLA and the micro-step is one loop-free
    # XLA program. It takes the micro-batch, not its index: XLA needs slice bounds as
    # compile-time constants, so an index would compile k programs.
    def trace(carry):
        return _trace(lambda carry, micro_batch: step(carry, micro_batch, True), carry,
                      micro_batch_at(tf.constant(0)), xla_loop_on_host)

    try:
        traced = trace(carry)
        # Traced again when the loss sums other parts than the carry has; twice at most (the
        # first trace builds the compiled loss if the model had not).
        for _ in range(2):
            if loss_terms.stored_layout(model) == layout:
                break
            layout = loss_terms.stored_layout(model)
            carry = _laid_out(carry, layout)
            traced = trace(carry)
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        # The micro-step synchronizes the replicas where the strategy does so by a merge
        # call (a synchronized BatchNormalization under MirroredStrategy), which TensorFlow
        # cannot do inside a function or a loop: the step then holds k micro-steps.
        warnings.warn(
            f"tfmem: the micro-step synchronizes the replicas (e.g. a synchronized "
            f"BatchNormalization), which TensorFlow cannot do inside a loop under "
            f"{type(tf.distribute.get_strategy()).__name__}; the step's graph holds its "
            f"{k} micro-steps one after another instead: the same training, but the graph and "
            "the first step's tracing grow with accumulation_steps (fewer steps, a larger "
            "micro-batch, cost less).", stacklevel=2)
        return _one_after_another(model, step, carry, micro_batch_at, k)
    rows = sparse_gradients.buffers(_all_sums(traced.structured_outputs), k)
    carry = _without_row_sums(carry, rows)

    def body(i, carry, rows):
        stepped = traced(carry, micro_batch_at(i))
        return i + 1, _keep_sums(carry, stepped), sparse_gradients.write(
            rows, i, _all_sums(stepped))

    _, carry, rows = tf.while_loop(
        lambda i, *_: i < k,
        body,
        (tf.constant(0), carry, rows),
        # Sequential micro-batches: running them in parallel would keep
        # several micro-batches of activations alive and defeat the purpose.
        parallel_iterations=1,
        maximum_iterations=k,
    )
    return carry, _has_gradient(traced.structured_outputs), layout, rows


def _trace(step, carry: AccumulationState, micro_batch, jit_compile: bool = False):
    """`step` traced on `micro_batch`, for any carry whose sums have `carry`'s dtypes (a sparse
    variable's is a scalar in the loop: `sparse_gradients.without_sums`)."""
    relaxed = _with_all_sums(carry, sparse_gradients.relaxed(_all_sums(carry)))
    return tf.function(step, jit_compile=True if jit_compile else None,
                       autograph=False).get_concrete_function(relaxed, micro_batch)


def _all_sums(carry: AccumulationState) -> list:
    """The gradient sums of every group, one flat list (group after group)."""
    return [*carry.gradient_sums, *(total for sums in carry.group_gradient_sums
                                    for total in sums)]


def _with_all_sums(carry: AccumulationState, flat: list) -> AccumulationState:
    """`carry` with its gradient sums taken from `flat` (`_all_sums`' order)."""
    size = len(carry.gradient_sums)
    groups = [flat[size * (g + 1):size * (g + 2)]
              for g in range(len(carry.group_gradient_sums))]
    return carry._replace(gradient_sums=flat[:size], group_gradient_sums=groups)


def _without_row_sums(carry: AccumulationState, rows: dict) -> AccumulationState:
    return _with_all_sums(carry, sparse_gradients.without_sums(_all_sums(carry), rows))


def _one_after_another(model: keras.Model, step, carry: AccumulationState, micro_batch_at,
                       k: int) -> tuple[AccumulationState, list, loss_terms.Layout, dict]:
    """`_accumulate`'s loop written out: `step` on each of the `k` micro-batches in turn.

    Traced, micro-batch `i + 1` is taken only once micro-step `i`'s sums and rows exist (its
    index is made from them), so TensorFlow's executor runs the micro-steps one after another,
    as the loop would, not side by side with their activations all held.
    """
    for i in range(k):
        index = (tf.constant(i) if i == 0 or tf.executing_eagerly()
                 else _after_sums(carry, i,
                                  sparse_gradients.values(rows, _all_sums(stepped))))
        stepped = step(carry, micro_batch_at(index))
        if i == 0:
            rows = sparse_gradients.buffers(
                _gradients_as_traced(step, carry, micro_batch_at, stepped), k)
        rows = sparse_gradients.write(rows, i, _all_sums(stepped))
        carry = _keep_sums(carry, stepped)
        if i == 0:
            carry = _without_row_sums(carry, rows)
    return carry, _has_gradient(stepped), loss_terms.stored_layout(model), rows


def _gradients_as_traced(step, carry: AccumulationState, micro_batch_at,
                         stepped: AccumulationState) -> list:
    """The first micro-step's gradients (sums or rows, `_all_sums`' order) as its graph has
    them. An eager tensor records no op, so eagerly the kind of rows
    (`sparse_gradients.DistinctRows`) is read from a trace of the step, made only where some
    gradient is rows."""
    gradients = _all_sums(stepped)
    if not (tf.executing_eagerly() and any(map(sparse_gradients.is_rows, gradients))):
        return gradients
    try:
        return _all_sums(_trace(step, carry, micro_batch_at(tf.constant(0))).structured_outputs)
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        return gradients  # a step that synchronizes the replicas cannot be traced: rows per lookup


def _after_sums(carry: AccumulationState, i: int, rows: list) -> tf.Tensor:
    """`i`, as an int32 tensor made only once every sum of `carry` and the `rows` (tensors)
    exist: a 0 made from the first element of each is added to it
    (`backend_tf.zero_once_made`; a NaN one adds 0 too)."""
    zero = zero_once_made([*_all_sums(carry), *carry.statistic_deltas, carry.loss_sum, *rows])
    return i + tf.minimum(tf.cast(tf.math.is_nan(zero), tf.int32), 0)


def _micro_step(model: keras.Model, window: _Window, carry: AccumulationState,
                micro_batch: tuple, traced_again_if_new: bool = False) -> AccumulationState:
    """Forward + backward of one micro-batch `(x, y, sample_weight)`, added into `carry`.

    Returns the new carry, in which a variable that got no gradient has None for its sum, as
    `tape.gradient` has None for its gradient (`_keep_sums` puts the sum back). Each gradient
    group of the loss (`loss_terms`) has its own sums; the carry takes the layout the loss has.
    `traced_again_if_new`: this trace is discarded when it finds a layout other than the
    stored one (`_accumulate`), so it may assume the stored one.
    """
    x, y, sample_weight = micro_batch
    # Several gradient groups take one gradient each from the tape.
    persistent = not traced_again_if_new or loss_terms.stored_layout(model).num_groups > 1
    with tf.GradientTape(persistent=persistent) as tape:
        y_pred = model(x, training=True) if internals.call_has_training_arg(model) else model(x)
        with loss_terms.recording(model) as record:
            loss = internals.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
        parts = loss_terms.split(loss, record, model.accumulation_steps)
        scaled = [model.optimizer.scale_loss(part) if model.optimizer else part
                  for part in parts.losses]
    loss_terms.store_layout(model, parts.layout)
    carry = _laid_out(carry, parts.layout)
    group_sums = []
    for group, (sums, part) in enumerate(zip([carry.gradient_sums,
                                              *carry.group_gradient_sums], scaled)):
        # A tape that is not persistent gives one gradient; this trace is then made again.
        grads = (tape.gradient(part, window.variables) if window.variables
                 and (group == 0 or persistent) else [None] * len(window.variables))
        group_sums.append([None if g is None else sparse_gradients.add(total, g)
                           for total, g in zip(sums, grads)])
    del tape
    # Collect this micro-batch's change of the BN statistics, then rewind them so
    # every micro-batch steps from the same start (docs/accumulation.md).
    statistic_deltas = [
        total + tf.cast(v.value - start, total.dtype)
        for total, v, start in zip(carry.statistic_deltas, window.statistics, window.starts)
    ]
    for v, start in zip(window.statistics, window.starts):
        v.assign(start)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return carry._replace(
        gradient_sums=group_sums[0],
        group_gradient_sums=group_sums[1:],
        statistic_deltas=statistic_deltas,
        loss_sum=carry.loss_sum + tf.cast(parts.report, carry.loss_sum.dtype),
        term_sums=[[total + tf.cast(part, total.dtype) for total, part in zip(sums, new)]
                   for sums, new in zip(carry.term_sums, parts.term_sums)],
    )


def _laid_out(carry: AccumulationState, layout: loss_terms.Layout) -> AccumulationState:
    """`carry` with the sums of `layout`'s gradient groups and tracked losses: those it has,
    zeros for those it lacks."""
    return _with_sums(carry, layout.num_groups - 1, len(layout.tracked))


def _with_sums(carry: AccumulationState, num_groups: int, num_terms: int) -> AccumulationState:
    groups = list(carry.group_gradient_sums)[:num_groups]
    terms = list(carry.term_sums)[:num_terms]
    zero = tf.zeros((), carry.loss_sum.dtype)
    return carry._replace(
        group_gradient_sums=groups + [[tf.zeros_like(total) for total in carry.gradient_sums]
                                      for _ in range(num_groups - len(groups))],
        term_sums=terms + [[zero, zero] for _ in range(num_terms - len(terms))],
    )


def _keep_sums(carry: AccumulationState, stepped: AccumulationState) -> AccumulationState:
    """`stepped`, with the sums it has None (no gradient) or rows for taken from `carry`."""
    carry = _with_sums(carry, len(stepped.group_gradient_sums), len(stepped.term_sums))

    def kept(totals, news):
        return [total if new is None or sparse_gradients.is_rows(new) else new
                for total, new in zip(totals, news)]

    return stepped._replace(
        gradient_sums=kept(carry.gradient_sums, stepped.gradient_sums),
        group_gradient_sums=[kept(totals, news) for totals, news in
                             zip(carry.group_gradient_sums, stepped.group_gradient_sums)],
    )


def _has_gradient(stepped: AccumulationState) -> list[list[bool]]:
    """Per gradient group, per trainable variable: whether it got a gradient."""
    return [[total is not None for total in sums]
            for sums in (stepped.gradient_sums, *stepped.group_gradient_sums)]


def _update(model: keras.Model, window: _Window, layout: loss_terms.Layout,
            carry: AccumulationState, has_gradient: list, rows: dict, dynamic_batch: tf.Tensor,
            checks: list) -> None:
    """The window's one update: the BatchNorm statistics, the logged losses, the gradient
    (for a gradient that is rows, the window's rows, scaled as a dense sum is)."""
    k = model.accumulation_steps
    for v, start, delta_sum in zip(window.statistics, window.starts, carry.statistic_deltas):
        v.assign(average_statistic(start, delta_sum, k))
    # The logged loss is the mean over replicas: Keras sums replica logs, so each replica
    # reports its loss × replicas (as Keras's own step does).
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    loss, term_values = loss_terms.window_values(layout, carry.loss_sum, carry.term_sums, k,
                                                 mean)
    internals.loss_tracker(model).update_state(loss * replicas, sample_weight=dynamic_batch)
    # A tracked loss's own log (`<output>_loss`) takes the window's value once, as on the
    # whole batch, instead of its k micro-batch values.
    for (index, _, _), value in zip(layout.tracked, term_values):
        if index < len(window.loss_metrics):
            metric, starts = window.loss_metrics[index]
            for v, start in starts:
                v.assign(start)
            metric.update_state(value * replicas, sample_weight=dynamic_batch)
    if window.variables:
        sums = sparse_gradients.with_rows(_all_sums(carry), rows, window.variables)
        carry = _with_all_sums(carry, sums)
        group_sums = [[total if used else None for total, used in zip(sums, flags)]
                      for sums, flags in zip((carry.gradient_sums, *carry.group_gradient_sums),
                                             has_gradient)]
        grads = loss_terms.window_gradient(layout, group_sums, carry.term_sums, k, mean,
                                           sparse_gradients.scaled, sparse_gradients.added)
        with tf.control_dependencies(checks):  # `optimizer.iterations` moves only then
            model.optimizer.apply_gradients(zip(grads, window.variables))


def _platform(strategy) -> str:
    """The kind of device ("cpu", "gpu" or "tpu") the strategy's replicas run on."""
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return "tpu"
    try:
        device = strategy.extended.worker_devices[0]
    except RuntimeError:  # the default strategy: TensorFlow places ops on GPU:0 if there is one
        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return tf.DeviceSpec.from_string(device).device_type.lower()


def _multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and internals.in_multi_worker_mode(strategy)


def _first_local_batch(strategy, iterator):
    """The first batch of a Keras epoch iterator, first local replica's values."""
    batch = internals.first_batch(iterator)
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues)
        else v,
        batch,
    )


def _dense(data) -> bool:
    """Whether every part of a batch (or of a dataset's element spec) is a dense tensor,
    array or `tf.TensorSpec` (or None: no sample weights)."""
    return all(part is None or isinstance(part, (tf.TensorSpec, tf.Tensor, np.ndarray))
               for part in tf.nest.flatten(data))  # ragged and sparse tensors are no tf.Tensor


def _is_built(model) -> bool:
    return model.built and all(layer.built for layer in internals.flatten_layers(model))


def _as_tensor(value):
    if value is None or isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        return value
    return tf.convert_to_tensor(value)


def _rows(name: str, tensor, k: int) -> tuple[int | None, tf.Tensor]:
    """The number of rows of `tensor`: static (None if unknown) and as a tensor."""
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.shape[0], tf.cast(tensor.nrows(), tf.int32)
    if isinstance(tensor, tf.SparseTensor):
        return tensor.shape[0], tf.cast(tensor.dense_shape[0], tf.int32)
    if tensor.shape.rank == 0:
        raise micro_batches.scalar_error(name, k)
    static = tensor.shape[0] if tensor.shape.rank else None
    return static, tf.shape(tensor)[0]


def _check_rows(leaves: list, k: int) -> tuple[tf.Tensor, list]:
    """The batch's number of rows, and the checks that `k` divides it and every tensor has it.

    What is known when the step is traced raises `ValueError` there; the rest becomes
    assertions that fail the step before anything is updated.
    """
    # The targets are the reference: an input that does not match them is the odd one.
    (first_name, first), *others = sorted(leaves, key=lambda leaf: not leaf[0].startswith("y"))
    batch_size, rows = _rows(first_name, first, k)
    checks = []
    for name, tensor in others:
        static, dynamic = _rows(name, tensor, k)
        if static is not None and batch_size is not None:
            if static != batch_size:
                raise ValueError(micro_batches.rows_mismatch_message(
                    f"`{name}` has {static} rows and `{first_name}` has {batch_size}", name, k))
        else:
            difference = f"the rows of `{name}` (x below) and `{first_name}` (y below) differ"
            checks.append(tf.debugging.assert_equal(
                dynamic, rows, message=micro_batches.rows_mismatch_message(difference, name, k)))
    if batch_size is not None:  # each replica receives batch_size rows of the global batch
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        split_batch(batch_size * replicas, replicas, k, in_a_step=True)
    if batch_size is None:
        checks.append(_divisible(rows, k))
    return rows, checks


def _divisible(rows: tf.Tensor, k: int):
    """The check of a batch whose size is known only when the step runs: `split_batch`'s
    message, with the batch's own size and the nearest sizes that split."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    divisor = replicas * k
    size = tf.cast(rows, tf.int64) * replicas
    below = size // divisor * divisor

    def text(value):
        return tf.strings.as_string(value)

    nearest = tf.where(below > 0, tf.strings.join([text(below), " or ", text(below + divisor)]),
                       text(below + divisor))
    return tf.debugging.Assert(tf.equal(size % divisor, 0), [tf.strings.join([
        "tfmem: AccumModel: the batch of this step (", text(size), ") must be divisible by "
        f"replicas × accumulation_steps ({replicas} × {k} = {divisor}). Try ", nearest,
        " as the batch size. If this is the last batch of an epoch, batch the data with "
        "`drop_remainder=True`."])])


def _split(tensor, k: int):
    """Dense `[B, ...]` -> `[k, B // k, ...]` (row block `i` is micro-batch `i`); a sparse or
    ragged tensor stays whole (new component tensors, under the caller's control dependencies)
    and `_micro_batch` cuts its rows."""
    if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        return tf.nest.map_structure(tf.identity, tensor, expand_composites=True)
    tensor = tf.convert_to_tensor(tensor)
    shape = tf.shape(tensor)
    split = tf.reshape(tensor, tf.concat([[k, shape[0] // k], shape[1:]], axis=0))
    static = tensor.shape
    rows = None if static[0] is None else static[0] // k
    return tf.ensure_shape(split, [k, rows] + static[1:].as_list()) if static.rank else split


def _micro_batch(split, i: tf.Tensor, k: int):
    """Micro-batch `i` of a tensor `_split` returned: rows `[i * B/k, (i + 1) * B/k)`."""
    if isinstance(split, tf.RaggedTensor):
        rows = tf.cast(split.nrows(), tf.int32) // k
        return split[i * rows:(i + 1) * rows]
    if isinstance(split, tf.SparseTensor):
        rows = split.dense_shape[0] // k
        start = tf.concat([[tf.cast(i, tf.int64) * rows], tf.zeros_like(split.dense_shape[1:])], 0)
        size = tf.concat([[rows], split.dense_shape[1:]], 0)
        part = tf.sparse.slice(split, start, size)
        static = split.shape
        part.set_shape([None if static[0] is None else static[0] // k] + static[1:].as_list())
        return part
    return split[i]
