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
import weakref
from collections.abc import Collection

import keras

from tfmem import _keras_internals as internals
from tfmem import backend
from tfmem.memory import gradient_trace, xla_rules
from tfmem.memory.graph_walk import Walker, itemsize, sample_bytes
from tfmem.remat import flat_graph, segments
from tfmem.remat.graph import last_uses, node_order
from tfmem.remat.scope import measured_as_written
from tfmem.remat.segments import GraphFacts


@dataclasses.dataclass(frozen=True)
class SavedTensors:
    """What one sample costs in the activations a training step keeps for backward.

    Attributes:
        saved_bytes: bytes of the distinct tensors the backward pass reads, for one sample.
        largest_tensor_bytes: bytes of the largest single tensor of the forward pass (one sample).
        workspace_bytes: the largest transient a step needs besides the kept tensors and
            the largest recomputed range's (`recomputed_bytes`), for one sample. A call's
            own is the largest of its output's gradient beside its inputs' (at most the
            output's size again; `Walker.gradients`) and its own transient (its gradients and
            temporaries, from its traced graph: `gradient_trace.transient_bytes`); a call
            inside a rematerialized range runs beside that range's tensors, recomputed, one
            outside beside none.
        workspace_fixed_bytes: the part of the backward's largest transient that does not
            grow with the batch (`xla_rules`: a grouped convolution's kernel gradient on
            XLA:CPU).
        heap_scratch_bytes: what the largest grouped convolution's XLA call (Keras's
            TensorFlow backend) leaves in glibc's default heap on a CPU, for one sample: kept
            through the step beside everything else, where the heap keeps freed blocks.
        input_bytes: bytes of one sample of the model's inputs, as fed.
        fallback_calls: calls counted as keeping their inputs and outputs (an upper bound),
            each with the reason the general path failed on it.
        traced_calls: class names of the calls measured by the general path (`gradient_trace`).
        loop_calls: class names of traced calls with loops whose intermediates are not counted.
        segments: `(name, bytes per sample it keeps inside)` of each rematerialized layer;
            those bytes are not in `saved_bytes`: one such layer at a time holds them again,
            while it is recomputed in the backward pass.
        kept_output_bytes: bytes per sample of the model's outputs among the kept tensors
            (a softmax's output, which its backward reads).
        bounded_bytes: `(micro-batch, bytes per sample)` of the kept tensors XLA holds only at
            micro-batches up to that one (`Walker.keep_below`), not in `saved_bytes`.
        lane_tensors: for a step XLA compiles for a TPU, `((sample shape, itemsize), bytes
            per sample)` of the kept tensors whose shapes are known, summed by layout: what
            its tiles pad (`tpu_layout`); empty for other targets.
    """

    saved_bytes: int
    largest_tensor_bytes: int
    input_bytes: int
    workspace_bytes: int = 0
    fallback_calls: tuple[str, ...] = ()
    traced_calls: tuple[str, ...] = ()
    loop_calls: tuple[str, ...] = ()
    segments: tuple[tuple[str, int], ...] = ()
    kept_output_bytes: int = 0
    workspace_fixed_bytes: int = 0
    heap_scratch_bytes: int = 0
    bounded_bytes: tuple = ()
    lane_tensors: tuple = ()

    @property
    def recomputed_bytes(self) -> int:
        """What the largest rematerialized layer keeps inside while it is recomputed."""
        return max((nbytes for _, nbytes in self.segments), default=0)


def saved_tensors(model: keras.Model, *, compute_dtype: str | None = None,
                  frozen: Collection[int] = (), input_shapes=None,
                  recomputed: Collection[int] = (), ranges=(),
                  inner_graphs: dict | None = None,
                  device_kind: str | None = None) -> SavedTensors:
    """Per-sample bytes the backward pass of `model` keeps.

    Args:
        model: a built Keras model: functional, Sequential or subclassed.
        compute_dtype: count float32 activations in this dtype instead (a float32-built
            model planned under a mixed policy); None counts the model's own dtypes.
        frozen: ids of layers and variables to treat as not trainable (a frozen backbone).
        input_shapes: for a subclassed model, the shape of one sample of each input (no
            batch axis); default: the shapes it was built with.
        recomputed: ids of rematerialized layers (`AccumModel(rematerialize=...)`) of a
            functional model.
        ranges: rematerialized ranges of the functional graph's calls, and of the graphs
            inside its layers (a spec of `tfmem.remat.plan`).
        inner_graphs: `id(layer) → graph` of the subclassed layers `ranges` cuts inside.
        device_kind: the kind of device the step runs on ("cpu", "gpu", "tpu"): on JAX,
            the XLA target whose rules apply (`xla_rules`); None applies none of them.

    Raises:
        ValueError: a tensor has an unknown non-batch dimension, or a subclassed model was
            never built and no `input_shapes` were given.
    """
    graph = internals.functional_of(model)
    if graph is None:
        raise ValueError("The Sequential model is not built: give it a `keras.Input` first "
                         "layer or call `model.build((None, H, W, C))`.")
    if not internals.is_graph_network(graph):
        called = _called_as_graph(model, input_shapes) if recomputed else None
        if called is not None:  # its named layers keep their inputs: walked as a graph
            walker = _walked(called, compute_dtype, frozen, recomputed, (), None,
                             device_kind=device_kind)
            return _result(walker, called.inputs, called.outputs)
        return traced_saved_tensors(model, compute_dtype=compute_dtype, frozen=frozen,
                                    input_shapes=input_shapes, device_kind=device_kind)
    flat = flat_graph.flattened(model, ranges) if ranges else None
    if flat is not None:  # the layers cut inside made part of the graph, as AccumModel runs
        walker = _walked(flat.graph, compute_dtype, frozen, recomputed, (("", flat.ranges),),
                         None, flat.paths, device_kind=device_kind)
        return _result(walker, flat.graph.inputs, flat.graph.outputs)
    walker = _walked(graph, compute_dtype, frozen, recomputed, ranges, inner_graphs,
                     device_kind=device_kind)
    return _result(walker, graph.inputs, graph.outputs)


