"""Every private Keras/TensorFlow attribute tfmem relies on still exists and behaves as assumed."""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmem import _keras_internals as internals

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _functional():
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
    hidden = keras.layers.Dense(4, name="dense")(keras.layers.Concatenate()([inputs["a"], inputs["b"]]))
    outputs = [keras.layers.Dense(1, name="out1")(hidden), keras.layers.Dense(2, name="out2")(hidden)]
    return keras.Model(inputs, outputs)


def test_functional_structs_keep_the_nesting():
    inputs_struct, outputs_struct = internals.functional_structs(_functional())
    assert isinstance(inputs_struct, dict) and sorted(inputs_struct) == ["a", "b"]
    assert isinstance(outputs_struct, list) and len(outputs_struct) == 2


def test_call_has_training_arg_reads_the_call_signature():
    class Plain(keras.layers.Layer):
        def call(self, x):
            return x

    class Training(keras.layers.Layer):
        def call(self, x, training=None):
            return x

    assert internals.call_has_training_arg(Training())
    assert not internals.call_has_training_arg(Plain())


def test_compute_loss_is_the_compiled_loss_and_leaves_the_tracker_alone():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].set_weights([np.array([[1.0], [2.0]], "float32")])
    model.compile("sgd", "mse")
    x, y = np.array([[1.0, 1.0], [0.0, 1.0]], "float32"), np.array([[0.0], [0.0]], "float32")
    y_pred = model(x)
    loss = internals.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None,
                                  training=True)
    assert float(loss) == pytest.approx((3.0**2 + 2.0**2) / 2)  # hand-computed MSE
    tracker = internals.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert float(tracker.count) == 0  # the tracker was not updated


def test_compiled_losses_lists_each_loss_once_built():
    model = _functional()
    model.compile("sgd", loss=["mse", keras.losses.MeanAbsoluteError(reduction="sum")])
    assert internals.compiled_losses(model) == []  # built on the first call
    data = {"a": np.zeros((4, 3)), "b": np.zeros((4, 2))}
    model.train_on_batch(data, [np.zeros((4, 1)), np.zeros((4, 2))])
    losses = internals.compiled_losses(model)
    assert [getattr(loss, "reduction", None) for _, loss in losses][1] == "sum"
    assert len(losses) == 2
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    uncompiled.compile("sgd")  # no loss: compute_loss is the user's
    assert internals.compiled_losses(uncompiled) == []


def test_compiled_metrics_are_the_metrics_compile_was_given_before_any_step():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    iou = keras.metrics.MeanIoU(3)
    model.compile("sgd", "mse", metrics=[iou], weighted_metrics=["mae"])
    assert internals.compiled_metrics(model) == [iou, "mae"]
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert internals.compiled_metrics(uncompiled) == []
    uncompiled.compile("sgd", "mse")
    assert internals.compiled_metrics(uncompiled) == []


def test_compiled_loss_entries_are_what_the_compiled_loss_calls_and_its_metrics_align():
    model = _functional()
    model.compile("sgd", loss=["mse", "mae"], loss_weights=[0.5, 2.0])
    assert internals.compiled_loss_entries(model) is None  # built on the first call
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    uncompiled.compile("sgd")  # no loss: compute_loss is the user's
    assert internals.compiled_loss_entries(uncompiled) == []
    data = {"a": np.ones((4, 3)), "b": np.ones((4, 2))}
    y = [np.zeros((4, 1)), np.zeros((4, 2))]
    model.train_on_batch(data, y)
    entries = internals.compiled_loss_entries(model)
    assert [entry[2] for entry in entries] == [0.5, 2.0]  # (path, loss, weight, name)
    metrics = internals.compiled_loss_metrics(model)
    assert [m.name for m in metrics] == [f"{entry[3]}_loss" for entry in entries]
    calls = []

    def doubled(y_true, y_pred, sample_weight=None, loss=entries[1][1]):
        calls.append(1)
        return 2 * loss(y_true, y_pred, sample_weight)

    y_pred = model(data)
    before = internals.compute_loss(model, x=data, y=y, y_pred=y_pred, sample_weight=None)
    entries[1] = entries[1]._replace(loss=doubled)
    after = internals.compute_loss(model, x=data, y=y, y_pred=y_pred, sample_weight=None)
    mae = float(np.mean(np.abs(np.asarray(y_pred[1]))))
    assert calls == [1]
    assert float(after) - float(before) == pytest.approx(2.0 * mae, rel=1e-5)


