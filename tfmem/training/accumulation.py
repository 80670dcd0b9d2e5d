"""`AccumModel`: a `keras.Model` that runs each global batch as micro-batches in one train step.

What a step computes (split, loss normalisation, gradients, mixed precision, BatchNorm, metrics,
memory) and what is exact is stated once, in docs/accumulation.md. The step itself is the
backend's (`accumulation_tf`, `accumulation_jax`), chosen once in `tfmem.backend`.
"""

from __future__ import annotations

import numbers
import warnings
import weakref

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


class AccumModel(backend.AccumTrainer, keras.Model):
    """A `keras.Model` that accumulates gradients over micro-batches in one step.

    Make one as you would make a `keras.Model`, in one of three ways:

    * **Functional:** `AccumModel(inputs, outputs, accumulation_steps=k)`.
    * **Wrapping** a functional or `Sequential` model, sharing its layers:
      `AccumModel.wrap(model, accumulation_steps=k)`.
    * **Subclassing:** `class Net(AccumModel)` with your own `__init__` (which
      forwards `**kwargs`, or passes `accumulation_steps`, to `super().__init__`)
      and `call`.

    `compile`, `fit`, `evaluate` and `predict` are the plain Keras ones; only
    `train_step` differs (its exact semantics: docs/accumulation.md). Batch the
    data by the *global* batch size: each step splits it by rows into
    `accumulation_steps` micro-batches and applies one optimizer update.

    Like `keras.Model(inputs, outputs)`, which returns an instance of Keras's
    `Functional`, `AccumModel(inputs, outputs)` returns an instance of
    `AccumModel`'s functional form (a subclass of both); test for it with
    `isinstance(model, AccumModel)`.

    Args:
        *args: Forwarded to `keras.Model` (`inputs`, `outputs`).
        accumulation_steps: Number of micro-batches `k` per global batch, or
            "auto": `fit` picks the smallest `k` whose micro-batch fits the
            replica's memory (`tfmem.plan`). None (the default) means 1, except
            for the copy `keras.models.clone_model` makes of an `AccumModel`,
            which keeps the original's.
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

    class Net(tfmem.AccumModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(64, activation="relu")
            self.head = keras.layers.Dense(10)

        def call(self, x):
            return self.head(self.hidden(x))

    net = Net(accumulation_steps=4)
    ```
    """

    def __new__(cls, *args, **kwargs):
        # `AccumModel(inputs, outputs)` makes the functional form, as `keras.Model(inputs,
        # outputs)` makes a `Functional`; AccumModel itself stays a subclassable Model.
        if internals.functional_init_arguments(args, kwargs):
            cls = _functional_form(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, accumulation_steps: int | str | None = None, **kwargs):
        if accumulation_steps is None:
            accumulation_steps = _replayed_accumulation_steps(args, kwargs)
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
        try:
            memory_plan = planner.plan(
                self, global_batch_size=global_batch, optimizer=self.optimizer,
                precision=precision if precision.startswith("mixed_") else "float32",
                # A subclassed model Keras has not built yet is planned at the data's shapes.
                input_shape=None if self.built else _sample_shapes(x), **budget)
        except Exception as error:  # noqa: BLE001 - a model the planner cannot size still trains
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if auto:
                raise ValueError(
                    'accumulation_steps="auto" takes k from the memory plan, and the planner '
                    f"could not plan this run ({reason}). Set `accumulation_steps` to a "
                    f"number k that divides the per-replica batch ({per_replica}), e.g. "
                    "`accumulation_steps=1`.") from error
            if not getattr(self, "_unplanned_warning_given", False):
                warnings.warn(f"AccumModel: memory check skipped, the planner could not plan "
                              f"this run ({reason}); training without the check.")
                self._unplanned_warning_given = True
            return
        # The guard refuses only a plan it computed.
        planner.check(memory_plan, accumulation_steps=None if auto else self.accumulation_steps,
                      allow_over_budget=not check_memory and not auto)
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
        config["accumulation_steps"] = self._configured_steps()
        return config

    def _configured_steps(self) -> int | str:
        return "auto" if self._auto_accumulation else self.accumulation_steps

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


class Functional(AccumModel, internals.functional_class()):
    """The functional form of `AccumModel`: what `AccumModel(inputs, outputs)` returns.

    It is to `AccumModel` what Keras's `Functional` is to `keras.Model`, and is named like it
    because Keras tells functional models by that class name (TensorBoard writes their graph).
    """

    def _run_through_graph(self, *args, **kwargs):  # internals.GRAPH_REPLAY_HOOK
        outputs = super()._run_through_graph(*args, **kwargs)
        if not hasattr(self, "_auto_accumulation"):  # Keras's own checks while constructing
            return outputs
        # `keras.models.clone_model` builds its copy from these outputs, named like this model.
        for tensor in keras.tree.flatten(outputs):
            if isinstance(tensor, keras.KerasTensor):
                _REPLAYED_FROM[tensor] = (self.name, self._configured_steps())
        return outputs


# Symbolic outputs of a functional AccumModel's graph → (that model's name, its steps).
_REPLAYED_FROM = weakref.WeakKeyDictionary()


def _functional_form(cls: type) -> type:
    """The class `cls(inputs, outputs)` instantiates."""
    if issubclass(cls, internals.functional_class()):
        return cls
    if cls is AccumModel:
        return Functional
    # A subclass built from inputs and outputs becomes functional for good, as Keras makes a
    # `keras.Model` subclass so used; AccumModel itself is never changed, so subclassing it and
    # building it functionally work in any order.
    cls.__bases__ = tuple(
        _functional_form(base) if issubclass(base, AccumModel) else base for base in cls.__bases__
    )
    return cls


def _replayed_accumulation_steps(args: tuple, kwargs: dict) -> int | str:
    """The steps of the model whose clone these constructor arguments build; otherwise 1."""
    outputs = kwargs["outputs"] if "outputs" in kwargs else args[1] if len(args) > 1 else None
    sources = {_REPLAYED_FROM.get(tensor) for tensor in keras.tree.flatten(outputs)
               if isinstance(tensor, keras.KerasTensor)}
    if len(sources) == 1:
        (source,) = sources
        if source is not None and source[0] == kwargs.get("name"):
            return source[1]
    return 1


# Saved AccumModels revive through `AccumModel.from_config` (registered last under the name),
# which builds the functional form again from a functional config.
for _cls in (Functional, AccumModel):
    keras.saving.register_keras_serializable(package="tfmem", name="AccumModel")(_cls)
del _cls


def _sample_shapes(x) -> list[tuple] | None:
    """One sample's shape per model input, from `fit`'s `x`: arrays, or a batched
    `tf.data.Dataset` of `x` or `(x, y[, sample_weight])`; None for anything else."""
    element_spec = getattr(x, "element_spec", None)
    if element_spec is not None:
        x = element_spec[0] if isinstance(element_spec, tuple) else element_spec
    parts = keras.tree.flatten(x)
    shapes = [getattr(part, "shape", None) for part in parts]
    if not parts or any(shape is None or len(shape) < 1 for shape in shapes):
        return None
    return [tuple(shape)[1:] for shape in shapes]


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
