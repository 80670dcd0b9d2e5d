"""A layer cut inside is made part of the model's graph: its concatenations cross it."""

import keras
import numpy as np

import tfmem
from tfmem import _keras_internals as internals
from tfmem.remat import flat_graph
from tfmem.remat.graph import node_order, range_inputs
from tfmem.remat.spec import Ranges


class _DenseStack(keras.layers.Layer):
    """3 × Dense(16), each on the concatenation of the input and every earlier one's output;
    returns the whole stack (64 + 3 × 16 = 112 values on a 64-value input)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.units = [keras.layers.Dense(16, name=f"d{i}") for i in range(3)]

    def call(self, x):
        stack = x
        for unit in self.units:
            stack = keras.ops.concatenate([stack, unit(stack)], axis=-1)
        return stack


def _model(rematerialize=None, block_dtype=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    stack = _DenseStack(name="block", dtype=block_dtype)(inputs)
    accum = tfmem.AccumModel(inputs, keras.layers.Dense(3, name="head")(stack),
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


# The head alone, and each unit of the block with its concatenation (the block's traced call
# runs d0, concatenate, d1, concatenate_1, d2, concatenate_2).
_SPEC = Ranges((("", ((1, 1),)), ("block", ((0, 1), (2, 3), (4, 5)))))


def test_the_blocks_output_stack_is_made_again_from_its_pieces_and_planned_so():
    # Per sample, in float32 values. Without rematerialization: d0, d1, d2 keep the stacks
    # they take (64, 80, 96), the head the block's output (112): 352. Cut so, the head's
    # segment takes the block's output stack as its pieces, made in the block: the input
    # and the three new 16s are kept across the passes (112); the largest segment holds
    # the stack it makes again for the head (112). Planned layer by layer, the block's
    # output would be kept whole besides its pieces: 64 + 16 + 16 + 112 kept, 96 inside.
    plain, cut = (tfmem.plan(_model(setting), global_batch_size=8, memory_budget=2**30)
                  for setting in (None, _SPEC))
    assert plain.activation_bytes_per_sample == 352 * 4
    assert cut.activation_bytes_per_sample == (112 + 112) * 4
    assert cut.rematerialized == _SPEC.ranges
    note = cut.notes[-1]
    assert note.startswith("rematerialized, recomputed in the backward pass one at a time")
    assert "block:d2…concatenate" in note
    # No Dense runs again: each keeps only its input, a stack made again from its pieces.
    assert note.endswith("head 0.4 KiB/sample; ≈ +0% compute")
    # The graph run and planned: the block's calls between the model's, the head's
    # segment making the stack again from the input and the three units' outputs.
    model = _model(_SPEC)
    flat = flat_graph.flattened(model, _SPEC.ranges)
    nodes = node_order(flat.graph)
    names = [node.operation.name for node in nodes]
    assert names[0::2] == ["d0", "d1", "d2", "head"] and len(names) == 7
    assert all(internals.concatenation(nodes[p]) is not None for p in (1, 3, 5))
    assert flat.ranges == ((0, 1), (2, 3), (4, 5), (6, 6))
    assert {flat.paths[id(node)] for node in nodes[:6]} == {"block"}
    inputs, joins = range_inputs(nodes, flat.ranges)[6]
    (stack, axis, pieces), = joins
    units = [nodes[p].outputs[0] for p in (0, 2, 4)]
    assert axis == 1 and [id(t) for t in pieces] == [id(flat.graph.inputs[0])] + [
        id(t) for t in units]
    assert [id(t) for t in inputs] == [id(t) for t in pieces]


def test_a_stack_made_across_the_layer_trains_to_the_same_weights():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 64)).astype("float32"), np.arange(48) % 3
    weights = []
    for setting in (None, _SPEC):
        accum = _model(setting)
        accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights.append(accum.get_weights())
    assert accum.rematerialized_segments == _SPEC.ranges
    # Grappler's options are the process's own (its dependency optimizer on): with the kernels'
    # updates ordered after their recomputations only by control edges, which that rewrite
    # may drop, this differed in a few runs of a hundred (tests/remat/test_backend_tf.py).
    import tensorflow as tf
    assert "dependency_optimization" not in tf.config.optimizer.get_experimental_options()
    differences = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(*weights)]
    assert len(differences) == 8 and max(differences) <= 1e-6, differences


def test_a_layer_that_casts_its_inputs_is_cut_layer_by_layer():
    # A float16 block on the float32 input casts it when called: made part of the graph, its
    # calls would take it uncast (the stacks would be float32). It runs as written, its own
    # graph cut inside, and trains to the weights of the same model without rematerialization.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 64)).astype("float32"), np.arange(48) % 3
    weights = []
    for setting in (None, _SPEC):
        accum = _model(setting, block_dtype="mixed_float16")
        assert flat_graph.flattened(accum, _SPEC.ranges) is None
        accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights.append(accum.get_weights())
    differences = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(*weights)]
    assert len(differences) == 8 and max(differences) <= 1e-6, differences
