"""Where to cut a functional graph for rematerialization, and what each cut costs.

A segment is a range of the graph's calls in the order Keras runs them (`node_order`): any
such range is a subgraph whose inputs come from before it, so it can be run again on its own
in the backward pass. Rematerialized, a segment keeps only its inputs between the passes; what
it kept inside exists again only while it is recomputed, one segment at a time.

- `full`: cuts the whole graph where it passes the fewest bytes (inside a residual or dense
  block the skip tensor crosses every cut, so blocks stay whole), with segment sizes chosen
  for the lowest peak: Chen et al.'s √n rule, found by trying sizes instead of assumed.
- a layer whose call traces as a graph (`inner_graph`) can be cut inside the same way
  (`tfmem.memory.remat_search` decides where, and "auto" how many segments).

Everything here reads one walk of the graph as written (`GraphFacts`, made by the planner's
walk); the planner plans the chosen segments with a second walk, exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from collections.abc import Collection, Sequence

import keras

from tfmem import _keras_internals as internals
from tfmem.remat.graph import call_again, node_order, range_inputs, set_node_order
from tfmem.remat.scope import measured_as_written


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """What one walk of a functional graph (nothing of it rematerialized, though layers may
    be cut inside) says about each of its calls.

    Attributes:
        names: the layer of each call, in `node_order`.
        node_keys: the tensors (walk keys) each call keeps for the backward pass.
        input_keys: the keys of each call's inputs.
        output_keys: the keys of each call's outputs.
        sizes: bytes per sample of every key.
        live: bytes per sample that cross a cut after each call (made before, used after).
        flops: forward FLOPs per sample of each call (an estimate: 2 × weights × positions).
        inner_peaks: per call, the largest range rematerialized inside it (a layer cut
            inside, `descend`), held while that range is recomputed.
        nodes: the calls, in `node_order`.
        tensor_keys: `id(tensor) → key` of every tensor the calls take or make.
    """

    names: tuple[str, ...]
    node_keys: tuple[frozenset, ...]
    input_keys: tuple[frozenset, ...]
    output_keys: tuple[frozenset, ...]
    sizes: dict
    live: tuple[int, ...]
    flops: tuple[int, ...]
    inner_peaks: tuple[int, ...] = ()
    nodes: tuple = ()
    tensor_keys: dict = dataclasses.field(default_factory=dict)

    def activation(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, list[int]]:
        """(bytes kept across the passes, bytes kept inside each range) with `ranges`
        rematerialized; the activation term is the first plus the largest of the second."""
        inside_range = set()
        kept: set = set()
        insides = []
        taken = range_inputs(self.nodes, ranges)
        for start, stop in ranges:
            inside_range.update(range(start, stop + 1))
            inputs = {self.tensor_keys[id(t)] for t in taken[start][0]}
            kept |= inputs
            inner = set().union(*self.node_keys[start:stop + 1]) - inputs
            insides.append(sum(self.sizes[key] for key in inner))
        for position, keys in enumerate(self.node_keys):
            if position not in inside_range:
                kept |= keys
        insides += [peak for position, peak in enumerate(self.inner_peaks)
                    if peak and position not in inside_range]
        return sum(self.sizes[key] for key in kept), insides

    def recomputed_calls(self, ranges: Sequence[tuple[int, int]]) -> set[int]:
        """The calls of `ranges` run again in the backward pass: a call whose output a call
        of its range keeps for its gradient (a ReLU's own, a convolution's input), or that
        keeps tensors it makes inside (not one drawn from a seed, as a dropout's mask), and
        the calls that make what those take. The others' outputs no gradient reads: a
        convolution that only makes its segment's output, kept from the forward pass, is not
        run again (the framework drops a computation nothing reads)."""
        again: set[int] = set()
        for start, stop in ranges:
            needed = set().union(*self.node_keys[start:stop + 1])
            for position in range(stop, start - 1, -1):
                ins, outs = self.input_keys[position], self.output_keys[position]
                inside = {key for key in self.node_keys[position] - ins - outs
                          if not _drawn(key) and _copied(key) not in ins}
                if outs & needed or inside:
                    again.add(position)
                    needed |= ins
        return again

    def recomputed_flops(self, ranges: Sequence[tuple[int, int]]) -> int:
        return sum(self.flops[position] for position in self.recomputed_calls(ranges))


def _drawn(key) -> bool:
    """Whether a walk key is a tensor drawn from a seed (`Walker.keep_drawn`)."""
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "drawn"


def _copied(key):
    """The key of the tensor a kept copy in another dtype was made from (`Walker.keep`)."""
    return key[0] if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple) \
        else None


def lowest_peak_segments(graph_facts: GraphFacts, barriers: Collection[int] = ()
                         ) -> list[tuple[int, int]]:
    """Segments covering the graph but `barriers` (calls cut inside instead, `descend`)
    with the lowest estimated activation peak.

    For each candidate segment size M (bytes kept inside), the cuts are placed by dynamic
    programming where the fewest bytes cross; the M whose segments give the lowest kept-plus-
    largest-inside is taken (fewer segments on a tie).
    """
    n = len(graph_facts.names)
    own = [sum(graph_facts.sizes[k] for k in keys) for keys in graph_facts.node_keys]
    runs, start = [], 0
    for barrier in sorted(set(barriers)) + [n]:
        if barrier > start:
            runs.append((start, barrier))
        start = barrier + 1
    total = sum(own[a] for a, b in runs for a in range(a, b))
    if total <= 0 or n - len(set(barriers)) < 2:
        return []
    best = None
    size = max(max(own[a] for a, b in runs for a in range(a, b)), total / n)
    while size < total * 1.5:
        ranges = [(a + s, a + e) for a, b in runs
                  for s, e in _partition(own[a:b], graph_facts.live[a:b], size)]
        kept, insides = graph_facts.activation(ranges)
        peak = kept + max(insides, default=0)
        if best is None or (peak, len(ranges)) < best[:2]:
            best = (peak, len(ranges), ranges)
        size *= 1.5
    plain, _ = graph_facts.activation([])
    return best[2] if best and best[0] < plain else []


def _partition(own: list[int], live: Sequence[int], limit: float) -> list[tuple[int, int]]:
    """Ranges of at most `limit` bytes inside each, cut where the fewest bytes cross: a
    sliding-window minimum over the cost of the cuts before (O(n))."""
    n = len(own)
    prefix = [0]
    for nbytes in own:
        prefix.append(prefix[-1] + nbytes)
    cost = [math.inf] * (n + 1)  # cost[p]: cheapest cuts covering calls 0 .. p - 1
    back = [0] * (n + 1)
    cost[0] = 0
    window: collections.deque = collections.deque()  # start positions, cost increasing
    low = 0
    for end in range(1, n + 1):  # a segment [start, end - 1]
        start = end - 1
        while window and cost[window[-1]] >= cost[start]:
            window.pop()
        window.append(start)
        while prefix[end] - prefix[low] > limit and low < end - 1:
            low += 1
        while window and window[0] < low:
            window.popleft()
        if not window or cost[window[0]] == math.inf:
            continue
        cut = live[end - 1] if end < n else 0
        cost[end] = cost[window[0]] + cut
        back[end] = window[0]
    ranges = []
    end = n
    while end > 0:
        start = back[end]
        ranges.append((start, end - 1))
        end = start
    return ranges[::-1]


def pair_ranges(graph, pairs: Sequence[tuple[str, str]]) -> list[tuple[int, int]]:
    """The node-order ranges from layer `first` to layer `last` of each pair.

    Raises:
        ValueError: a name that is no call of the graph's top level, a pair whose first
            layer runs after its last, or ranges that overlap.
    """
    names = [node.operation.name for node in node_order(graph)]
    ranges = []
    for first, last in pairs:
        missing = [name for name in (first, last) if name not in names]
        if missing:
            raise ValueError(
                f"rematerialize: {', '.join(map(repr, missing))} "
                f"{'is not a layer' if len(missing) == 1 else 'are not layers'} at the top "
                f"level of {graph.name!r} (a (first, last) pair names two of its layers); "
                f"its layers: {', '.join(names)}")
        start = names.index(first)
        stop = len(names) - 1 - names[::-1].index(last)
        if stop < start:
            raise ValueError(f"rematerialize: ({first!r}, {last!r}): {first!r} runs after "
                             f"{last!r}; give the pair in the order the model runs them.")
        ranges.append((start, stop))
    ranges.sort()
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if start <= stop:
            raise ValueError(f"rematerialize: the ranges {pairs!r} overlap; give ranges "
                             "that share no layer.")
    return ranges


def flops_of(node, inner_graphs=None) -> int:
    """Forward FLOPs per sample of one call: 2 × weights × output positions (a convolution's
    or dense layer's multiply-adds), at least one per output value; a nested graph's calls
    summed."""
    operation = node.operation
    inner = (inner_graphs or {}).get(id(operation))
    if inner is None and (internals.is_graph_network(operation)
                          or isinstance(operation, keras.Sequential)):
        inner = sized_graph(internals.functional_of(operation), node)
    if inner is not None:
        return sum(flops_of(inner_node) for inner_node in node_order(inner))
    elements = sum(math.prod(d for d in t.shape[1:] if d) for t in node.outputs)
    weights = sum(math.prod(w.shape) for w in getattr(operation, "weights", []))
    channels = max((t.shape[-1] or 1 for t in node.outputs if t.shape), default=1)
    return int(max(elements, 2 * weights * elements / channels))


# Graphs traced from subclassed layers' calls, by layer: an entry goes with its layer.
_INNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inner_graph(layer: keras.layers.Layer, node) -> keras.Model | None:
    """The call of a subclassed `layer` as a functional graph of its sub-layers and Keras ops,
    traced on symbolic inputs shaped like `node`'s: what lets a cut fall inside it. A nested
    functional model is its own graph, sized at `node`'s inputs (`sized_graph`). None when the call cannot be traced so (it has weights
    of its own, uses backend ops or Python control flow on values, or its tensors' shapes are
    known only at run time), or takes more than tensors and `training`: then the layer
    stays whole."""
    if internals.is_graph_network(layer) or isinstance(layer, keras.Sequential):
        return sized_graph(internals.functional_of(layer), node)
    if not isinstance(layer, keras.layers.Layer):  # a Keras op: nothing inside
        return None
    if layer in _INNER:
        return _INNER[layer]
    graph = None
    sublayers = internals.flatten_layers(layer)
    if sublayers and not internals.own_weights(layer):
        inputs = [keras.Input(tuple(t.shape[1:]), dtype=t.dtype) for t in node.input_tensors]
        args, kwargs = node.arguments.fill_in(
            {id(t): x for t, x in zip(node.input_tensors, inputs)})
        kwargs.pop("training", None)  # given to each sub-layer by the functional call
        if not kwargs:
            graph = call_graph(layer, inputs, args)
    _INNER[layer] = graph
    return graph


# Nested graphs called again on sized inputs, by graph: `{input shapes: graph}`.
_SIZED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sized_graph(graph: keras.Model, node) -> keras.Model:
    """The functional `graph` of a nested model as `node` calls it: `graph` itself where
    each of its tensors has a known size beyond the batch, else the same calls made again on
    inputs shaped like `node`'s (a text backbone built for any sequence length, called on
    fixed-length inputs), their order kept, so that positions in one are positions in the
    other. `graph` itself where the call's inputs leave a size open too, or the calls cannot
    be made again."""
    if _all_sized(graph):
        return graph
    shapes = tuple(tuple(t.shape) for t in node.input_tensors)
    if len(shapes) != len(graph.inputs) or any(None in shape[1:] for shape in shapes):
        return graph
    found = _SIZED.setdefault(graph, {})
    if shapes not in found:
        found[shapes] = _called_again(graph, shapes)
    return found[shapes]


def _all_sized(graph) -> bool:
    return all(None not in tuple(t.shape)[1:] for node in node_order(graph)
               for t in node.outputs)


def _called_again(graph: keras.Model, shapes) -> keras.Model:
    inputs = [keras.Input(batch_shape=shape, dtype=x.dtype, name=x.name)
              for shape, x in zip(shapes, graph.inputs)]
    values = {id(x): y for x, y in zip(graph.inputs, inputs)}
    try:
        with measured_as_written():
            order = [call_again(node, values) for node in node_order(graph)]
        inputs_struct, outputs_struct = internals.functional_structs(graph)
        again = keras.Model(
            keras.tree.pack_sequence_as(inputs_struct, inputs),
            keras.tree.pack_sequence_as(outputs_struct, [
                values[id(t)] for t in keras.tree.flatten(outputs_struct)]),
            name=graph.name)
    except Exception:  # noqa: BLE001 - not made again: the graph as it is, sized or not
        return graph
    set_node_order(again, order)
    return again


def call_graph(layer: keras.layers.Layer, inputs: list, args: tuple) -> keras.Model | None:
    """`layer.call(*args)` on the symbolic `inputs` (`keras.Input`s, which `args` hold) as a
    functional graph; None when it does not trace so (backend ops, Python control flow on
    values) or a tensor's shape is known only at run time."""
    try:
        with measured_as_written():
            outputs = layer.call(*args)
        graph = keras.Model(inputs, outputs, name=f"{layer.name}_graph")
    except Exception:  # noqa: BLE001 - not traceable as a graph: the caller keeps it whole
        return None
    if not all(None not in tuple(t.shape)[1:] for node in node_order(graph)
               for t in node.outputs):
        return None  # shapes known only at run time: not planned, so not cut
    return graph
