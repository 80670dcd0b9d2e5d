"""Rematerialized layers train to the weights of the same model without it (both backends)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tests.training import remat_cases

CASES = os.path.join(os.path.dirname(__file__), "remat_cases.py")


def test_rematerialized_block_ends_with_the_same_weights_and_statistics():
    differences = remat_cases.relative_differences(["block"])
    # Kernels, biases, BatchNorm's gamma/beta and moving mean/variance, all after 3 steps.
    assert len(differences) == 10
    assert max(differences) <= 1e-6, differences


def test_under_mirrored_strategy_on_two_cpus(two_cpu_strategy):
    def trained(rematerialize):
        with two_cpu_strategy.scope():
            accum = remat_cases.model(rematerialize)
        x, y = remat_cases.data()
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        accum.fit(dataset, epochs=1, verbose=0)
        return accum.get_weights()

    plain, recomputed = trained(None), trained(["block"])
    for a, b in zip(plain, recomputed, strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * max(np.linalg.norm(a), 1e-12)


def test_the_block_runs_forward_again_in_the_backward_pass():
    # TensorFlow traces the train step's micro-step once (the plan traces the model too);
    # rematerialized, the block's forward is traced once more, for the gradient.
    _, plain = remat_cases.trained(None)
    _, recomputed = remat_cases.trained(["block"])
    assert recomputed == plain + 1


def test_names_that_are_no_layer_and_bad_settings_are_one_error():
    with pytest.raises(ValueError, match=r"rematerialize: 'nope' is not a layer of "
                                         r"'functional\w*'; its layers: .*block"):
        remat_cases.model(["block", "nope"])
    for bad in ("block", [], [3]):
        with pytest.raises(ValueError, match="must be None or a list of layer names"):
            remat_cases.model(bad)


def test_the_setting_is_saved_with_the_model(tmp_path):
    accum = remat_cases.model(["block"])
    accum.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, tfmem.AccumModel) and loaded.rematerialize == ("block",)


def test_on_the_jax_backend_too():
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    result = subprocess.run([sys.executable, CASES], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["backend"] == "jax"
    assert all(found["changed"])  # every weight and statistic moved in training
    assert max(found["block"]) <= 1e-6 and max(found["layers"]) <= 1e-6, found
    # The same under a DataParallel over 8 host devices (tfmem.detect()).
    assert found["replicas"] == 8 and max(found["data_parallel"]) <= 1e-6, found


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
    # head's (3 × 64) stay, and one block's 64 + 512 is held again while it is recomputed.
    def activations(rematerialize):
        return tfmem.plan(_two_blocks(rematerialize), global_batch_size=8,
                          memory_budget=2**30)
    plain, recomputed = activations(None), activations(["block_a", "block_b"])
    assert plain.activation_bytes_per_sample == 1216 * 4
    assert recomputed.activation_bytes_per_sample == (3 * 64 + 64 + 512) * 4
    assert ("rematerialized, recomputed in the backward pass one at a time (the largest "
            "counted in activations): block_a 2.2 KiB/sample, block_b 2.2 KiB/sample") in (
        recomputed.table())


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
