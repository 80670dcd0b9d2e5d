"""Rematerialization of chosen layers: their activations are recomputed in the backward pass.

A rematerialized layer (a block, a nested model, any layer) keeps only its inputs for the
backward pass and runs its forward again there, so the activations inside it are not held
between the two passes. What makes it exact, unlike `keras.remat`:

- the recomputation sees the layer's state as the forward pass saw it (BatchNormalization's
  moving statistics, the seed of a Dropout), so it draws the same masks;
- what the recomputation would update is dropped: BatchNormalization's statistics are
  updated once per step, by the forward pass.

The backend's half (`remat_tf`: a recomputed custom gradient; `remat_jax`: `jax.checkpoint` over a
stateless call) is chosen in `tfmem.backend`. Only training calls are rematerialized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import keras

from tfmem import _keras_internals as internals

_HOOKED = "_tfmem_rematerialized"


def check_setting(value):
    """`rematerialize`: None, "full", "auto", or a list of layer names and `(first, last)`
    pairs of layer names; returned as None, the string, or a tuple (pairs as tuples)."""
    from tfmem.memory.segments import Ranges

    if value is None or isinstance(value, Ranges) or (
            isinstance(value, str) and value in ("full", "auto")):
        return value
    if isinstance(value, dict) and set(value) == {"segments"}:  # chosen ranges, from a config
        return Ranges(tuple((path, tuple(tuple(span) for span in spans))
                            for path, spans in value["segments"]))

    def item(entry):
        if isinstance(entry, str) and entry:
            return entry
        if (isinstance(entry, (list, tuple)) and len(entry) == 2
                and all(isinstance(name, str) and name for name in entry)):
            return tuple(entry)
        return None

    items = ([item(entry) for entry in value]
             if isinstance(value, Sequence) and not isinstance(value, str) else [])
    if not items or None in items:
        raise ValueError(
            f'`rematerialize` must be None, "full", "auto", or a list of layer names and '
            f"(first, last) layer pairs, got {value!r}; e.g. rematerialize=['block_3', "
            "('conv_4', 'add_4')] (model.summary() lists the names)")
    return tuple(items)


def to_config(setting):
    """A setting as JSON: the string, a list (pairs as lists), or `{"segments": ...}`."""
    from tfmem.memory.segments import Ranges

    if isinstance(setting, Ranges):
        return {"segments": [[path, [list(span) for span in spans]]
                             for path, spans in setting.ranges]}
    if isinstance(setting, str):
        return setting
    return [item if isinstance(item, str) else list(item) for item in setting]


def names_of(flag: str | None):
    """`--rematerialize full`, `auto`, or `down0_dense, conv_4:add_4` (a layer name, or
    `first:last` for a range) → the setting; None when the flag is empty or `none`."""
    if flag is not None and flag.strip() in ("full", "auto"):
        return flag.strip()
    if flag is not None and flag.strip().lower() == "none":
        return None
    items = []
    for entry in (flag or "").split(","):
        entry = entry.strip()
        if ":" in entry:
            pair = tuple(part.strip() for part in entry.split(":"))
            if len(pair) != 2 or not all(pair):
                raise ValueError(
                    f"rematerialize: {entry!r} is neither a layer name nor a first:last pair "
                    "of layer names; write e.g. conv_4:add_4 (model.summary() lists the names)")
            items.append(pair)
        elif entry:
            items.append(entry)
    return check_setting(items) if items else None


def check_graph(model: keras.Model, setting) -> None:
    """Raises the one error for segments ("full", "auto", pairs) of a subclassed model.

    Raises:
        ValueError: `model` keeps no functional graph to cut.
    """
    if not internals.is_graph_network(internals.functional_of(model)):
        raise ValueError(
            f"rematerialize={setting!r} cuts a functional graph and {model.name!r} is a "
            "subclassed model: name its blocks instead, e.g. rematerialize=['block_1', "
            "'block_2'] (a whole sub-layer is recomputed).")


def layer_names(setting) -> tuple[str, ...]:
    """The plain layer names of a setting (each rematerialized as a whole layer)."""
    if not isinstance(setting, tuple):
        return ()
    return tuple(item for item in setting if isinstance(item, str))


def layer_pairs(setting) -> tuple[tuple[str, str], ...]:
    """The `(first, last)` pairs of a setting (each rematerialized as one segment)."""
    if not isinstance(setting, tuple):
        return ()
    return tuple(item for item in setting if not isinstance(item, str))


def apply(model: keras.Model, names: Sequence[str]) -> list[keras.layers.Layer]:
    """Rematerializes the layers of `model` named `names` (found at any depth); returns them.

    Raises:
        ValueError: a name that is no layer of the model (naming the layers it has).
    """
    from tfmem.backend import rematerialized_call

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
            layer.call = rematerialized_call(layer, original)  # this instance only
            setattr(layer, _HOOKED, True)
    return chosen


def layers_within(segment) -> list[keras.layers.Layer]:
    """The layers a rematerialized call runs: a layer and those inside it, or a graph
    segment's (`_Variables`)."""
    if isinstance(segment, _Variables):
        return segment.layers
    return [segment, *internals.flatten_layers(segment)]


