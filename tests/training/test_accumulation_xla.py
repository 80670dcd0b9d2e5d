"""AccumModel under `jit_compile=True` on the TensorFlow backend: the same numbers as without XLA.

On a CPU the micro-batch loop runs outside XLA and each micro-step is one XLA program
(`tfmem.training.placement`); on other platforms the whole step, loop included, is compiled.
Both constructions are run here on the CPU (the second by emptying `HOST_LOOP_PLATFORMS`) and
checked against a plain Keras model with XLA on the global batch.
"""

import keras
import numpy as np
import pytest

import tfmem
from tfmem.training import placement

K = 4


def _model(accumulation_steps=None, batch_norm=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization(momentum=0.9)(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden))
    if accumulation_steps is None:
        return keras.Model(inputs, outputs)
    return tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps)


def _fit(model, jit_compile, sample_weight=True):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 64)
    weights = rng.uniform(0.1, 2.0, 64).astype("float32") if sample_weight else None
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit_compile)
    history = model.fit(x, y, sample_weight=weights, batch_size=32, epochs=1, shuffle=False,
                        verbose=0).history
    return model, history


def _difference(a, b):
    a = np.concatenate([np.ravel(w) for w in a])
    b = np.concatenate([np.ravel(w) for w in b])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


@pytest.fixture(params=["host loop", "in-graph loop"])
def loop(request, monkeypatch):
    if request.param == "in-graph loop":
        monkeypatch.setattr(placement, "HOST_LOOP_PLATFORMS", ())
    return request.param


def test_micro_batches_under_xla_equal_one_big_batch(loop):
    plain, plain_history = _fit(_model(), jit_compile=True)
    accum, accum_history = _fit(_model(K), jit_compile=True)
    assert accum.jit_compile is True  # the user's setting survives building the step
    assert _difference(plain.get_weights(), accum.get_weights()) <= 1e-5
    assert accum_history["loss"][0] == pytest.approx(plain_history["loss"][0], rel=1e-5)
    assert accum_history["accuracy"] == plain_history["accuracy"]
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == 2


def test_batch_norm_statistics_under_xla_equal_the_step_without_it(loop):
    # BatchNorm normalises each micro-batch by itself, so the reference is AccumModel without XLA.
    reference, _ = _fit(_model(K, batch_norm=True), jit_compile=False)
    compiled, _ = _fit(_model(K, batch_norm=True), jit_compile=True)
    assert _difference(reference.get_weights(), compiled.get_weights()) <= 1e-5
    layer = next(l for l in compiled.layers if isinstance(l, keras.layers.BatchNormalization))
    assert np.abs(np.asarray(layer.moving_mean)).max() > 0  # the statistics did move


def test_the_loop_runs_on_the_host_only_where_placement_says(monkeypatch):
    model, _ = _fit(_model(K), jit_compile=True, sample_weight=False)
    assert model._xla_loop_on_host()  # CPU
    monkeypatch.setattr(placement, "HOST_LOOP_PLATFORMS", ())
    assert not model._xla_loop_on_host()
    model.jit_compile = False
    monkeypatch.setattr(placement, "HOST_LOOP_PLATFORMS", ("cpu",))
    assert not model._xla_loop_on_host()  # without XLA the loop is TensorFlow's own while
