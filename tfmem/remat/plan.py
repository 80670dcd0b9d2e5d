"""Which segments a rematerialization setting cuts in a model, as the planner and `AccumModel`
both need them.

A *spec* is a tuple of `(path, ranges)`: `path` "" is the model's own graph, `"name"` the graph
inside its top-level layer `name` (a nested model, or the traced call of a subclassed layer,
`segments.inner_graph`), `"name/inner"` the graph inside layer `inner` of that one, and so on
(Keras layer names have no "/"); `ranges` are `(start, stop)` ranges of that graph's
`node_order`. `"full"` cuts the top-level graph, and goes inside the layers that bound its
peak (FC-DenseNet's dense blocks, a transformer's blocks, a keras-hub backbone's encoder)
when their calls trace as graphs, as deep as they nest.
"""

from __future__ import annotations

import keras

from tfmem import _keras_internals as internals
from tfmem.memory import segments
from tfmem.memory.graph_walk import node_order
from tfmem.memory.saved_tensors import saved_tensors_facts

# How many times "full" looks again for layers to cut inside, each after re-cutting the top.
_DESCENTS = 4


def saves_memory(device_kind: str) -> bool:
    """Whether rematerialization lowers the peak on a device of this kind with this backend.
    Not on JAX on a CPU: XLA's CPU scheduler runs each recomputation where it saves nothing
    (ViT-S/16: 136 MiB per sample without, 149 with), so there it only costs time."""
    from tfmem import backend  # chosen once there; imported here so the planner stays TF-free

    return device_kind != "cpu" or backend.REMAT_SAVES_ON_CPU


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
    """Raises for segments given as a spec (a saved setting, `segments.Ranges`) that do not
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
        graph = graph_of(model, path)
        plain = facts(graph, compute_dtype, frozen, (), cache)
        before = plain.activation(())[0]
        for span in ranges:
            saved = before - plain.activation([span])[0]
            ranked.append((saved / max(plain.recomputed_flops([span]), 1), ((path, (span,)),)))
    ranked.sort(key=lambda entry: -entry[0])
    return [unit for _, unit in ranked]


def spec_of(chosen: list[tuple]) -> tuple:
    """The spec of some `units`: the ranges of each graph together, the model's first."""
    by_path: dict[str, list] = {}
    for unit in chosen:
        for path, ranges in unit:
            by_path.setdefault(path, []).extend(ranges)
    return tuple((path, tuple(sorted(by_path[path]))) for path in sorted(by_path))


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


def recompute_fraction(model: keras.Model, spec, compute_dtype=None, frozen=frozenset(),
                       cache: dict | None = None) -> float:
    """The recomputed forward FLOPs of `spec` over a training step's (forward + backward ≈ 3
    forwards), from `segments`' per-call estimate: of each segment, the calls run again
    (`segments.GraphFacts.recomputed_calls`; all of them where its graph cannot be walked)."""
    graph = internals.functional_of(model)
    graphs = inner_graphs(model, spec)
    total = 3 * sum(segments.flops_of(node, graphs) for node in node_order(graph))
    recomputed = 0
    for path, ranges in spec:
        inner = graph_of(model, path)
        nodes = node_order(inner)
        try:
            again = facts(inner, compute_dtype, frozen, (), cache).recomputed_calls(ranges)
        except ValueError:  # a graph the walk cannot size
            again = {p for start, stop in ranges for p in range(start, stop + 1)}
        recomputed += sum(segments.flops_of(nodes[p], graphs) for p in again)
    return recomputed / total if total else 0.0


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