class _Variables:
    """The variables of a segment's layers, as `rematerialized_call` reads a layer's."""

    def __init__(self, layers):
        names = [getattr(layer, "name", "?") for layer in layers]
        self.description = (f"the segment of layers {names[0]!r} to {names[-1]!r}"
                            if names else "an empty segment")
        self.layers = []  # the layers, and those inside them
        for layer in layers:
            if isinstance(layer, keras.layers.Layer):
                self.layers.extend([layer, *internals.flatten_layers(layer)])
        seen: set = set()
        self.trainable_variables, self.non_trainable_variables = [], []
        for layer in layers:
            for attribute in ("trainable_variables", "non_trainable_variables"):
                for variable in getattr(layer, attribute, []):
                    if id(variable) not in seen:
                        seen.add(id(variable))
                        getattr(self, attribute).append(variable)


def apply_spec(model: keras.Model, spec) -> None:
    """Cuts the segments of a spec (`tfmem.memory.remat_plan`): ranges of `model`'s graph,
    and of the graphs inside its layers, at any depth. In training calls the model then runs
    the graph with those layers made part of it (`tfmem.memory.flat_graph`), so that a
    segment makes a concatenation again from pieces made in other layers; where they cannot
    be, layer by layer (a subclassed layer running its traced graph). Replaces what an
    earlier spec cut."""
    from tfmem.memory import flat_graph
    from tfmem.memory.graph_walk import node_order

    graph = internals.functional_of(model)
    flat = flat_graph.flattened(model, spec)
    _apply_inside(graph, () if flat is not None else tuple(spec))
    if flat is not None:
        internals.replace_graph_runner(graph, _runner(
            node_order(flat.graph), flat.graph.inputs, flat.graph.outputs,
            internals.functional_structs(graph)[1], flat.ranges, _original_runner(graph)))
    model._tfmem_spec = tuple(spec)


_INSIDE = "_tfmem_cut_inside"  # a layer with ranges cut in the graph inside it
_THROUGH = "_tfmem_runs_its_graph"  # a subclassed layer whose call runs its traced graph


def _apply_inside(graph: keras.Model, spec: tuple) -> None:
    """`apply_spec` on `graph`, with `spec`'s paths relative to it."""
    from tfmem.memory import segments
    from tfmem.memory.graph_walk import node_order

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
        if inner is not internals.functional_of(layer) and not getattr(layer, _THROUGH, False):
            layer.call = _through(layer, layer.call, inner)  # this instance only
            setattr(layer, _THROUGH, True)
    apply_ranges(graph, dict(spec).get("", ()))