def test_keras_mask_and_the_reduction_helpers_are_keras_loss_arithmetic():
    tokens = np.array([[3, 4, 0, 0], [5, 0, 0, 0]], "int32")
    embedded = keras.layers.Embedding(8, 2, mask_zero=True)(tokens)
    mask = internals.keras_mask(embedded)
    np.testing.assert_array_equal(np.asarray(mask), tokens != 0)
    assert internals.keras_mask(tf.constant([1.0])) is None
    values = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], "float32")
    weights = np.array([2.0, 1.0], "float32")
    masked = internals.reduce_weighted_values(values, None, mask, "sum_over_batch_size",
                                              "float32")
    assert float(masked) == pytest.approx((1 + 2 + 5) / 3)  # over the 3 valid elements
    summed = internals.reduce_weighted_values(values, weights[:, None], None, "sum", "float32")
    assert float(summed) == pytest.approx(2 * 10 + 26)
    merged = internals.masked_sample_weight(tf.constant(weights[:, None]), tf.constant(mask),
                                            "float32", "mean_with_sample_weight")
    np.testing.assert_array_equal(np.asarray(merged), [[2, 2, 0, 0], [1, 0, 0, 0]])


def test_flatten_layers_is_recursive_and_own_variables_are_not():
    inner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="inner_dense")], name="inner")
    inputs = keras.Input((2,))
    outer = keras.Model(inputs, keras.layers.Dense(1, name="head")(inner(inputs)))
    names = [layer.name for layer in internals.flatten_layers(outer)]
    assert "inner_dense" in names and "head" in names and outer.name not in names
    assert internals.own_trainable_variables(inner) == []
    assert len(internals.own_trainable_variables(outer.get_layer("head"))) == 2


def test_functional_graph_of_sequential_and_functional_models():
    sequential = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    graph = internals.functional_of(sequential)
    assert internals.is_graph_network(graph)
    assert not internals.is_graph_network(sequential)
    depths = internals.nodes_by_depth(graph)
    layers = {node.operation.name for nodes in depths.values() for node in nodes}
    assert sequential.layers[0].name in layers
    functional = _functional()
    assert internals.functional_of(functional) is functional


def test_distribute_strategy_and_multi_worker_mode(two_cpu_strategy):
    with two_cpu_strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert internals.distribute_strategy(model) is two_cpu_strategy
    assert internals.in_multi_worker_mode(two_cpu_strategy) is False


def test_symbolic_build_hook_is_the_tensorflow_trainer_method():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    assert callable(getattr(TensorFlowTrainer, internals.SYMBOLIC_BUILD_HOOK))


def test_epoch_dataset_is_what_the_epoch_iterator_reads():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    x, y = np.ones((6, 2), "float32"), np.zeros((6, 3), "float32")
    iterator = TFEpochIterator(distribute_strategy=tf.distribute.get_strategy(), x=x, y=y,
                               batch_size=4)
    spec = internals.epoch_dataset(iterator).element_spec
    assert [(tuple(s.shape), s.dtype) for s in spec] == [((None, 2), tf.float32),
                                                          ((None, 3), tf.float32)]
    batch = internals.first_batch(iterator)  # the dataset the batches come from
    assert [tuple(t.shape) for t in batch] == [(4, 2), (4, 3)]


def test_functional_class_and_how_keras_tells_a_functional_construction():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    assert type(keras.Model(inputs, outputs)) is internals.functional_class()
    assert issubclass(internals.functional_class(), keras.Model)
    assert internals.functional_init_arguments((inputs, outputs), {})
    assert internals.functional_init_arguments((), {"inputs": inputs, "outputs": outputs})
    assert internals.functional_init_arguments((inputs,), {"outputs": outputs})
    assert not internals.functional_init_arguments((), {"name": "net"})


def test_symbolic_build_creates_the_weights_without_running_the_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)
            self.bn = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            return self.bn(self.dense(x), training=training)

    model = Net()
    model.compile("sgd", "mse")
    assert model.weights == []
    internals.symbolic_build(model, (np.ones((4, 2), "float32"), np.ones((4, 3), "float32")))
    assert [tuple(w.shape) for w in model.dense.weights] == [(2, 3), (3,)]
    np.testing.assert_array_equal(model.bn.moving_mean.numpy(), np.zeros(3))  # not run


