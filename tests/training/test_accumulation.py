"""AccumModel: k micro-batches in one step == one plain Keras step on the whole batch.

References are plain `keras.Model`s trained on the same global batches from the
same initial weights, and hand-computed formulas (BatchNorm statistics, SGD
updates under a learning-rate schedule).
"""

import functools
import re

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfmem
from tfmem import cli
from tests.training import remat_cases

# float32 exactness budget of the issue: relative difference on the weights.
RTOL = 1e-5


def _dense(cls=keras.Model, batch_norm=False, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization(momentum=0.9)(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    return cls(inputs, outputs, **kwargs)


def _conv(cls=keras.Model, **kwargs):
    inputs = keras.Input((8, 8, 2))
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    hidden = keras.layers.Conv2D(4, 3, strides=2)(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    return cls(inputs, outputs, **kwargs)


def _pair(builder, k, **compile_kwargs):
    """An AccumModel and a plain model with identical initial weights, compiled alike."""
    keras.utils.set_random_seed(1)
    accum = builder(tfmem.AccumModel, accumulation_steps=k)
    plain = builder()
    plain.set_weights(accum.get_weights())
    for model in (accum, plain):
        model.compile(**{k_: (v() if callable(v) else v) for k_, v in compile_kwargs.items()})
    return accum, plain


def _rel_diff(weights, reference):
    return max(
        float(np.max(np.abs(w - r)) / max(np.max(np.abs(r)), 1e-12))
        for w, r in zip(weights, reference)
    )


def _data(shape, num, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, *shape)).astype("float32")
    y = rng.normal(size=(num, outputs)).astype("float32")
    weights = rng.uniform(0.0, 2.0, size=(num,)).astype("float32")
    weights[::5] = 0.0  # zero weights must not change the normaliser either
    return x, y, weights


class _CountBatches(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


@pytest.mark.parametrize(
    "builder,shape,optimizer,weighted",
    [
        (_dense, (6,), "sgd", False),
        (_dense, (6,), "sgd", True),
        (_dense, (6,), "adam", False),
        (_dense, (6,), "adam", True),
        (_conv, (8, 8, 2), "sgd", False),
        (_conv, (8, 8, 2), "adam", True),
    ],
)
def test_matches_plain_big_batch_steps(builder, shape, optimizer, weighted):
    k, global_batch, num_updates = 4, 16, 3
    x, y, w = _data(shape, global_batch * num_updates)
    accum, plain = _pair(
        builder, k, optimizer=lambda: keras.optimizers.get(optimizer), loss="mse",
        metrics=["mae"],
    )
    histories, counters = [], []
    for model in (accum, plain):
        counter = _CountBatches()
        histories.append(
            model.fit(
                x, y, sample_weight=w if weighted else None, batch_size=global_batch,
                shuffle=False, verbose=0, callbacks=[counter],
            ).history
        )
        counters.append(counter.count)
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL
    # One real update per global batch: optimizer step, callbacks, logged loss/metrics.
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == num_updates
    assert counters == [num_updates, num_updates]
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=RTOL)
    np.testing.assert_allclose(histories[0]["mae"], histories[1]["mae"], rtol=RTOL)


def test_batch_norm_moving_statistics_average_over_window():
    k, momentum = 4, 0.9
    x, y, _ = _data((6,), 16)
    keras.utils.set_random_seed(2)
    model = _dense(tfmem.AccumModel, batch_norm=True, accumulation_steps=k)
    model.compile("sgd", "mse")
    bn = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    bn.moving_mean.assign(np.linspace(-1, 1, 8).astype("float32"))
    bn.moving_variance.assign(np.linspace(0.5, 2, 8).astype("float32"))
    start_mean, start_var = bn.moving_mean.numpy(), bn.moving_variance.numpy()
    kernel, bias = (v.numpy() for v in model.layers[1].weights)  # before the update
    hidden = np.tanh(x @ kernel + bias).reshape(k, 16 // k, 8)
    micro_means, micro_vars = hidden.mean(axis=1), hidden.var(axis=1)  # biased, as Keras

    model.train_on_batch(x, y)

    # s <- momentum * s + (1 - momentum) * mean_i(stat_i): one step per window.
    expected_mean = momentum * start_mean + (1 - momentum) * micro_means.mean(axis=0)
    expected_var = momentum * start_var + (1 - momentum) * micro_vars.mean(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), expected_var, rtol=1e-5, atol=1e-6)
    # ... and not k chained momentum steps (what a naive loop would leave).
    chained = start_mean
    for micro_mean in micro_means:
        chained = momentum * chained + (1 - momentum) * micro_mean
    assert np.max(np.abs(chained - expected_mean)) > 1e-2


class _PartlyUsed(keras.layers.Layer):
    """A dense layer with a second weight its call never reads, so it gets no gradient."""

    def build(self, input_shape):
        self.kernel = self.add_weight((input_shape[-1], 3), initializer="glorot_uniform")
        self.unused = self.add_weight((3,), initializer="ones")

    def call(self, inputs):
        return inputs @ self.kernel


def _partly_used(cls=keras.Model, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return cls(inputs, _PartlyUsed()(hidden), **kwargs)


@pytest.mark.parametrize("run_eagerly,jit_compile", [(False, False), (True, False),
                                                     (False, True)])
def test_weight_without_gradient_is_left_out_of_the_update(run_eagerly, jit_compile):
    # AdamW decays every weight it gets a gradient for, a zero one too; a weight whose gradient
    # is None (as in a plain step) is left out, so it keeps its initial ones.
    x, y, w = _data((6,), 32)
    accum, plain = _pair(
        _partly_used, 4, optimizer=lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
        loss="mse", run_eagerly=run_eagerly, jit_compile=jit_compile,
    )
    for model in (accum, plain):
        model.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)
        np.testing.assert_array_equal(model.layers[-1].unused.numpy(), np.ones(3))
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL


def test_learning_rate_schedule_counts_real_updates():
    # y = w·x with x = 1, target 0, MSE: grad = 2w, so SGD gives w <- w (1 - 2 lr).
    k, num_updates = 4, 5
    inputs = keras.Input((1,))
    model = tfmem.AccumModel(
        inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs),
        accumulation_steps=k,
    )
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.01])
    model.compile(keras.optimizers.SGD(schedule), "mse")
    kernels = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: kernels.append(model.weights[0].numpy().item())
    )
    x = np.ones((8 * num_updates, 1), "float32")
    model.fit(x, 0 * x, batch_size=8, shuffle=False, verbose=0, callbacks=[callback])
    ratios = np.array(kernels) / np.array([1.0] + kernels[:-1])
    # Updates 1..3 run at steps 0..2 (<= boundary 2): lr 0.1; updates 4, 5: lr 0.01.
    np.testing.assert_allclose(ratios, [0.8, 0.8, 0.8, 0.98, 0.98], rtol=1e-6)
    assert int(model.optimizer.iterations) == num_updates