def _through(layer, original, inner):
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
    Keras runs them, `tfmem.memory.graph_walk.node_order`): each range runs as one
    recomputed function in training calls. Replaces any ranges set before; () removes them.
    """
    from tfmem.memory.graph_walk import node_order

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
        graph.call = _telling_training(graph.call)  # this instance only
    return original


def _runner(nodes, graph_inputs, graph_outputs, outputs_struct, ranges, original):
    """A graph runner over `nodes` (from `graph_inputs` to `graph_outputs`, packed as
    `outputs_struct`) that runs each of `ranges` as one recomputed function in training
    calls, and `original` otherwise."""
    from keras import tree

    from tfmem.backend import rematerialized_call
    from tfmem.memory.graph_walk import last_uses, range_inputs

    starts = {start: stop for start, stop in ranges}
    units = []  # (nodes, inputs, joins, outputs, variables) per range; (node,) per plain call
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
                      _Variables([node.operation for node in inside])))
        position = stop + 1

    def run_through_graph(inputs, operation_fn=lambda op: op, call_fn=None):
        flat = tree.flatten(inputs)
        if (call_fn is not None or internals.any_symbolic(flat, {})
                or not is_training_call()):
            return original(inputs, operation_fn=operation_fn, call_fn=call_fn)
        values = {id(x): y for x, y in zip(graph_inputs, flat)}
        for unit in units:
            if len(unit) == 1:
                _run_node(unit[0], values, operation_fn)
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

            results = rematerialized_call(variables, run)(
                *[values[id(t)] for t in unit_inputs])
            values.update({id(t): y for t, y in zip(unit_outputs, results)})
        return tree.pack_sequence_as(outputs_struct, [values[id(x)] for x in graph_outputs])

    return run_through_graph


# The `training` argument of the functional calls now running, innermost last: JAX's trainer
# calls a model through `stateless_call`, which runs `call` without Keras's call context.
_GRAPH_TRAINING: list = []


def _telling_training(call):
    """A functional model's `call` that records its `training` argument for its graph runner."""

    def telling(*args, **kwargs):
        training = kwargs.get("training", args[1] if len(args) > 1 else None)
        _GRAPH_TRAINING.append(training if training is not None
                               else internals.call_training())
        try:
            return call(*args, **kwargs)
        finally:
            _GRAPH_TRAINING.pop()

    return telling


def _run_node(node, values: dict, operation_fn) -> None:
    args, kwargs = node.arguments.fill_in(values)
    call = operation_fn(node.operation)
    if _SEGMENT_CALLS:
        call = _SEGMENT_CALLS[-1](node, call)
    outputs = call(*args, **kwargs)
    for x, y in zip(node.outputs, keras.tree.flatten(outputs)):
        values[id(x)] = y


# While a graph segment runs, innermost last: how its calls run (the backend's
# `wrap(node, call)`: `remat_tf` orders the gradients of layers with weights, and reads
# shapes from the forward pass's tensors).
_SEGMENT_CALLS: list = []


@contextlib.contextmanager
def segment_calls(wrap):
    """Inside, a graph segment's calls run as `wrap(node, call)(*args, **kwargs)`."""
    _SEGMENT_CALLS.append(wrap)
    try:
        yield
    finally:
        _SEGMENT_CALLS.pop()


_AS_WRITTEN = []  # non-empty while the planner measures layers without rematerialization


@contextlib.contextmanager
def as_written():
    """Inside, rematerialized layers run as written: the planner measures what each keeps
    inside, and counts the rematerialization itself."""
    _AS_WRITTEN.append(True)
    try:
        yield
    finally:
        _AS_WRITTEN.pop()


def is_training_call() -> bool:
    """Whether the layer call now running is a training one to rematerialize (Keras's call
    context, else the `training` of the functional call running), and not one the planner
    measures as written."""
    training = internals.call_training()
    if training is None and _GRAPH_TRAINING:
        training = _GRAPH_TRAINING[-1]
    return not _AS_WRITTEN and bool(training)