def test_clone_model_replays_the_graph_through_the_hook():
    replays = []

    class Recording(internals.functional_class()):
        pass

    def hook(self, *args, **kwargs):
        replays.append(self)
        return getattr(internals.functional_class(), internals.GRAPH_REPLAY_HOOK)(
            self, *args, **kwargs)

    setattr(Recording, internals.GRAPH_REPLAY_HOOK, hook)
    inputs = keras.Input((2,))
    model = Recording(inputs, keras.layers.Dense(1)(inputs), name="recorded")
    replays.clear()
    clone = keras.models.clone_model(model)
    # The original replays its graph; the copy is built from that replay, with its name.
    assert replays[0] is model and clone.name == "recorded"


# The JAX internals, in one process on the Keras JAX backend (this session runs on TensorFlow):
# each check prints one line.
_JAX_PROGRAM = textwrap.dedent(
    """
    import keras, numpy as np
    from tfmem import _keras_internals as internals

    # update_metrics_variables: the loss tracker's and the MAE metric's row counts.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    model.train_on_batch(np.zeros((2, 2)), np.zeros((2, 1)))  # builds the metrics
    before = [v.value for v in model.metrics_variables]
    x, y = np.ones((3, 2), "float32"), np.ones((3, 1), "float32")
    _, after = internals.update_metrics_variables(
        model, before, np.float32(2.0), x, y, np.zeros((3, 1), "float32"), None)
    counts = [float(b) for b, a, v in zip(before, after, model.metrics_variables)
              if v.path.endswith("count")]
    updated = [float(a) for b, a, v in zip(before, after, model.metrics_variables)
               if v.path.endswith("count")]
    print("metrics", [u - c for c, u in zip(counts, updated)])

    # jax_state_shardings and jax_train_function.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.train_on_batch(np.zeros((2, 2)), np.zeros((2, 1)))
    shardings = internals.jax_state_shardings(model)
    print("shardings", len(shardings), len(shardings[0]) == len(model.trainable_variables))
    calls = []
    def step(state, data):
        calls.append(data)
        return {"loss": 0.0}, state
    model.steps_per_execution = 3
    function = internals.jax_train_function(model, step)
    logs, state = function("state", iter([1, 2, 3, 4]))
    print("train_function", calls, state)
    """
)


@pytest.fixture(scope="module")
def jax_internals():
    """The lines `_JAX_PROGRAM` printed, by their first word."""
    result = subprocess.run(
        [sys.executable, "-c", _JAX_PROGRAM], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return dict(line.split(" ", 1) for line in result.stdout.splitlines()
                if line.startswith(("metrics ", "shardings ", "train_function ")))


def test_jax_stateless_metrics_update_counts_the_rows(jax_internals):
    # the loss tracker and the MAE metric each counted the 3 rows of the batch
    assert jax_internals["metrics"] == "[3.0, 3.0]"


def test_a_missing_internal_raises_naming_it_and_the_tested_versions():
    class NotAModel:
        pass

    with pytest.raises(internals.KerasInternalsError, match=r"NotAModel\._loss_tracker.*keras>="):
        internals.loss_tracker(NotAModel())


def test_jax_train_function_and_state_shardings(jax_internals):
    # four state parts (trainable, non-trainable, optimizer, metrics); one step per batch of
    # a steps_per_execution window, the state threaded through
    assert jax_internals["shardings"] == "4 True"
    assert jax_internals["train_function"] == "[1, 2, 3] state"


def _pending():
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("uninitialized_variables") or []


def test_shapes_only_builds_without_weights_and_leaves_nothing_to_initialise_later():
    with keras.StatelessScope(initialize_variables=False):  # the user's own deferred layer
        outer = keras.layers.Dense(3)
        outer.build((None, 2))
    with internals.shapes_only():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512)])
    assert [id(v) for v in _pending()] == [id(v) for v in outer.weights]
    # Any outermost stateless scope initialises what is pending: the user's layer, not the
    # model built for its shapes.
    with keras.StatelessScope():
        pass
    assert _pending() == []
    # A variable's stored value: None until it is initialised (reading `.value` before that
    # computes a fresh one each time).
    assert outer.kernel._value is not None
    assert all(weight._value is None for weight in model.weights)


