"""On JAX the plan counts what XLA keeps (`tfmem.memory.xla_rules`): checked against XLA:CPU's
memory analysis of the compiled train step and against a hand count, in a JAX process."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_PROGRAM = r"""
import json
import keras
import numpy as np
import tfmem
from keras import ops
from tfmem.memory import probe_jax

L = keras.layers
SHAPE, BATCH = (16, 16, 16), 32
inputs = keras.Input(SHAPE)
x = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(16, 3, padding="same")(inputs)))
x = L.Conv2D(16, 3, padding="same", activation="swish")(x)
x = ops.relu(L.Conv2D(16, 3, padding="same")(x))
model = keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling2D()(x)))
model.compile(optimizer="sgd", loss="mse")
model.optimizer.build(model.trainable_variables)
batch = (np.zeros((BATCH,) + SHAPE, "float32"), np.zeros((BATCH, 4), "float32"))
plan = tfmem.plan(model, global_batch_size=BATCH, optimizer="sgd", device="t4",
                  input_batches_in_flight=1)
print(json.dumps({"backend": keras.backend.backend(),
                  "xla": probe_jax.compiled_step_memory(model, batch)["peak_bytes"],
                  "plan": plan.peak_bytes(BATCH, 1),
                  "activations": plan.activation_bytes_per_sample}))
"""


@pytest.fixture(scope="module")
def on_jax():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               # the same buffers, about half the compile time (tests/training's JAX cases)
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_cpu_use_fusion_emitters=false")
    result = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert results["backend"] == "jax"
    return results


def test_the_plan_of_a_gpu_is_within_the_band_of_xlas_compiled_step(on_jax):
    # The planned peak for an XLA device against XLA:CPU's own figure of the same step
    # (conv → BN → relu, conv with silu, conv → keras.ops.relu): within ±15%, never more
    # than 10% under.
    assert 0.90 * on_jax["xla"] <= on_jax["plan"] <= 1.15 * on_jax["xla"]


def test_xla_keeps_the_pre_activation_and_silus_gate(on_jax):
    feature_map = 16 * 16 * 16 * 4  # bytes per sample
    # The model's input (the first convolution's); BatchNormalization's input, which is
    # also relu's pre-activation's source; relu's input (XLA recomputes the mask from it)
    # and output (the next convolution's input); silu's input and gate, its output (the
    # last convolution's input); ops.relu's pre-activation (JAX's mask, held as the float
    # it compares; its broadcast zeros hold nothing); the Dense layer's 16 inputs.
    assert on_jax["activations"] == 8 * feature_map + 16 * 4
