"""The segments a rematerialization setting cuts in a model (a *spec*), as the planner and
`AccumModel` both need them.

A *spec* is a tuple of `(path, ranges)`: `path` "" is the model's own graph, `"name"` the graph
inside its top-level layer `name` (a nested model, or the traced call of a subclassed layer,
`segments.inner_graph`), `"name/inner"` the graph inside layer `inner` of that one, and so on
(Keras layer names have no "/"); `ranges` are `(start, stop)` ranges of that graph's
`node_order`. Which segments "full" and "auto" cut the planner decides
(`tfmem.memory.remat_search`); `pair_spec` is the spec of `(first, last)` pairs.
"""

from __future__ import annotations

import keras

from tfmem import _keras_internals as internals
from tfmem.remat import segments
from tfmem.remat.graph import node_order


def _inside(graph: keras.Model, name: str):
    """`(layer, its graph)` of the call of layer `name` in `graph`; graph None when its call
    does not trace as one; None when `graph` has no such call."""
    for node in node_order(graph):
        if node.operation.name == name:
            return node.operation, segments.inner_graph(node.operation, node)
    return None


def graph_of(model: keras.Model, path: str) -> keras.Model | None:
    """The graph a spec's `path` names in `model` (None: no such layer, or one whose call
    does not trace as a graph)."""
    graph = internals.functional_of(model)
    for name in path.split("/") if path else ():
        found = _inside(graph, name) if graph is not None else None
        graph = found[1] if found else None
    return graph


def inner_graphs(model: keras.Model, spec) -> dict:
    """`id(layer) → graph` of the subclassed layers a spec cuts inside, at any depth."""
    found = {}
    for path, _ in spec:
        graph = internals.functional_of(model)
        for name in path.split("/") if path else ():
            inside = _inside(graph, name) if graph is not None else None
            if not inside or inside[1] is None:
                break
            layer, graph = inside
            if not internals.is_graph_network(layer):
                found[id(layer)] = graph
    return found


def check_spec(model: keras.Model, spec) -> None:
    """Raises for segments given as a spec (a saved setting, `spec.Ranges`) that do not
    fit `model`: a path that names no layer whose call traces as a graph, a range outside
    its graph's calls, ranges that overlap.

    Raises:
        ValueError: naming the path and what is wrong.
    """
    for path, ranges in spec:
        graph = graph_of(model, path)
        if graph is None:
            raise ValueError(
                f"rematerialize: the segments of {path!r} name no layer of {model.name!r} "
                "whose call traces as a graph; plan the model again (rematerialize='full' "
                "or 'auto') rather than reuse segments of another model.")
        count = len(node_order(graph))
        spans = sorted(tuple(span) for span in ranges)
        if any(not 0 <= start <= stop < count for start, stop in spans) or any(
                start <= stop for (_, stop), (start, _) in zip(spans, spans[1:])):
            raise ValueError(
                f"rematerialize: the segments {spans} of {path or model.name!r} do not fit "
                f"its {count} calls (each range within 0 … {count - 1}, none overlapping); "
                "plan the model again rather than reuse segments of another model.")


def spec_of(chosen: list[tuple]) -> tuple:
    """The spec of some `units`: the ranges of each graph together, the model's first."""
    by_path: dict[str, list] = {}
    for unit in chosen:
        for path, ranges in unit:
            by_path.setdefault(path, []).extend(ranges)
    return tuple((path, tuple(sorted(by_path[path]))) for path in sorted(by_path))


def names(model: keras.Model, spec) -> list[str]:
    """`first…last` of every segment, prefixed by the path of the layer it is inside
    (`up4_dense:bn0…concatenate_3`, `backbone/encoder:block_0…block_3`)."""
    out = []
    for path, ranges in spec:
        graph = graph_of(model, path)
        nodes = node_order(graph)
        for start, stop in ranges:
            first, last = nodes[start].operation.name, nodes[stop].operation.name
            name = first if start == stop else f"{first}…{last}"
            out.append(f"{path}:{name}" if path else name)
    return out


def pair_spec(model: keras.Model, pairs) -> tuple:
    """The spec of `(first, last)` pairs of layer names of `model`'s own graph.

    Raises:
        ValueError: as `segments.pair_ranges`.
    """
    if not pairs:
        return ()
    return (("", tuple(segments.pair_ranges(internals.functional_of(model), pairs))),)