def test_concatenation_reads_the_axis_and_pieces_of_both_kinds_of_concatenate():
    a, b = keras.Input((4, 3)), keras.Input((4, 5))
    by_op = keras.ops.concatenate([a, b], axis=-1)
    by_layer = keras.layers.Concatenate(axis=1)([a, a])
    other = keras.layers.Dense(2)(a)
    model = keras.Model([a, b], [by_op, by_layer, other])
    found = {node.operation.name: internals.concatenation(node)
             for depth in internals.nodes_by_depth(model).values() for node in depth
             if node.operation is not None and not node.is_input}
    joins = {name: (axis, [id(t) for t in tensors]) for name, value in found.items()
             if value is not None for axis, tensors in [value]}
    assert sorted(joins.values()) == sorted([(2, [id(a), id(b)]), (1, [id(a), id(a)])])
    assert sum(value is None for value in found.values()) == 1  # the Dense


def test_node_of_is_the_call_that_made_a_tensor():
    dense = keras.layers.Dense(2)
    a = keras.Input((4,))
    first, second = dense(a), dense(keras.ops.relu(a))
    nodes = [internals.node_of(first), internals.node_of(second)]
    assert [node.operation for node in nodes] == [dense, dense]
    assert nodes[0].outputs[0] is first and nodes[1].outputs[0] is second
    assert nodes[1].input_tensors[0] is not a  # the ReLU's output, not the input


def test_in_xla_compilation_tells_a_jit_compiled_function():
    seen = {}

    def traced(name):
        def function(x):
            seen[name] = internals.in_xla_compilation()
            return x + 1.0
        return function

    tf.function(traced("xla"), jit_compile=True)(tf.ones(2))
    tf.function(traced("graph"))(tf.ones(2))
    assert seen == {"xla": True, "graph": False}


def test_a_collecting_stateless_scope_keeps_the_losses_and_the_layer_their_ids():
    class Penalized(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    layer = Penalized()
    with internals.stateless_scope([], collect_losses=True) as scope:
        layer(np.ones((2, 3), "float32"))
        assert [float(loss) for loss in layer.losses] == [6.0]
    (loss,) = scope.losses
    assert id(loss) in internals.loss_ids(layer)
    with internals.stateless_scope([]) as scope:  # not collecting: dropped
        layer(np.ones((2, 3), "float32"))
    assert scope.losses == []


def test_replace_op_input_rewires_a_traced_op():
    graph = tf.Graph()
    with graph.as_default():
        one, two = tf.constant(1.0), tf.constant(2.0)
        copied = tf.identity(one)
        internals.replace_op_input(copied.op, 0, two)
        assert copied.op.inputs[0].name == two.name
        with tf.compat.v1.Session(graph=graph) as session:
            assert session.run(copied) == 2.0


def test_replace_call_runs_for_this_instance_with_training_handed_on():
    class Scaled(keras.layers.Layer):
        def call(self, x, training=None):
            return x * 2.0

    seen = []
    layer, other = Scaled(), Scaled()
    original = layer.call

    def call(*args, **kwargs):
        seen.append(kwargs.get("training"))
        return original(*args, **kwargs) + 1.0

    internals.replace_call(layer, call)
    x = np.array([[1.0, 2.0]], "float32")
    np.testing.assert_array_equal(layer(x, training=True), [[3.0, 5.0]])  # 2x + 1
    np.testing.assert_array_equal(other(x, training=True), [[2.0, 4.0]])  # not replaced
    symbolic = layer(keras.Input((2,)))
    assert seen[0] is True and tuple(symbolic.shape) == (None, 2) and len(seen) == 2


def test_functional_bases_puts_the_functional_form_where_keras_puts_functional():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)

    class KerasSubclass(keras.Model):  # what Keras itself does to its subclasses
        pass

    KerasSubclass(inputs, outputs)
    assert KerasSubclass.__bases__ == (internals.functional_class(),)

    class Base(keras.Model):
        pass

    class BaseFunctional(Base, internals.functional_class()):
        pass

    class Sub(Base):
        pass

    with pytest.raises(RuntimeError, match="construction failed"):
        with internals.functional_bases(Sub, Base, BaseFunctional):
            assert Sub.__bases__ == (BaseFunctional,)
            raise RuntimeError("construction failed")
    assert Sub.__bases__ == (Base,)  # put back
    with internals.functional_bases(Sub, Base, BaseFunctional):
        model = Sub(inputs, outputs)
    assert Sub.__bases__ == (BaseFunctional,) and Base.__bases__ == (keras.Model,)
    assert isinstance(model, internals.functional_class())
    np.testing.assert_array_equal(model(np.ones((1, 2), "float32")),
                                  model.layers[-1](np.ones((1, 2), "float32")))