@pytest.fixture
def dtype_policy():
    yield keras.mixed_precision.set_dtype_policy
    keras.mixed_precision.set_dtype_policy("float32")


def test_float16_non_finite_micro_batch_skips_whole_update_and_halves_scale(dtype_policy):
    dtype_policy("mixed_float16")
    k = 4
    x, y, _ = _data((6,), 16)
    accum, plain = _pair(_dense, k, optimizer="sgd", loss="mse")
    assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    for model in (accum, plain):
        model.optimizer.build(model.trainable_variables)
    before, scale = accum.get_weights(), float(accum.optimizer.dynamic_scale)
    poisoned = x.copy()
    poisoned[9, 2] = np.inf  # third of four micro-batches; the other three are finite
    accum.train_on_batch(poisoned, y)
    for weight, start in zip(accum.get_weights(), before):
        np.testing.assert_array_equal(weight, start)
    assert float(accum.optimizer.dynamic_scale) == scale / 2
    assert int(accum.optimizer.iterations) == 0
    # A finite window is applied, unscaled once, like a float16 big-batch step.
    accum.train_on_batch(x, y)
    plain.optimizer.dynamic_scale.assign(scale / 2)
    plain.train_on_batch(x, y)
    assert int(accum.optimizer.iterations) == 1
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= 1e-3
    assert _rel_diff(accum.get_weights(), before) > 1e-3


