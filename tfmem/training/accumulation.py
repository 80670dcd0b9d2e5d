"""Gradient accumulation inside one train step: `AccumModel`.

`AccumModel` is a `keras.Model` whose `train_step` receives the **global** batch
(per replica), runs it as `k = accumulation_steps` micro-batches and applies
**one** optimizer update. Only the activations of one micro-batch are alive at
a time, so activation memory scales with the micro-batch, not the global batch.

Semantics (the single reference; `tfmem/training/accumulation_jax.py` mirrors it):

* **Split.** A global batch of `B` rows (per replica) is reshaped to
  `[k, B // k, ...]`; micro-batch `i` is the contiguous rows
  `[i * B/k, (i + 1) * B/k)` of `x`, `y` and `sample_weight` alike. `B` must be
  divisible by `k`: a static `B` that is not raises `ValueError` when the step
  is traced; a dynamic one (a partial last batch) fails the step with an
  `InvalidArgumentError` carrying the same advice (batch with
  `drop_remainder=True`).
* **Loss normalisation.** Keras reduces a compiled loss with
  `"sum_over_batch_size"`: `L = sum_j(w_j * l_j) / N`, where `N` counts the
  loss *elements* (rows × any trailing dims), **not** the sum of sample
  weights. A micro-batch loss is therefore `L_i = sum_{j in i}(w_j l_j) / (N/k)`
  and the window loss `(1/k) * sum_i L_i` equals the big-batch loss exactly,
  with or without sample weights (zero weights included). Regularisation
  losses, added once to every `L_i`, also average to themselves. Reductions
  that normalise per call by something else (`"sum"`,
  `"mean_with_sample_weight"`, `"none"`) cannot be recombined by a mean and are
  rejected with a `ValueError` when the step is traced.
* **Gradients.** `g = (1/k) * sum_i grad(scale * L_i)`, accumulated in
  float32 in `tf.while_loop` carried tensors (one extra float32 copy of the
  trainable weights), then one `optimizer.apply_gradients(g)`: one gradient
  all-reduce per update under `tf.distribute`, one `optimizer.iterations`
  increment, one learning-rate schedule step. Weights that get no gradient
  stay `None`, as in a plain step.
* **Mixed precision.** `scale` is the `LossScaleOptimizer`'s current scale
  (1 otherwise). The sum of scaled micro-batch gradients is unscaled once by
  the optimizer; a non-finite gradient in any micro-batch makes the sum
  non-finite, so the whole update is skipped and the scale lowered. A window
  is never applied partially.
* **BatchNormalization.** Each micro-batch is normalised with its own
  statistics (as in any accumulation). The moving statistics `s` (moving
  mean, moving variance, and the renorm statistics) of every
  `BatchNormalization` layer take one momentum step per window with the
  micro-batch statistics averaged:
  `s <- momentum * s + (1 - momentum) * (1/k) * sum_i stat_i`, where `stat_i`
  is micro-batch `i`'s batch mean (or biased variance). Other stateful layers
  (dropout seeds, custom state) update once per micro-batch, as they would in
  `k` forward passes.
* **Metrics and the logged loss** are accumulated over the `k` micro-batches
  (each metric sees every row once) and reported once per global batch, so
  callbacks and the progress bar count real updates.
* **Memory.** `fit` plans the run before the first step (`tfmem.memory.planner.guard`):
  a global batch whose micro-batch does not fit the replica's memory raises
  `tfmem.MemoryPlanError` naming the setting that would fit (`check_memory=False`
  runs anyway); `accumulation_steps="auto"` takes `k` from that plan.
* **Not exact:** losses that use Keras masks (normalised by the valid entries
  of each micro-batch); `BatchNormalization(synchronized=True)` under a
  strategy is untested.
"""

from __future__ import annotations

import numbers
import warnings

import keras
import tensorflow as tf
from keras.src.losses.loss import unscale_loss_for_distribution

from tfmem.memory import planner
from tfmem.runtime.distribute import nearest_multiples

