"""Every kind of Keras graph plans, against hand counts or the whole model's own gradient trace."""

import math
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import tfmem
from tfmem.memory.guard import UnplannedRunWarning
from tfmem.memory.saved_tensors import traced_saved_tensors

GIB = 2**30


def _plan(model, **kwargs):
    return tfmem.plan(model, global_batch_size=4, memory_budget=GIB, **kwargs)


def _floats(*shape):
    return 4 * math.prod(shape)


def _assert_equals_whole_trace(model):
    """The node-by-node analysis equals one trace of the whole model's forward and backward."""
    p = _plan(model)
    reference = traced_saved_tensors(model)
    assert p.activation_bytes_per_sample == reference.saved_bytes > 0
    return p


def test_keras_ops_nodes():
    inputs = keras.Input((8,))
    a, b = keras.layers.Dense(8)(inputs), keras.layers.Dense(8)(inputs)
    outputs = ops.relu(a + b) * 2.0  # three Operation nodes, not layers
    p = _assert_equals_whole_trace(keras.Model(inputs, outputs))
    # Both Dense keep the one model input; relu keeps its output; + and × 2.0 keep nothing.
    assert p.activation_bytes_per_sample == _floats(8) + _floats(8)
    assert any("Add" in note and "Relu" in note for note in p.notes)


def test_residual_attention_block_with_layer_norm_and_gelu():
    inputs = keras.Input((16, 32))
    attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(inputs, inputs)
    x = keras.layers.LayerNormalization()(attention + inputs)
    hidden = keras.layers.Dense(64, activation="gelu")(x)
    outputs = keras.layers.LayerNormalization()(keras.layers.Dense(32)(hidden) + x)
    p = _assert_equals_whole_trace(keras.Model(inputs, outputs))
    # The softmax output of the attention scores (4 heads × 16 × 16) is among what is kept.
    assert p.activation_bytes_per_sample > _floats(4, 16, 16)
    assert any("MultiHeadAttention" in note for note in p.notes)


def test_nested_models_count_as_their_flat_twin():
    def block():
        inputs = keras.Input((8, 8, 4))
        x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.BatchNormalization()(x))

    inputs = keras.Input((8, 8, 4))
    sequential = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(4, 1),
                                   keras.layers.Activation("tanh")])
    nested = keras.Model(inputs, sequential(block()(inputs)))
    flat_x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    flat_x = keras.layers.BatchNormalization()(flat_x)
    flat_x = keras.layers.Activation("tanh")(keras.layers.Conv2D(4, 1)(flat_x))
    flat = keras.Model(inputs, flat_x)
    assert _plan(nested).activation_bytes_per_sample == _plan(flat).activation_bytes_per_sample
    _assert_equals_whole_trace(nested)


class PositionTable(keras.layers.Layer):
    """A learned position embedding as long as its input: a size known only at run time."""

    def build(self, shape):
        self.table = self.add_weight(shape=(32, shape[-1]), name="table")

    def call(self, x):
        return x + self.table[: ops.shape(x)[1]]


def _encoder(length):
    """A text backbone as keras-hub builds one, on token ids and a padding mask of `length`
    (None: any length)."""
    tokens = keras.Input((length,), dtype="int32", name="token_ids")
    mask = keras.Input((length,), dtype="int32", name="padding_mask")
    x = PositionTable()(keras.layers.Embedding(100, 16)(tokens))
    attention = ops.cast(mask, "bool")[:, None, :]
    x = x + keras.layers.MultiHeadAttention(2, 8)(x, x, attention_mask=attention)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dense(16, activation="gelu")(x)
    return keras.Model({"token_ids": tokens, "padding_mask": mask}, x, name="encoder")


def _classifier(encoder, length=12):
    tokens = keras.Input((length,), dtype="int32")
    mask = keras.Input((length,), dtype="int32")
    x = encoder({"token_ids": tokens, "padding_mask": mask})
    return keras.Model([tokens, mask], keras.layers.Dense(3)(ops.mean(x, axis=1)))


@pytest.mark.parametrize("rematerialize", [None, "full"])
def test_a_nested_model_of_any_length_plans_at_the_length_it_is_called_with(rematerialize):
    # Built for any length, called on 12 tokens: planned as the same model built for 12.
    kwargs = {"rematerialize": rematerialize} if rematerialize else {}
    planned = [_plan(_classifier(_encoder(length)), **kwargs) for length in (None, 12)]
    assert planned[0].activation_bytes_per_sample == planned[1].activation_bytes_per_sample > 0
    assert planned[0].workspace_bytes_per_sample == planned[1].workspace_bytes_per_sample
    assert planned[0].rematerialized == planned[1].rematerialized
    assert bool(planned[0].rematerialized) == bool(rematerialize)
    # Twice the tokens: the sequence's tensors twice the bytes.
    longer = _plan(_classifier(_encoder(None), length=24), **kwargs)
    assert longer.activation_bytes_per_sample > 1.8 * planned[0].activation_bytes_per_sample


