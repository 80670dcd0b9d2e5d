"""The facts of a functional graph that rematerialization runs on: the order of its calls,
what a range of them takes from before it, where each tensor is last used."""

from __future__ import annotations

import weakref

import keras

from tfmem import _keras_internals as internals


# Graphs whose calls run in an order of their own (`flat_graph`'s), by graph.
_ORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def node_order(graph) -> list:
    """The layer calls of a functional graph in the order Keras runs them (a topological
    order: every call's inputs come from the graph's inputs or from calls before it), or
    the order set for it (`set_node_order`)."""
    if graph in _ORDERS:
        return list(_ORDERS[graph])
    by_depth = internals.nodes_by_depth(graph)
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]
            if node.operation is not None and not node.is_input]


def set_node_order(graph, nodes) -> None:
    """Makes `nodes` (all of `graph`'s calls, in a topological order) the order `node_order`
    gives for `graph`: a graph made of several graphs' calls keeps each one's together."""
    _ORDERS[graph] = tuple(nodes)


def call_again(node, values: dict):
    """Makes `node`'s call again on `values` (by id of the symbolic tensors it takes), adds
    what it makes to `values` under the ids of `node`'s outputs, and returns the new call."""
    args, kwargs = node.arguments.fill_in({id(t): values[id(t)] for t in node.input_tensors})
    outputs = keras.tree.flatten(node.operation(*args, **kwargs))
    values.update((id(t), y) for t, y in zip(node.outputs, outputs))
    return internals.node_of(outputs[0])


def range_inputs(nodes, ranges) -> dict[int, tuple[list, list]]:
    """What each rematerialized `(start, stop)` range of `nodes` takes from before it:
    `start → (inputs, joins)`.

    A concatenation made before a range (a dense block's stack of all earlier maps) that
    only calls inside ranges use is made again inside each range that takes it, from its
    pieces (nested concatenations along the same axis flattened into one): the pieces are
    kept across the passes, the concatenation is not. A dense block cut after each layer
    then keeps every layer's new maps once, linear in its depth, instead of the stack at
    every cut, quadratic (the memory-efficient DenseNet). `joins` are `(tensor, axis,
    pieces)`: the concatenations to make first, each from `inputs`.
    """
    ranged = {p for start, stop in ranges for p in range(start, stop + 1)}
    made_at = {id(t): p for p, node in enumerate(nodes) for t in node.outputs}
    users: dict = {}
    for position, node in enumerate(nodes):
        for tensor in node.input_tensors:
            users.setdefault(id(tensor), set()).add(position)
    joins_at = {p: internals.concatenation(node) for p, node in enumerate(nodes)}

    def join(tensor):  # (axis, tensors) of a concatenation to make again, or None
        position = made_at.get(id(tensor))
        found = joins_at.get(position)
        if found is None or not users.get(id(tensor), set()) <= ranged:
            return None
        if any(part.dtype != tensor.dtype for part in found[1]):
            return None  # it casts its pieces (a mixed policy's layer): kept as it is made
        return found

    def pieces(tensor, axis) -> list:
        found = join(tensor)
        if found is None or found[0] != axis:
            return [tensor]
        return [piece for part in found[1] for piece in pieces(part, axis)]

    taken = {}
    for start, stop in ranges:
        made = {id(t) for node in nodes[start:stop + 1] for t in node.outputs}
        inputs: dict = {}
        joins = []
        for node in nodes[start:stop + 1]:
            for tensor in node.input_tensors:
                if id(tensor) in made or id(tensor) in inputs:
                    continue
                found = join(tensor)
                if found is None:
                    inputs[id(tensor)] = tensor
                    continue
                made.add(id(tensor))  # made again here, first
                axis, parts = found
                flat = [piece for part in parts for piece in pieces(part, axis)]
                joins.append((tensor, axis, flat))
                inputs.update((id(piece), piece) for piece in flat)
        taken[start] = (list(inputs.values()), joins)
    return taken


def last_uses(nodes, ranges=(), taken=None) -> dict[int, int]:
    """`id(tensor) → the position of the last of `nodes` that takes it as an input`; with
    rematerialized `ranges`, each range's calls count as what it takes (`taken`, from
    `range_inputs`) at its start: a tensor made in a range is needed after it only if this
    says so."""
    starts = {start: stop for start, stop in ranges}
    last = {}
    position = 0
    while position < len(nodes):
        if position in starts:
            for tensor in taken[position][0]:
                last[id(tensor)] = position
            position = starts[position] + 1
            continue
        for tensor in nodes[position].input_tensors:
            last[id(tensor)] = position
        position += 1
    return last
