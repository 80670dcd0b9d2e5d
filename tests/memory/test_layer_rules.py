"""Every rule of `layer_rules` equals what the framework's own gradient keeps for that layer."""

import keras
import pytest

from tfmem.memory import layer_rules
from tfmem.memory.saved_tensors import saved_tensors, traced_saved_tensors

L = keras.layers
ACTIVATIONS = sorted(layer_rules._KEEPS_OUTPUT | layer_rules._KEEPS_INPUT | {"linear"})


def _image(make_layer):
    """Input → a trainable 1×1 conv (so a gradient reaches the layer) → the layer."""
    def build():
        inputs = keras.Input((6, 6, 4))
        x = L.Conv2D(4, 1)(inputs)
        return keras.Model(inputs, make_layer()(x))
    return build


def _merge(make_layer):
    def build():
        inputs = keras.Input((6, 6, 4))
        a = L.Conv2D(4, 1)(inputs)
        b = L.Conv2D(4, 1, activation="tanh")(a)
        return keras.Model(inputs, make_layer()([a, b]))
    return build


def _vector(make_layer):
    def build():
        inputs = keras.Input((8,))
        return keras.Model(inputs, make_layer()(L.Dense(8)(inputs)))
    return build


def _sequence(make_layer):
    def build():
        inputs = keras.Input((6, 4))
        return keras.Model(inputs, make_layer()(L.Conv1D(4, 1)(inputs)))
    return build


CASES = {
    **{f"Conv2D-{name}": _image(lambda name=name: L.Conv2D(4, 3, padding="same",
                                                           activation=name))
       for name in ACTIVATIONS},
    **{f"Activation-{name}": _image(lambda name=name: L.Activation(name))
       for name in ACTIVATIONS},
    **{f"Dense-{name}": _vector(lambda name=name: L.Dense(8, activation=name))
       for name in ("relu", "sigmoid", "softmax", "silu")},
    "DepthwiseConv2D": _image(lambda: L.DepthwiseConv2D(3, padding="same")),
    "Conv2D-grouped": _image(lambda: L.Conv2D(4, 3, padding="same", groups=2)),
    "SeparableConv2D": _image(lambda: L.SeparableConv2D(4, 3, padding="same",
                                                        activation="relu")),
    "Conv2DTranspose": _image(lambda: L.Conv2DTranspose(4, 3, strides=2)),
    "EinsumDense": _vector(lambda: L.EinsumDense("ab,bc->ac", output_shape=8)),
    "BatchNormalization": _image(L.BatchNormalization),
    "ReLU": _image(L.ReLU), "ELU": _image(L.ELU), "Softmax": _image(L.Softmax),
    "LeakyReLU": _image(L.LeakyReLU), "MaxPooling2D": _image(L.MaxPooling2D),
    "GlobalAveragePooling2D": _image(L.GlobalAveragePooling2D),
    "UpSampling2D-nearest": _image(L.UpSampling2D),
    "UpSampling2D-bilinear": _image(lambda: L.UpSampling2D(interpolation="bilinear")),
    "Dropout": _image(lambda: L.Dropout(0.5)),
    "ZeroPadding2D": _image(L.ZeroPadding2D), "Cropping2D": _image(L.Cropping2D),
    "Rescaling": _image(lambda: L.Rescaling(0.5)), "Reshape": _image(lambda: L.Reshape((36, 4))),
    "Flatten": _image(L.Flatten), "Permute": _image(lambda: L.Permute((3, 1, 2))),
    "Identity": _image(L.Identity), "RepeatVector": _vector(lambda: L.RepeatVector(3)),
    "Add": _merge(L.Add), "Subtract": _merge(L.Subtract), "Concatenate": _merge(L.Concatenate),
    "Conv1D": _sequence(lambda: L.Conv1D(4, 3, activation="relu")),
    "Conv1DTranspose": _sequence(lambda: L.Conv1DTranspose(4, 3)),
    "DepthwiseConv1D": _sequence(lambda: L.DepthwiseConv1D(3)),
    "SeparableConv1D": _sequence(lambda: L.SeparableConv1D(4, 3, activation="sigmoid")),
    "MaxPooling1D": _sequence(L.MaxPooling1D),
    "GlobalAveragePooling1D": _sequence(L.GlobalAveragePooling1D),
    "ZeroPadding1D": _sequence(L.ZeroPadding1D), "Cropping1D": _sequence(L.Cropping1D),
}


# Mixed precision on a few layers of each kind (casts, float32 upcasts, shared inputs).
MIXED = ("Conv2D-relu", "BatchNormalization", "Add", "MaxPooling2D", "Dense-silu")


@pytest.mark.parametrize("case, precision", [(case, "float32") for case in sorted(CASES)]
                         + [(case, "mixed_float16") for case in MIXED])
def test_rule_equals_the_traced_gradient(case, precision):
    keras.mixed_precision.set_global_policy(precision)
    try:
        model = CASES[case]()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    walked = saved_tensors(model)
    assert not walked.traced_calls, f"no rule fired: {walked.traced_calls}"
    assert walked.saved_bytes == traced_saved_tensors(model).saved_bytes