# Reductions for which "mean of the k micro-batch losses" == "big-batch loss".
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def _validate_accumulation_steps(value) -> int | str:
    """Returns `value` as an int (or "auto"), or raises: the one place that checks it."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`accumulation_steps` must be a positive integer; received {value!r} "
            f"of type {type(value).__name__}. Pass the number of micro-batches each "
            "global batch is split into, e.g. `accumulation_steps=4`, or \"auto\" to "
            "take it from the memory plan when `fit` starts."
        )
    if value < 1:
        raise ValueError(
            f"`accumulation_steps` must be >= 1; received {value}. Use 1 for no "
            "accumulation, or k > 1 to split each global batch into k micro-batches."
        )
    return int(value)


@keras.saving.register_keras_serializable(package="tfmem")
class AccumModel(keras.Model):
    """A `keras.Model` that accumulates gradients over micro-batches in one step.

    Build it like a functional model, or wrap an existing one with
    `AccumModel.wrap`. `compile`, `fit`, `evaluate` and `predict` are the
    plain Keras ones; only `train_step` differs (see the module docstring for
    the exact split, normalisation, mixed-precision and BatchNorm semantics).
    Batch the data by the *global* batch size: each step splits it into
    `accumulation_steps` micro-batches.

    Args:
        *args: Forwarded to `keras.Model` (`inputs`, `outputs`).
        accumulation_steps: Number of micro-batches `k` per global batch, or
            "auto": `fit` picks the smallest `k` whose micro-batch fits the
            replica's memory (`tfmem.plan`).
        **kwargs: Forwarded to `keras.Model` (`name`, ...).

    Raises:
        ValueError: If `accumulation_steps` is not an integer >= 1 or "auto".

    Example:

    ```python
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
    model = tfmem.AccumModel(inputs, outputs, accumulation_steps=4)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(images, labels, batch_size=256)  # 4 micro-batches of 64, 1 update
    ```
    """

    def __init__(self, *args, accumulation_steps: int | str = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.accumulation_steps = accumulation_steps
        self._auto_accumulation = accumulation_steps == "auto"

    @property
    def accumulation_steps(self) -> int | str:
        """Number of micro-batches each global batch is split into ("auto" until `fit`)."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value) -> None:
        self._accumulation_steps = _validate_accumulation_steps(value)
        # A compiled step has `k` baked into its graph; retrace on change.
        self.train_function = None

    def fit(self, x=None, y=None, batch_size=None, *args, check_memory: bool = True,
            memory_budget: int | None = None, **kwargs):
        """`keras.Model.fit`, after checking the memory plan of the run.

        Args:
            x, y, batch_size, *args, **kwargs: as `keras.Model.fit`; batch by the
                *global* batch size.
            check_memory: False skips the check (the explicit override); with
                `accumulation_steps="auto"` the plan still picks `k`.
            memory_budget: bytes per replica; default: what the distribution
                strategy's devices have (`tfmem.Runtime.from_strategy`).

        Raises:
            tfmem.MemoryPlanError: the global batch's micro-batches do not fit,
                with the breakdown and the `accumulation_steps` that would.
        """
        self._plan_memory(x, batch_size, check_memory, memory_budget)
        return super().fit(x, y, batch_size, *args, **kwargs)

    def _plan_memory(self, x, batch_size, check_memory, memory_budget):
        auto = self._auto_accumulation
        if not (check_memory or auto):
            return
        global_batch = _global_batch_size(x, batch_size)
        if global_batch is None:
            if auto:
                raise ValueError(
                    'accumulation_steps="auto" needs the global batch size before the '
                    "first step, and the data has no static batch dimension. Batch the "
                    "dataset with `drop_remainder=True`, or set `accumulation_steps`."
                )
            warnings.warn("AccumModel: memory check skipped, the data has no static batch "
                          "size (batch it with drop_remainder=True to check).")
            return
        runtime = None
        if keras.backend.backend() == "jax":  # no tf.distribute strategy on JAX
            from tfmem.runtime import distribute_jax

            runtime = distribute_jax.current_runtime()
        replicas = runtime.num_replicas if runtime else self.distribute_strategy.num_replicas_in_sync
        per_replica, remainder = divmod(global_batch, replicas)
        if remainder or (not auto and per_replica % self.accumulation_steps):
            return  # the step itself raises, with the sizes that would divide
        if memory_budget is not None:
            budget = dict(memory_budget=memory_budget, num_replicas=replicas)
        else:
            from tfmem.runtime.distribute import Runtime  # strategy → device memory

            budget = dict(runtime=runtime or Runtime.from_strategy(self.distribute_strategy))
            if budget["runtime"].memory_per_replica is None and not auto:
                warnings.warn("AccumModel: memory check skipped, the device memory is "
                              "unknown; pass fit(..., memory_budget=bytes) to check.")
                return
        precision = self.dtype_policy.name
        memory_plan = planner.guard(
            self, global_batch_size=global_batch,
            accumulation_steps="auto" if auto else self.accumulation_steps,
            allow_over_budget=not check_memory and not auto, optimizer=self.optimizer,
            precision=precision if precision.startswith("mixed_") else "float32", **budget)
        if auto:
            self.accumulation_steps = memory_plan.accumulation_steps

    @classmethod
    def wrap(cls, model: keras.Model, accumulation_steps: int = 1) -> "AccumModel":
        """Wraps a functional or `Sequential` model, sharing its layers and weights.

        The returned model is not compiled (compile it as usual). Layers are
        shared, not copied, so training either model trains both.

        Args:
            model: A built functional or `Sequential` model, e.g. from
                `keras.applications`.
            accumulation_steps: Number of micro-batches per global batch.

        Returns:
            An `AccumModel` with the same inputs, outputs and name.

        Raises:
            TypeError: If `model` has no symbolic inputs/outputs (a subclassed
                or unbuilt model).

        Example:

        ```python
        base = keras.applications.EfficientNetV2B0(weights=None, input_shape=(96, 96, 3))
        model = tfmem.AccumModel.wrap(base, accumulation_steps=8)
        ```
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"`AccumModel.wrap` expects a keras.Model; received {type(model).__name__}."
            )
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs or not outputs:
            raise TypeError(
                f"`AccumModel.wrap` needs a functional or built Sequential model, but "
                f"{model.name!r} ({type(model).__name__}) has no symbolic inputs/outputs. "
                "Call it on a `keras.Input` instead: `inputs = keras.Input(shape); "
                "AccumModel(inputs, model(inputs), accumulation_steps=k)`."
            )
        # Keep the original nesting: a single-input model takes a tensor, not a list.
        inputs = model._inputs_struct if hasattr(model, "_inputs_struct") else inputs
        outputs = model._outputs_struct if hasattr(model, "_outputs_struct") else outputs
        return cls(inputs, outputs, accumulation_steps=accumulation_steps, name=model.name)

    def get_config(self) -> dict:
        config = super().get_config()
        config["accumulation_steps"] = (
            "auto" if self._auto_accumulation else self.accumulation_steps)
        return config

    # `Model.from_config` revives functional configs through `cls(inputs=...,
    # outputs=..., **config)`, which passes `accumulation_steps` back to __init__.

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            # Keras's JAX trainer calls a stateless train_step(state, data) -> (logs, state).
            from tfmem.training import accumulation_jax

            return accumulation_jax.train_step(self, *args)
        (data,) = args
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
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        batch_size = first.shape[0]
        if batch_size is not None and batch_size % k:
            raise ValueError(
                f"The batch each replica receives ({batch_size} rows) must be divisible "
                f"by `accumulation_steps` ({k}). Use a batch of "
                f"{nearest_multiples(batch_size, k)} rows per replica (global batch = "
                "rows per replica × replicas), or change `accumulation_steps`."
            )
        dynamic_batch = tf.shape(first)[0]
        checks = []
        if batch_size is None:
            checks.append(
                tf.debugging.assert_equal(
                    dynamic_batch % k,
                    0,
                    message=(
                        f"AccumModel: the batch of this step is not divisible by "
                        f"accumulation_steps={k} (typically the partial last batch of "
                        "an epoch). Batch the dataset with drop_remainder=True, or make "
                        "the number of samples a multiple of the global batch size."
                    ),
                )
            )
        with tf.control_dependencies(checks):
            split = tf.nest.map_structure(
                lambda t: None if t is None else _split(t, k), (x, y, sample_weight)
            )

        variables = list(self.trainable_variables)
        if not variables:
            warnings.warn("The model does not have any trainable weights.")
        bn_variables = self._batch_norm_statistics()
        bn_start = [tf.identity(v.value) for v in bn_variables]
        has_gradient = [False] * len(variables)

        def body(i, loss_sum, grad_sums, bn_sums):
            x_i, y_i, w_i = tf.nest.map_structure(
                lambda t: None if t is None else t[i], split
            )
            with tf.GradientTape() as tape:
                y_pred = self(x_i, training=True) if self._call_has_training_arg else self(x_i)
                loss = self._compute_loss(
                    x=x_i, y=y_i, y_pred=y_pred, sample_weight=w_i, training=True
                )
                scaled = self.optimizer.scale_loss(loss) if self.optimizer else loss
            grads = tape.gradient(scaled, variables) if variables else []
            for index, grad in enumerate(grads):
                has_gradient[index] = has_gradient[index] or grad is not None
            grad_sums = [
                acc if g is None else acc + tf.cast(tf.convert_to_tensor(g), tf.float32)
                for acc, g in zip(grad_sums, grads)
            ]
            # Collect this micro-batch's BN update, then rewind the statistics so
            # every micro-batch steps from the same start (module docstring).
            bn_sums = [acc + v.value for acc, v in zip(bn_sums, bn_variables)]
            for v, start in zip(bn_variables, bn_start):
                v.assign(start)
            self.compute_metrics(x_i, y_i, y_pred, sample_weight=w_i)
            return i + 1, loss_sum + tf.cast(loss, tf.float32), grad_sums, bn_sums

        _, loss_sum, grad_sums, bn_sums = tf.while_loop(
            lambda i, *_: i < k,
            body,
            (
                tf.constant(0),
                tf.constant(0.0, tf.float32),
                [tf.zeros(v.shape, tf.float32) for v in variables],
                [tf.zeros_like(s) for s in bn_start],
            ),
            # Sequential micro-batches: running them in parallel would keep
            # several micro-batches of activations alive and defeat the purpose.
            parallel_iterations=1,
            maximum_iterations=k,
        )
        # The compiled loss is built while the loop body traces, so check it here.
        self._check_loss_reductions()
        for v, total in zip(bn_variables, bn_sums):
            v.assign(total / k)

        loss = loss_sum / k
        self._loss_tracker.update_state(
            unscale_loss_for_distribution(loss),
            sample_weight=dynamic_batch,
        )
        if variables:
            grads = [s / k if used else None for s, used in zip(grad_sums, has_gradient)]
            self.optimizer.apply_gradients(zip(grads, variables))
        return self._multi_worker_logs(self.get_metrics_result())

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
        # (`getattr`: only the TensorFlow trainer has `_distribute_strategy`; not the JAX one.)
        if iterator is not None and getattr(self, "_distribute_strategy", None) is not None:
            data_batch = _first_local_batch(self._distribute_strategy, iterator)
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _batch_norm_statistics(self) -> list:
        return [
            v
            for layer in self._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in layer.non_trainable_variables
        ]

    def _check_optimizer(self) -> None:
        if getattr(self.optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The optimizer has `gradient_accumulation_steps="
                f"{self.optimizer.gradient_accumulation_steps}` and the model has "
                f"`accumulation_steps={self.accumulation_steps}`: both accumulate. "
                "Remove `gradient_accumulation_steps` from the optimizer; AccumModel "
                "accumulates inside each step."
            )

    def _check_loss_reductions(self) -> None:
        """Rejects losses whose micro-batch mean would differ from the big-batch loss."""
        compile_loss = getattr(self, "_compile_loss", None)
        for entry in getattr(compile_loss, "_flat_losses", None) or []:
            reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
            if reduction not in _MEAN_REDUCTIONS:
                raise ValueError(
                    f"AccumModel needs losses reduced with 'sum_over_batch_size' (the "
                    f"Keras default), but {entry.name or entry.loss!r} uses "
                    f"reduction={reduction!r}: averaging {self.accumulation_steps} "
                    "micro-batch losses reduced that way does not give the big-batch "
                    "loss. Use the loss's default reduction."
                )


def _global_batch_size(x, batch_size) -> int | None:
    """Rows per step of `fit(x, batch_size=...)` over all replicas, if static."""
    if isinstance(x, tf.data.Dataset):
        spec = tf.nest.flatten(x.element_spec)[0]
        return spec.shape[0] if spec.shape.rank else None
    arrays = tf.nest.flatten(x)
    if not arrays or not hasattr(arrays[0], "shape"):
        return None  # a generator or PyDataset: batched by the user, size unknown here
    return min(batch_size or 32, int(arrays[0].shape[0]))  # Keras's default batch is 32


def _multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


def _first_local_batch(strategy, iterator):
    """The first batch of a Keras epoch iterator, first local replica's values."""
    for _, _, batches in iterator:
        batch = next(batches)
        break
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues)
        else v,
        batch,
    )


def _split(tensor, k: int) -> tf.Tensor:
    """`[B, ...]` -> `[k, B // k, ...]`; row block `i` is micro-batch `i`."""
    tensor = tf.convert_to_tensor(tensor)
    shape = tf.shape(tensor)
    split = tf.reshape(tensor, tf.concat([[k, shape[0] // k], shape[1:]], axis=0))
    static = tensor.shape
    rows = None if static[0] is None else static[0] // k
    return tf.ensure_shape(split, [k, rows] + static[1:].as_list()) if static.rank else split
