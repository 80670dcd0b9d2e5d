"""A training process whose first micro-batch needs more memory than it can have.

Usage: python out_of_memory_run.py BACKUP_DIR OUT_JSON ACCUMULATION_STEPS LIMIT [EPOCHS
[REFERENCE_DIR]]

The backend is KERAS_BACKEND's. The run is `fit_resumable` over EPOCHS (default 1) epochs of 2
steps of a global batch of 64; the weights and what happened are written to OUT_JSON. EPOCHS may
be two counts, `1,2`: the run over the first, then the run started again over the second, as a
new process would start it (the model built again from ACCUMULATION_STEPS, `fit_resumable`
resuming from BACKUP_DIR), written under OUT_JSON's "again"; the line `AGAIN` (below) on stderr
separates what each run printed. With REFERENCE_DIR, the same process then lifts its cap and
trains the same model again from its start at the accumulation steps the run ended with, backed
up there, and writes what happened under OUT_JSON's "reference". LIMIT says how memory runs out:

* a number of bytes: after the framework has started (before the first train step), the
  address space of this process is capped at what it maps now plus that many bytes
  (`RLIMIT_AS`), so a micro-batch whose activations need more fails for real, with the error
  the framework raises (JAX; TensorFlow on a CPU crashes instead of raising);
* "machine": no cap, but the model asks, in each micro-batch, for 2 ** (rows / 2 + 3) floats:
  2 MB at 32 rows, 128 GiB at 64, which the kernel refuses (more than the machine has), and
  TensorFlow raises its own out-of-memory error, as it does on a GPU;
* "none": neither (the model of "machine", without its ask);
* "allocator": a residual chain of 16 `Dense` layers over 4096 positions (about 38 MiB per
  sample in a step, 16 with `rematerialize="full"`) and a global batch of 4; the memory limit is the
  environment's: TensorFlow's GPU allocator (BFC) on the CPU with a limit
  (`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=...`, and
  `TF_ENABLE_ONEDNN_OPTS=0`: oneDNN's kernels crash where that allocator refuses), which
  raises TensorFlow's out-of-memory error as it does on a GPU. Without the limit, it runs the
  same model straight.

`build` and `train` are this program's run for a test process that computes a reference itself.
"""

import json
import resource
import sys

import keras
import numpy as np
import tensorflow as tf

import tfmem

STEPS = 2
AGAIN = "out_of_memory_run: started again"


class AsksForMemory(keras.layers.Layer):
    """Asks for 2 ** (rows / 2 + 3) floats; its output is its input."""

    def call(self, x):
        rows = tf.cast(tf.shape(x)[0], tf.float32)
        size = tf.cast(2.0 ** (rows / 2 + 3), tf.int64)
        asked = tf.fill(tf.reshape(size, [1]), x[0, 0, 0, 0])
        return x + 0.0 * tf.reduce_mean(asked)


def build(limit, accumulation_steps):
    """The compiled model of LIMIT's kind and its data: `(model, make_dataset)`."""
    keras.utils.set_random_seed(7)
    global_batch = 64
    if limit == "allocator":
        global_batch = 4
        inputs = keras.Input((4096, 16))
        hidden = keras.layers.Dense(64)(inputs)
        for _ in range(16):
            hidden = keras.layers.Add()([hidden, keras.layers.Dense(
                64, activation="relu", kernel_initializer=keras.initializers.RandomNormal(
                    stddev=0.005))(hidden)])
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
    else:
        # A wide pointwise expansion: 4.5 MiB of activation per sample at 48 × 48 (288 MiB at
        # micro-batch 64; the step holds it about three times), what runs out under a cap on
        # bytes; where the model asks for its memory itself (or nothing limits it), 8 × 8 images.
        side = 8 if limit in ("machine", "none") else 48
        inputs = keras.Input((side, side, 4))
        hidden = AsksForMemory()(inputs) if limit == "machine" else inputs
        hidden = keras.layers.Conv2D(512, 1, activation="relu")(hidden)
        hidden = keras.layers.Conv2D(4, 1)(hidden)
        hidden = keras.layers.BatchNormalization(momentum=0.5)(hidden)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden))
    model = tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    rng = np.random.default_rng(0)
    images = rng.normal(size=(global_batch * STEPS, *inputs.shape[1:])).astype("float32")
    corner = images.reshape(len(images), -1, images.shape[-1])[:, :64]
    labels = (corner[..., 0].mean(axis=1) > 0).astype("int32") + (
        corner[..., 1].mean(axis=1) > 0).astype("int32")

    def make_dataset(epoch):
        return tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch,
                                                                          drop_remainder=True)

    return model, make_dataset


def train(model, make_dataset, backup_dir, epochs):
    """`fit_resumable` over `epochs`: the weights and what happened."""
    recoveries = []
    history = tfmem.fit_resumable(model, make_dataset, epochs=epochs, steps_per_epoch=STEPS,
                                  backup_dir=backup_dir, verbose=0, check_memory=False,
                                  memory_recoveries=recoveries)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "accumulation_steps": model.accumulation_steps,
            "recoveries": recoveries, "loss": history["loss"],
            "rematerialize": model.rematerialize,
            "segments": model.rematerialized_segments}


def main(argv):
    backup_dir, out_path = argv[1], argv[2]
    accumulation_steps, limit = int(argv[3]), argv[4]
    epochs, *again = (int(count) for count in (argv[5] if len(argv) > 5 else "1").split(","))
    reference_dir = argv[6] if len(argv) > 6 else None
    model, make_dataset = build(limit, accumulation_steps)
    if limit not in ("machine", "none", "allocator"):
        # Start what the run will use before the cap: the framework's threads, the data
        # pipeline.
        images, _ = next(iter(make_dataset(0)))
        model.predict(np.asarray(images[:1]), verbose=0)
        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status
                          if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + int(limit), resource.RLIM_INFINITY))
    outcome = train(model, make_dataset, backup_dir, epochs)
    for count in again:
        print(AGAIN, file=sys.stderr, flush=True)
        outcome["again"] = train(*build(limit, accumulation_steps), backup_dir, count)
    if reference_dir is not None:
        # The run left its memory mapped (compiled programs, freed buffers kept by the
        # allocator): under the same cap the reference could run out where a new process
        # would not.
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        outcome["reference"] = train(*build(limit, outcome["accumulation_steps"]),
                                     reference_dir, epochs)
    with open(out_path, "w") as file:
        json.dump(outcome, file)


if __name__ == "__main__":
    main(sys.argv)
