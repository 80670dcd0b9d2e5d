"""Per-sample bytes of the tensors a training step keeps alive for its backward pass.

A functional or Sequential model is walked node by node (nested models, shared layers,
`keras.ops` nodes and several inputs/outputs included): Keras's own layers go through the
rules of `layer_rules` (each checked against the framework's gradient), every other call,
and any layer a rule does not cover, through the general path `gradient_trace`, once per
distinct configuration and shape. A subclassed model has no graph to walk: its whole call
is traced. A call that cannot be traced is counted as keeping its inputs and outputs (an
upper bound) and named in the plan's notes; nothing here raises for an unknown layer.

A call whose output needs no gradient (frozen weights and no trainable layer before it)
keeps nothing: no backward op is built for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

import keras
import numpy as np

from tfmem import _keras_internals as internals
from tfmem.memory import gradient_trace, layer_rules


@dataclasses.dataclass(frozen=True)
class SavedTensors:
    """What one sample costs in the activations a training step keeps for backward.

    Attributes:
        saved_bytes: bytes of the distinct tensors the backward pass reads, for one sample.
        largest_tensor_bytes: bytes of the largest single tensor of the forward pass (one sample).
        input_bytes: bytes of one sample of the model's inputs, as fed.
        fallback_calls: calls counted as keeping their inputs and outputs (an upper bound),
            each with the reason the general path failed on it.
        traced_calls: class names of the calls measured by the general path (`gradient_trace`).
        loop_calls: class names of traced calls with loops whose intermediates are not counted.
    """

    saved_bytes: int
    largest_tensor_bytes: int
    input_bytes: int
    fallback_calls: tuple[str, ...] = ()
    traced_calls: tuple[str, ...] = ()
    loop_calls: tuple[str, ...] = ()


def _itemsize(dtype) -> int:
    return np.dtype(keras.backend.standardize_dtype(dtype)).itemsize


def _sample_bytes(shape, dtype) -> int:
    dims = tuple(shape)[1:]
    if any(d is None for d in dims):
        raise ValueError(
            f"A tensor of shape {tuple(shape)} has an unknown size beyond the batch dimension. "
            "The planner needs concrete shapes: build the model with a concrete input shape, "
            "e.g. `keras.Input((224, 224, 3))` instead of `(None, None, 3)`."
        )
    return math.prod(dims) * _itemsize(dtype)


# Traces by call configuration, shared by every plan in this process: a model planned again
# (the guard at each `fit`, the levers when nothing fits, several devices) is not retraced.
_TRACES: dict = {}
_MAX_TRACES = 4096


class _Walker:
    """Collects the kept tensors of one model, keyed so that a tensor counts once."""

    def __init__(self, compute_dtype: str | None, frozen: Collection[int], backend_name: str):
        self.override = compute_dtype  # the plan's compute dtype for a float32-built model
        self.frozen = frozenset(frozen)  # ids of layers the plan treats as not trainable
        self.backend_name = backend_name
        self.context: tuple = ()  # the nested-model calls the walk is inside
        self.alias: dict = {}  # key -> key of the tensor whose buffer it shares
        self.sizes: dict = {}  # kept key -> bytes per sample
        self.needs_grad: set = set()
        self.model_inputs: set = set()
        self.largest = 0
        self.fallbacks: set[str] = set()
        self.traced: set[str] = set()
        self.loops: set[str] = set()

    # -- keys and dtypes --------------------------------------------------------------------
    def key(self, tensor):
        raw = (self.context, id(tensor))
        return self.alias.get(raw, raw)

    def dtype_of(self, tensor) -> str:
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if self.override and dtype == "float32" and self.key(tensor) not in self.model_inputs:
            return self.override
        return dtype

    def compute_dtype(self, layer) -> str:
        dtype = keras.backend.standardize_dtype(getattr(layer, "compute_dtype", "float32"))
        return self.override if self.override and dtype == "float32" else dtype

    def is_frozen(self, layer) -> bool:
        return id(layer) in self.frozen

    def has_trainable(self, layer) -> bool:
        if not isinstance(layer, keras.layers.Layer) or self.is_frozen(layer):
            return False
        return any(id(w) not in self.frozen for w in layer.trainable_weights)

    # -- what is kept -----------------------------------------------------------------------
    def keep(self, tensor, dtype=None) -> None:
        """Keeps `tensor` (shared by identity) or, in another dtype, a new copy of it."""
        own = self.dtype_of(tensor)
        dtype = keras.backend.standardize_dtype(dtype) if dtype else own
        key = self.key(tensor) if dtype == own else (self.key(tensor), dtype)
        self.sizes[key] = _sample_bytes(tensor.shape, dtype)
        self.largest = max(self.largest, self.sizes[key])

    def keep_new(self, shape, dtype) -> None:
        self.keep_bytes(_sample_bytes(shape, dtype))
        self.largest = max(self.largest, _sample_bytes(shape, dtype))

    def keep_bytes(self, nbytes: int) -> None:
        self.sizes[("new", len(self.sizes))] = int(nbytes)

    # -- the walk ---------------------------------------------------------------------------
    def walk(self, model) -> None:
        graph = internals.functional_of(model)
        by_depth = internals.nodes_by_depth(graph)
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                self.call(node)

    def call(self, node) -> None:
        operation, inputs, outputs = node.operation, node.input_tensors, node.outputs
        if internals.is_graph_network(operation) or isinstance(operation, keras.Sequential):
            self.nested(node)
            return
        for tensor in outputs:
            self.largest = max(self.largest, _sample_bytes(tensor.shape, self.dtype_of(tensor)))
        viewing = isinstance(operation, layer_rules.VIEWS) or (
            isinstance(operation, layer_rules.DROPOUTS) and not operation.rate)
        if viewing and len(inputs) == 1:
            self.alias[(self.context, id(outputs[0]))] = self.key(inputs[0])
            return
        has_trainable = self.has_trainable(operation)
        if not has_trainable and not any(self.key(t) in self.needs_grad for t in inputs):
            return
        self.needs_grad.update(self.key(t) for t in outputs)
        if isinstance(operation, keras.layers.Layer) and layer_rules.apply(
                self, operation, inputs, outputs, has_trainable):
            return
        self.general(node, has_trainable)

    def nested(self, node) -> None:
        inner = internals.functional_of(node.operation)
        outer_keys = [self.key(t) for t in node.input_tensors]
        outer_context, self.context = self.context, self.context + (id(node),)
        for outer_key, inner_input in zip(outer_keys, inner.inputs):
            self.alias[(self.context, id(inner_input))] = outer_key
        self.walk(inner)
        inner_keys = [self.key(t) for t in inner.outputs]
        self.context = outer_context
        for outer, inner_key in zip(node.outputs, inner_keys):
            self.alias[(self.context, id(outer))] = inner_key

    # -- the general path -------------------------------------------------------------------
    def general(self, node, has_trainable: bool) -> None:
        operation, inputs = node.operation, node.input_tensors
        differentiable = [self.key(t) in self.needs_grad for t in inputs]

        def call(xs):
            args, kwargs = node.arguments.fill_in({id(t): x for t, x in zip(inputs, xs)})
            if (isinstance(operation, keras.layers.Layer)
                    and internals.call_has_training_arg(operation)):
                kwargs = {**kwargs, "training": True}
            return operation(*args, **kwargs)

        result = self.trace(operation, call, inputs, differentiable, has_trainable,
                            extra_key=repr(node.arguments.convert(_placeholder)))
        if result is None:
            for tensor in list(inputs) + list(node.outputs):
                self.keep(tensor)
            return
        for index in result.kept_inputs:
            self.keep(inputs[index])
        for index in result.kept_outputs:
            self.keep(node.outputs[index])
        self.keep_internal(result)

    def keep_internal(self, result: gradient_trace.TracedCall, repeat: int = 1) -> None:
        for nbytes, dtype in result.internal:
            if self.override and dtype == "float32":
                nbytes = nbytes * _itemsize(self.override) // 4
            self.keep_bytes(nbytes * repeat)
        self.largest = max(self.largest, result.largest_bytes)

    def recurrent(self, layer, sequence, has_trainable: bool) -> None:
        """A recurrent layer keeps what one step of its cell keeps, once per timestep."""
        cell = layer.cell
        sizes = cell.state_size if isinstance(cell.state_size, (list, tuple)) else [
            cell.state_size]
        dtype = keras.backend.standardize_dtype(sequence.dtype)
        step = [(tuple(sequence.shape[2:]), dtype)] + [
            ((s,) if isinstance(s, int) else tuple(s), layer.compute_dtype) for s in sizes]
        timesteps = sequence.shape[1]
        grad_in = self.key(sequence) in self.needs_grad

        def call(xs):
            states = list(xs[1:])
            return cell(xs[0], states if len(states) > 1 or isinstance(
                cell.state_size, (list, tuple)) else states[0], training=True)

        specs = [keras.KerasTensor((None,) + shape, dtype=d) for shape, d in step]
        result = self.trace(cell, call, specs, [grad_in] + [True] * len(sizes),
                            has_trainable, extra_key="cell")
        if result is None or timesteps is None:
            self.keep(sequence)
            return
        kept_in, kept_out = set(result.kept_inputs), set(result.kept_outputs)
        total = _sample_bytes(specs[0].shape, specs[0].dtype) * timesteps if 0 in kept_in else 0
        for j, spec in enumerate(specs[1:]):
            # State j enters step t as input j + 1 and leaves step t - 1 as output j + 1 (a
            # built-in cell's output 0 is state 0 too): kept on either side, it is one tensor
            # per step, plus the initial (or last) state when both sides keep it.
            as_input = j + 1 in kept_in
            as_output = j + 1 in kept_out or (j == 0 and 0 in kept_out)
            if as_input or as_output:
                nbytes = _sample_bytes(spec.shape, spec.dtype)
                total += nbytes * (timesteps + int(as_input and as_output))
        self.keep_bytes(total)
        self.keep_internal(result, repeat=timesteps)

    def trace(self, operation, call, inputs, differentiable, has_trainable, extra_key=""):
        """`gradient_trace.trace_call` for one call, cached; None when it cannot be traced."""
        name = type(operation).__name__
        weights = list(getattr(operation, "weights", []))
        trainable = [w for w in getattr(operation, "trainable_weights", [])
                     if has_trainable and id(w) not in self.frozen]
        trainable_ids = {id(w) for w in trainable}
        others = [w for w in weights if id(w) not in trainable_ids]
        specs = [(tuple(t.shape[1:]), keras.backend.standardize_dtype(t.dtype)) for t in inputs]
        cache_key = (self.backend_name, type(operation), _config_key(operation), extra_key,
                     str(getattr(operation, "compute_dtype", "")), tuple(specs),
                     tuple(differentiable), tuple((tuple(w.shape), str(w.dtype),
                                                   id(w) in trainable_ids) for w in weights))
        if cache_key in _TRACES:
            result, reason = _TRACES[cache_key]
        else:
            result, reason = None, ""
            try:
                result = gradient_trace.trace_call(
                    call, specs, differentiable=differentiable, trainable=trainable,
                    non_trainable=others, backend_name=self.backend_name)
            except Exception as error:  # noqa: BLE001 - any failure: the upper bound, named
                reason = f"{name} ({type(error).__name__}: {_first_line(error)})"
            if len(_TRACES) >= _MAX_TRACES:
                _TRACES.clear()
            _TRACES[cache_key] = result, reason
        if result is None:
            self.fallbacks.add(reason)
        else:
            self.traced.add(name)
            if result.has_loop:
                self.loops.add(name)
        return result


def _placeholder(value):
    return "<tensor>" if isinstance(value, keras.KerasTensor) else value


def _config_key(operation) -> str:
    """The configuration as a cache key. Non-zero float settings (dropout and
    stochastic-depth rates, which change from block to block) are one value: they decide
    whether a mask exists, not its size; sizes are in the key through weights and shapes."""
    try:
        config = operation.get_config()
    except Exception:  # noqa: BLE001 - a config that cannot be read: the weights still differ
        return ""

    def normal(value):
        if isinstance(value, float):
            return "float>0" if value else 0.0
        return value

    return repr(sorted((k, keras.tree.map_structure(normal, v)) for k, v in config.items()
                       if k != "name"))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else ""


def saved_tensors(model: keras.Model, *, compute_dtype: str | None = None,
                  frozen: Collection[int] = (), input_shapes=None) -> SavedTensors:
    """Per-sample bytes the backward pass of `model` keeps.

    Args:
        model: a built Keras model: functional, Sequential or subclassed.
        compute_dtype: count float32 activations in this dtype instead (a float32-built
            model planned under a mixed policy); None counts the model's own dtypes.
        frozen: ids of layers and variables to treat as not trainable (a frozen backbone).
        input_shapes: for a subclassed model, the shape of one sample of each input (no
            batch axis); default: the shapes it was built with.

    Raises:
        ValueError: a tensor has an unknown non-batch dimension, or a subclassed model was
            never built and no `input_shapes` were given.
    """
    graph = internals.functional_of(model)
    if graph is None:
        raise ValueError("The Sequential model is not built: give it a `keras.Input` first "
                         "layer or call `model.build((None, H, W, C))`.")
    if not internals.is_graph_network(graph):
        return traced_saved_tensors(model, compute_dtype=compute_dtype, frozen=frozen,
                                    input_shapes=input_shapes)
    walker = _walker(compute_dtype, frozen)
    walker.model_inputs = {walker.key(t) for t in graph.inputs}
    walker.walk(graph)
    return _result(walker, graph.inputs)


def traced_saved_tensors(model: keras.Model, *, compute_dtype: str | None = None,
                         frozen: Collection[int] = (), input_shapes=None) -> SavedTensors:
    """The same, from one trace of the whole model's forward and backward (`gradient_trace`).

    What `saved_tensors` does for a subclassed model; for a functional one, the reference
    that its node-by-node walk is tested against. Arguments as `saved_tensors`.

    Raises:
        ValueError: the model cannot be traced (the message says why).
    """
    walker = _walker(compute_dtype, frozen)
    graph = internals.functional_of(model)
    if graph is not None and internals.is_graph_network(graph):
        inputs = list(graph.inputs)
    else:
        inputs = _subclassed_inputs(model, input_shapes)
        if not all(layer.built for layer in internals.flatten_layers(model)):
            # `Model.build(shape)` does not build the layers a subclassed `call` uses; a
            # symbolic call does, as the first `fit` step would.
            model(inputs[0] if len(inputs) == 1 else inputs)
    walker.model_inputs = {walker.key(t) for t in inputs}

    def call(xs):
        return model(xs[0] if len(xs) == 1 else list(xs), training=True)

    result = walker.trace(model, call, inputs, [False] * len(inputs),
                          walker.has_trainable(model))
    if result is None:
        raise ValueError(
            f"{type(model).__name__} could not be traced to find what its backward pass "
            f"keeps: {'; '.join(sorted(walker.fallbacks))}. Build it functionally, or "
            "measure it with `tfmem.probe`.")
    for index in result.kept_inputs:
        walker.keep(inputs[index])
    for index in result.kept_outputs:
        nbytes = result.output_bytes[index]
        walker.keep_bytes(nbytes * _itemsize(walker.override) // 4 if walker.override else nbytes)
    walker.keep_internal(result)
    return _result(walker, inputs)


def _walker(compute_dtype, frozen) -> _Walker:
    from tfmem import backend  # chosen once there; imported here so the planner stays TF-free

    return _Walker(compute_dtype, frozen, backend.NAME)


def _result(walker: _Walker, inputs) -> SavedTensors:
    return SavedTensors(
        saved_bytes=int(sum(walker.sizes.values())),
        largest_tensor_bytes=int(walker.largest),
        input_bytes=int(sum(_sample_bytes(t.shape, t.dtype) for t in inputs)),
        fallback_calls=tuple(sorted(walker.fallbacks)),
        traced_calls=tuple(sorted(walker.traced)),
        loop_calls=tuple(sorted(walker.loops)),
    )


def _subclassed_inputs(model, input_shapes) -> list:
    """Symbolic inputs of a subclassed model, from `input_shapes` or its build shapes."""
    if input_shapes is not None:
        if input_shapes and isinstance(input_shapes[0], int):
            input_shapes = [input_shapes]  # one shape given bare
        input_shapes = [(None,) + tuple(shape) for shape in input_shapes]
    else:
        config = model.get_build_config() if model.built else None
        if not config:
            raise ValueError(
                f"{type(model).__name__} is a subclassed model that has not been built, so "
                "its input shape is unknown. Call it once on a batch, `model.build((None, H, "
                "W, C))`, or pass `input_shape=(H, W, C)` to the planner.")
        if "input_shape" in config:
            input_shapes = [config["input_shape"]]
        else:
            input_shapes = list(config["shapes_dict"].values())
    return [keras.KerasTensor(tuple(shape), dtype="float32") for shape in input_shapes]
