"""Which segments a rematerialization setting cuts in a model, as the planner and `AccumModel`
both need them.

A *spec* is a tuple of `(path, ranges)`: `path` "" is the model's own graph, a layer's name
the graph inside that top-level layer (a nested model, or the traced call of a subclassed
layer, `segments.inner_graph`); `ranges` are `(start, stop)` ranges of that graph's
`node_order`. `"full"` cuts the top-level graph, and goes inside the layers that bound its
peak (FC-DenseNet's dense blocks, a transformer's blocks) when their calls trace as graphs.
"""

from __future__ import annotations

import keras

from tfmem import _keras_internals as internals
from tfmem.memory import segments
from tfmem.memory.graph_walk import node_order
from tfmem.memory.saved_tensors import saved_tensors_facts

# How many times "full" looks again for layers to cut inside, each after re-cutting the top.
_DESCENTS = 4


def graph_of(model: keras.Model, path: str) -> keras.Model | None:
    """The graph a spec's `path` names in `model` (None: no such top-level layer, or one
    whose call does not trace as a graph)."""
    graph = internals.functional_of(model)
    if path == "":
        return graph
    for node in node_order(graph):
        if node.operation.name == path:
            return segments.inner_graph(node.operation, node)
    return None


def inner_graphs(model: keras.Model, spec) -> dict:
    """`id(layer) → graph` of the subclassed top-level layers a spec cuts inside."""
    paths = {path for path, _ in spec if path}
    if not paths:
        return {}
    graph = internals.functional_of(model)
    found = {}
    for node in node_order(graph):
        operation = node.operation
        if operation.name in paths and not internals.is_graph_network(operation):
            inner = segments.inner_graph(operation, node)
            if inner is not None:
                found[id(operation)] = inner
    return found


def facts(model: keras.Model, compute_dtype, frozen, spec=(), cache: dict | None = None
          ) -> segments.GraphFacts:
    """`segments.GraphFacts` of `model`'s top-level graph, with the inner cuts of `spec`
    made (cached in `cache`)."""
    cache = {} if cache is None else cache
    key = ("facts", id(model), compute_dtype, frozenset(frozen), spec)
    if key not in cache:
        cache[key] = saved_tensors_facts(model, compute_dtype=compute_dtype, frozen=frozen,
                                         ranges=spec, inner_graphs=inner_graphs(model, spec))
    return cache[key]


def full(model: keras.Model, compute_dtype=None, frozen=frozenset(), cache: dict | None = None
         ) -> tuple:
    """The spec of `rematerialize="full"`: the top-level graph cut where the fewest bytes
    cross; a call that alone holds at least half of the largest segment is cut inside
    instead (when its call traces as a graph), and the top cut again around it.

    Returns the spec with the lowest estimated peak of the tries.
    """
    cache = {} if cache is None else cache
    key = ("full", id(model), compute_dtype, frozenset(frozen))
    if key in cache:
        return cache[key]
    nodes = node_order(internals.functional_of(model))
    inside: dict[str, tuple] = {}  # layer name -> its ranges
    best = None
    for _ in range(_DESCENTS):
        inner_spec = tuple(sorted(inside.items()))
        found = facts(model, compute_dtype, frozen, inner_spec, cache)
        barriers = [p for p, node in enumerate(nodes) if node.operation.name in inside]
        top = tuple(segments.full(found, barriers))
        kept, insides = found.activation(top)
        peak = kept + max(insides, default=0)
        spec = ((("", top),) if top else ()) + inner_spec
        if best is None or peak < best[0]:
            best = (peak, spec)
        largest, new = max(insides, default=0), {}
        for p, node in enumerate(nodes):
            own = sum(found.sizes[k] for k in found.node_keys[p])
            name = node.operation.name
            if p in barriers or name in new or own <= 0 or 2 * own < largest:
                continue
            inner = segments.inner_graph(node.operation, node)
            if inner is None:
                continue
            try:
                ranges = tuple(segments.full(facts(inner, compute_dtype, frozen, (), cache)))
            except ValueError:  # a graph the walk cannot size: the layer stays whole
                continue
            if ranges:
                new[name] = ranges
        if not new:
            break
        inside.update(new)
    plain = facts(model, compute_dtype, frozen, (), cache).activation(())[0]
    cache[key] = best[1] if best[0] < plain else ()
    return cache[key]


