"""The one door to private Keras and TensorFlow attributes that tfmem relies on.

Keras has no public API for a few things tfmem must do (read a functional graph's nodes,
run the compiled loss without its tracker, update metrics statelessly on JAX). Each such
access is a function here, and `tests/test_keras_internals.py` checks that every name still
exists and behaves as tfmem assumes. Where a name is missing, the function raises
`KerasInternalsError` naming it and the Keras versions tfmem is tested on; nothing falls
back silently.
"""

from __future__ import annotations

import contextlib
import importlib

import keras

# The Keras versions the test suite passes on (with TensorFlow 2.21 and JAX); `setup.cfg`
# states the same lowest version.
TESTED_KERAS = ">=3.15"


class KerasInternalsError(RuntimeError):
    """A private Keras/TensorFlow attribute tfmem relies on is missing in this version."""


def _attribute(owner, name: str, purpose: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise KerasInternalsError(
            f"tfmem needs `{type(owner).__name__}.{name}` ({purpose}), which Keras "
            f"{keras.__version__} does not have. Install a Keras version tfmem is tested on "
            f"(keras{TESTED_KERAS}), or report this Keras version to tfmem."
        ) from None


def _module_attribute(module: str, name: str, purpose: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise KerasInternalsError(
            f"tfmem needs `{module}.{name}` ({purpose}), which Keras {keras.__version__} does "
            f"not have. Install a Keras version tfmem is tested on (keras{TESTED_KERAS}), or "
            "report this Keras version to tfmem."
        ) from None


def functional_class() -> type:
    """Keras's `Functional`: the class of a model built from `inputs` and `outputs`."""
    return _module_attribute("keras.src.models.functional", "Functional",
                             "the class of functional models")


def functional_init_arguments(args: tuple, kwargs: dict) -> bool:
    """Whether these arguments, reaching `keras.Model.__init__`, build a functional model
    (inputs and outputs), as Keras decides for `keras.Model` and its subclasses alike."""
    return bool(_module_attribute("keras.src.models.model", "functional_init_arguments",
                                  "how keras.Model tells a functional construction")(args, kwargs))


def symbolic_build(model: keras.Model, data_batch) -> None:
    """Creates the weights of `model` (and of its optimizer, loss and metrics) from a batch's
    shapes, without running the model on it: what Keras does before `fit` under a strategy."""
    _attribute(model, "_symbolic_build", "building a model from a batch's shapes")(
        data_batch=data_batch)


def functional_structs(model: keras.Model) -> tuple:
    """A functional model's inputs and outputs in their original nesting (tensor, list, dict)."""
    return (
        _attribute(model, "_inputs_struct", "the nesting of a functional model's inputs"),
        _attribute(model, "_outputs_struct", "the nesting of a functional model's outputs"),
    )


def graph_runner(graph: keras.Model):
    """The method a functional model's `call` runs its nodes with:
    `(inputs, operation_fn, call_fn) → outputs`."""
    return _attribute(graph, "_run_through_graph", "how a functional model runs its nodes")


def replace_graph_runner(graph: keras.Model, runner) -> None:
    """Makes `graph`'s `call` (this instance only) run its nodes with `runner`."""
    graph_runner(graph)  # the attribute must exist to be replaced
    graph._run_through_graph = runner


def replace_call(layer: keras.layers.Layer, call) -> None:
    """Makes `layer`'s calls (this instance only) run `call` in place of its `call` method.

    Keras has no per-layer hook for this: `Layer.__call__` looks `self.call` up at every call,
    symbolic calls included, inside the call context it sets up, and hands `training` on as
    the layer's own `call` takes it (its signature is read when the layer is made).
    """
    if not callable(_attribute(layer, "call", "the method a layer's calls run")):
        raise KerasInternalsError(f"`{type(layer).__name__}.call` is not callable.")
    layer.call = call


@contextlib.contextmanager
def functional_bases(cls: type, model_class: type, functional_form: type):
    """Makes `cls`, a subclass of `model_class`, functional: for good if the block succeeds.

    Keras has no hook for this either: its `Model.__init__` makes a `keras.Model` subclass
    functional, when the subclass's `__init__` hands `inputs` and `outputs` on, by rewriting
    the bases of the class and of its ancestors until `Functional` stands where `Model` did
    (`inject_functional_model_class`). The same here, with `functional_form` (a subclass of
    `model_class` and `Functional`) where `model_class` stood; `model_class` itself never
    changes. A block that raises puts the bases back.
    """
    changed = []  # (class, its bases before), in the order they were changed

    def rebase(klass: type) -> type:
        if issubclass(klass, functional_class()):
            return klass
        if klass is model_class:
            return functional_form
        bases = tuple(rebase(base) if issubclass(base, model_class) else base
                      for base in klass.__bases__)
        changed.append((klass, klass.__bases__))
        klass.__bases__ = bases
        return klass

    try:
        rebase(cls)
        yield
    except BaseException:
        for klass, bases in reversed(changed):
            klass.__bases__ = bases
        raise


def call_has_training_arg(layer: keras.layers.Layer) -> bool:
    """Whether `layer.call` takes a `training` argument."""
    return bool(_attribute(layer, "_call_has_training_arg", "whether call() takes `training`"))


def compute_loss(model: keras.Model, **kwargs):
    """The compiled loss plus regularisation losses, without updating the loss tracker."""
    return _attribute(model, "_compute_loss", "the loss without its tracker update")(**kwargs)


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    """The `Mean` metric behind the `loss` entry of a compiled model's logs."""
    return _attribute(model, "_loss_tracker", "the metric behind the logged loss")


def compiled_losses(model: keras.Model) -> list[tuple[str, object]]:
    """`(name, loss)` for each loss `compile` was given, once the compiled loss is built.

    Raises:
        KerasInternalsError: the compiled loss exists but its flat list of losses does not.
    """
    compile_loss = _attribute(model, "_compile_loss", "the compiled loss")
    if compile_loss is None:  # compiled without a loss: `compute_loss` is overridden
        return []
    entries = _attribute(compile_loss, "_flat_losses", "the compiled loss's list of losses")
    if entries is None:  # not built yet: built on the first call of the compiled loss
        return []
    return [(entry.name, entry.loss) for entry in entries]


def compiled_loss_entries(model: keras.Model) -> list | None:
    """The compiled loss's own list of `(path, loss, loss_weight, name)` entries, in the order
    it sums them ([] without a compiled loss, None before it is built). Entries may be replaced
    in place (`entry._replace(loss=...)`): the compiled loss calls what the list holds."""
    compile_loss = _attribute(model, "_compile_loss", "the compiled loss")
    if compile_loss is None:
        return []
    return _attribute(compile_loss, "_flat_losses", "the compiled loss's list of losses")


def compiled_loss_metrics(model: keras.Model) -> list:
    """The `Mean` metrics behind the `<output>_loss` logs, one per compiled loss in the order of
    `compiled_loss_entries` (none when the model has a single loss)."""
    compile_loss = _attribute(model, "_compile_loss", "the compiled loss")
    return [] if compile_loss is None else list(compile_loss.metrics)


def compiled_metrics(model: keras.Model) -> list:
    """The metrics `compile` was given (`metrics` and `weighted_metrics`, flattened), as
    given: before the first step builds them ([] for a model compiled without any)."""
    compile_metrics = _attribute(model, "_compile_metrics", "the compiled metrics")
    if compile_metrics is None:
        return []
    given = [_attribute(compile_metrics, name, "the metrics compile was given")
             for name in ("_user_metrics", "_user_weighted_metrics")]
    return [metric for group in given if group for metric in keras.tree.flatten(group)]


def keras_mask(tensor):
    """The Keras mask a layer (or a loss's `call`) set on `tensor`, or None."""
    return _module_attribute("keras.src.backend.common.masking", "get_keras_mask",
                             "Keras's mask of a tensor")(tensor)


def reduce_weighted_values(values, sample_weight, mask, reduction: str | None, dtype):
    """Keras's reduction of a loss's per-element values (`Loss.__call__`'s last step)."""
    return _module_attribute("keras.src.losses.loss", "reduce_weighted_values",
                             "how Keras reduces a loss's values")(
        values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)


def masked_sample_weight(sample_weight, mask, dtype, reduction: str | None):
    """The sample weight Keras reduces a loss with once a mask is merged into it (None: none)."""
    return _module_attribute("keras.src.losses.loss", "apply_mask",
                             "how Keras merges a mask into the sample weight")(
        sample_weight, mask, dtype=dtype, reduction=reduction)


def flatten_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every layer inside `model` (recursively), not `model` itself."""
    return list(_attribute(model, "_flatten_layers", "the layers inside a model")(
        include_self=False))


def own_trainable_variables(layer: keras.layers.Layer) -> list:
    """The trainable variables a layer creates itself (not those of layers inside it)."""
    return list(_attribute(layer, "_trainable_variables", "a layer's own trainable weights"))


def own_weights(layer: keras.layers.Layer) -> list:
    """Every variable a layer creates itself (trainable or not; not its sub-layers')."""
    return (list(_attribute(layer, "_trainable_variables", "a layer's own trainable weights"))
            + list(_attribute(layer, "_non_trainable_variables",
                              "a layer's own non-trainable weights")))


def functional_of(model: keras.Model) -> keras.Model | None:
    """The functional model a built `Sequential` keeps (None before it is built)."""
    if isinstance(model, keras.Sequential):
        return _attribute(model, "_functional", "the functional graph of a Sequential model")
    return model


def is_graph_network(model) -> bool:
    """Whether `model` keeps a functional graph of nodes (`nodes_by_depth` works on it)."""
    return isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth")


def nodes_by_depth(model: keras.Model) -> dict:
    """A functional model's graph: depth → the nodes (layer calls) at that depth."""
    return _attribute(model, "_nodes_by_depth", "the nodes of a functional graph")


def node_of(tensor):
    """The call (a node of a functional graph) that made the symbolic `tensor`."""
    history = _attribute(tensor, "_keras_history", "which call made a symbolic tensor")
    nodes = _attribute(history.operation, "_inbound_nodes", "the calls of a layer")
    return nodes[history.node_index]


def concatenation(node) -> tuple[int, list] | None:
    """`(axis, tensors)` when a graph's call `node` concatenates its tensors along one axis
    (`keras.ops.concatenate`, or a `Concatenate` layer on inputs of one rank); else None.
    The axis is counted from 0, the batch axis."""
    operation = node.operation
    op_class = _module_attribute("keras.src.ops.numpy", "Concatenate",
                                 "the operation of keras.ops.concatenate")
    if not isinstance(operation, (op_class, keras.layers.Concatenate)):
        return None
    args = node.arguments.args
    if len(args) != 1 or node.arguments.kwargs or not isinstance(args[0], (list, tuple)):
        return None
    tensors = list(args[0])
    if not tensors or not all(isinstance(t, keras.KerasTensor) for t in tensors):
        return None
    ranks = {len(t.shape) for t in tensors}
    if len(ranks) != 1 or len(node.outputs) != 1:
        return None
    rank = ranks.pop()
    axis = operation.axis
    if not isinstance(axis, int) or not -rank <= axis < rank:
        return None
    return axis % rank, tensors


def update_metrics_variables(model: keras.Model, *args):
    """JAX trainer: the stateless update of the loss tracker and compiled metrics."""
    return _attribute(model, "_update_metrics_variables",
                      "the JAX trainer's stateless metrics update")(*args)


def distribute_strategy(model: keras.Model):
    """The `tf.distribute.Strategy` a model trains under (TensorFlow backend only)."""
    return _attribute(model, "_distribute_strategy", "the model's distribution strategy")


def in_multi_worker_mode(strategy) -> bool:
    """Whether a `MultiWorkerMirroredStrategy` really spans several workers."""
    return bool(_attribute(strategy.extended, "_in_multi_worker_mode",
                           "whether a strategy spans several workers")())


def first_batch(epoch_iterator):
    """The first batch of the TensorFlow trainer's epoch iterator.

    Its items end with an iterator over the step's batches; the items before it (the step
    number, or the first and last step) differ between Keras versions.
    """
    for item in epoch_iterator:
        return next(item[-1])
    raise ValueError("The data has no batches: the first epoch is empty.")


def epoch_dataset(epoch_iterator):
    """The dataset the TensorFlow trainer's epoch iterator reads (distributed or not)."""
    return _attribute(epoch_iterator, "_distributed_dataset", "the epoch iterator's dataset")


# `keras.models.clone_model` copies a functional model by replaying its graph through this
# method with cloned layers, then builds `type(model)(inputs, outputs, name=model.name)` from the
# replay's outputs; AccumModel's functional form overrides it to hand its `accumulation_steps` on.
GRAPH_REPLAY_HOOK = "_run_through_graph"

# The TensorFlow trainer builds a model from the first batch in this method; AccumModel
# overrides it (see `tfmem.training.accumulation_tf`), so its name is checked like the rest.
SYMBOLIC_BUILD_HOOK = "_maybe_symbolic_build"


def jax_train_function(model: keras.Model, step):
    """JAX trainer: Keras's `(state, iterator)` train function around a `(state, data)` step.

    It runs `step` `steps_per_execution` times per call, as Keras's own jitted step is run.
    """
    return _attribute(model, "_make_function", "the JAX trainer's loop over steps")(step)


def call_training() -> bool | None:
    """The `training` value of the layer call now running (Keras's call context), if any."""
    context = _module_attribute("keras.src.backend.common.global_state",
                                "get_global_attribute", "Keras's global state")("current_call_ctx")
    return None if context is None else context.training


def stateless_scope(state_mapping, collect_losses=False):
    """Keras's `StatelessScope` over `(variable, value)` pairs: reads see the values, and
    assignments are recorded in the scope instead of the variables; with `collect_losses`,
    the losses layers add inside are kept in the scope's `losses` (else dropped)."""
    scope = _module_attribute("keras.src.backend.common.stateless_scope", "StatelessScope",
                              "Keras's stateless scope")
    return scope(state_mapping=state_mapping, collect_losses=collect_losses)


def loss_ids(layer: keras.layers.Layer) -> set:
    """The ids of the losses `layer` added in the stateless scope now entered (Keras's
    `Layer.losses` there takes those of the scope's losses whose ids a layer holds)."""
    return _attribute(layer, "_loss_ids", "the losses a layer added")


def keep_keras_masks(originals, replacements) -> None:
    """Sets on each of `replacements` the Keras mask of the tensor it stands for (in
    `originals`), as Keras's layers set them on their outputs."""
    get = _module_attribute("keras.src.backend.common.masking", "get_keras_mask",
                            "Keras's mask of a tensor")
    put = _module_attribute("keras.src.backend.common.masking", "set_keras_mask",
                            "Keras's mask of a tensor")
    for original, replacement in zip(originals, replacements):
        mask = get(original)
        if mask is not None:
            put(replacement, mask)


def any_symbolic(args, kwargs) -> bool:
    """Whether a call's arguments hold symbolic tensors (a functional model being built)."""
    check = _module_attribute("keras.src.backend.common.keras_tensor", "any_symbolic_tensors",
                              "Keras's symbolic tensor check")
    return check(args, kwargs)


def in_xla_compilation() -> bool:
    """Whether the TensorFlow graph being built is compiled by XLA (`jit_compile=True`)."""
    import tensorflow as tf

    check = _module_attribute("tensorflow.python.ops.control_flow_util",
                              "GraphOrParentsInXlaContext",
                              "whether a graph is compiled by XLA")
    return bool(check(tf.compat.v1.get_default_graph()))


def drop_jax_state(model: keras.Model) -> None:
    """JAX trainer: forgets the state `fit` held between steps, after a step that failed.

    The failed step was given that state as donated buffers, which are gone; the model's
    variables are then assigned again (a resume point is loaded) before the next `fit`.
    """
    if hasattr(model, "_jax_state"):
        model._jax_state = None
        model._jax_state_synced = True


def jax_state_shardings(model: keras.Model) -> tuple:
    """JAX trainer: the shardings of `(trainable, non_trainable, optimizer, metrics)` state."""
    return _attribute(model, "_get_state_sharding_spec",
                      "the JAX trainer's state shardings")()


def is_initialized(variable) -> bool:
    """Whether a Keras variable holds a value (one made under `shapes_only` never does: its
    `value` would make the initial value, and its memory, each time it is read)."""
    return _attribute(variable, "_value", "whether a variable holds its value") is not None


@contextlib.contextmanager
def shapes_only():
    """Builds models whose weights are never initialised: only their shapes exist.

    Inside, `keras.StatelessScope(initialize_variables=False)` defers every new variable's
    initialisation. Keras keeps deferred variables on one global list and initialises the
    whole list when any later outermost `StatelessScope` exits (a symbolic call of a custom
    layer opens one), so a planned XL model would otherwise fill memory long after it was
    planned. On exit, the variables created inside leave that list for good: a model built
    here can be planned, not trained.
    """
    get = _module_attribute("keras.src.backend.common.global_state", "get_global_attribute",
                            "Keras's global state")
    put = _module_attribute("keras.src.backend.common.global_state", "set_global_attribute",
                            "Keras's global state")
    before = list(get("uninitialized_variables") or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        known = {id(variable) for variable in before}
        pending = get("uninitialized_variables") or []
        put("uninitialized_variables", [v for v in pending if id(v) in known])


def replace_op_input(op, index: int, tensor) -> None:
    """Makes the traced TensorFlow op `op` read `tensor` as its input `index`
    (`Operation._update_input`: TensorFlow has no public way to rewire a graph's op)."""
    _attribute(op, "_update_input", "rewiring a traced TensorFlow op's input")(index, tensor)
