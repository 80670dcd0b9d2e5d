"""AccumModel on TensorFlow with gradients that are rows (`tf.IndexedSlices`: an Embedding's).

Keras's optimizers update such a variable row by row (Adam squares each row before duplicate
tokens add up), so the reference is a plain `keras.Model` stepping on the whole global batch:
AccumModel must hand the optimizer the same rows, not their dense sum. Also Keras's own
`test_fit_sparse` (sparse inputs into a Dense layer: its kernel's gradient is rows), run with
an AccumModel in place of its model.
"""

import functools
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.training import placement

VOCABULARY, TOKENS, GLOBAL_BATCH, STEPS = 7, 5, 8, 2
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
}


def _model(cls=keras.Model, **kwargs):
    inputs = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 4, name="embedding")(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(hidden))
    return cls(inputs, outputs, **kwargs)


def _data():
    """Tokens of a small vocabulary (repeated within and across micro-batches); token 0 in
    every sample, so in every micro-batch."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCABULARY, (GLOBAL_BATCH * STEPS, TOKENS)).astype("int32")
    x[:, 0] = 0
    return x, rng.normal(size=(len(x), 2)).astype("float32")


@functools.cache
def _initial_weights() -> list:
    keras.utils.set_random_seed(1)
    return _model().get_weights()


def _train(model, optimizer, **compile_kwargs):
    model.set_weights(_initial_weights())
    model.compile(OPTIMIZERS[optimizer](), "mse", **compile_kwargs)
    extra = dict(check_memory=False) if isinstance(model, tfmem.AccumModel) else {}
    x, y = _data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, **extra)
    return model.get_weights()


@functools.cache
def _plain(optimizer) -> list:
    """Each optimizer's reference: a plain Keras model's weights after the same steps."""
    return _train(_model(), optimizer)


def _update_difference(weights, reference) -> float:
    """The largest difference from `reference`, as a share of the reference's update."""
    return max(float(np.max(np.abs(w - r)) / np.max(np.abs(r - start)))
               for w, r, start in zip(weights, reference, _initial_weights()))


@pytest.mark.parametrize("optimizer, k", [*((name, 2) for name in OPTIMIZERS), ("adam", 4)])
def test_embedding_updates_as_plain_keras_on_the_whole_batch(optimizer, k):
    accum = _train(_model(tfmem.AccumModel, accumulation_steps=k), optimizer)
    assert _update_difference(accum, _plain(optimizer)) <= 1e-5


def test_the_dense_sum_of_the_rows_would_not_be_the_same_update():
    """Why the rows are kept: Adam on the rows' dense sum moves the embedding differently."""
    plain = _plain("adam")
    summed = _model()
    summed.set_weights(_initial_weights())
    summed.compile(OPTIMIZERS["adam"](), "mse")
    x, y = _data()
    for start in range(0, len(x), GLOBAL_BATCH):
        batch = slice(start, start + GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = summed.compute_loss(x=x[batch], y=y[batch], y_pred=summed(x[batch]))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, summed.trainable_variables)]
        summed.optimizer.apply_gradients(zip(grads, summed.trainable_variables))
    assert _update_difference(summed.get_weights(), plain) > 0.1


@pytest.mark.parametrize("how", ["run_eagerly", "jit_compile host loop",
                                 "jit_compile in-graph loop"])
def test_embedding_rows_in_each_way_the_step_runs(how, monkeypatch):
    if how == "jit_compile in-graph loop":
        monkeypatch.setattr(placement, "HOST_LOOP_PLATFORMS", ())
    compile_kwargs = (dict(run_eagerly=True) if how == "run_eagerly"
                      else dict(jit_compile=True))
    accum = _train(_model(tfmem.AccumModel, accumulation_steps=2), "adam", **compile_kwargs)
    assert _update_difference(accum, _plain("adam")) <= 1e-5


def test_embedding_rows_under_mirrored_strategy(two_cpu_strategy):
    # Each replica takes half of every global batch as its own k micro-batches; the optimizer
    # gathers the replicas' rows as it does a plain model's.
    with two_cpu_strategy.scope():
        accum = _train(_model(tfmem.AccumModel, accumulation_steps=2), "adam")
    assert _update_difference(accum, _plain("adam")) <= 1e-5


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


