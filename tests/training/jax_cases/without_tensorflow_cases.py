"""tfmem on the JAX backend in an environment without TensorFlow: prints the numbers to assert.

Run by tests/test_without_tensorflow.py with the Python of a virtual environment that has JAX and
Keras but no TensorFlow. `plan_model()` is shared with the test, which plans the same model on
the TensorFlow backend as the reference.
"""

import os
import sys

import numpy as np


def plan_model():
    """A small conv net of the layers the planner knows, plus one it must trace."""
    import keras

    class GatedDense(keras.layers.Layer):
        def build(self, shape):
            self.gate = self.add_weight(shape=(shape[-1], 8))

        def call(self, x):
            h = keras.ops.matmul(x, self.gate)
            return keras.ops.tanh(h) * keras.ops.sigmoid(h)

    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = GatedDense()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


PLAN_ARGUMENTS = dict(global_batch_size=64, optimizer="adam", memory_budget=2**30,
                      loss="sparse_categorical_crossentropy")
# Bytes of address space allowed beyond what the process maps once JAX has started: micro-batch
# 64 of `out_of_memory`'s model needs ~1.6 GB of activations and their gradients.
OUT_OF_MEMORY_LIMIT = 700_000_000


def resume_differences():
    """fit_resumable on arrays and on a PyDataset (2 epochs of 6 updates, k = 2), stopped by an
    exception at update 9 and resumed: `{kind: the largest difference from an uninterrupted
    run's weights}`."""
    import tempfile

    import keras

    import tfmem

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    class Shuffled(keras.utils.PyDataset):
        def __init__(self, order):
            super().__init__()
            self.order = order

        def __len__(self):
            return len(self.order) // 8

        def __getitem__(self, index):
            rows = self.order[index * 8:(index + 1) * 8]
            return x[rows], y[rows]

    class Interrupted(Exception):
        pass

    def fit(kind, backup_dir, stop_at=None):
        def make_data(epoch):
            order = np.random.default_rng(100 + epoch).permutation(48)
            return (x[order], y[order]) if kind == "arrays" else Shuffled(order)

        class Stop(keras.callbacks.Callback):
            updates = 0

            def on_train_batch_end(self, batch, logs=None):
                Stop.updates += 1
                if Stop.updates == stop_at:
                    raise Interrupted

        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs))
        model = tfmem.AccumModel(inputs, outputs, accumulation_steps=2)
        model.compile(keras.optimizers.Adam(0.05), "mse")
        tfmem.fit_resumable(model, make_data, epochs=2, steps_per_epoch=6,
                            backup_dir=backup_dir, save_every_steps=2, callbacks=[Stop()],
                            verbose=0, **({"batch_size": 8} if kind == "arrays" else {}))
        return np.concatenate([np.ravel(w) for w in model.get_weights()])

    differences = {}
    with tempfile.TemporaryDirectory() as directory:
        for kind in ("arrays", "PyDataset"):
            expected = fit(kind, os.path.join(directory, kind + "-straight"))
            resumed = os.path.join(directory, kind + "-resumed")
            try:  # at update 9: epoch 2, step 3; it goes on from step 2
                fit(kind, resumed, stop_at=9)
            except Interrupted:
                pass
            differences[kind] = float(np.max(np.abs(fit(kind, resumed) - expected)))
    return differences


def out_of_memory(limit, accumulation_steps):
    """fit_resumable over a PyDataset of 2 global batches of 64 (a wide pointwise conv: ~8 MB of
    activations per sample) starting at `accumulation_steps`, with `limit` bytes of address
    space allowed beyond what the process maps once JAX has started; returns the weights, k,
    the recoveries and the updates made."""
    import resource
    import tempfile

    import keras
    import psutil

    import tfmem

    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(128, 64, 64, 4)).astype("float32")
    labels = (images[:, 0, :, 0].mean(axis=1) > 0).astype("int32")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return images[index * 64:(index + 1) * 64], labels[index * 64:(index + 1) * 64]

    inputs = keras.Input((64, 64, 4))
    hidden = keras.layers.Conv2D(512, 1, activation="relu")(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(hidden))
    model = tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.predict(images[:1], verbose=0)  # the framework started before the cap
    mapped = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(limit), resource.RLIM_INFINITY))
    recoveries = []
    with tempfile.TemporaryDirectory() as directory:
        tfmem.fit_resumable(model, lambda epoch: Batches(), epochs=1, steps_per_epoch=2,
                            backup_dir=directory, verbose=0, check_memory=False,
                            memory_recoveries=recoveries)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "accumulation_steps": model.accumulation_steps, "recoveries": recoveries,
            "iterations": int(model.optimizer.iterations)}


def tfmem_env():
    """`tfmem-env` run as `python -m tfmem.runtime.report` runs it: [exit status, output]."""
    import contextlib
    import io
    import runpy

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        try:
            runpy.run_module("tfmem.runtime.report", run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exit:
            status = exit.code
    return [status, output.getvalue()]


def main():
    os.environ["KERAS_BACKEND"] = "jax"
    import importlib.util
    import json
    import re

    results = {"tensorflow_installed": importlib.util.find_spec("tensorflow") is not None}
    import keras

    import tfmem

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 64)

    def model(accumulation_steps):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        hidden = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden))
        if accumulation_steps is None:
            return keras.Model(inputs, outputs)
        return tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps)

    trained = []
    for accumulation_steps in (None, 4):
        net = model(accumulation_steps)
        net.compile(keras.optimizers.SGD(0.1),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        net.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        trained.append(np.concatenate([np.ravel(w) for w in net.get_weights()]))
    results["accumulation_difference"] = float(
        np.max(np.abs(trained[0] - trained[1])) / np.max(np.abs(trained[0])))

    runtime = tfmem.detect()
    results["runtime"] = [runtime.kind, runtime.num_replicas]
    # describe()'s rows are "  name<padding>  value".
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                for line in tfmem.describe(runtime).splitlines()[1:])
    results["describe_tensorflow"] = rows["tensorflow"]

    clean = np.full((16, 16, 3), 100.0, "float32")
    results["psnr"] = float(tfmem.psnr(clean, clean + 10.0, data_range=255))
    results["ssim_identical"] = float(tfmem.ssim(clean, clean, data_range=255))
    # Jitted, the metric cannot raise: an image outside the declared range scores NaN.
    import jax

    pair = np.stack([clean, clean]), np.stack([clean + 10.0, clean + 300.0])
    results["psnr_jit"] = [float(v) for v in jax.jit(
        lambda a, b: tfmem.psnr(a, b, data_range=255))(*pair)]

    import dataclasses

    memory_plan = tfmem.plan(plan_model(), **PLAN_ARGUMENTS)
    results["plan"] = {key: value for key, value in dataclasses.asdict(memory_plan).items()
                       if isinstance(value, int)}
    results["plan_notes"] = list(memory_plan.notes)

    results["resume_difference"] = resume_differences()

    errors = {}
    for name in ("image_dataset", "write_image_tfrecords"):
        try:
            getattr(tfmem, name)
        except ImportError as error:
            errors[name] = str(error)
    results["errors"] = errors
    results["tfmem_env"] = tfmem_env()
    if sys.platform.startswith("linux"):  # RLIMIT_AS as Linux enforces it
        # Last: the address space cap stays with the process.
        results["out_of_memory"] = out_of_memory(OUT_OF_MEMORY_LIMIT, 1)
    results["tensorflow_imported"] = "tensorflow" in sys.modules
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