def test_bfloat16_matches_plain_big_batch(dtype_policy):
    dtype_policy("mixed_bfloat16")
    x, y, w = _data((8, 8, 2), 32)
    accum, plain = _pair(_conv, 4, optimizer="adam", loss="mse")
    for model in (accum, plain):
        model.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= 2e-2


def test_mirrored_strategy_matches_single_device(two_cpu_strategy):
    strategy = two_cpu_strategy
    x, y, w = _data((6,), 48)
    keras.utils.set_random_seed(3)
    plain = _dense()
    plain.compile("adam", "mse")
    with strategy.scope():
        accum = _dense(tfmem.AccumModel, accumulation_steps=2)
        accum.set_weights(plain.get_weights())
        accum.compile("adam", "mse")
    assert accum.distribute_strategy.num_replicas_in_sync == 2
    for model in (accum, plain):  # global batch 16 = 2 replicas × 2 micro-batches × 4
        model.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL
    assert accum.optimizer.iterations.numpy() == 3


def test_jit_compile_matches_plain_big_batch():
    x, y, _ = _data((8, 8, 2), 32)
    accum, plain = _pair(_conv, 4, optimizer="adam", loss="mse")
    accum.compile("adam", "mse", jit_compile=True)
    for model in (accum, plain):
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert accum.jit_compile
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL


@functools.cache
def _traced_step(k):
    """The graph of a dense AccumModel's train_step with `k` steps, for a batch of 16."""
    model = _dense(tfmem.AccumModel, accumulation_steps=k)
    model.compile("sgd", "mse")
    model.optimizer.build(model.trainable_variables)
    spec = (tf.TensorSpec((16, 6)), tf.TensorSpec((16, 3)))
    # Traced as Keras traces its steps: without AutoGraph.
    return tf.function(model.train_step, autograph=False).get_concrete_function(spec).graph


def test_graph_size_does_not_grow_with_accumulation_steps():
    sizes = []
    for k in (2, 8):
        graph = _traced_step(k)
        library = graph.as_graph_def().library.function
        sizes.append(len(graph.as_graph_def().node) + sum(len(f.node_def) for f in library))
    assert sizes[0] == sizes[1]


def test_one_step_is_keras_own_step_without_a_loop():
    x, y, w = _data((6,), 48)
    accum, plain = _pair(_dense, 1, optimizer="adam", loss="mse", metrics=["mae"])
    histories = [model.fit(x, y, sample_weight=w, batch_size=16, shuffle=False,
                           verbose=0).history for model in (accum, plain)]
    # The same computation as a plain Keras model, so the same bits.
    for mine, reference in zip(accum.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(mine, reference)
    assert histories[0] == histories[1]
    # No while loop and no float32 running sums in the traced step (k = 2 has both).
    ops = {k: {op.type for op in _traced_step(k).get_operations()} for k in (1, 2)}
    assert not ops[1] & {"While", "StatelessWhile"}
    assert ops[2] & {"While", "StatelessWhile"}


def test_save_load_round_trip_continues_training(tmp_path):
    x, y, w = _data((6,), 64)
    keras.utils.set_random_seed(4)
    model = _dense(tfmem.AccumModel, batch_norm=True, accumulation_steps=2)
    reference = _dense(tfmem.AccumModel, batch_norm=True, accumulation_steps=2)
    reference.set_weights(model.get_weights())
    for m in (model, reference):
        m.compile("adam", "mse", metrics=["mae"])
    model.fit(x[:32], y[:32], sample_weight=w[:32], batch_size=16, shuffle=False, verbose=0)
    path = tmp_path / "accum.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, tfmem.AccumModel) and restored.accumulation_steps == 2
    assert tfmem.AccumModel.from_config(model.get_config()).accumulation_steps == 2
    restored.fit(x[32:], y[32:], sample_weight=w[32:], batch_size=16, shuffle=False, verbose=0)
    reference.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations) == 4
    assert _rel_diff(restored.get_weights(), reference.get_weights()) <= RTOL


