"""Which segments `rematerialize="full"` and "auto" cut, measured by the planner's walk.

"full" cuts the top-level graph where the fewest bytes cross, and goes inside the layers that
bound its peak (FC-DenseNet's dense blocks, a transformer's blocks, a keras-hub backbone's
encoder) when their calls trace as graphs, as deep as they nest; "auto" adds its segments,
most bytes saved per recomputed FLOP first (`units`), until the planned micro-batch fits.
"""

from __future__ import annotations

import keras

from tfmem import _keras_internals as internals
from tfmem.memory.saved_tensors import saved_tensors_facts
from tfmem.remat import plan, segments
from tfmem.remat.graph import node_order
from tfmem.remat.spec import RematSpec

# How many times "full" looks again for layers to cut inside, each after re-cutting the top.
_DESCENTS = 4


def facts(model: keras.Model, compute_dtype, frozen, spec=(), cache: dict | None = None
          ) -> segments.GraphFacts:
    """`segments.GraphFacts` of `model`'s top-level graph, with the inner cuts of `spec`
    made (cached in `cache`)."""
    cache = {} if cache is None else cache
    key = ("facts", id(model), compute_dtype, frozenset(frozen), spec)
    if key not in cache:
        cache[key] = saved_tensors_facts(
            model, compute_dtype=compute_dtype, frozen=frozen, ranges=spec,
            inner_graphs=plan.inner_graphs(model, spec))
    return cache[key]


def full(model: keras.Model, compute_dtype=None, frozen=frozenset(), cache: dict | None = None
         ) -> tuple:
    """The spec of `rematerialize="full"`: the top-level graph cut where the fewest bytes
    cross; a call that alone holds at least half of the largest segment is cut inside
    instead (when its call traces as a graph: "full" of its graph, so layers nested in it
    are cut inside the same way), and the top cut again around it.

    Returns the spec with the lowest estimated peak of the tries.
    """
    cache = {} if cache is None else cache
    key = ("full", id(model), compute_dtype, frozenset(frozen))
    if key in cache:
        return cache[key]
    nodes = node_order(internals.functional_of(model))
    inside: dict[str, tuple] = {}  # layer name -> the spec of its graph ("full" of it)
    best = None
    for _ in range(_DESCENTS):
        inner_spec = tuple(sorted(
            (f"{name}/{path}" if path else name, ranges)
            for name, spec in inside.items() for path, ranges in spec))
        found = facts(model, compute_dtype, frozen, inner_spec, cache)
        barriers = [p for p, node in enumerate(nodes) if node.operation.name in inside]
        top = tuple(segments.lowest_peak_segments(found, barriers))
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
                spec = full(inner, compute_dtype, frozen, cache)  # and inside its layers
            except ValueError:  # a graph the walk cannot size: the layer stays whole
                continue
            if spec:
                new[name] = spec
        if not new:
            break
        inside.update(new)
    plain = facts(model, compute_dtype, frozen, (), cache).activation(())[0]
    cache[key] = best[1] if best[0] < plain else ()
    return cache[key]


def units(model: keras.Model, spec, compute_dtype=None, frozen=frozenset(),
          cache: dict | None = None) -> list[tuple]:
    """The segments of a "full" spec, each as a unit `((path, (span,)),)`, most bytes saved
    per recomputed FLOP first: the order "auto" adds them in. A segment's saving is counted
    in the graph it cuts (the model's, or the one inside a layer), as if it were the only one
    there."""
    cache = {} if cache is None else cache
    ranked = []
    for path, ranges in spec:
        graph = plan.graph_of(model, path)
        plain = facts(graph, compute_dtype, frozen, (), cache)
        before = plain.activation(())[0]
        for span in ranges:
            saved = before - plain.activation([span])[0]
            ranked.append((saved / max(plain.recomputed_flops([span]), 1), ((path, (span,)),)))
    ranked.sort(key=lambda entry: -entry[0])
    return [unit for _, unit in ranked]


def segments_for(model: keras.Model, spec: RematSpec, compute_dtype=None,
                 frozen=frozenset(), cache: dict | None = None) -> tuple:
    """The segments `spec`'s "full" or `(first, last)` pairs cut (names are hooks, not
    ranges; "auto" is decided by a plan)."""
    if spec.mode == "full":
        return full(model, compute_dtype, frozen, cache)
    return plan.pair_spec(model, spec.pairs)


def recompute_fraction(model: keras.Model, spec, compute_dtype=None, frozen=frozenset(),
                       cache: dict | None = None) -> float:
    """The recomputed forward FLOPs of `spec` over a training step's (forward + backward ≈ 3
    forwards), from `segments`' per-call estimate: of each segment, the calls run again
    (`segments.GraphFacts.recomputed_calls`; all of them where its graph cannot be walked)."""
    graph = internals.functional_of(model)
    graphs = plan.inner_graphs(model, spec)
    total = 3 * sum(segments.flops_of(node, graphs) for node in node_order(graph))
    recomputed = 0
    for path, ranges in spec:
        inner = plan.graph_of(model, path)
        nodes = node_order(inner)
        try:
            again = facts(inner, compute_dtype, frozen, (), cache).recomputed_calls(ranges)
        except ValueError:  # a graph the walk cannot size
            again = {p for start, stop in ranges for p in range(start, stop + 1)}
        recomputed += sum(segments.flops_of(nodes[p], graphs) for p in again)
    return recomputed / total if total else 0.0


def recomputed_variables(model: keras.Model, spec) -> int:
    """How many variables the calls inside `spec`'s segments use (each counted once)."""
    seen: set[int] = set()
    for path, ranges in spec:
        nodes = node_order(plan.graph_of(model, path))
        for start, stop in ranges:
            for node in nodes[start:stop + 1]:
                seen.update(id(v) for v in getattr(node.operation, "variables", ()))
    return len(seen)