def units(model: keras.Model, spec, compute_dtype=None, frozen=frozenset(),
          cache: dict | None = None) -> list[tuple]:
    """The segments of a "full" spec as `(path, ranges)` units (a top-level range alone; a
    layer cut inside with all its ranges), most bytes saved per recomputed FLOP first: the
    order "auto" adds them in."""
    cache = {} if cache is None else cache
    plain = facts(model, compute_dtype, frozen, (), cache)
    inner_spec = tuple(entry for entry in spec if entry[0])
    inner = facts(model, compute_dtype, frozen, inner_spec, cache)
    graphs = inner_graphs(model, spec)
    nodes = node_order(internals.functional_of(model))
    before = plain.activation(())[0]
    ranked = []
    for path, ranges in spec:
        if path == "":
            for span in ranges:
                saved = before - plain.activation([span])[0]
                ranked.append((saved / max(plain.recomputed_flops([span]), 1), ("", (span,))))
            continue
        p = next(i for i, node in enumerate(nodes) if node.operation.name == path)
        saved = (sum(plain.sizes[k] for k in plain.node_keys[p])
                 - sum(inner.sizes[k] for k in inner.node_keys[p]))
        inside = node_order(graph_of(model, path))
        flops = sum(segments.flops_of(node, graphs) for start, stop in ranges
                    for node in inside[start:stop + 1])
        ranked.append((saved / max(flops, 1), (path, ranges)))
    ranked.sort(key=lambda entry: -entry[0])
    return [unit for _, unit in ranked]


def spec_of(chosen: list[tuple]) -> tuple:
    """The spec of some `units`: the top-level ranges together, each layer's on its own."""
    top = tuple(sorted(span for path, ranges in chosen if path == "" for span in ranges))
    inner = tuple(sorted((path, ranges) for path, ranges in chosen if path))
    return ((("", top),) if top else ()) + inner


def from_setting(model: keras.Model, setting, compute_dtype=None, frozen=frozenset(),
                 cache: dict | None = None) -> tuple:
    """The spec of a setting's `"full"` or `(first, last)` pairs (names are hooks, not
    ranges; "auto" is decided by a plan)."""
    if setting == "full":
        return full(model, compute_dtype, frozen, cache)
    pairs = [item for item in setting if not isinstance(item, str)]
    if not pairs:
        return ()
    return (("", tuple(segments.pair_ranges(internals.functional_of(model), pairs))),)


def recompute_fraction(model: keras.Model, spec) -> float:
    """The recomputed forward FLOPs of `spec` over a training step's (forward + backward ≈ 3
    forwards), from `segments`' per-call estimate."""
    graph = internals.functional_of(model)
    graphs = inner_graphs(model, spec)
    total = 3 * sum(segments.flops_of(node, graphs) for node in node_order(graph))
    recomputed = 0
    for path, ranges in spec:
        nodes = node_order(graph_of(model, path))
        for start, stop in ranges:
            recomputed += sum(segments.flops_of(node, graphs) for node in nodes[start:stop + 1])
    return recomputed / total if total else 0.0


def names(model: keras.Model, spec) -> list[str]:
    """`first…last` of every segment, prefixed by the layer it is inside (`up4_dense:
    bn0…concatenate_3`)."""
    out = []
    for path, ranges in spec:
        graph = graph_of(model, path)
        nodes = node_order(graph)
        for start, stop in ranges:
            first, last = nodes[start].operation.name, nodes[stop].operation.name
            name = first if start == stop else f"{first}…{last}"
            out.append(f"{path}:{name}" if path else name)
    return out
