"""Rematerialization at run time: named layers hooked, ranges of a graph's calls run as one
recomputed function in training calls.

What makes it exact, unlike `keras.remat`: the recomputation sees the layer's state as the
forward pass saw it (BatchNormalization's moving statistics, a Dropout's seed), and what it
would update is dropped (the forward pass updates it once per step). Each backend's half
(`backend_tf`: a recomputed custom gradient; `backend_jax`: `jax.checkpoint` over a stateless
call) is chosen here.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmem import _keras_internals as internals
from tfmem import backend
from tfmem.remat import flat_graph, segments
from tfmem.remat.graph import last_uses, node_order, range_inputs
from tfmem.remat.scope import is_training_call, recording_training, segment_call
from tfmem.remat.spec import RematSpec
from tfmem.remat.variables import SegmentVariables

_HALF = backend.half(tensorflow="tfmem.remat.backend_tf", jax="tfmem.remat.backend_jax")


def saves_memory(device_kind: str) -> bool:
    """Whether rematerialization lowers the peak on a device of this kind with this backend
    (not on JAX on a CPU, where XLA's scheduler makes it cost time only)."""
    return device_kind != "cpu" or _HALF.SAVES_ON_CPU


def check_graph(model: keras.Model, spec: RematSpec) -> None:
    """Raises the one error for segments ("full", "auto", pairs) of a subclassed model.

    Raises:
        ValueError: `model` keeps no functional graph to cut.
    """
    if not internals.is_graph_network(internals.functional_of(model)):
        raise ValueError(
            f"rematerialize={spec!r} cuts a functional graph and {model.name!r} is a "
            "subclassed model: name its blocks instead, e.g. rematerialize=['block_1', "
            "'block_2'] (a whole sub-layer is recomputed).")


_HOOKED = "_tfmem_rematerialized"


def apply(model: keras.Model, names: Sequence[str]) -> list[keras.layers.Layer]:
    """Rematerializes the layers of `model` named `names` (found at any depth); returns them.

    Raises:
        ValueError: a name that is no layer of the model (naming the layers it has).
    """
    layers = {layer.name: layer for layer in internals.flatten_layers(model)
              if layer is not model}
    missing = [name for name in names if name not in layers]
    if missing:
        raise ValueError(
            f"rematerialize: {', '.join(map(repr, missing))} "
            f"{'is not a layer' if len(missing) == 1 else 'are not layers'} of "
            f"{model.name!r}; its layers: {', '.join(layers)}")
    chosen = [layers[name] for name in names]
    for layer in chosen:
        if not getattr(layer, _HOOKED, False):
            original = layer.call
            internals.replace_call(layer, _HALF.rematerialized_call(layer, original))
            setattr(layer, _HOOKED, True)
    return chosen


def apply_spec(model: keras.Model, spec) -> None:
    """Cuts the segments of a spec (`tfmem.remat.plan`): ranges of `model`'s graph, and of
    the graphs inside its layers, at any depth. In training calls the model then runs the
    graph with those layers made part of it (`flat_graph`), so that a segment makes a
    concatenation again from pieces made in other layers; where they cannot be, layer by
    layer (a subclassed layer running its traced graph). Replaces what an earlier spec cut."""
    graph = internals.functional_of(model)
    flat = flat_graph.flattened(model, spec)
    _apply_inside(graph, () if flat is not None else tuple(spec))
    if flat is not None:
        internals.replace_graph_runner(graph, _runner(
            node_order(flat.graph), flat.graph.inputs, flat.graph.outputs,
            internals.functional_structs(graph)[1], flat.ranges, _original_runner(graph)))
    model._tfmem_spec = tuple(spec)


_INSIDE = "_tfmem_cut_inside"  # a layer with ranges cut in the graph inside it
_RUNS_ITS_GRAPH = "_tfmem_runs_its_graph"  # a subclassed layer whose call runs its traced graph


def _apply_inside(graph: keras.Model, spec: tuple) -> None:
    """`apply_spec` on `graph`, with `spec`'s paths relative to it."""
    for node in node_order(graph):
        layer = node.operation
        name = layer.name
        inner_spec = tuple((path[len(name) + 1:], ranges) for path, ranges in spec
                           if path == name or path.startswith(name + "/"))
        if not inner_spec and not getattr(layer, _INSIDE, False):
            continue
        inner = segments.inner_graph(layer, node)
        if inner is None:
            continue
        _apply_inside(inner, inner_spec)
        setattr(layer, _INSIDE, bool(inner_spec))
        if (inner is not internals.functional_of(layer)
                and not getattr(layer, _RUNS_ITS_GRAPH, False)):
            internals.replace_call(layer, _running_traced_graph(layer, layer.call, inner))
            setattr(layer, _RUNS_ITS_GRAPH, True)
    apply_ranges(graph, dict(spec).get("", ()))


def _running_traced_graph(layer, original, inner):
    """`layer.call` that, in training calls, runs the graph traced from it (`inner`), so
    that the ranges cut in that graph are recomputed; otherwise the layer's own call."""

    def call(*args, **kwargs):
        if internals.any_symbolic(args, kwargs) or not is_training_call() or not getattr(
                layer, _INSIDE, False):
            return original(*args, **kwargs)
        kwargs.pop("training", None)
        return inner(list(args) if len(args) > 1 else args[0], training=True)

    return call


def apply_ranges(graph: keras.Model, ranges: Sequence[tuple[int, int]]) -> None:
    """Rematerializes `(start, stop)` ranges of a functional graph's calls (in the order
    Keras runs them, `graph.node_order`): each range runs as one recomputed function in
    training calls. Replaces any ranges set before; () removes them.
    """
    original = _original_runner(graph)
    if not ranges:
        internals.replace_graph_runner(graph, original)
        return
    internals.replace_graph_runner(graph, _runner(
        node_order(graph), graph.inputs, graph.outputs, internals.functional_structs(graph)[1],
        ranges, original))


def _original_runner(graph: keras.Model):
    """The graph runner `graph` was built with (kept the first time it is replaced, when its
    `call` starts recording its `training` argument)."""
    original = getattr(graph, "_tfmem_graph_runner", None)
    if original is None:
        original = internals.graph_runner(graph)
        graph._tfmem_graph_runner = original
        internals.replace_call(graph, recording_training(graph.call))
    return original


def _runner(nodes, graph_inputs, graph_outputs, outputs_struct, ranges, original):
    """A graph runner over `nodes` (from `graph_inputs` to `graph_outputs`, packed as
    `outputs_struct`) that runs each of `ranges` as one recomputed function in training
    calls, and `original` otherwise."""
    units = _units(nodes, graph_outputs, ranges)
    first = _weighted_after_ranges(units)

    def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
        flat = keras.tree.flatten(inputs)
        if (call_fn is not None or internals.any_symbolic(flat, {})
                or not is_training_call()):
            return original(inputs, operation_fn=operation_fn, call_fn=call_fn)
        values = {id(x): y for x, y in zip(graph_inputs, flat)}
        for unit in units:
            if len(unit) == 1:
                _run_node(unit[0], values, operation_fn,
                          _HALF.weights_first if id(unit[0]) in first else None)
                continue
            inside, unit_inputs, joins, unit_outputs, variables = unit

            def run(*tensors, inside=inside, unit_inputs=unit_inputs, joins=joins,
                    unit_outputs=unit_outputs):
                local = {id(x): y for x, y in zip(unit_inputs, tensors)}
                for tensor, axis, pieces in joins:  # made again here from their pieces
                    local[id(tensor)] = keras.ops.concatenate(
                        [local[id(piece)] for piece in pieces], axis=axis)
                for node in inside:
                    _run_node(node, local, operation_fn)
                return [local[id(t)] for t in unit_outputs]

            results = _HALF.rematerialized_call(variables, run)(
                *[values[id(t)] for t in unit_inputs])
            values.update({id(t): y for t, y in zip(unit_outputs, results)})
        return keras.tree.pack_sequence_as(outputs_struct,
                                           [values[id(x)] for x in graph_outputs])

    return run_through_graph


def _units(nodes, graph_outputs, ranges) -> list[tuple]:
    """What a runner runs: `(nodes, inputs, joins, outputs, variables)` per range, `(node,)`
    per plain call."""
    starts = {start: stop for start, stop in ranges}
    units = []
    position = 0
    taken = range_inputs(nodes, ranges)
    last_use = last_uses(nodes, ranges, taken)
    wanted = {id(t) for t in graph_outputs}
    made_at = {id(t): p for p, node in enumerate(nodes) for t in node.outputs}
    # The pieces later ranges make their concatenations from, passed through every range in
    # between (as the same buffer): each piece then has one user per range, and the backward
    # pass adds its gradients up range by range. Taken by every later range directly, its
    # gradients would all be held until the last one arrived (TensorFlow adds a tensor's
    # gradients once all are made): as many bytes again as the stacks not kept.
    later_pieces: dict = {}
    threaded = {}
    for start, _ in sorted(ranges, reverse=True):
        threaded[start] = [t for key, t in later_pieces.items()
                           if made_at.get(key, -1) < start]
        later_pieces.update((id(piece), piece) for _, _, pieces in taken[start][1]
                            for piece in pieces)
    while position < len(nodes):
        stop = starts.get(position)
        if stop is None:
            units.append((nodes[position],))
            position += 1
            continue
        inside = nodes[position:stop + 1]
        made = {id(t): t for node in inside for t in node.outputs}
        inputs, joins = taken[position]
        outputs = [t for key, t in made.items()
                   if last_use.get(key, -1) > stop or key in wanted]
        passed = threaded[position]  # made before the range, so none of `outputs`
        inputs = list({id(t): t for t in list(inputs) + passed}.values())
        outputs = outputs + passed
        units.append((inside, inputs, joins, outputs,
                      SegmentVariables([node.operation for node in inside])))
        position = stop + 1
    return units


def _weighted_after_ranges(units) -> set:
    """Ids of the plain calls whose weights' gradients a range's recomputation is to wait
    for: on each path from a range's outputs, the first call with trainable weights (a
    head), where no other call reads its inputs and it reads none twice. The range waits
    for its outputs' gradients, which such a call then makes after its weights' (through
    the calls without weights in between), so that its output's gradient, which its
    weights' gradients read, is freed before the range is recomputed."""
    readers: dict = {}
    for unit in units:
        for node in unit[:1] if len(unit) == 1 else unit[0]:
            for tensor in node.input_tensors:
                readers.setdefault(id(tensor), []).append(node)
    plain = {id(unit[0]) for unit in units if len(unit) == 1}
    chosen, seen = set(), set()
    todo = [node for unit in units if len(unit) > 1 for t in unit[3]
            for node in readers.get(id(t), ())]
    while todo:
        node = todo.pop()
        if id(node) in seen or id(node) not in plain:
            continue
        seen.add(id(node))
        if not getattr(node.operation, "trainable_weights", None):
            todo.extend(reader for t in node.outputs for reader in readers.get(id(t), ()))
        elif all(len(readers[id(t)]) == 1 for t in node.input_tensors
                 if "float" in str(t.dtype)):  # a mask or ids may be read by many
            chosen.add(id(node))
    return chosen


def _run_node(node, values: dict, operation_fn, wrap=None) -> None:
    args, kwargs = node.arguments.fill_in(values)
    call = segment_call(node, operation_fn(node.operation))
    if wrap is not None:
        call = wrap(call)
    outputs = call(*args, **kwargs)
    for x, y in zip(node.outputs, keras.tree.flatten(outputs)):
        values[id(x)] = y
