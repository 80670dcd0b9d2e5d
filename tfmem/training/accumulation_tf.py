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
from tfmem.training import micro_batches
from tfmem.runtime.cluster import split_batch
from tfmem.training import placement
from tfmem.training.accumulation_math import (
    AccumulationState,
    accumulator_dtype,
    average_statistic,
    mean,
)


class AccumTrainer:
    """The TensorFlow half of `AccumModel`: its `train_step` and first-batch build.

    The class it is mixed into is a `keras.Model` with the hooks that
    `tfmem.training.accumulation_math` lists: `accumulation_steps`,
    `check_accumulation_setup()`, `check_loss_reductions()` and `batch_norm_statistics()`.
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
        carry, has_gradient = _accumulate(self, window, split, k, self._xla_loop_on_host())
        # The compiled loss is built while the micro-step traces, so check it here.
        self.check_loss_reductions()
        _update(self, window, carry, has_gradient, dynamic_batch, checks)
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
        """Without a strategy Keras 3.15 builds nothing here: the optimizer's slots and the
        metrics' variables are made while the step traces, and TensorFlow then traces the step
        a second time (a function that makes variables is traced once to make them and again
        to run) and keeps both graphs for the run's life (tiramisu-103 at 224 px: two graphs
        of 30,000 ops, 368 MiB more resident set, 63% more time in the first step). Built
        here from the data's shapes (the dataset's element spec: no batch is read, no
        shuffle buffer filled), the step traces once.
        Data whose shapes are not plain tensors (ragged, sparse) is left to Keras, as is a
        model that cannot be built on symbolic inputs: the step then builds it as before."""
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


def _window(model: keras.Model) -> _Window:
    variables = list(model.trainable_variables)
    if not variables:
        warnings.warn("The model does not have any trainable weights.")
    statistics = model.batch_norm_statistics()
    return _Window(variables, statistics, [tf.identity(v.value) for v in statistics])


def _accumulate(model: keras.Model, window: _Window, split, k: int,
                xla_loop_on_host: bool) -> tuple[AccumulationState, list[bool]]:
    """Runs `_micro_step` on the `k` micro-batches of `split`, one after the other.

    Returns the final carry and, per trainable variable, whether it got a gradient. That is a
    property of the graph, not of the values: it is read from the micro-step's one trace (from
    its first call, when running eagerly), where such a variable's sum is None.
    """
    carry = AccumulationState(
        gradient_sums=[tf.zeros(v.shape, accumulator_dtype(v.dtype)) for v in window.variables],
        statistic_deltas=[tf.zeros(s.shape, accumulator_dtype(s.dtype)) for s in window.starts],
        loss_sum=tf.zeros((), accumulator_dtype(model.compute_dtype)),
    )

    def micro_batch_at(i):
        return tf.nest.map_structure(lambda t: None if t is None else _micro_batch(t, i, k), split)

    def step(carry, micro_batch):
        return _micro_step(model, window, carry, micro_batch)

    if tf.executing_eagerly():  # `run_eagerly`: the loop runs in Python, as `tf.while_loop` would
        return _one_after_another(step, carry, micro_batch_at, k)
    # The micro-step is traced once, as a function that every iteration calls (TensorFlow
    # inlines it; micro-batch 0 only gives the argument types). On a host-loop platform
    # (`tfmem.training.placement`) the step runs without XLA and the micro-step is one loop-free
    # XLA program. It takes the micro-batch, not its index: XLA needs slice bounds as
    # compile-time constants, so an index would compile k programs.
    traced = tf.function(step, jit_compile=True if xla_loop_on_host else None, autograph=False)
    try:
        traced = traced.get_concrete_function(carry, micro_batch_at(tf.constant(0)))
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
        return _one_after_another(step, carry, micro_batch_at, k)
    _, carry = tf.while_loop(
        lambda i, _: i < k,
        lambda i, carry: (i + 1, _keep_sums(carry, traced(carry, micro_batch_at(i)))),
        (tf.constant(0), carry),
        # Sequential micro-batches: running them in parallel would keep
        # several micro-batches of activations alive and defeat the purpose.
        parallel_iterations=1,
        maximum_iterations=k,
    )
    return carry, _has_gradient(traced.structured_outputs)


def _one_after_another(step, carry: AccumulationState, micro_batch_at,
                       k: int) -> tuple[AccumulationState, list[bool]]:
    """`_accumulate`'s loop written out: `step` on each of the `k` micro-batches in turn.

    Traced, micro-batch `i + 1` is taken only once micro-step `i`'s sums exist (its index is
    made from them), so TensorFlow's executor runs the micro-steps one after another, as the
    loop would, not side by side with their activations all held.
    """
    for i in range(k):
        index = tf.constant(i) if i == 0 or tf.executing_eagerly() else _after_sums(carry, i)
        stepped = step(carry, micro_batch_at(index))
        carry = _keep_sums(carry, stepped)
    return carry, _has_gradient(stepped)


def _after_sums(carry: AccumulationState, i: int) -> tf.Tensor:
    """`i`, as an int32 tensor made only once every sum of `carry` exists: a 0 made from the
    first element of each is added to it (`backend_tf.zero_once_made`; a NaN one adds 0 too)."""
    zero = zero_once_made([*carry.gradient_sums, *carry.statistic_deltas, carry.loss_sum])
    return i + tf.minimum(tf.cast(tf.math.is_nan(zero), tf.int32), 0)


def _micro_step(model: keras.Model, window: _Window, carry: AccumulationState,
                micro_batch: tuple) -> AccumulationState:
    """Forward + backward of one micro-batch `(x, y, sample_weight)`, added into `carry`.

    Returns the new carry, in which a variable that got no gradient has None for its sum, as
    `tape.gradient` has None for its gradient (`_keep_sums` puts the sum back).
    """
    x, y, sample_weight = micro_batch
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True) if internals.call_has_training_arg(model) else model(x)
        loss = internals.compute_loss(
            model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        scaled = model.optimizer.scale_loss(loss) if model.optimizer else loss
    grads = tape.gradient(scaled, window.variables) if window.variables else []
    gradient_sums = [
        None if g is None else total + tf.cast(tf.convert_to_tensor(g), total.dtype)
        for total, g in zip(carry.gradient_sums, grads)
    ]
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
        gradient_sums=gradient_sums,
        statistic_deltas=statistic_deltas,
        loss_sum=carry.loss_sum + tf.cast(loss, carry.loss_sum.dtype),
    )


def _keep_sums(carry: AccumulationState, stepped: AccumulationState) -> AccumulationState:
    """`stepped`, with the sums it has None for (no gradient) taken from `carry`."""
    return stepped._replace(gradient_sums=[
        total if new is None else new
        for total, new in zip(carry.gradient_sums, stepped.gradient_sums)
    ])


def _has_gradient(stepped: AccumulationState) -> list[bool]:
    return [total is not None for total in stepped.gradient_sums]


def _update(model: keras.Model, window: _Window, carry: AccumulationState,
            has_gradient: list[bool], dynamic_batch: tf.Tensor, checks: list) -> None:
    """The window's one update: the BatchNorm statistics, the logged loss, the mean gradient."""
    k = model.accumulation_steps
    for v, start, delta_sum in zip(window.statistics, window.starts, carry.statistic_deltas):
        v.assign(average_statistic(start, delta_sum, k))
    # The logged loss is the mean over replicas: Keras sums replica logs, so each replica
    # reports its loss × replicas (as Keras's own step does).
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    internals.loss_tracker(model).update_state(
        mean(carry.loss_sum, k) * replicas,
        sample_weight=dynamic_batch,
    )
    if window.variables:
        grads = [mean(total, k) if used else None
                 for total, used in zip(carry.gradient_sums, has_gradient)]
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
        checks.append(
            tf.debugging.assert_equal(
                rows % k,
                0,
                message=(
                    f"AccumModel: the batch of this step is not divisible by "
                    f"accumulation_steps={k} (typically the partial last batch of "
                    "an epoch). Batch the dataset with drop_remainder=True, or make "
                    "the number of samples a multiple of the global batch size."
                ),
            )
        )
    return rows, checks


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
