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

from tfmem import _keras_internals as internals
from tfmem import backend
from tfmem.memory import planner

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
class AccumModel(backend.AccumTrainer, keras.Model):
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
        runtime = backend.current_runtime(self)
        replicas = runtime.num_replicas
        per_replica, remainder = divmod(global_batch, replicas)
        if remainder or (not auto and per_replica % self.accumulation_steps):
            return  # the step itself raises, with the sizes that would divide
        if memory_budget is not None:
            budget = dict(memory_budget=memory_budget, num_replicas=replicas)
        else:
            budget = dict(runtime=runtime)
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
        if internals.is_graph_network(model):
            inputs, outputs = internals.functional_structs(model)
        return cls(inputs, outputs, accumulation_steps=accumulation_steps, name=model.name)

    def get_config(self) -> dict:
        config = super().get_config()
        config["accumulation_steps"] = (
            "auto" if self._auto_accumulation else self.accumulation_steps)
        return config

    # `Model.from_config` revives functional configs through `cls(inputs=...,
    # outputs=..., **config)`, which passes `accumulation_steps` back to __init__.

    def _batch_norm_statistics(self) -> list:
        return [
            v
            for layer in internals.flatten_layers(self)
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
        for name, loss in internals.compiled_losses(self):
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            if reduction not in _MEAN_REDUCTIONS:
                raise ValueError(
                    f"AccumModel needs losses reduced with 'sum_over_batch_size' (the "
                    f"Keras default), but {name or loss!r} uses "
                    f"reduction={reduction!r}: averaging {self.accumulation_steps} "
                    "micro-batch losses reduced that way does not give the big-batch "
                    "loss. Use the loss's default reduction."
                )


def _global_batch_size(x, batch_size) -> int | None:
    """Rows per step of `fit(x, batch_size=...)` over all replicas, if static."""
    element_spec = getattr(x, "element_spec", None)  # a tf.data.Dataset
    if element_spec is not None:
        spec = keras.tree.flatten(element_spec)[0]
        return spec.shape[0] if spec.shape.rank else None
    arrays = keras.tree.flatten(x)
    if not arrays or not hasattr(arrays[0], "shape"):
        return None  # a generator or PyDataset: batched by the user, size unknown here
    return min(batch_size or 32, int(arrays[0].shape[0]))  # Keras's default batch is 32
