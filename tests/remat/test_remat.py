"""Rematerialized layers train to the weights of the same model without it (both backends)."""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tests.jax_flags import jax_xla_flags
from tests.training import remat_cases
from tfmem.memory import remat_search
from tfmem.remat import segments
from tfmem.remat.graph import node_order, range_inputs
from tfmem.remat.spec import Ranges, RematSpec
from tfmem.runtime.budget import Budget

CASES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "training", "remat_cases.py")


def test_rematerialized_block_ends_with_the_same_weights_and_statistics():
    differences = remat_cases.relative_differences(["block"])
    # Kernels, biases, BatchNorm's gamma/beta and moving mean/variance, all after 3 steps.
    assert len(differences) == 10
    assert max(differences) <= 1e-6, differences


@pytest.mark.parametrize("build, setting", [
    (remat_cases.model, ["block"]),
    (remat_cases.dense, "full"),  # inside a nested block, its stacks made again from pieces
])
def test_under_mirrored_strategy_on_two_cpus(two_cpu_strategy, build, setting):
    def trained(rematerialize):
        with two_cpu_strategy.scope():
            accum = build(rematerialize)
        x, y = remat_cases.data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        accum.fit(dataset, epochs=1, verbose=0)
        return accum

    plain, recomputed = trained(None), trained(setting)
    if setting == "full":
        assert recomputed.rematerialized_segments[0][0] == "backbone/dense"
    for a, b in zip(plain.get_weights(), recomputed.get_weights(), strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * max(np.linalg.norm(a), 1e-12)


def test_the_block_runs_forward_again_in_the_backward_pass():
    # TensorFlow traces the train step's micro-step once; rematerialized, the block's forward
    # is traced once more, for the gradient.
    _, plain = remat_cases.trained(None)
    _, recomputed = remat_cases.trained(["block"])
    assert recomputed == plain + 1


def test_the_command_line_flag_reads_as_the_setting():
    def flag(text):
        return RematSpec.from_flag(text).value

    assert flag("full") == "full" and flag(" auto ") == "auto"
    assert flag("none") is flag("None") is flag("") is None
    assert flag("block3, conv4_1:add4_3") == ("block3", ("conv4_1", "add4_3"))
    with pytest.raises(ValueError, match=r"'a:b:c' is neither a layer name nor a first:last"):
        RematSpec.from_flag("a:b:c")


def test_names_that_are_no_layer_and_bad_settings_are_one_error():
    with pytest.raises(ValueError, match=r"rematerialize: 'nope' is not a layer of "
                                         r"'functional\w*'; its layers: .*block"):
        remat_cases.model(["block", "nope"])
    for bad in ("block", [], [3], [("a", "b", "c")]):
        with pytest.raises(ValueError, match='must be None, "full", "auto", or a list of '
                                             'layer names and \\(first, last\\) layer pairs'):
            remat_cases.model(bad)


def test_the_setting_is_saved_with_the_model(tmp_path):
    accum = remat_cases.model(["block"])
    accum.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, tfmem.AccumModel) and loaded.rematerialize == ("block",)
    # Segments a plan chose (what finetune.py trains with) are saved as they are.
    chosen = Ranges((("", ((1, 2),)), ("backbone/dense", ((0, 9),))))
    saved = remat_cases.dense(chosen).get_config()["rematerialize"]
    assert saved == {"segments": [["", [[1, 2]]], ["backbone/dense", [[0, 9]]]]}
    assert RematSpec.parse(saved).value == chosen
    # Segments that do not fit the model are one error each, at once.
    for bad, message in (
            ({"segments": [["backbone/nope", [[0, 1]]]]}, "'backbone/nope' name no layer"),
            ({"segments": [["backbone/dense", [[0, 99]]]]}, r"do not fit its 20 calls"),
            ({"segments": [["", [[0, 3], [2, 5]]]]}, "none overlapping")):
        with pytest.raises(ValueError, match=message):
            remat_cases.dense(bad)


