"""A model's graph with the layers a rematerialization spec cuts inside made part of it.

A spec (`tfmem.remat.plan`) cuts ranges in the model's graph and in the graphs inside
its layers. Run as written, a layer cut inside is a wall: what enters it or leaves it is one
tensor, kept whole across the passes, even where it is a concatenation whose pieces are kept
anyway (a dense block's output stack, a skip connection into the next block). Here those
layers are replaced by their calls, as deep as the spec goes: one graph of the same layers
and Keras ops, in which a segment makes any concatenation again from its pieces
(`graph.range_inputs`), wherever the pieces were made. The planner walks this graph and
`AccumModel` runs it, so both see the same segments.

A layer is made part of the graph only where that changes nothing its call would do: its
inputs enter its graph in the dtype they have (no autocast, no conversion by a nested model),
and it is not itself inside a range of the graph around it. Otherwise the spec is planned and
run as written, layer by layer.
"""

from __future__ import annotations

import dataclasses
import weakref

import keras

from tfmem import _keras_internals as internals
from tfmem.remat import segments
from tfmem.remat.graph import call_again, node_order, set_node_order
from tfmem.remat.scope import measured_as_written


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """Calls of a model's layers on symbolic tensors, as a functional model's graph reads
    (`inputs`, `outputs`, `name`; its calls in `graph.node_order`). Not a
    `keras.Model`: the layers of several graphs may share names."""

    name: str
    inputs: list
    outputs: list


@dataclasses.dataclass(frozen=True)
class Flat:
    """A model's graph with the layers a spec cuts inside made part of it.

    Attributes:
        graph: the calls of the model's own layers and Keras ops (a `Graph`).
        ranges: the spec's ranges, as `(start, stop)` ranges of `graph`'s calls.
        paths: `id(node) → the path of the graph the call comes from` ("" the model's own,
            "backbone/dense" the graph inside layer `dense` of layer `backbone`).
    """

    graph: Graph
    ranges: tuple
    paths: dict


# By model: `{spec: Flat or None}`; an entry goes with its model.
_FLAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flattened(model: keras.Model, spec) -> Flat | None:
    """`model`'s graph with every layer `spec` cuts inside made part of it; None when the
    spec cuts inside no layer, or one of them cannot be made part of it (above)."""
    spec = tuple((path, tuple(tuple(span) for span in spans)) for path, spans in spec)
    inlined = {"/".join(path.split("/")[:depth]) for path, spans in spec if path and spans
               for depth in range(1, len(path.split("/")) + 1)}
    graph = internals.functional_of(model)
    if not inlined or not internals.is_graph_network(graph):
        return None
    cache = _FLAT.setdefault(model, {})
    if spec not in cache:
        cache[spec] = _build(model, graph, spec, inlined)
    return cache[spec]


def _build(model, graph, spec, inlined) -> Flat | None:
    inputs = [keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype) for t in graph.inputs]
    values = {id(t): x for t, x in zip(graph.inputs, inputs)}
    order: list = []
    paths: dict = {}
    ranges: list = []
    with measured_as_written():
        if not _inline(graph, "", dict(spec), inlined, values, order, paths, ranges):
            return None
    outputs = [values[id(t)] for t in keras.tree.flatten(graph.outputs)]
    if not _all_reach(order, outputs):
        return None  # a call whose outputs reach no output: run as written, it still runs
    flat = Graph(name=f"{model.name}_flat", inputs=inputs, outputs=outputs)
    set_node_order(flat, order)
    return Flat(graph=flat, ranges=tuple(sorted(ranges)), paths=paths)


def _all_reach(order, outputs) -> bool:
    """Whether every call of `order` makes a tensor that an output is made from."""
    needed = {id(t) for t in outputs}
    for node in reversed(order):
        if not any(id(t) in needed for t in node.outputs):
            return False
        needed.update(id(t) for t in node.input_tensors)
    return True


def _inline(graph, path, spec, inlined, values, order, paths, ranges) -> bool:
    """Calls `graph`'s calls again on `values` (by id of `graph`'s tensors), the layers in
    `inlined` through their own graphs; appends the calls made to `order` and the ranges of
    `graph` (`spec[path]`), as positions of `order`, to `ranges`. False when a layer of
    `inlined` cannot be made part of it."""
    nodes = node_order(graph)
    own = spec.get(path, ())
    in_range = {p for start, stop in own for p in range(start, stop + 1)}
    first, last = {}, {}
    for position, node in enumerate(nodes):
        layer = node.operation
        inner_path = f"{path}/{layer.name}" if path else layer.name
        first[position] = len(order)
        if inner_path in inlined:
            inner = segments.inner_graph(layer, node)
            if position in in_range or inner is None or not _enters_as_is(layer, node, inner):
                return False
            inner_values = {id(x): values[id(t)]
                            for x, t in zip(inner.inputs, node.input_tensors)}
            if not _inline(inner, inner_path, spec, inlined, inner_values, order, paths,
                           ranges):
                return False
            for t, x in zip(node.outputs, keras.tree.flatten(inner.outputs)):
                values[id(t)] = inner_values[id(x)]
        else:
            made = call_again(node, values)
            order.append(made)
            paths[id(made)] = path
        last[position] = len(order) - 1
    ranges.extend((first[start], last[stop]) for start, stop in own)
    return True


def _enters_as_is(layer, node, inner) -> bool:
    """Whether `node`'s inputs reach `inner`'s calls as they are when `layer` is called: the
    same dtypes and ranks (a nested model converts its inputs to its own inputs' dtypes, a
    layer autocasts floats to its compute dtype)."""
    if len(node.input_tensors) != len(inner.inputs):
        return False
    for tensor, inner_input in zip(node.input_tensors, inner.inputs):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if (dtype != keras.backend.standardize_dtype(inner_input.dtype)
                or len(tensor.shape) != len(inner_input.shape)):
            return False
        if keras.backend.is_float_dtype(dtype) and dtype != keras.backend.standardize_dtype(
                layer.input_dtype):
            return False
    return True