def test_a_nested_model_of_any_length_trains_checked_and_rematerialized_exactly():
    keras.utils.set_random_seed(0)
    model = _classifier(_encoder(None))
    reference = _classifier(_encoder(None))  # plain Keras, on the whole batch
    reference.set_weights(model.get_weights())
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 100, (8, 12)).astype("int32")
    mask = (np.arange(12)[None] < rng.integers(3, 13, (8, 1))).astype("int32")
    y = rng.normal(size=(8, 3)).astype("float32")
    accum = tfmem.AccumModel.wrap(model, accumulation_steps=2, rematerialize="full")
    accum.compile(keras.optimizers.SGD(0.1), "mse")
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnplannedRunWarning)  # the check ran
        accum.fit([tokens, mask], y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  memory_budget=GIB)
    reference.fit([tokens, mask], y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert [path for path, _ in accum.rematerialized_segments] == ["encoder"]  # cut inside
    for ours, theirs in zip(accum.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_a_nested_model_called_twice_counts_twice():
    inner_input = keras.Input((6,))
    inner = keras.Model(inner_input, keras.layers.Dense(6, activation="sigmoid")(inner_input))
    inputs = keras.Input((6,))
    once = keras.Model(inputs, inner(inputs))
    twice = keras.Model(inputs, inner(inner(inputs)))
    # Each call keeps its own Dense input and sigmoid output.
    assert _plan(once).activation_bytes_per_sample == 2 * _floats(6)
    assert _plan(twice).activation_bytes_per_sample == 4 * _floats(6) - _floats(6)
    _assert_equals_whole_trace(twice)


def test_a_layer_called_twice_keeps_each_calls_tensors():
    shared = keras.layers.Dense(5, activation="tanh")
    inputs = keras.Input((5,))
    p = _assert_equals_whole_trace(keras.Model(inputs, shared(shared(inputs))))
    # Call 1 keeps the input and its tanh output; call 2's input *is* that output.
    assert p.activation_bytes_per_sample == _floats(5) * 3


def test_several_inputs_and_outputs():
    image, scalars = keras.Input((4, 4, 2), name="image"), keras.Input((3,), name="scalars")
    features = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(3, 3)(image))
    joined = keras.layers.Concatenate()([features, scalars])
    outputs = [keras.layers.Dense(2, activation="softmax")(joined), keras.layers.Dense(1)(joined)]
    p = _assert_equals_whole_trace(keras.Model([image, scalars], outputs))
    # Both inputs, and no loss given: targets shaped as the outputs.
    assert p.input_bytes_per_sample == _floats(4, 4, 2) + _floats(3) + _floats(2) + _floats(1)
    # conv keeps the image; both Dense keep the 6-wide concatenation; softmax its output.
    assert p.activation_bytes_per_sample == _floats(4, 4, 2) + _floats(6) + _floats(2)


@pytest.mark.parametrize("layer", [keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN])
def test_recurrent_layers_keep_each_step(layer):
    inputs = keras.Input((7, 5))
    looped = keras.Model(inputs, layer(6)(inputs))
    # Reference: the same layer unrolled, so the whole-model trace sees every step.
    unrolled = keras.Model(inputs, layer(6, unroll=True)(inputs))
    p = _plan(looped)
    assert p.activation_bytes_per_sample == traced_saved_tensors(unrolled).saved_bytes
    assert any(layer.__name__ + "Cell" in note for note in p.notes)


def test_custom_layer_and_folded_batch_reshape():
    class Folded(keras.layers.Layer):
        """Squares every channel vector, with the batch folded into the rows."""

        def call(self, x):
            rows = ops.reshape(x, (-1, x.shape[-1]))  # (batch × 4 × 4, 3)
            return ops.reshape(ops.square(rows), ops.shape(x))

    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Conv2D(3, 1)(inputs)
    p = _assert_equals_whole_trace(keras.Model(inputs, Folded()(x)))
    # conv keeps the input; square's gradient reads its (folded) input, 4·4·3 per sample.
    assert p.activation_bytes_per_sample == _floats(4, 4, 3) + _floats(4, 4, 3)


class SmallCNN(keras.Model):
    """A subclassed model: its call is Python, not a graph."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(8, 3, activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.head(self.pool(self.conv(x)))


def test_subclassed_model_plans_like_its_functional_twin():
    model = SmallCNN()
    model.build((None, 10, 10, 3))
    inputs = keras.Input((10, 10, 3))
    twin = keras.Model(inputs, model.head(model.pool(model.conv(inputs))))
    p = _plan(model)
    assert p.activation_bytes_per_sample == _plan(twin).activation_bytes_per_sample == (
        _floats(10, 10, 3) + _floats(8, 8, 8) + _floats(8))  # conv in, relu out, head in
    assert p.num_parameters == twin.count_params()
    assert p.input_bytes_per_sample == _floats(10, 10, 3) + _floats(3)  # targets as output
    with pytest.raises(ValueError, match=r"not been built.*input_shape=\(H, W, C\)"):
        _plan(SmallCNN())
    unbuilt = SmallCNN()
    unbuilt.build((None, 10, 10, 3))
    assert _plan(unbuilt, input_shape=(10, 10, 3)).activation_bytes_per_sample == (
        p.activation_bytes_per_sample)


def test_a_call_that_cannot_be_traced_is_an_upper_bound_not_an_error():
    class HostSide(keras.layers.Layer):
        def call(self, x):
            return x * float(np.asarray(x).mean())  # needs a concrete tensor

        def compute_output_shape(self, shape):  # so that a functional graph can hold it
            return shape

    inputs = keras.Input((6,))
    x = keras.layers.Dense(6)(inputs)
    p = _plan(keras.Model(inputs, HostSide()(x)))
    # Dense keeps the input; HostSide is counted as keeping its input and output.
    assert p.activation_bytes_per_sample == 3 * _floats(6)
    assert any("HostSide" in note and "upper bound" in note for note in p.notes)


def _dataset():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)


def test_accum_model_trains_a_graph_with_keras_ops():
    inputs = keras.Input((8,))
    a, b = keras.layers.Dense(8)(inputs), keras.layers.Dense(8)(inputs)
    model = tfmem.AccumModel(inputs, ops.relu(a + b) * 2.0, accumulation_steps="auto")
    model.compile("sgd", "mse")
    model.fit(_dataset(), epochs=1, verbose=0, memory_budget=GIB)
    assert model.accumulation_steps == 1 and int(model.optimizer.iterations) == 2


def test_a_model_the_planner_cannot_plan_warns_once_and_trains():
    inputs = keras.Input((None,))  # a length only known at run time: no plan can be made
    hidden = keras.layers.Dense(8)(ops.expand_dims(inputs, -1))
    model = tfmem.AccumModel(inputs, ops.mean(hidden, axis=1), accumulation_steps=1)
    model.compile("sgd", "mse")
    with pytest.warns(UserWarning, match=r"memory check skipped, the planner could not plan "
                                         r"this run \(UnknownSizeError: A tensor of shape"):
        model.fit(_dataset(), epochs=1, verbose=0, memory_budget=GIB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(_dataset(), epochs=1, verbose=0, memory_budget=GIB)
    assert not [w for w in caught if "memory check skipped" in str(w.message)]  # warned once
    assert int(model.optimizer.iterations) == 4
    auto = tfmem.AccumModel(inputs, ops.mean(hidden, axis=1), accumulation_steps="auto")
    auto.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"accumulation_steps='auto'` takes k from the memory "
                                         r"plan.*Set k to a number.*`accumulation_steps=1`"):
        auto.fit(_dataset(), epochs=1, verbose=0, memory_budget=GIB)


class SmallAccumCNN(tfmem.AccumModel):
    """SmallCNN written as users write a subclassed AccumModel: `fit` is what builds it."""

    def __init__(self, accumulation_steps):
        super().__init__(accumulation_steps=accumulation_steps)
        self.conv = keras.layers.Conv2D(8, 3, activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.head(self.pool(self.conv(x)))


@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_an_unbuilt_subclassed_accum_model_is_planned_at_the_data_shapes(data):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 10, 10, 3)).astype("float32")
    y = rng.integers(0, 3, 32)
    fit = (dict(x=x, y=y, batch_size=16) if data == "arrays" else
           dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)))
    reference = SmallCNN()
    reference.build((None, 10, 10, 3))
    expected = tfmem.plan(reference, global_batch_size=16, optimizer="sgd", memory_budget=GIB)
    # A budget that micro-batches of 4 fit and micro-batches of 8 do not: the guard refuses
    # k=1 ...
    fits, too_big = expected.peak_bytes(4, 4), expected.peak_bytes(8, 2)
    assert fits < too_big
    budget = (fits + too_big) / 2
    model = SmallAccumCNN(accumulation_steps=1)
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    with pytest.raises(tfmem.MemoryPlanError, match=r"global batch 16"):
        model.fit(**fit, epochs=1, verbose=0, memory_budget=int(budget / expected.safety))
    # ... and "auto" picks the k that fits, with no "memory check skipped" warning.
    auto = SmallAccumCNN(accumulation_steps="auto")
    auto.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto.fit(**fit, epochs=1, verbose=0, memory_budget=int(budget / expected.safety))
    assert not [w for w in caught if "memory check skipped" in str(w.message)]
    assert auto.accumulation_steps == 4 and int(auto.optimizer.iterations) == 2


_ON_JAX = r"""
import json
import keras
from keras import ops
from tfmem.memory.saved_tensors import saved_tensors, traced_saved_tensors

L = keras.layers
inputs = keras.Input((16, 8))
x = L.Dense(8)(inputs)
y = ops.relu(x) * 2.0 + x
z = L.MultiHeadAttention(num_heads=2, key_dim=4)(L.LayerNormalization()(y), y)
model = keras.Model(inputs, L.Dense(3)(z + y))
walked = saved_tensors(model)
print(json.dumps([keras.backend.backend(), walked.saved_bytes,
                  traced_saved_tensors(model).saved_bytes, walked.fallback_calls]))
"""


def test_on_jax_the_general_path_reads_jax_residuals():
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _ON_JAX], capture_output=True, text=True,
                            timeout=300, cwd=root,
                            env=dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=str(root)))
    assert result.returncode == 0, result.stderr[-2000:]
    backend, walked, whole, fallbacks = json.loads(result.stdout.splitlines()[-1])
    # Node by node (ops nodes, LayerNorm and attention through `jax.vjp`) equals one
    # `jax.vjp` of the whole model; the Dense input alone is 16 × 8 floats.
    assert backend == "jax" and walked == whole > 16 * 8 * 4 and fallbacks == []


def test_a_grouped_convolution_holds_what_xla_holds_and_glibcs_default_heap_keeps():
    from tfmem.runtime.budget import Budget

    inputs = keras.Input((6, 6, 4))
    x = keras.layers.Conv2D(4, 1)(inputs)
    model = keras.Model(inputs, keras.layers.Conv2D(4, 3, padding="same", groups=2)(x))
    fixed, default = (tfmem.plan(model, global_batch_size=4, budget=Budget(
        "cpu", "cpu", GIB, 1, heap_keeps_freed=keeps)) for keeps in (False, True))
    # Its input's copy and gradient and its output's gradient (XLA's convolution backward);
    # with glibc's default heap, kh·kw × its input beside them, kept through the step.
    assert fixed.workspace_bytes_per_sample == 3 * _floats(6, 6, 4)
    assert default.workspace_bytes_per_sample == (3 + 3 * 3) * _floats(6, 6, 4)
    assert any("fix_mmap_threshold" in note for note in default.notes)
    assert not any("fix_mmap_threshold" in note for note in fixed.notes)
    assert fixed.activation_bytes_per_sample == 2 * _floats(6, 6, 4)  # each conv keeps its input


def test_grouped_convolutions_on_a_cpu_add_xla_and_the_dense_kernel_it_makes():
    import re

    import tensorflow as tf

    # A depthwise (32-group) 3×3 convolution's forward and kernel gradient, compiled by XLA
    # as Keras's TensorFlow backend compiles a grouped convolution: the largest buffer of
    # XLA:CPU's optimised program is the dense kernel, 3·3 × 32 × 32 (not 3·3 × 1 × 32).
    x, kernel = tf.zeros((2, 5, 5, 32)), tf.zeros((3, 3, 1, 32))

    @tf.function(jit_compile=True)
    def step(x, kernel):
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            y = tf.nn.convolution(x, kernel, padding="SAME")
        return tape.gradient(y, kernel)

    hlo = step.experimental_get_compiler_ir(x, kernel)(stage="optimized_hlo")
    largest = max(math.prod(int(d) for d in dims.split(","))
                  for dims in re.findall(r"f32\[([\d,]+)\]", hlo))
    assert largest == 3 * 3 * 32 * 32
    inputs = keras.Input((5, 5, 32))
    grouped = keras.Model(inputs, keras.layers.Conv2D(32, 3, padding="same", groups=32)(inputs))
    depthwise = keras.Model(inputs, keras.layers.DepthwiseConv2D(3, padding="same")(inputs))
    # The same variables (kernel, bias); on a CPU the grouped one adds XLA's runtime and the
    # dense kernel, whatever the batch; an accelerator's plan has no runtime term.
    added = _plan(grouped).runtime_bytes - _plan(depthwise).runtime_bytes
    assert added == 100 * 2**20 + 4 * largest
    assert tfmem.plan(grouped, global_batch_size=4, device="t4").runtime_bytes == 0