def test_wrap_shares_layers_of_an_existing_model():
    keras.utils.set_random_seed(5)
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    wrapped = tfmem.AccumModel.wrap(base, accumulation_steps=4)
    assert wrapped.accumulation_steps == 4 and wrapped.name == base.name
    assert [id(v) for v in wrapped.weights] == [id(v) for v in base.weights]
    x, _, _ = _data((6,), 5)
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), base.predict(x, verbose=0))

    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(TypeError, match="keras.Input"):
        tfmem.AccumModel.wrap(Subclassed(), accumulation_steps=2)


@pytest.mark.parametrize("steps", [0, -2, 2.5, "4", True])
def test_rejects_bad_accumulation_steps(steps):
    with pytest.raises(ValueError, match="accumulation_steps"):
        _dense(tfmem.AccumModel, accumulation_steps=steps)


def test_static_batch_not_divisible_names_both_and_nearest_sizes():
    x, y, _ = _data((6,), 20)
    model = _dense(tfmem.AccumModel, accumulation_steps=4)
    model.compile("sgd", "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10, drop_remainder=True)
    with pytest.raises(ValueError, match=r"`global_batch_size` \(10\) must be divisible by "
                                         r"replicas × accumulation_steps \(1 × 4 = 4\)\. Try 8 "
                                         r"or 12\. If this is the last batch of an epoch"):
        model.fit(dataset, verbose=0)


def test_dynamic_partial_last_batch_fails_the_step_with_advice():
    x, y, _ = _data((6,), 18)  # batches of 8, 8, then 2: 2 % 4 != 0
    model = _dense(tfmem.AccumModel, accumulation_steps=4)
    model.compile("sgd", "mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="drop_remainder=True"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)


def test_a_dynamic_batch_that_k_does_not_divide_is_named_with_its_size():
    x, y, _ = _data((6,), 64)
    model = _dense(tfmem.AccumModel, accumulation_steps=3)
    model.compile("sgd", "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # a batch of unknown size
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        model.fit(dataset, verbose=0)
    assert re.search(r"the batch of this step \(64\) must be divisible by replicas × "
                     r"accumulation_steps \(1 × 3 = 3\)\. Try 63 or 66 as the batch size\.",
                     caught.value.message), caught.value.message
    assert cli.one_line(caught.value).startswith("AccumModel: the batch of this step (64)")


def test_rejects_double_accumulation():
    x, y, _ = _data((6,), 8)
    model = _dense(tfmem.AccumModel, accumulation_steps=2)
    model.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), "mse")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        model.train_on_batch(x, y)


@pytest.fixture(scope="module")
def one_device_normalized():
    """`remat_cases.normalized`'s model (not synchronized) trained on one device on the rows
    of `remat_cases.data()` in the order of two replicas' micro-batches."""
    x, y = remat_cases.data()
    rows = remat_cases.by_replica_micro_batches(len(x))
    one_device = remat_cases.normalized(False)
    one_device.fit(x[rows], y[rows], batch_size=16, shuffle=False, verbose=0)
    return one_device


@pytest.mark.parametrize("rematerialize", [None, "full"])
def test_a_synchronized_batch_norm_under_mirrored_strategy_steps_on_its_micro_batches(
        two_cpu_strategy, one_device_normalized, rematerialize):
    # A synchronized BatchNormalization all-reduces its moments across the replicas: under
    # MirroredStrategy a merge call, which TensorFlow cannot make inside the micro-step loop.
    # The step then holds its micro-steps one after another. Each replica takes 8 rows of a
    # batch of 16 and micro-batches of 4: micro-batch 0 normalizes rows 0-3 and 8-11 together,
    # as one device's micro-batch of those 8 rows does.
    x, y = remat_cases.data()
    one_device = one_device_normalized
    with two_cpu_strategy.scope():
        mirrored = remat_cases.normalized(True, rematerialize)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.warns(UserWarning, match="synchronizes the replicas.*2 micro-steps one after"):
        mirrored.fit(dataset, epochs=1, shuffle=False, verbose=0)
    # The all-reduce computes the variance as E[x²] - E[x]², one device from the deviations:
    # a difference of rounding. Without synchronizing, the weights end about 50% apart.
    assert _rel_diff(mirrored.get_weights(), one_device.get_weights()) <= RTOL
    assert mirrored.optimizer.iterations.numpy() == 3
    if rematerialize:
        assert mirrored.rematerialized_segments