def test_transient_bytes_holds_each_tensor_until_its_last_reader_by_hand():
    import tensorflow as tf

    from tfmem.memory.gradient_trace import transient_bytes

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 10))  # 40 bytes per sample
        a = tf.exp(x)  # x's only reader but for its shape below: a is written over x
        b = tf.reshape(a, (-1, 10)) * 2.0  # the reshape is a view of a, which c reads too
        c = a + b  # a and b are read for the last time: c is written over b, read only here
        tf.shape(x)  # reads only x's shape: x is not held until here

    def per_sample(tensor):
        shape = tensor.shape
        return 4 * shape[1:].num_elements() if shape.rank and shape[0] is None else 0

    assert c.shape[1:] == (10,)
    # x, then a in x's buffer, then a and b, then c in b's: two tensors of 40 bytes at most.
    # Without the reuse (each op a buffer of its own): x and a, then a, b and c.
    assert transient_bytes(graph.get_operations(), per_sample) == 2 * 40


def test_transient_bytes_runs_only_the_ops_the_results_need_by_hand():
    import tensorflow as tf

    from tfmem.memory.gradient_trace import transient_bytes

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 10))  # 40 bytes per sample
        a = tf.exp(x)
        unused = tf.square(x) * 3.0  # nothing returned reads it: a function never runs it
        b = a * 2.0

    def per_sample(tensor):
        shape = tensor.shape
        return 4 * shape[1:].num_elements() if shape.rank and shape[0] is None else 0

    assert unused.shape[1:] == (10,)
    # Every op: x, a and the square at once (x is read until the square, and by two ops: its
    # buffer is not reused; each product is written over the one tensor only it reads). Only
    # what b needs: x, then a over it (its only reader now), then b over a.
    assert transient_bytes(graph.get_operations(), per_sample) == 3 * 40
    assert transient_bytes(graph.get_operations(), per_sample, [b]) == 1 * 40


def test_swish_transient_leaves_out_the_gradient_of_its_constant_beta():
    # tf.nn.silu's custom gradient also returns beta's gradient (three tensors of the input's
    # size: x², times the incoming gradient, times sigmoid), which no step computes: beta is
    # a constant. What runs, by hand: the backward recomputes sigmoid(beta·x) and holds at
    # its peak the incoming gradient, sigmoid, beta·x and 1 - sigmoid: 4 tensors of the
    # input's size; beta·x·(1 - sigmoid) and the products after it are written over tensors
    # only they read. The input, which the backward keeps, is counted with the kept tensors,
    # so the transient is the peak less it: 3 (4 with beta's gradient).
    from tfmem.memory import gradient_trace

    layer = L.Activation("silu")
    traced = gradient_trace.trace_call_tensorflow(
        lambda xs: layer(xs[0]), [((10,), "float32")], differentiable=[True],
        trainable=[], non_trainable=[])
    assert traced.kept_inputs == (0,)
    assert traced.transient_bytes == 3 * 40


# Layers that keep their input's shape: their transient is traced once on a small copy and
# scaled; each is over the `2 × largest` the workspace counted before, so the test can fail.
SHAPE_KEEPING = {
    "BatchNormalization": L.BatchNormalization,
    "Activation-silu": lambda: L.Activation("silu"),
    "Softmax": L.Softmax,
}


@pytest.mark.parametrize("case", sorted(SHAPE_KEEPING))
def test_a_rule_layers_transient_is_the_layer_traced_at_its_own_size(case):
    from tfmem.memory import gradient_trace

    shape = (10, 12, 24)
    inputs = keras.Input(shape)
    layer = SHAPE_KEEPING[case]()
    model = keras.Model(inputs, layer(L.Conv2D(24, 1)(inputs)))
    walked = saved_tensors(model)
    alone = gradient_trace.trace_call_tensorflow(
        lambda xs: layer(xs[0], training=True), [(shape, "float32")], differentiable=[True],
        trainable=layer.trainable_weights, non_trainable=layer.non_trainable_weights)
    assert not walked.traced_calls  # the rules covered every layer
    assert alone.transient_bytes > 2 * walked.largest_tensor_bytes
    assert walked.workspace_bytes == alone.transient_bytes


@pytest.mark.parametrize("case", ["BatchNormalization", "Softmax"])
def test_a_wide_rule_layer_is_traced_narrower_and_counted_at_least_as_at_its_own_size(case):
    # 200 channels: the copy is traced at 64. Per channel (BatchNorm) that is the same
    # multiple of the input; a softmax's two reductions along the axis are 1/64 of the input
    # each there instead of 1/200: over by 2 × (1/64 - 1/200) of the input at most.
    from tfmem.memory import gradient_trace

    shape = (6, 6, 200)
    inputs = keras.Input(shape)
    layer = SHAPE_KEEPING[case]()
    walked = saved_tensors(keras.Model(inputs, layer(L.Conv2D(200, 1)(inputs))))
    alone = gradient_trace.trace_call_tensorflow(
        lambda xs: layer(xs[0], training=True), [(shape, "float32")], differentiable=[True],
        trainable=layer.trainable_weights, non_trainable=layer.non_trainable_weights)
    over = walked.workspace_bytes - alone.transient_bytes
    if case == "BatchNormalization":
        assert over == 0
    else:
        assert 0 < over <= 2 * (1 / 64 - 1 / 200) * 4 * 6 * 6 * 200 + 4