def test_on_the_jax_backend_too():
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=jax_xla_flags("--xla_force_host_platform_device_count=8"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    result = subprocess.run([sys.executable, CASES], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["backend"] == "jax"
    assert all(found["changed"])  # every weight and statistic moved in training
    assert max(found["block"]) <= 1e-6 and max(found["layers"]) <= 1e-6, found
    # Segments of the graph, and inside a subclassed block, under JAX's host loop of
    # jitted micro-steps (k = 2 on a CPU).
    for case in ("chain full", "dense full"):
        assert max(found[case]["differences"]) <= 1e-6 and found[case]["segments"], found
    assert found["dense full"]["segments"][0][0] == "backbone/dense"
    # They are recomputed: the JAX step traces one jax.checkpoint per segment (k = 2: the
    # micro-step is traced once per step function).
    assert set(found["checkpoints"]) == {"chain", "dense"}
    # Each step after the first runs what the first compiled (the micro-step and the update).
    assert found["compiles after the first step"] == [0, 0], found
    for name, (checkpoints, cut) in found["checkpoints"].items():
        assert cut >= 2 and checkpoints >= cut, (name, checkpoints, cut)
    # Losses the layers add inside a segment (regularizers, add_loss) count, and train.
    for setting in (["block"], "full"):
        case = found[f"regularized {setting}"]
        assert max(case["differences"]) <= 1e-6, case
        assert case["losses"][1] == pytest.approx(case["losses"][0], rel=1e-6), case
    # The same under a DataParallel over 8 host devices (tfmem.detect()).
    assert found["replicas"] == 8 and max(found["data_parallel"]) <= 1e-6, found
    assert max(found["data_parallel full"]) <= 1e-6, found
    # On a CPU, XLA runs each recomputation where it saves nothing: planned as kept, said so,
    # and not offered when nothing fits; planned for a GPU, the same segments save.
    cpu, gpu = found["planned"]["cpu"], found["planned"]["gpu"]
    assert (cpu["kind"], gpu["kind"]) == ("cpu", "gpu")
    assert cpu["segments"] == gpu["segments"] == 3
    # (A plan for a CPU counts what XLA:CPU keeps, a plan for a GPU what `layer_rules` says.)
    assert cpu["activations"][1] == cpu["activations"][0]
    assert gpu["activations"][1] < gpu["activations"][0] / 1.5
    assert ("rematerialized layers planned as kept: on JAX on a CPU, XLA runs the "
            "recomputation where it saves no memory (only time)") in cpu["notes"]
    assert "rematerialize" not in cpu["levers"] and "rematerialize" in gpu["levers"]


def _two_blocks(rematerialize):
    inputs = keras.Input((64,))
    x = inputs
    for name in ("block_a", "block_b"):
        block_in = keras.Input((64,))
        hidden = keras.layers.Dense(512, activation="relu")(block_in)
        x = keras.Model(block_in, keras.layers.Dense(64)(hidden), name=name)(x)
    return tfmem.AccumModel(inputs, keras.layers.Dense(3)(x), rematerialize=rematerialize)


def test_the_plan_counts_what_rematerialization_keeps():
    # Per sample, in float32 values: each block keeps its input (64) and its hidden layer
    # (512, for the ReLU and the second Dense); the head keeps its input (64).
    # Without: 64 + 512 + 64 + 512 + 64 = 1216. Rematerialized: the blocks' inputs and the
    # head's (3 × 64) stay, and one block's hidden 512 is held again while it is recomputed.
    def activations(rematerialize):
        return tfmem.plan(_two_blocks(rematerialize), global_batch_size=8,
                          memory_budget=2**30)
    plain, recomputed = activations(None), activations(["block_a", "block_b"])
    assert plain.activation_bytes_per_sample == 1216 * 4
    assert recomputed.activation_bytes_per_sample == (3 * 64 + 512) * 4
    assert ("rematerialized, recomputed in the backward pass one at a time (the largest "
            "counted in activations): block_a 2.0 KiB/sample, block_b 2.0 KiB/sample") in (
        recomputed.table())


def test_a_call_outside_the_recomputed_block_runs_beside_none_of_it():
    # One block (64 → 512 → 64) recomputed, then a head of 2048 values, per sample in float32
    # values. Kept: the block's input and the head's (2 × 64); the block's hidden 512 is held
    # again while it is recomputed, beside its own calls' workspace (2 × 512: an output's and
    # an input's gradient). The head's backward (its output's gradient, 2048, and its input's,
    # 64) runs before that, beside the kept tensors only: the peak is
    # 128 + max(2048 + 64, 512 + 1024).
    inputs = keras.Input((64,))
    block_in = keras.Input((64,))
    hidden = keras.layers.Dense(512, activation="relu")(block_in)
    block = keras.Model(block_in, keras.layers.Dense(64)(hidden), name="block")
    model = tfmem.AccumModel(inputs, keras.layers.Dense(2048)(block(inputs)),
                             rematerialize=["block"])
    plan = tfmem.plan(model, global_batch_size=8, memory_budget=2**30, loss="mse")
    assert plan.activation_bytes_per_sample == (128 + 512) * 4
    assert plan.recomputed_bytes_per_sample == 512 * 4
    assert plan.activation_bytes_per_sample + plan.workspace_bytes_per_sample == (
        128 + 2048 + 64) * 4


class _TwoBlocksSubclassed(tfmem.AccumModel):
    """`_two_blocks` as a subclassed model: its own `call`, the same layers."""

    def __init__(self, scaled=False, **kwargs):
        super().__init__(name="two_blocks", **kwargs)  # Keras's scopes take no leading "_"
        self.block_a = _two_blocks(None).get_layer("block_a")
        self.block_b = _two_blocks(None).get_layer("block_b")
        self.head = keras.layers.Dense(3)
        # A weight of its own: the call is no longer a graph of its layers alone.
        self.scale = self.add_weight(shape=(), initializer="ones") if scaled else None

    def call(self, x):
        x = self.block_b(self.block_a(x))
        return self.head(x if self.scale is None else x * self.scale)


def test_a_subclassed_model_plans_and_trains_its_named_blocks():
    # The same hand count as the functional model above: 1216 values kept without, 704 with
    # the two blocks named, whether planned before `fit` or by the guard at `fit` (unbuilt).
    names = ["block_a", "block_b"]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 64)).astype("float32"), rng.normal(size=(48, 3)).astype("float32")
    trained = []
    for setting in (None, names):
        keras.utils.set_random_seed(0)
        model = _TwoBlocksSubclassed(rematerialize=setting)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        run = model.plan_memory(x, batch_size=8, memory_budget=2**30)
        assert run.plan.activation_bytes_per_sample == (1216 if setting is None
                                                        else 3 * 64 + 512) * 4
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        trained.append(model.get_weights())
    for a, b in zip(*trained, strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * max(np.linalg.norm(a), 1e-12)
    # A call that is not a graph of its layers: the blocks planned as kept, and said so.
    scaled = _TwoBlocksSubclassed(scaled=True, rematerialize=names)
    scaled(x[:1])
    plan = tfmem.plan(scaled, global_batch_size=8, memory_budget=2**30)
    assert plan.activation_bytes_per_sample >= 1216 * 4
    assert ("rematerialized layers planned as kept (an upper bound): the call of "
            "_TwoBlocksSubclassed does not trace as a graph of its layers") in plan.notes


class _Block(keras.layers.Layer):
    """Dense(512, relu) → Dense(64) as one layer: planned by tracing its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = keras.layers.Dense(512, activation="relu"), keras.layers.Dense(64)

    def call(self, x):
        return self.out(self.hidden(x))


def test_a_layer_block_is_planned_by_what_its_call_keeps():
    def planned(rematerialize):
        inputs = keras.Input((64,))
        x = _Block(name="block_b")(_Block(name="block_a")(inputs))
        accum = tfmem.AccumModel(inputs, keras.layers.Dense(3)(x), rematerialize=rematerialize)
        return tfmem.plan(accum, global_batch_size=8, memory_budget=2**30)

    plain, recomputed = planned(None), planned(["block_a", "block_b"])
    # Measured as written (not through the recomputation), the same inside for both blocks.
    segments = dict(saved.split(" ") for saved in recomputed.notes[-1].split(": ")[1].replace(
        " KiB/sample", "").split(", "))
    assert set(segments) == {"block_a", "block_b"} and segments["block_a"] == segments["block_b"]
    assert float(segments["block_a"]) >= 512 * 4 / 1024  # its hidden layer at least
    assert recomputed.activation_bytes_per_sample < plain.activation_bytes_per_sample


# -- Segments cut in the graph itself: "full", "auto", (first, last) pairs ----------------------

def _chain_runs(setting, jit_compile):
    """`remat_cases.chain` fitted without and with `setting`: the weights' relative
    differences, the segments cut, and how often each run's steps traced Counted's forward."""
    runs, counts = [], []
    for rematerialize in (None, setting):
        runs.append(remat_cases.fitted(remat_cases.chain, rematerialize, jit_compile=jit_compile,
                                       callbacks=[remat_cases.CountsFromTrainBegin()])[0])
        counts.append(remat_cases.Counted.calls)
    plain, accum = runs
    return (remat_cases._differences(plain.get_weights(), accum.get_weights()),
            accum.rematerialized_segments, counts)


@pytest.fixture(scope="module")
def chain_full():
    """`_chain_runs` of "full" without XLA (what `jit_compile="auto"` is on a CPU)."""
    return _chain_runs("full", False)


@pytest.mark.parametrize("setting, jit_compile", [("full", False), ("full", True),
                                                  ([("conv1a", "add2")], "auto")])
def test_segments_of_the_graph_train_to_the_same_weights_and_statistics(setting, jit_compile,
                                                                        request):
    differences, cut, _ = (request.getfixturevalue("chain_full")
                           if (setting, jit_compile) == ("full", False)
                           else _chain_runs(setting, jit_compile))
    # 7 convolution weights (the 3 before a BatchNorm have no bias), 3 BatchNorms × 4, the
    # head's 2: all after 3 steps of k = 2, under XLA too (jit_compile=True compiles the
    # micro-step).
    assert len(differences) == 25 and max(differences) <= 1e-6, differences
    (path, ranges), = cut  # the model's own graph: no layer is cut inside
    assert path == "" and len(ranges) >= 1 and all(start <= stop for start, stop in ranges)
    if setting != "full":  # conv1a is call 7 of the order Keras runs, add2 call 18
        assert ranges == ((7, 18),)


@pytest.fixture(scope="module")
def plain_regularized():
    """`remat_cases.regularized`'s model fitted without rematerialization, and its loss."""
    return remat_cases.fitted(remat_cases.regularized)


@pytest.mark.parametrize("setting", [["block"], "full"])
def test_losses_the_layers_add_inside_a_segment_count_once(setting, plain_regularized):
    # Activity and kernel regularizers and an `add_loss` inside the block, one after it
    # (11 weights: 3 convolutions, BatchNorm, the head):
    # the loss fit reports, and the weights after 3 steps, are those without.
    differences, (plain, recomputed) = remat_cases.regularized_differences(
        setting, plain_regularized)
    assert len(differences) == 11 and max(differences) <= 1e-6, differences
    assert recomputed == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("jit_compile, rows", [("auto", 40), (True, 48)])
def test_full_cuts_inside_a_subclassed_block_and_trains_to_the_same_weights(jit_compile, rows):
    # Without XLA, 40 samples in batches of 16: the last is 8, so the step is traced for any
    # batch size, and each dropout of the dense block reads its input's shape, which the
    # recomputation reads from the forward pass's tensor.
    x, y = remat_cases.data()
    runs = []
    for setting in (None, "full"):
        runs.append(remat_cases.dense(setting, jit_compile=jit_compile))
        runs[-1].fit(x[:rows], y[:rows], batch_size=16, epochs=1, shuffle=False, verbose=0)
    differences = remat_cases._differences(*(run.get_weights() for run in runs))
    cut = runs[1].rematerialized_segments
    # The stem's 2, 4 × (BatchNorm's 4, the conv's 2), the head's 2.
    assert len(differences) == 28 and max(differences) <= 1e-6, differences
    # The block holds almost every activation: cut inside it, in the backbone, between its
    # units (each a BatchNorm … concatenate of its traced call), each unit making its stack
    # again from the pieces; the tiny top and stem are left whole.
    (path, ranges), = cut
    assert path == "backbone/dense" and len(ranges) >= 2
    backbone = _inner_graph(runs[1], "backbone")
    graph = _inner_graph(backbone, "dense")
    assert sum(1 for layer in graph.layers if isinstance(layer, keras.layers.Conv2D)) == 4
    taken = range_inputs(node_order(graph), ranges)
    assert sum(len(joins) for _, joins in taken.values()) >= len(ranges) - 1


def _inner_graph(model, name):
    node = next(node for node in node_order(model) if node.operation.name == name)
    return segments.inner_graph(node.operation, node)


def test_segments_run_forward_again_in_the_backward_pass(chain_full):
    *_, counts = chain_full
    # TensorFlow traces each ReLU once more, for the gradient of its segment.
    assert counts[1] == counts[0] + 3, counts


def _dense_chain(rematerialize=None):
    inputs = keras.Input((64,))
    x = inputs
    for block in ("a", "b"):
        hidden = keras.layers.Dense(512, activation="relu", name=f"{block}_hidden")(x)
        x = keras.layers.Dense(64, name=f"{block}_out")(hidden)
    return tfmem.AccumModel(inputs, keras.layers.Dense(3, name="head")(x),
                            rematerialize=rematerialize)


def _planned(rematerialize, **arguments):
    if "budget" not in arguments:
        arguments.setdefault("memory_budget", 2**30)
    return tfmem.plan(_dense_chain(rematerialize), global_batch_size=8, **arguments)


def _accelerator(memory):
    """A GPU's budget: no host runtime term, whose retraced segments would outweigh the few
    kilobytes recomputing saves in these small models."""
    return Budget("gpu", "gpu", memory, 1)


def test_pairs_and_full_are_planned_by_hand_counts():
    # As the nested blocks above, in one graph: (a_hidden, a_out) and (b_hidden, b_out) keep
    # their inputs (64 each) and the head its input (64); one hidden 512 is held again.
    pairs = _planned([("a_hidden", "a_out"), ("b_hidden", "b_out")])
    assert pairs.activation_bytes_per_sample == (3 * 64 + 512) * 4
    assert pairs.rematerialized == (("", ((0, 1), (2, 3))),)
    # "full" cuts where one 64-value tensor crosses: a_hidden…a_out | b_hidden…head keeps
    # the two inputs, and recomputes at most 512 + 64 (b's hidden and the head's input):
    # 704 values, the lowest peak of any cut (3 segments reach 704 too; fewer is chosen).
    full = _planned("full")
    assert full.rematerialized == (("", ((0, 1), (2, 4))),)
    assert full.activation_bytes_per_sample == (2 * 64 + 512 + 64) * 4
    note = full.notes[-1]
    assert "a_hidden…a_out 2.0 KiB/sample, b_hidden…head 2.2 KiB/sample" in note
    # Run again: a_hidden (its ReLU output is kept), b_hidden and b_out (the head keeps
    # b_out's output); not a_out nor the head, whose outputs no gradient reads. Forward
    # FLOPs per sample, 2 × weights (kernel and bias) for a Dense: hidden 2 · (64 · 512 +
    # 512), out 2 · (512 · 64 + 64), head 2 · (64 · 3 + 3).
    hidden, out, head = 2 * (64 * 512 + 512), 2 * (512 * 64 + 64), 2 * (64 * 3 + 3)
    forward = 2 * hidden + 2 * out + head
    again = 2 * hidden + out
    assert abs(full.recompute_fraction - again / (3 * forward)) < 1e-9
    assert note.endswith("≈ +25% compute")
    # On a CPU each recomputed segment's forward is traced again in its gradient: the runtime
    # term grows by 0.7 MiB per variable the segments use (a kernel and a bias per Dense:
    # 10 in full's 5 layers, 8 in the pairs' 4).
    plain = _planned(None)
    assert full.runtime_bytes - plain.runtime_bytes == 10 * int(0.7 * 2**20)
    assert pairs.runtime_bytes - plain.runtime_bytes == 8 * int(0.7 * 2**20)
    # `tfmem.plan` takes the setting for any Keras model, and it overrides the model's own.
    chain = _dense_chain()
    plain_keras = keras.Model(chain.inputs, chain.outputs)
    assert tfmem.plan(plain_keras, global_batch_size=8, memory_budget=2**30,
                      rematerialize="full").rematerialized == full.rematerialized
    assert tfmem.plan(_dense_chain("full"), global_batch_size=8, memory_budget=2**30,
                      rematerialize=[("a_hidden", "a_out")]).rematerialized == (
        ("", ((0, 1),)),)


def _stacked(rematerialize=None, layers=3):
    """A dense block of Dense layers: each takes the stack of the input and every earlier
    layer's 16 new values, concatenated."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    stack = inputs
    for i in range(layers):
        new = keras.layers.Dense(16, name=f"d{i}")(stack)
        stack = keras.layers.Concatenate(name=f"cat{i}")([stack, new])
    accum = tfmem.AccumModel(inputs, keras.layers.Dense(3, name="head")(stack),
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


_EACH_LAYER = [(f"d{i}", f"cat{i}") for i in range(3)]


def test_a_stack_is_made_again_from_its_pieces_and_planned_so():
    # Each Dense keeps its input, the stack: 64, 80, 96, and the head 112 values: 352.
    # Cut after each layer, a range takes the stack's pieces instead (the input and the
    # new values before it), and makes the stack again: kept across the passes are the
    # input (64), d0's and d1's new values (16 each) and the head's input (112, a call
    # outside every range keeps it whole); d2's stack (96) is held again while recomputed.
    plain, cut = (tfmem.plan(_stacked(setting), global_batch_size=8, memory_budget=2**30)
                  for setting in (None, _EACH_LAYER))
    assert plain.activation_bytes_per_sample == 352 * 4
    assert cut.activation_bytes_per_sample == (64 + 16 + 16 + 112 + 96) * 4
    graph = _stacked()
    nodes = node_order(graph)
    taken = range_inputs(nodes, [(0, 1), (2, 3), (4, 5)])
    made = {node.operation.name: node.outputs[0] for node in nodes}
    inputs, joins = taken[4]
    assert [id(t) for t in inputs] == [id(graph.inputs[0]), id(made["d0"]), id(made["d1"])]
    (stack, axis, pieces), = joins
    assert stack is made["cat1"] and axis == 1 and [id(t) for t in pieces] == [
        id(t) for t in inputs]
    # d2 alone: the stack d1 takes is used by d1, in no range (so kept by it): the pieces
    # stop there. The head alone, likewise, from d2's stack and new values.
    inputs, joins = range_inputs(nodes, [(4, 5)])[4]
    assert [id(t) for t in inputs] == [id(made["cat0"]), id(made["d1"])] and len(joins) == 1
    inputs, joins = range_inputs(nodes, [(6, 6)])[6]
    assert [id(t) for t in inputs] == [id(made["cat1"]), id(made["d2"])] and len(joins) == 1


def test_a_pieces_gradients_are_added_range_by_range_after_grapplers_rewrites():
    # Each of 5 ranges (d_i, cat_i) makes its stack again from the input and the new values
    # before it: the input's gradient is a sum over the 5 ranges of a slice of their stacks'
    # gradients. TensorFlow's arithmetic optimizer folds a chain of additions whose sums have
    # one reader each into one addition, made once every term exists: all of them held at
    # once. Each range's sum is read twice, so no addition takes more than the two slices one
    # range adds (4 without: every slice but the first range's, which adds the input whole).
    layers = 5
    accum = _stacked([(f"d{i}", f"cat{i}") for i in range(layers)], layers=layers)
    x, y = tf.ones((8, 64)), tf.range(8) % 3
    accum.train_on_batch(x, y)  # builds the optimizer's variables
    optimized = _after_grappler(_traced(accum.train_step).get_concrete_function((x, y)).graph)
    types = {node.name: node.op for node in optimized.node}
    additions = [[types.get(name.split(":")[0]) for name in node.input
                  if not name.startswith("^")]
                 for node in optimized.node if node.op in ("AddN", "AddV2", "Add")]
    assert any(node.name.startswith("ArithmeticOptimizer/") for node in optimized.node)
    assert sum("Slice" in inputs for inputs in additions) >= layers - 1
    assert max(inputs.count("Slice") for inputs in additions) <= 2


def _with_dropout(rematerialize):
    inputs = keras.Input((64,))
    x = keras.layers.Dense(256, name="d")(inputs)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    x = keras.layers.Dense(64, activation="relu", name="e")(x)
    return tfmem.AccumModel(inputs, keras.layers.Dense(3, name="head")(x),
                            rematerialize=rematerialize)


@pytest.mark.parametrize("batch", [8, None], ids=["batch known", "batch unknown"])
@pytest.mark.parametrize("build, setting, again", [
    (_dense_chain, "full", {"a_hidden", "b_hidden", "b_out"}),
    (_with_dropout, [("d", "drop")], set())], ids=["chain", "dropout"])
def test_the_plan_counts_as_run_again_what_the_step_runs_again(build, setting, again, batch):
    # The step as Grappler leaves it (what nothing reads is pruned) runs each Dense's forward
    # product once, and again for the layers whose outputs a gradient of their segment reads:
    # in the chain, a_hidden's and b_hidden's ReLU outputs and the head's input (b_out's);
    # not a_out's nor the head's. A dropout's mask is drawn from its seed: the Dense before
    # it, whose output only the dropout takes, does not run again, also where the step is
    # traced for any batch size and the dropout reads its input's shape.
    accum = build(setting)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = tf.ones((8, 64)), tf.range(8) % 3
    accum.train_on_batch(x, y)  # cuts the segments
    specs = (tf.TensorSpec((batch, 64)), tf.TensorSpec((batch,), tf.int32))
    optimized = _after_grappler(
        _traced(accum.train_step).get_concrete_function(specs).graph)
    products = [node for node in optimized.node if "MatMul" in node.op
                and not node.attr["transpose_a"].b and not node.attr["transpose_b"].b]
    dense = [layer for layer in accum.layers if isinstance(layer, keras.layers.Dense)]
    assert len(products) == len(dense) + len(again)
    (_, ranges), = accum.rematerialized_segments
    facts = remat_search.facts(accum, None, frozenset())
    assert {facts.names[p] for p in facts.recomputed_calls(ranges)} & {
        layer.name for layer in dense} == again


def _traced(function):
    """`function` as a `tf.function` traced as Keras traces its steps: without AutoGraph (which
    would convert every function the step calls, seconds for AccumModel's)."""
    return tf.function(function, autograph=False)


def _after_grappler(graph):
    """The GraphDef of a traced step as Grappler's default rewrites leave it (its outputs and
    control outputs kept)."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.grappler import tf_optimizer

    exported = tf.compat.v1.train.export_meta_graph(
        graph_def=graph.as_graph_def(add_shapes=True), graph=graph)
    exported.collection_def["train_op"].node_list.value.extend(
        [t.op.name for t in graph.outputs] + [op.name for op in graph.control_outputs])
    return tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), exported)


def _ancestors(graph_def, name) -> set:
    """The nodes `name` waits for in `graph_def`, through data or control edges."""
    inputs = {node.name: [i.lstrip("^").split(":")[0] for i in node.input]
              for node in graph_def.node}
    seen, todo = set(), [name]
    while todo:
        for parent in inputs.get(todo.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_a_layers_input_gradient_waits_for_its_weights_gradients_inside_a_segment_and_after():
    # In the segment (a_hidden, a_out), a_out's kernel gradient reads its input, a_hidden's
    # 512 outputs; a_hidden's gradients need only a_out's input gradient. Made first, that
    # input gradient lets a_hidden's backward run while a_out's input is still held; made
    # after a_out's kernel gradient, as now, the input is freed first: a_hidden's kernel
    # gradient waits for a_out's, in the traced step and after Grappler's rewrites.
    accum = _dense_chain([("a_hidden", "a_out")])
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = tf.ones((8, 64)), tf.range(8) % 3
    accum.train_on_batch(x, y)  # cuts the segment
    index = {id(v): i for i, v in enumerate(accum.trainable_variables)}

    @_traced
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = accum.compute_loss(x=x, y=y, y_pred=accum(x, training=True))
        return tape.gradient(loss, accum.trainable_variables)

    graph = gradients.get_concrete_function(x, y).graph
    for graph_def in (graph.as_graph_def(), _after_grappler(graph)):
        nodes = {node.name: node for node in graph_def.node}

        def made(layer):  # what the returned gradient of the layer's kernel waits for
            returned = graph.outputs[index[id(accum.get_layer(layer).kernel)]]
            # from the value it returns: the function's outputs also wait for every read of
            # a variable, the recomputation's included
            value = [name.split(":")[0] for name in nodes[returned.op.name].input
                     if not name.startswith("^")]
            return set(value).union(*(_ancestors(graph_def, name) for name in value))

        def kernel_gradients(names, layer=""):  # input^T × output's gradient: a Dense
            return {name for name in names if "MatMul" in nodes[name].op  # kernel's
                    and nodes[name].attr["transpose_a"].b and f"/{layer}" in name}

        a_out = kernel_gradients(made("a_out"), "a_out")
        assert len(a_out) == 1 and a_out <= made("a_hidden")
        # b_hidden, the first call with weights after the segment, passes its input gradient
        # back only once its kernel's gradient is made: the segment is recomputed once
        # b_hidden's output gradient, which that kernel gradient reads, can be freed.
        b_hidden = kernel_gradients(made("b_hidden"), "b_hidden")
        assert len(b_hidden) == 1 and b_hidden <= made("a_hidden") & made("a_out")
        # the other calls outside the segment run as Keras runs them
        assert not kernel_gradients(made("b_out")) & made("b_hidden")


@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_draws_of_stateful_random_ops_are_the_forward_passes_in_the_recomputation(jit_compile):
    # Keras's unseeded keras.random (its global seed generator, which the forward pass
    # advanced), a tf.random.Generator's and tf.random.uniform's draws: run again, each
    # would draw other numbers, and the segment's gradient would be that of other noise.
    # (XLA draws tf.random.uniform regardless of its seed: two plain runs differ there.)
    draws = ("Unseeded", "Generated", "Generated" if jit_compile is True else "Masked")
    runs = []
    for setting in (None, "full"):
        runs.append(remat_cases.noisy(setting, jit_compile=jit_compile, draws=draws))
        runs[-1].fit(*remat_cases.data(), batch_size=16, epochs=1, shuffle=False, verbose=0)
    plain, accum = runs
    differences = remat_cases._differences(plain.get_weights(), accum.get_weights())
    assert len(differences) == 8 and max(differences) <= 1e-6, differences
    (_, ranges), = accum.rematerialized_segments
    assert ranges  # each noise layer is recomputed in a segment
    # What the layer writes to TensorFlow variables is written once per micro-batch (6), not
    # again in the recomputation: the generator's state skipped ahead, the count added, the
    # mean assigned as without rematerialization.
    (plain_layer, layer) = (model.get_layer("noise1") for model in runs)
    assert layer.calls.numpy() == plain_layer.calls.numpy() == 6
    np.testing.assert_array_equal(layer.generator.state.numpy(),
                                  plain_layer.generator.state.numpy())
    assert layer.mean.numpy() == pytest.approx(plain_layer.mean.numpy(), rel=1e-6)
    if jit_compile is True:
        return
    x, y = remat_cases.data()

    @_traced
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = accum.compute_loss(x=x, y=y, y_pred=accum(x, training=True))
        return tape.gradient(loss, accum.trainable_variables)

    graph = gradients.get_concrete_function(x[:16], y[:16]).graph
    masks = [op for op in graph.get_operations() if op.type == "RandomUniform"]
    # Masked's draw and its recomputation's, which nothing reads: its readers read the
    # forward pass's mask.
    assert [bool(op.outputs[0].consumers()) for op in masks] == [True, False]


class _Scattered(keras.layers.Layer):
    """Adds its input's first row to a TensorFlow variable's first row (a scatter)."""

    def build(self, shape):
        self.total = tf.Variable(tf.zeros((2, shape[-1])))

    def call(self, x, training=None):
        if training:
            self.total.scatter_add(tf.IndexedSlices(x[:1, 0, 0], tf.constant([0])))
        return x


def test_a_recomputation_that_would_write_a_variable_again_is_one_error():
    inputs = keras.Input((8, 8, 3))
    x = inputs
    for i in range(3):
        x = keras.layers.Conv2D(6, 3, padding="same")(x)
        x = keras.layers.ReLU()(_Scattered(name=f"scattered{i}")(x) if i == 1 else x)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
    accum = tfmem.AccumModel(inputs, outputs, rematerialize="full")
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"cannot be recomputed as its forward pass ran: its "
                       r"op '.*scattered1.*' \(ResourceScatterAdd\) is stateful and writes a "
                       r"TensorFlow variable again.*keras.random.SeedGenerator"):
        accum.fit(*remat_cases.data(), batch_size=16, epochs=1, verbose=0)


def test_a_masked_sequence_trains_to_the_same_weights():
    # The segment takes the Embedding's padding mask (a bool tensor) as an input: it has no
    # gradient to pass on (it was given a 0 added to it, a TypeError), and the GRU in it
    # reads it again when recomputed.
    def build(rematerialize):
        keras.utils.set_random_seed(3)
        tokens = keras.Input((10,), dtype="int32")
        x = keras.layers.Embedding(20, 8, mask_zero=True, name="embed")(tokens)
        x = keras.layers.Dense(8, name="d1")(x)
        x = keras.layers.GRU(8, return_sequences=True, name="gru")(x)
        x = keras.layers.Dense(8, name="d2")(x)
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        accum = tfmem.AccumModel(tokens, keras.layers.Dense(3, name="head")(x),
                                 rematerialize=rematerialize, accumulation_steps=2)
        accum.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return accum

    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(32, 10)).astype("int32")
    x[:, 6:] = 0  # padding, masked
    y = np.arange(32) % 3
    weights = []
    for setting in (None, [("d1", "head")]):
        accum = build(setting)
        accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights.append(accum.get_weights())
    assert accum.rematerialized_segments == (("", ((2, 6),)),)
    assert max(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12)
               for a, b in zip(*weights, strict=True)) <= 1e-6


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_a_stack_made_again_trains_to_the_same_weights(precision):
    x = np.random.default_rng(0).normal(size=(48, 64)).astype("float32")
    y = np.arange(48) % 3
    weights = []
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        for setting in (None, _EACH_LAYER):
            accum = _stacked(setting)
            accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            weights.append(accum.get_weights())
    finally:
        keras.config.set_dtype_policy(policy)
    if precision == "mixed_float16":  # loss-scaled; the input's float32 stack is cast, so
        # it is kept as made (not taken apart), the float16 stacks after it are
        assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
        nodes = node_order(accum)
        taken = range_inputs(nodes, [(0, 1), (2, 3), (4, 5)])
        assert [len(joins) for _, joins in taken.values()] == [0, 0, 1]
        assert [t.dtype for t in taken[4][0]] == ["float16", "float16"]
    # 4 kernels and biases; the gradients reaching a piece from several ranges are summed
    # in another order than through the stack's split.
    differences = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(*weights)]
    assert len(differences) == 8 and max(differences) <= 1e-6, differences


def test_auto_rematerializes_only_when_the_target_micro_batch_does_not_fit():
    roomy = _accelerator(2**30)
    plain, full = _planned(None, budget=roomy), _planned("full", budget=roomy)
    # A device whose 80% lies between the two peaks at micro-batch 8 (the whole batch).
    memory = int((plain.peak_bytes(8, 1) + full.peak_bytes(8, 1)) / 2 / 0.8)
    # Without: nothing fits (a smaller micro-batch adds k > 1's accumulation buffers, far
    # more than the activations it saves on this small model).
    assert not _planned(None, budget=_accelerator(memory)).fits
    auto = _planned("auto", budget=_accelerator(memory))
    assert (auto.micro_batch_size, auto.accumulation_steps) == (8, 1)
    assert auto.rematerialized == full.rematerialized
    assert auto.notes[-1] == ("rematerialize auto: nothing fits without it; with 2 of 2 "
                              "segments recomputed, micro-batch 8 × 1 at ≈ +25% compute")
    roomy = _planned("auto")
    assert roomy.rematerialized == () and roomy.notes[-1] == (
        "rematerialize auto: not needed, micro-batch 8 fits")


def test_auto_takes_the_segments_inside_a_nested_layer_one_by_one():
    model = remat_cases.dense()
    plain, full = (tfmem.plan(model, global_batch_size=8, budget=_accelerator(2**30),
                              rematerialize=setting) for setting in (None, "full"))
    (path, spans), = full.rematerialized
    assert path == "backbone/dense" and len(spans) == 3
    # A device where micro-batch 8 fits with some of the dense block's segments, not none.
    memory = int((0.3 * full.peak_bytes(8, 1) + 0.7 * plain.peak_bytes(8, 1)) / 0.8)
    auto = tfmem.plan(model, global_batch_size=8, budget=_accelerator(memory),
                      rematerialize="auto")
    (auto_path, chosen), = auto.rematerialized
    assert auto_path == path and len(chosen) == 2 and set(chosen) < set(spans)
    assert (auto.micro_batch_size, auto.accumulation_steps) == (8, 1)
    assert auto.notes[-1].startswith("rematerialize auto: micro-batch 4 × 2 without it; "
                                     "with 2 of 3 segments recomputed, micro-batch 8 × 1")


def _any_size(rematerialize):
    """A fully convolutional AccumModel on `keras.Input((None, None, 3))` (k = 2, SGD)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 3))
    x = inputs
    for i in range(3):
        x = keras.layers.Conv2D(6, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(keras.layers.BatchNormalization(name=f"bn{i}")(x))
    accum = tfmem.AccumModel(inputs, keras.layers.Conv2D(2, 1)(x), accumulation_steps=2,
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


def test_a_model_of_any_input_size_recomputes_named_layers_and_says_what_full_needs():
    # "full" and "auto" choose segments by the bytes of each tensor, which a model built on
    # (None, None, 3) does not have; named layers need none, and train at any size.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 12, 12, 3)).astype("float32"), rng.integers(0, 2, (16, 12, 12))
    for setting in ("full", "auto"):
        with pytest.raises(ValueError, match=rf"rematerialize='{setting}' chooses the segments "
                           r".* by the bytes of its tensors, which are not known: .*keras.Input"
                           r".*Or name the layers to recompute"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _any_size(setting).fit(x, y, batch_size=8, epochs=1, verbose=0)
    runs = []
    for setting in (None, [("conv1", "relu2")]):
        runs.append(_any_size(setting))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan cannot size it either: UnplannedRunWarning
            for size in (12, 8):  # two image sizes, each traced
                runs[-1].fit(x[:, :size, :size], y[:, :size, :size], batch_size=8, epochs=1,
                             shuffle=False, verbose=0)
    assert runs[1].rematerialized_segments
    differences = remat_cases._differences(runs[0].get_weights(), runs[1].get_weights())
    assert len(differences) == 20 and max(differences) <= 1e-6, differences


def test_full_that_cuts_nothing_says_so_in_the_plan_and_at_fit():
    # A recurrent layer keeps its per-step tensors inside its loop, which the plan does not
    # count: cutting around it lowers no planned peak, and the run says what to do instead.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,), dtype="int32")
    x = keras.layers.LSTM(8, name="lstm")(keras.layers.Embedding(50, 8, mask_zero=True)(inputs))
    accum = tfmem.AccumModel(inputs, keras.layers.Dense(3)(x), rematerialize="full")
    accum.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plan = tfmem.plan(accum, global_batch_size=16, memory_budget=2**30)
    assert plan.rematerialized == () and plan.recompute_fraction == 0
    assert ("rematerialize full: no cut lowers the planned peak, so none is made (not "
            "counted: the loop intermediates of LSTM; name those layers to recompute them)"
            in plan.notes), plan.notes
    with pytest.warns(UserWarning, match=r'rematerialize="full" cuts no segment of '
                                         r"'\w+': .*name them \(rematerialize=\["):
        accum.fit(np.ones((32, 12), "int32"), np.zeros(32), batch_size=16, verbose=0)
    assert accum.rematerialized_segments == ()


def test_nothing_fits_tries_rematerialization_first():
    roomy = _accelerator(2**30)
    plain, full = _planned(None, budget=roomy), _planned("full", budget=roomy)
    memory = int((plain.peak_bytes(8, 1) + full.peak_bytes(8, 1)) / 2 / 0.8)
    p = _planned(None, budget=_accelerator(memory))
    assert not p.fits and p.alternative.changes == ("rematerialize full",)
    assert p.alternative.tried == ("rematerialize full",)


def test_bad_segments_are_one_error_each():
    with pytest.raises(ValueError, match=r"'nope' is not a layer at the top level of '\w+' "
                                         r"\(a \(first, last\) pair names two of its layers\)"
                                         r"; its layers: a_hidden, a_out, b_hidden, b_out, head"):
        _planned([("a_hidden", "nope")])
    with pytest.raises(ValueError, match=r"'b_out' runs after 'a_hidden'; give the pair in "
                                         "the order"):
        _planned([("b_out", "a_hidden")])
    with pytest.raises(ValueError, match="overlap"):
        _planned([("a_hidden", "b_hidden"), ("a_out", "head")])
    subclassed = tfmem.AccumModel.wrap(keras.Sequential([keras.Input((4,)),
                                                         keras.layers.Dense(2)]))
    assert subclassed.rematerialize is None  # a Sequential is wrapped as a graph: no error


class _Scaled(keras.layers.Layer):
    """A weight of its own around a sub-layer: its call is not cut inside (stays whole)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(512, activation="relu")

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return self.inner(x) * self.scale


def test_a_layer_that_cannot_be_cut_inside_stays_whole():
    inputs = keras.Input((64,))
    x = keras.layers.Dense(64, name="down")(_Scaled(name="scaled")(inputs))
    accum = tfmem.AccumModel(inputs, keras.layers.Dense(3, name="head")(x),
                             rematerialize="full")
    p = tfmem.plan(accum, global_batch_size=8, memory_budget=2**30)
    assert all(path == "" for path, _ in p.rematerialized)
    assert _inner_graph(accum, "scaled") is None
