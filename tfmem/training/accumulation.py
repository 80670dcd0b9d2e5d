"""`AccumModel`: a `keras.Model` that runs each global batch as micro-batches in one train step.

What a step computes (split, loss normalisation, gradients, mixed precision, BatchNorm, metrics,
memory) and what is exact is stated once, in docs/accumulation.md. The step itself is the
backend's (`accumulation_tf`, `accumulation_jax`), chosen here (`tfmem.backend.half`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref

import keras

from tfmem import _keras_internals as internals
from tfmem import backend
from tfmem.memory import guard, remat_search
from tfmem.memory.graph_walk import UnknownSizeError
from tfmem.memory.guard import RunPlan
from tfmem.memory.plan_report import Switches
from tfmem.remat import plan as remat_plan
from tfmem.remat import runner
from tfmem.remat.spec import RematSpec
from tfmem.runtime import current
from tfmem.runtime.cluster import check_accumulation_steps

# The train step of the running backend (as Keras picks its trainer class for `Model`).
_STEP = backend.half(tensorflow="tfmem.training.accumulation_tf",
                     jax="tfmem.training.accumulation_jax")


class AccumModel(_STEP.AccumTrainer, keras.Model):
    """A `keras.Model` that accumulates gradients over micro-batches in one step.

    Make one as you would make a `keras.Model`, in one of three ways:

    * **Functional:** `AccumModel(inputs, outputs, accumulation_steps=k)`.
    * **Wrapping** a functional or `Sequential` model, sharing its layers:
      `AccumModel.wrap(model, accumulation_steps=k)`.
    * **Subclassing:** `class Net(AccumModel)` with your own `__init__` (any
      arguments; it forwards `**kwargs`, or passes `accumulation_steps`, to
      `super().__init__`) and `call`. A loss of its own goes in `compute_loss`,
      which the step calls on each micro-batch; an override of `train_step`
      replaces the accumulating step and is refused unless `accumulation_steps=1`.

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
        rematerialize: what is recomputed in the backward pass instead of kept: less
            memory per sample for about one more forward pass of it. Exact:
            BatchNormalization statistics are updated once and Dropout draws the same masks
            (docs/rematerialization.md). None (the default): nothing. "full": the whole
            functional graph, in segments cut where it passes the fewest bytes. "auto": only
            as many of those segments as the micro-batch needs to fit (decided by the plan
            at `fit`). Or a list of layer names (blocks, nested models, any layer at any
            depth; applied to the layers themselves, so a model that shares them recomputes
            them too) and `(first, last)` pairs of top-level layer names (the calls from
            `first` to `last`, as one segment). Names: at `__init__` for a functional model,
            at `fit` for a subclassed one; segments: at `fit`.
        **kwargs: Forwarded to `keras.Model` (`name`, ...).

    Raises:
        ValueError: If `accumulation_steps` is not an integer >= 1 or "auto", or not 1
            for a class that overrides `train_step`; if `rematerialize` is none of the
            above (or, at `fit`, names no layer, or cuts segments of a subclassed model).

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
        # outputs)` makes a `Functional`. A subclass is decided in `__init__`, from what its
        # own `__init__` hands on (as Keras decides in `Model.__init__`), so a subclass takes
        # any arguments, two positional sub-models included.
        if cls is AccumModel and internals.functional_init_arguments(args, kwargs):
            cls = Functional
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, accumulation_steps: int | str | None = None,
                 rematerialize=None, **kwargs):
        functional = internals.functional_init_arguments(args, kwargs)
        # As Keras makes a `keras.Model` subclass functional, the functional form goes under
        # each `AccumModel` subclass among the bases; a construction that fails undoes it.
        with (internals.functional_bases(type(self), AccumModel, Functional) if functional
              else contextlib.nullcontext()):
            if accumulation_steps is None:
                accumulation_steps = (_replayed_accumulation_steps(args, kwargs) if functional
                                      else 1)
            super().__init__(*args, **kwargs)
            self.accumulation_steps = accumulation_steps
            self._auto_accumulation = accumulation_steps == "auto"
            self._rematerialize = RematSpec.parse(rematerialize)
            if internals.is_graph_network(self):  # a subclassed model's: at `fit`
                if self._rematerialize.names:
                    runner.apply(self, self._rematerialize.names)
                # Checked now: names, order, overlaps; a saved spec fits the model.
                remat_plan.pair_spec(self, self._rematerialize.pairs)
                remat_plan.check_spec(self, self._rematerialize.chosen)

    @property
    def rematerialize(self):
        """What is recomputed in the backward pass: None, "full", "auto", or a tuple of
        layer names and `(first, last)` pairs."""
        return self._rematerialize.value

    @property
    def rematerialized_segments(self) -> tuple:
        """The segments cut since the last `fit`: `(path, ranges)` pairs, path "" for the
        model's own graph, a layer's path (`"backbone"`, `"backbone/encoder"`) for the graph
        inside it, ranges of that graph's calls in the order Keras runs them
        (`tfmem.remat.plan`)."""
        return getattr(self, "_tfmem_spec", ())

    @property
    def accumulation_steps(self) -> int | str:
        """Number of micro-batches each global batch is split into ("auto" until `fit`)."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value) -> None:
        value = check_accumulation_steps(value)
        if value != 1:
            _check_train_step_accumulates(type(self), value)
        self._accumulation_steps = value
        # A compiled step has `k` baked into its graph; retrace on change.
        self.train_function = None

    def fit(self, x=None, y=None, batch_size=None, *args, check_memory: bool = True,
            memory_budget: int | None = None, **kwargs):
        """`keras.Model.fit`, after checking the memory plan of the run (`plan_memory`).

        Args:
            x, y, batch_size, *args, **kwargs: as `keras.Model.fit`; batch by the
                *global* batch size.
            check_memory: False skips the check (the explicit override); with
                `accumulation_steps="auto"` the plan still picks `k` (micro-batch 1
                when nothing fits).
            memory_budget: bytes per replica; default: what the distribution
                strategy's devices have (`tfmem.Runtime.from_strategy`).

        Raises:
            tfmem.MemoryPlanError: the global batch's micro-batches do not fit,
                with the breakdown and the `accumulation_steps` that would.
            TypeError: a keyword that neither `keras.Model.fit` nor this method takes
                (before anything is planned or run).
        """
        fit_parameters = inspect.signature(super().fit).parameters
        unknown = sorted(set(kwargs) - set(fit_parameters))
        if unknown and not any(parameter.kind is inspect.Parameter.VAR_KEYWORD
                               for parameter in fit_parameters.values()):
            raise TypeError(
                f"AccumModel.fit() got unexpected keyword argument(s) "
                f"{', '.join(map(repr, unknown))}: it takes keras.Model.fit's arguments, "
                "`check_memory` (False trains over the memory budget) and `memory_budget`.")
        if self._rematerialize.names:
            runner.apply(self, self._rematerialize.names)
        weights = inspect.signature(super().fit).bind_partial(x, y, batch_size, *args, **kwargs)
        run = self.plan_memory(x, batch_size, check_memory=check_memory,
                               memory_budget=memory_budget, y=y,
                               sample_weight=weights.arguments.get("sample_weight"),
                               class_weight=weights.arguments.get("class_weight"))
        self._apply_segments(run.plan if run is not None else None)
        return super().fit(x, y, batch_size, *args, **kwargs)

    def _apply_segments(self, plan) -> None:
        """Cuts the segments the `MemoryPlan` chose ("full", "auto", pairs); without a plan,
        those cut already (by an earlier plan or its memory check), else those the setting
        names ("auto" then cuts all of "full")."""
        setting = self._rematerialize
        if not setting.cuts_segments:
            return
        runner.check_graph(self, setting)
        if setting.mode == "chosen":
            spec = setting.chosen
        elif plan is not None:
            spec = plan.rematerialized
        elif hasattr(self, "_tfmem_spec"):
            return
        else:
            if setting.mode == "auto":
                warnings.warn('rematerialize="auto" needs a memory plan and this run has '
                              'none: every segment of "full" is recomputed.',
                              guard.UnplannedRunWarning, stacklevel=3)
            try:
                spec = remat_search.segments_for(
                    self, RematSpec("full") if setting.mode == "auto" else setting)
            except UnknownSizeError as error:
                raise ValueError(
                    f"rematerialize={setting!r} chooses the segments of {self.name!r} by the "
                    f"bytes of its tensors, which are not known: {error} Or name the "
                    "layers to recompute, which takes any input size: rematerialize="
                    "[('first_layer', 'last_layer'), 'block_3'] (model.summary() lists the "
                    "names).") from None
        if setting.mode == "full" and not spec:
            warnings.warn(f'rematerialize="full" cuts no segment of {self.name!r}: no cut '
                          'lowers its planned peak, so nothing is recomputed; to recompute '
                          "layers anyway, name them (rematerialize=['block_3', ...]; "
                          'model.summary() lists the names).', UserWarning, stacklevel=3)
        if spec != getattr(self, "_tfmem_spec", None):
            runner.apply_spec(self, spec)
            self.train_function = None  # traced again with the new segments

    def make_train_function(self, force=False):
        # A step that starts without `fit` (`train_on_batch`) cuts the setting's segments.
        if (self._rematerialize.cuts_segments and not hasattr(self, "_tfmem_spec")
                and internals.is_graph_network(self)):
            self._apply_segments(None)
        return super().make_train_function(force)

    def plan_memory(self, x=None, batch_size=None, *, check_memory: bool = True,
                    memory_budget: int | None = None, y=None, sample_weight=None,
                    class_weight=None) -> RunPlan | None:
        """Plans and checks the run `fit(x, y, batch_size=batch_size)` would make; `fit`
        calls it.

        The one guard (`tfmem.memory.guard`): with `accumulation_steps="auto"` it sets `k`
        from the plan. Every `fit` calls it (so does `fit_resumable`, through `fit`). Where the
        backend compiles the step ahead (JAX), the split is checked with XLA's memory analysis
        of the compiled step (`guard`'s `compiled_peak`) before any step: a set `k` trains if
        that fits and is refused if not, whatever the plan said, and "auto" takes the largest
        micro-batch that fits. The step is compiled as `fit` runs it, and `fit` runs that
        executable.

        Args:
            x: the training data as `fit` takes it (arrays, or a batched `tf.data.Dataset`).
            batch_size: as in `fit`, for arrays.
            y: as in `fit`: the targets of array data.
            sample_weight, class_weight: as in `fit`; only whether the batch has weights (and
                their shape) matters: the step compiled for the check takes them as `fit`'s.
            check_memory: False skips the check (with "auto" the plan still picks `k`,
                micro-batch 1 when nothing fits).
            memory_budget: bytes per replica; default: the strategy's devices.

        Returns:
            The `RunPlan`, or None when nothing was planned (`check_memory=False` with a set
            `k`, or data without a static batch size, which is warned about).

        Raises:
            tfmem.MemoryPlanError: the run does not fit (see `fit`).
            ValueError: the global batch does not split into replicas × `k`, or "auto"
                for a run that cannot be planned.
        """
        auto = self._auto_accumulation
        if not (check_memory or auto):
            return None
        global_batch = global_batch_size(x, batch_size)
        if global_batch is None:
            guard.unplanned(self, "the data has no static batch size (batch it with "
                            "drop_remainder=True to check)", auto=auto)
            return None
        runtime = current.current_runtime(self)
        where = (dict(runtime=runtime) if memory_budget is None
                 else dict(memory_budget=memory_budget, num_replicas=runtime.num_replicas))
        run = guard.guard(
            self, global_batch_size=global_batch,
            accumulation_steps="auto" if auto else self.accumulation_steps,
            allow_over_budget=not check_memory, batch_of_the_data=True, **where,
            switches=Switches(allow_over_budget="check_memory=False"),
            compiled_peak=self.compiled_peaks(x, y, batch_size, sample_weight=sample_weight,
                                              class_weight=class_weight),
            optimizer=self.optimizer,
            precision=plan_precision(self),
            # A subclassed model Keras has not built yet is planned at the data's shapes.
            input_shape=None if self.built else _sample_shapes(x))
        if auto:
            self.accumulation_steps = run.accumulation_steps
        return run

    def compiled_peaks(self, x=None, y=None, batch_size=None, *, sample_weight=None,
                       class_weight=None, device=None):
        """The memory check's reading of the step `fit(x, y, batch_size=...)` runs: a
        function `(k, plan) →` XLA's peak bytes per device of the compiled step with `k`
        accumulation steps and the segments the `MemoryPlan` chose (which it cuts); what
        `tfmem.memory.guard.guard` takes as `compiled_peak`. The step is compiled as `fit`
        runs it, and `fit` runs that executable.

        Args:
            x, y, batch_size, sample_weight, class_weight: as in `fit` (only the data's
                shapes and dtypes are read).
            device: compile for this one device instead, a TPU's step for one replica
                (`tfmem.memory.probe_jax.tpu_device`, ahead of time where there is none).

        Returns:
            The function, or None where the backend compiles no step ahead (TensorFlow),
            the model runs eagerly, is not compiled, or the data has no static batch shape.
        """
        if not hasattr(_STEP.AccumTrainer, "compiled_step_memory") or self.run_eagerly:
            return None
        global_batch = global_batch_size(x, batch_size)
        batch = (None if global_batch is None else
                 _batch_shapes(x, y, global_batch, _weights_like(sample_weight, class_weight)))
        if batch is None or self.optimizer is None:
            return None

        def compiled_peak(accumulation_steps: int, plan=None) -> int:
            self._apply_segments(plan)  # the segments fit runs with this plan
            internals.symbolic_build(self, batch)  # the variables the compiled step takes
            chosen = self._accumulation_steps
            self._accumulation_steps = accumulation_steps
            try:
                return self.compiled_step_memory(batch, device)["peak_bytes"]
            finally:
                self._accumulation_steps = chosen

        return compiled_peak

    @classmethod
    def wrap(cls, model: keras.Model, accumulation_steps: int = 1,
             rematerialize=None) -> "AccumModel":
        """Wraps a functional or `Sequential` model, sharing its layers and weights.

        The returned model is not compiled (compile it as usual). Layers are
        shared, not copied, so training either model trains both.

        Args:
            model: A built functional or `Sequential` model, e.g. from
                `keras.applications`.
            accumulation_steps: Number of micro-batches per global batch.
            rematerialize: as in `AccumModel`: names of layers recomputed in the backward
                pass.

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
        return cls(inputs, outputs, accumulation_steps=accumulation_steps,
                   rematerialize=rematerialize, name=model.name)

    def get_config(self) -> dict:
        config = super().get_config()
        config["accumulation_steps"] = self._configured_steps()
        if self._rematerialize:
            config["rematerialize"] = self._rematerialize.config()
        return config

    def _configured_steps(self) -> int | str:
        return "auto" if self._auto_accumulation else self.accumulation_steps

    # `Model.from_config` revives functional configs through `cls(inputs=...,
    # outputs=..., **config)`, which passes `accumulation_steps` back to __init__.

    # The two hooks the backend's train step calls (`tfmem.training.accumulation_math` lists
    # what an `AccumTrainer` needs of this class).

    def batch_norm_statistics(self) -> list:
        """The variables averaged over a window: BatchNormalization's moving statistics.

        The rest of the non-trainable state is threaded through the micro-batches.
        """
        return [
            v
            for layer in internals.flatten_layers(self)
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in layer.non_trainable_variables
        ]

    def check_accumulation_setup(self) -> None:
        """Raises `ValueError` when no train step can run; called before each step.

        That is when `accumulation_steps` is still "auto" (`fit` chooses it), or when the
        optimizer accumulates gradients too (`gradient_accumulation_steps`).
        """
        if self.accumulation_steps == "auto":
            raise ValueError(
                'accumulation_steps="auto" is chosen when `fit` starts; call `fit`, or set '
                "`model.accumulation_steps = k` before `train_on_batch`."
            )
        if getattr(self.optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "The optimizer has `gradient_accumulation_steps="
                f"{self.optimizer.gradient_accumulation_steps}` and the model has "
                f"`accumulation_steps={self.accumulation_steps}`: both accumulate. "
                "Remove `gradient_accumulation_steps` from the optimizer; AccumModel "
                "accumulates inside each step."
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


def _check_train_step_accumulates(cls: type, accumulation_steps) -> None:
    """Raises `ValueError` when `cls` replaces the step that splits the batch.

    An override of `train_step` runs on the whole global batch, so it is refused for any
    `accumulation_steps` but 1; `compute_loss` is what a subclass overrides instead.
    """
    owner = next(klass for klass in cls.__mro__ if "train_step" in vars(klass))
    if owner is not _STEP.AccumTrainer:
        raise ValueError(
            f"{owner.__name__} overrides `train_step`, which replaces AccumModel's step "
            f"that splits each batch into micro-batches: accumulation_steps="
            f"{accumulation_steps!r} would not be applied. Override `compute_loss` instead "
            "(AccumModel calls it on each micro-batch), or pass accumulation_steps=1 to train "
            "with your `train_step` on whole batches."
        )


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


def _weights_like(sample_weight, class_weight):
    """What Keras feeds the step as the sample weights of array data given `sample_weight`
    or `class_weight` (floating arrays in `floatx`, one weight per row for class weights);
    None without weights."""
    if sample_weight is not None:
        return keras.KerasTensor(tuple(sample_weight.shape), keras.backend.floatx())
    if class_weight is not None:
        return keras.KerasTensor((None,), keras.backend.floatx())
    return None


def _batch_shapes(x, y, global_batch: int, sample_weight=None):
    """`(x, y[, sample_weight])` of one global batch as shapes and dtypes, from arrays or a
    batched `tf.data.Dataset` (its own elements); None for other data."""
    element_spec = getattr(x, "element_spec", None)
    if element_spec is not None:
        parts = element_spec
    elif y is None:
        parts = x
    else:
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    leaves = keras.tree.flatten(parts)
    if not leaves or any(getattr(leaf, "shape", None) is None for leaf in leaves):
        return None

    def shape_of(leaf):
        dtype = getattr(leaf.dtype, "as_numpy_dtype", leaf.dtype)  # a TensorSpec's
        return keras.KerasTensor((global_batch,) + tuple(leaf.shape)[1:], dtype)

    if any(len(leaf.shape) < 1 or None in tuple(leaf.shape)[1:] for leaf in leaves):
        return None
    return keras.tree.map_structure(shape_of, parts)


def plan_precision(model: keras.Model) -> str:
    """The precision a model's run is planned in: its mixed policy, else float32."""
    policy = model.dtype_policy.name
    return policy if policy.startswith("mixed_") else "float32"


def global_batch_size(x, batch_size=None) -> int | None:
    """Rows per step of `fit(x, batch_size=...)` over all replicas, if static."""
    element_spec = getattr(x, "element_spec", None)  # a tf.data.Dataset
    if element_spec is not None:
        spec = keras.tree.flatten(element_spec)[0]
        rows = spec.shape[0] if spec.shape.rank else None
        # A dataset split by process holds this process's part of each global batch.
        return None if rows is None else current.processes.global_batch(rows, x)
    if isinstance(x, keras.utils.PyDataset):  # its batches are indexed
        first = keras.tree.flatten(x[0])[0]  # the first's rows (the user batched it)
        return int(first.shape[0]) if getattr(first, "shape", None) else None
    arrays = keras.tree.flatten(x)
    if not arrays or not hasattr(arrays[0], "shape"):
        return None  # a generator: batched by the user, size unknown here
    return min(batch_size or 32, int(arrays[0].shape[0]))  # Keras's default batch is 32