def test_embedding_rows_under_a_loss_scale(mixed_float16):
    # The rows are of the scaled loss, unscaled once by the LossScaleOptimizer, as the sums.
    accum = _model(tfmem.AccumModel, accumulation_steps=2)
    accum_weights = _train(accum, "adam")
    assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 forward passes of a micro-batch and of the whole batch round differently.
    assert _update_difference(accum_weights, _train(_model(), "adam")) <= 1e-3


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_sparse_input_rows_one_per_distinct_column(run_eagerly):
    # A sparse input into a Dense layer looks its kernel up by `tf.nn.embedding_lookup_sparse`,
    # which makes the columns distinct first: one row per column of the batch, so the window's
    # rows are added up by column, as the whole batch's would be.
    def sparse_dense(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(4)
        inputs = keras.Input((6,), sparse=True)
        outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
        model = cls(inputs, outputs, **kwargs)
        model.compile(OPTIMIZERS["adam"](), "mse", run_eagerly=run_eagerly)
        return model

    rng = np.random.default_rng(0)
    x = ((rng.uniform(size=(24, 6)) < 0.3) * rng.normal(size=(24, 6))).astype("float32")
    y = rng.normal(size=(24, 3)).astype("float32")
    plain, accum = sparse_dense(), sparse_dense(tfmem.AccumModel, accumulation_steps=3)
    start = plain.get_weights()
    plain.fit(tf.sparse.from_dense(x), y, batch_size=12, shuffle=False, verbose=0)
    accum.fit(tf.sparse.from_dense(x), y, batch_size=12, shuffle=False, verbose=0,
              check_memory=False)
    assert max(float(np.max(np.abs(w - r)) / np.max(np.abs(r - s)))
               for w, r, s in zip(accum.get_weights(), plain.get_weights(), start)) <= 1e-5


# --- Keras's own test -------------------------------------------------------------------------

class _AccumExample(tfmem.AccumModel):
    """Keras's `trainer_test.ExampleModel` (a Dense layer, no bias, kernel of ones) as an
    AccumModel of 2 micro-batches (Keras's sparse batches have 2 rows)."""

    def __init__(self, units):
        super().__init__(accumulation_steps=2, name="example_model")
        self.dense = keras.layers.Dense(units, use_bias=False, kernel_initializer="ones")

    def call(self, inputs):
        return self.dense(inputs)

    def fit(self, *args, **kwargs):
        return super().fit(*args, check_memory=False, **kwargs)


def _keras_trainer_tests():
    from keras.src.trainers import trainer_test

    return trainer_test


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("generator", ["tf", "scipy", "jax"])
def test_keras_own_fit_sparse_passes_on_accum_model(generator, mode, monkeypatch):
    trainer_test = _keras_trainer_tests()
    monkeypatch.setattr(trainer_test, "ExampleModel", _AccumExample)
    result = unittest.TestResult()
    trainer_test.TestTrainer(f"test_fit_sparse_{generator}_{mode}").run(result)
    assert not result.skipped and result.testsRun == 1
    assert result.wasSuccessful(), [text for _, text in result.errors + result.failures]


def test_embedding_rows_when_the_micro_steps_are_written_out(two_cpu_strategy):
    # A synchronized BatchNormalization under MirroredStrategy writes the step's micro-steps
    # out one after another (no loop). Here its output is multiplied by 0, so the reference is
    # a plain Keras model on the whole batch (the BatchNormalization's own weights left out).
    def normalized(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((TOKENS,), dtype="int32")
        hidden = keras.layers.Embedding(VOCABULARY, 4, name="embedding")(inputs)
        normal = keras.layers.BatchNormalization(synchronized=bool(kwargs))(hidden)
        outputs = (keras.layers.Dense(2, name="head")(keras.layers.Flatten()(hidden))
                   + 0.0 * keras.ops.sum(normal, axis=(1, 2))[:, None])
        model = cls(inputs, outputs, **kwargs)
        model.compile(OPTIMIZERS["adam"](), "mse")
        return model

    x, y = _data()
    plain = normalized()
    with two_cpu_strategy.scope():
        mirrored = normalized(tfmem.AccumModel, accumulation_steps=2)
    start = [np.array(layer.get_weights()[0]) for layer in (plain.get_layer("embedding"),
                                                            plain.get_layer("head"))]
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="one after another"):
        mirrored.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1,
                     verbose=0, check_memory=False)
    for name, first in zip(("embedding", "head"), start):
        reference = plain.get_layer(name).get_weights()[0]
        difference = mirrored.get_layer(name).get_weights()[0] - reference
        assert np.max(np.abs(difference)) <= 1e-5 * np.max(np.abs(reference - first))


def _masked_tokens(cls=keras.Model, **kwargs):
    """Padded tokens (0) masked by the Embedding, a loss per token (counted over the valid
    ones), an activity regulariser on the embedded tokens and a kernel regulariser: the
    embedding's rows come from two gradient groups (the counted loss, the regularisers)."""
    inputs = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 4, mask_zero=True, name="embedding",
                                    activity_regularizer=keras.regularizers.L2(1e-2))(inputs)
    outputs = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(1e-2))(hidden)
    return cls(inputs, outputs, **kwargs)


def test_masked_tokens_with_regularisers_update_as_plain_keras_with_adam():
    rng = np.random.default_rng(2)
    x = rng.integers(1, VOCABULARY, (GLOBAL_BATCH, TOKENS)).astype("int32")
    x[: GLOBAL_BATCH // 2, 1:] = 0  # the first micro-batch is mostly padding
    y = rng.integers(0, 3, (GLOBAL_BATCH, TOKENS)).astype("int32")
    keras.utils.set_random_seed(3)
    start = _masked_tokens().get_weights()
    weights = []
    for model in (_masked_tokens(), _masked_tokens(tfmem.AccumModel, accumulation_steps=2)):
        model.set_weights(start)
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        extra = dict(check_memory=False) if isinstance(model, tfmem.AccumModel) else {}
        model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0, **extra)
        weights.append(model.get_weights())
    plain, accum = weights
    for w, r, s in zip(accum, plain, start):
        assert np.max(np.abs(w - r)) <= 1e-5 * np.max(np.abs(r - s))