def saved_tensors_facts(model: keras.Model, *, compute_dtype: str | None = None,
                        frozen: Collection[int] = (), ranges=(),
                        inner_graphs: dict | None = None) -> GraphFacts:
    """What each top-level call of a functional `model` keeps, with the cuts `ranges` makes
    inside its layers: where rematerialization may cut (`tfmem.remat.segments`).
    Arguments as `saved_tensors`."""
    graph = internals.functional_of(model)
    return _graph_facts(_walked(graph, compute_dtype, frozen, (), ranges, inner_graphs), graph)


def _graph_facts(walker: Walker, graph) -> GraphFacts:
    """`GraphFacts` of `graph` from `walker`, which has just walked it as written."""
    nodes = node_order(graph)
    produced_at = {id(t): p for p, node in enumerate(nodes) for t in node.outputs}
    last_use = last_uses(nodes)
    sizes = dict(walker.sizes)
    input_keys, output_keys = [], []
    for node in nodes:
        for tensors, keys in ((node.input_tensors, input_keys), (node.outputs, output_keys)):
            keys.append(frozenset(walker.key(t) for t in tensors))
            for tensor in tensors:
                sizes.setdefault(walker.key(tensor),
                                 sample_bytes(tensor.shape, walker.dtype_of(tensor)))
    # Bytes crossing the cut after each call: a tensor made at m and last used at u > m
    # crosses the cuts after m .. u - 1 (graph inputs cross from the start).
    crossing = [0] * (len(nodes) + 1)
    tensors = {id(t): t for node in nodes for t in node.input_tensors}
    for tensor_id, tensor in tensors.items():
        made, used = produced_at.get(tensor_id, -1), last_use[tensor_id]
        if used > made:
            nbytes = sample_bytes(tensor.shape, walker.dtype_of(tensor))
            crossing[max(made, 0)] += nbytes
            crossing[used] -= nbytes
    live = []
    running = 0
    for p in range(len(nodes)):
        running += crossing[p]
        live.append(running)
    return GraphFacts(
        names=tuple(node.operation.name for node in nodes),
        node_keys=tuple(walker.node_keys),
        input_keys=tuple(input_keys),
        output_keys=tuple(output_keys),
        sizes=sizes,
        live=tuple(live),
        flops=tuple(segments.flops_of(node, walker.inner_graphs) for node in nodes),
        inner_peaks=tuple(walker.inner_peaks),
        nodes=tuple(nodes),
        tensor_keys={id(t): walker.key(t) for node in nodes
                     for t in list(node.input_tensors) + list(node.outputs)},
    )


def traced_saved_tensors(model: keras.Model, *, compute_dtype: str | None = None,
                         frozen: Collection[int] = (), input_shapes=None,
                         device_kind: str | None = None) -> SavedTensors:
    """The same, from one trace of the whole model's forward and backward (`gradient_trace`).

    What `saved_tensors` does for a subclassed model; for a functional one, the reference
    that its node-by-node walk is tested against. Arguments as `saved_tensors`.

    Raises:
        ValueError: the model cannot be traced (the message says why).
    """
    walker = _walker(compute_dtype, frozen, device_kind=device_kind)
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

    with measured_as_written():  # planned as if not rematerialized (no graph to cut)
        result = walker.trace(model, call, inputs, [False] * len(inputs),
                              walker.has_trainable(model))
    if result is None:
        raise ValueError(
            f"{type(model).__name__} could not be traced to find what its backward pass "
            f"keeps: {'; '.join(sorted(walker.fallbacks))}. Build it functionally, or "
            "measure it with `tfmem.probe`.")
    for index in result.kept_inputs:
        walker.keep(inputs[index])
    kept_outputs = 0
    for index in result.kept_outputs:
        nbytes = result.output_bytes[index]
        nbytes = nbytes * itemsize(walker.override) // 4 if walker.override else nbytes
        walker.keep_bytes(nbytes)
        kept_outputs += nbytes
    walker.keep_internal(result)
    return dataclasses.replace(_result(walker, inputs), kept_output_bytes=kept_outputs)


