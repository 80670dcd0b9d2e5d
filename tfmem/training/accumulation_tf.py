"""The TensorFlow backend's accumulating train step (semantics: `tfmem.training.accumulation`).

`AccumTrainer` is mixed into `AccumModel` when Keras runs on TensorFlow (`tfmem.backend`):
`k` micro-batches in one `tf.while_loop`, gradients summed in float32, one optimizer update.
With `jit_compile=True` on a platform whose XLA runs loop bodies slowly (CPU), the loop stays
out of XLA and each micro-step is compiled on its own (`tfmem.training.placement`).
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from tfmem import _keras_internals as internals
from tfmem.training import micro_batches
from tfmem.runtime.cluster import split_batch
from tfmem.training import placement


class AccumTrainer:
    """The TensorFlow half of `AccumModel`: its `train_step` and first-batch build."""

    def train_step(self, data):
        k = self.accumulation_steps
        if k == "auto":
            raise ValueError(
                'accumulation_steps="auto" is chosen when `fit` starts; call `fit`, or set '
                "`model.accumulation_steps = k` before `train_on_batch`."
            )
        self._check_optimizer()
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

        variables = list(self.trainable_variables)
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
        bn_variables = self._batch_norm_statistics()
        bn_start = [tf.identity(v.value) for v in bn_variables]
        has_gradient = [False] * len(variables)

        def micro_step(x_i, y_i, w_i, loss_sum, grad_sums, bn_sums):
            with tf.GradientTape() as tape:
                y_pred = self(x_i, training=True) if internals.call_has_training_arg(self) else self(x_i)
                loss = internals.compute_loss(
                    self,
                    x=x_i, y=y_i, y_pred=y_pred, sample_weight=w_i, training=True
                )
                scaled = self.optimizer.scale_loss(loss) if self.optimizer else loss
            grads = tape.gradient(scaled, variables) if variables else []
            for index, grad in enumerate(grads):
                has_gradient[index] = has_gradient[index] or grad is not None
            grad_sums = [
                acc if g is None else acc + tf.cast(tf.convert_to_tensor(g), acc.dtype)
                for acc, g in zip(grad_sums, grads)
            ]
            # Collect this micro-batch's change of the BN statistics, then rewind them so
            # every micro-batch steps from the same start (docs/accumulation.md).
            bn_sums = [
                acc + tf.cast(v.value - start, acc.dtype)
                for acc, v, start in zip(bn_sums, bn_variables, bn_start)
            ]
            for v, start in zip(bn_variables, bn_start):
                v.assign(start)
            self.compute_metrics(x_i, y_i, y_pred, sample_weight=w_i)
            return loss_sum + tf.cast(loss, loss_sum.dtype), grad_sums, bn_sums

        if self._xla_loop_on_host():
            # The step runs without XLA and each micro-step is one loop-free XLA program
            # (`tfmem.training.placement`). It takes the micro-batch, not its index: XLA
            # needs slice bounds as compile-time constants, so an index would compile k programs.
            micro_step = tf.function(micro_step, jit_compile=True, autograph=False)

        def body(i, loss_sum, grad_sums, bn_sums):
            x_i, y_i, w_i = tf.nest.map_structure(
                lambda t: None if t is None else _micro_batch(t, i, k), split
            )
            return (i + 1, *micro_step(x_i, y_i, w_i, loss_sum, grad_sums, bn_sums))

        _, loss_sum, grad_sums, bn_sums = tf.while_loop(
            lambda i, *_: i < k,
            body,
            (
                tf.constant(0),
                tf.zeros((), _accumulator_dtype(self.compute_dtype)),
                [tf.zeros(v.shape, _accumulator_dtype(v.dtype)) for v in variables],
                [tf.zeros(s.shape, _accumulator_dtype(s.dtype)) for s in bn_start],
            ),
            # Sequential micro-batches: running them in parallel would keep
            # several micro-batches of activations alive and defeat the purpose.
            parallel_iterations=1,
            maximum_iterations=k,
        )
        # The compiled loss is built while the loop body traces, so check it here.
        self._check_loss_reductions()
        for v, start, total in zip(bn_variables, bn_start, bn_sums):
            # A statistic no micro-batch moved (a frozen layer's) keeps its exact bits.
            v.assign(tf.where(tf.equal(total, 0), start, start + tf.cast(total / k, start.dtype)))

        loss = loss_sum / k
        # The logged loss is the mean over replicas: Keras sums replica logs, so each replica
        # reports its loss × replicas (as Keras's own step does).
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        internals.loss_tracker(self).update_state(
            loss * replicas,
            sample_weight=dynamic_batch,
        )
        if variables:
            grads = [s / k if used else None for s, used in zip(grad_sums, has_gradient)]
            with tf.control_dependencies(checks):  # `optimizer.iterations` moves only then
                self.optimizer.apply_gradients(zip(grads, variables))
        return self._multi_worker_logs(self.get_metrics_result())

    def make_train_function(self, force=False):
        if not self._xla_loop_on_host():
            return super().make_train_function(force)
        # Keras compiles the whole step with XLA when `jit_compile` is on; here only the
        # micro-step is (`train_step`), so the step function is built with XLA off.
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
        if iterator is not None and strategy is not None:  # None: Keras builds at tracing
            data_batch = _first_local_batch(strategy, iterator)
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


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


def _accumulator_dtype(dtype) -> tf.DType:
    """Sums of a `dtype` value: float32, or the value's own dtype where that is wider."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


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
