"""Shared set-up of the JAX-backend case programs (run as subprocesses by test_accumulation_jax).

Each case program imports this first: it fixes the backend before Keras is imported, and gives
the small models and the comparison helpers the cases share. The programs print one JSON
object; the pytest side asserts on its numbers.
"""

import atexit
import json
import os
import shutil
import sys
import tempfile

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

# The cases build many models of the same architectures (a plain reference next to each
# AccumModel, the same model at several `k`), whose steps are the same XLA programs: a
# compilation cache keyed by the program compiles each once. It lives and dies with the process,
# so no run reads another's.
_CACHE = tempfile.mkdtemp(prefix="tfmem-jax-cases-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmem import AccumModel  # noqa: E402

if keras.backend.backend() != "jax":
    sys.exit(f"expected the JAX backend, Keras runs on {keras.backend.backend()}")


def dense_model(accumulation_steps=None, seed=0):
    """Tiny MLP; `accumulation_steps=None` builds a plain keras.Model with the same weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    return _model(inputs, outputs, accumulation_steps, wrap=False)


def conv_model(accumulation_steps=None, seed=0, batch_norm=False, dropout=0.0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization(momentum=0.9)(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    if dropout:
        hidden = keras.layers.Dropout(dropout)(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    return _model(inputs, outputs, accumulation_steps, wrap=True)


def _model(inputs, outputs, accumulation_steps, wrap):
    """keras.Model, or AccumModel built from the tensors (`wrap=False`) or wrapping one."""
    if accumulation_steps is None:
        return keras.Model(inputs, outputs)
    if wrap:
        return AccumModel.wrap(keras.Model(inputs, outputs), accumulation_steps=accumulation_steps)
    return AccumModel(inputs, outputs, accumulation_steps=accumulation_steps)


def compile_model(model, optimizer, metrics=("accuracy",)):
    """Compiles with a fresh optimizer instance and the sparse cross-entropy on logits."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def flat(weights):
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])


def relative_difference(a, b):
    """max |a - b| / max |a|, over flattened weight lists."""
    a, b = flat(a), flat(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


def data(shape, num_samples=32, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples,) + shape).astype("float32")
    y = rng.integers(0, 3, num_samples)
    sample_weight = rng.uniform(0.1, 2.0, num_samples).astype("float32")
    return x, y, sample_weight


def emit(results):
    print("RESULTS " + json.dumps(results))
