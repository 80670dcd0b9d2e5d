"""The models and the run the rematerialization tests compare, on the backend Keras runs on.

`python remat_cases.py` (with KERAS_BACKEND set) prints, as JSON, how far a rematerialized
AccumModel's weights and BatchNorm statistics end from the same model trained without it (on
JAX, also under `tfmem.detect()`'s DataParallel over every device).
"""

import json
import sys

import keras
import numpy as np

import tfmem


@keras.saving.register_keras_serializable(package="tfmem_tests")
class Counted(keras.layers.Layer):
    """ReLU that counts how often its forward pass runs on real (not symbolic) tensors."""

    calls = 0

    def call(self, x):
        if not isinstance(x, keras.KerasTensor):
            Counted.calls += 1
        return keras.ops.relu(x)


def model(rematerialize=None, accumulation_steps=2):
    keras.utils.set_random_seed(0)
    block_in = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same")(block_in)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = keras.layers.Dropout(0.3)(Counted()(h))
    block = keras.Model(block_in, h, name="block")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 1, name="pointwise")(block(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
    accum = tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps,
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 8, 8, 3)).astype("float32"), np.arange(48) % 3


def trained(rematerialize):
    """Weights after 3 steps of 16 (k = 2), and how often Counted's forward was traced."""
    Counted.calls = 0
    accum = model(rematerialize)
    x, y = data()
    accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return accum.get_weights(), Counted.calls


def relative_differences(rematerialize):
    plain, _ = trained(None)
    recomputed, _ = trained(rematerialize)
    return [float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))
            for a, b in zip(plain, recomputed, strict=True)]


if __name__ == "__main__":
    initial = model().get_weights()
    plain, _ = trained(None)
    found = {
        "backend": keras.backend.backend(),
        "block": relative_differences(["block"]),
        "layers": relative_differences(["pointwise", "block"]),
        "changed": [bool(np.any(a != b)) for a, b in zip(initial, plain)],
    }
    if keras.backend.backend() == "jax":  # then over every device (XLA_FLAGS may add some)
        found["replicas"] = tfmem.detect().num_replicas
        found["data_parallel"] = relative_differences(["block"])
    print(json.dumps(found))
    sys.exit(0)