def _walker(compute_dtype, frozen, recomputed=(), ranges=(), inner_graphs=None,
            device_kind=None) -> Walker:
    trace_call = backend.choose(tensorflow=gradient_trace.trace_call_tensorflow,
                                jax=gradient_trace.trace_call_jax)
    # On JAX the step is one XLA program compiled for the plan's device kind.
    return Walker(compute_dtype, frozen, trace_call, recomputed, ranges, inner_graphs,
                  target=backend.choose(tensorflow=None, jax=device_kind))


def _walked(graph, compute_dtype, frozen, recomputed, ranges, inner_graphs,
            node_paths=None, device_kind=None) -> Walker:
    """A walker that has walked the functional `graph` node by node."""
    walker = _walker(compute_dtype, frozen, recomputed, ranges, inner_graphs, device_kind)
    walker.node_paths = node_paths or {}
    walker.model_inputs = {walker.key(t) for t in graph.inputs}
    with measured_as_written():  # what each layer keeps inside; the walk counts the recompute
        walker.walk(graph)
    return walker


def _result(walker: Walker, inputs, outputs=()) -> SavedTensors:
    recomputed = max((nbytes for _, nbytes in walker.segments), default=0)
    # The backward's largest call runs beside the kept tensors and, inside a recomputed
    # range, that range's own: beyond the largest range, the larger of the two.
    backward = max([walker.workspace] + walker.recompute_peaks)
    if walker.backward_peaks and not walker.segments:
        # Each call's workspace beside what it and the calls before it keep.
        backward = max(max(walker.backward_peaks) - walker.kept_bytes(), 0)
    bounded: dict = {}
    for key, micro_batch in walker.bounded.items():
        if key in walker.sizes:  # not recomputed
            bounded[micro_batch] = bounded.get(micro_batch, 0) + walker.sizes[key]
    return SavedTensors(
        saved_bytes=int(walker.kept_bytes()),
        bounded_bytes=tuple(sorted(bounded.items())),
        largest_tensor_bytes=int(max(walker.largest, walker.largest_anywhere)),
        workspace_bytes=int(backward - recomputed),
        input_bytes=int(sum(sample_bytes(t.shape, t.dtype) for t in inputs)),
        fallback_calls=tuple(sorted(walker.fallbacks)),
        traced_calls=tuple(sorted(walker.traced)),
        loop_calls=tuple(sorted(walker.loops)),
        segments=tuple(walker.segments),
        kept_output_bytes=int(sum(walker.sizes.get(walker.key(t), 0)
                                  for t in {id(t): t for t in outputs}.values())),
        workspace_fixed_bytes=int(walker.fixed_transient),
        heap_scratch_bytes=int(walker.heap_scratch),
        lane_tensors=_lane_tensors(walker),
    )


def _lane_tensors(walker: Walker) -> tuple:
    """`SavedTensors.lane_tensors` of what `walker` kept."""
    if not xla_rules.holds("lane_padding", walker.target):
        return ()
    totals: dict = {}
    for key, nbytes in walker.sizes.items():
        layout = walker.layouts.get(key)
        if layout is not None and nbytes:
            totals[layout] = totals.get(layout, 0) + nbytes
    return tuple(sorted(totals.items()))


def model_outputs(model: keras.Model, input_shapes=None) -> tuple[list, list | None]:
    """The model's symbolic outputs (with a batch axis) and their names: a functional
    graph's own, else from a symbolic call of a subclassed model; `([], None)` when they
    cannot be read."""
    graph = internals.functional_of(model)
    if graph is not None and internals.is_graph_network(graph):
        return list(graph.outputs), list(getattr(graph, "output_names", None) or ()) or None
    try:
        inputs = _subclassed_inputs(model, input_shapes)
        spec = model.compute_output_spec(inputs[0] if len(inputs) == 1 else inputs)
    except Exception:  # noqa: BLE001 - a call that does not run symbolically: not counted
        return [], None
    return keras.tree.flatten(spec), None


# A subclassed model's call traced as a graph, by model: `(input shapes, graph)`.
_CALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _called_as_graph(model: keras.Model, input_shapes) -> keras.Model | None:
    """A subclassed model's call as a functional graph of the same layers (what lets the
    layers it rematerializes by name be planned as keeping only their inputs), traced once
    per input shapes; None when it has weights of its own or does not trace so
    (`segments.call_graph`)."""
    if internals.own_weights(model):
        return None
    inputs = [keras.Input(tuple(t.shape[1:]), dtype=t.dtype)
              for t in _subclassed_inputs(model, input_shapes)]
    shapes = tuple((tuple(x.shape), x.dtype) for x in inputs)
    if model in _CALLED and _CALLED[model][0] == shapes:
        return _CALLED[model][1]
    if not model.built:  # as the first `fit` step would build it
        model(inputs[0] if len(inputs) == 1 else inputs)
    graph = segments.call_graph(model, inputs, (inputs[0] if len(inputs) == 1 else inputs,))
    _CALLED[model] = shapes, graph
    return graph


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
