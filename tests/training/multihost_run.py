"""One process of a JAX run over several processes, or the one-process reference.

Usage: python multihost_run.py MODE OUT_JSON [--images DIR] [--read DIR]
                                             [--backup DIR --kill-at N]

MODE "accum": this process is one of several (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID are set by the caller), each with 2 CPU devices; `tfmem.detect()` starts JAX's
distributed runtime and an AccumModel (k = 2) trains on global batches of 16 of arrays with
`fit`, 1 epoch. Then, each step when asked:
  --read DIR    the SHA-1 of each image of each batch of one epoch of that image set, as this
                process reads it;
  --images DIR  an AccumModel trains 2 epochs on `tfmem.image_dataset(DIR, seed=epoch)`, plans
                its memory, and records the images of its batches;
  --backup DIR  (after OUT_JSON is written) the run of mode "resumable".
MODE "resumable": the arrays run with `fit_resumable(DIR)`, 2 epochs, a resume point after
every update; process 1 SIGKILLs itself after `--kill-at` updates (0: never).
MODE "plain": one process, one device, a plain `keras.Model` trained with `fit` on the same
global batches (3 per epoch), its weights after each of 2 epochs kept; with --images, then the
plain image model on that set's batches.
Each process writes its results to OUT_JSON: each step's under its name, with its process index.
"""

import argparse
import hashlib
import json
import os
import signal

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["accum", "resumable", "plain"])
parser.add_argument("out")
parser.add_argument("--images")
parser.add_argument("--read")
parser.add_argument("--backup")
parser.add_argument("--kill-at", type=int, default=0)
arguments = parser.parse_args()

os.environ["KERAS_BACKEND"] = "jax"
single = arguments.mode == "plain"
if not single:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                + " --xla_force_host_platform_device_count=2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402

GLOBAL_BATCH, STEPS = 16, 3
runtime = None if single else tfmem.detect(timeout=60)
if single:  # one process keeps the order the several processes keep
    tf.config.experimental.enable_op_determinism()
rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def images_read(directory):
    """The SHA-1 of each image of each batch of epoch 0, as this process reads them."""
    read = tfmem.image_dataset(directory, image_size=(16, 16), batch_size=GLOBAL_BATCH,
                               training=True, augment=False, seed=0)
    return [[hashlib.sha1(image.tobytes()).hexdigest() for image in batch.numpy()]
            for batch, _ in read]


def build(images):
    """The model of the arrays or of the images, the same initial weights in every process."""
    keras.utils.set_random_seed(0)
    if images:
        inputs = keras.Input((16, 16, 3))
        hidden = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(inputs))
        outputs = keras.layers.Dense(4)(hidden)
    else:
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    if single:
        model = keras.Model(inputs, outputs)
    else:
        model = tfmem.AccumModel(inputs, outputs, accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_dataset(epoch, images=None):
    # Each process builds the same global batches; Keras gives each process its rows.
    if images:
        return tfmem.image_dataset(images, image_size=(16, 16), batch_size=GLOBAL_BATCH,
                                   training=True, augment=False, seed=epoch)
    order = np.random.default_rng(epoch).permutation(len(x))
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True)


def fit(images=None, epochs=2):
    """Trains the model of the arrays or of `images`; the model and its weights by epoch."""
    model = build(images)
    by_epoch = []
    # Unchecked, so Keras builds the model from the epoch's first batch, as the plain
    # reference's fit does: a reshuffling dataset then starts the epoch with the same order.
    unchecked = {} if single else dict(check_memory=False)
    for epoch in range(epochs):
        model.fit(make_dataset(epoch, images), epochs=1, verbose=0, **unchecked)
        by_epoch.append([w.tolist() for w in model.get_weights()])
    return model, by_epoch


def outcome(model):
    return {"weights": [w.tolist() for w in model.get_weights()],
            "iterations": int(model.optimizer.iterations)}


class Kill(keras.callbacks.Callback):
    updates = 0

    def on_train_batch_end(self, batch, logs=None):
        Kill.updates += 1
        if Kill.updates == arguments.kill_at and os.environ["JAX_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)


def resumable():
    model = build(images=None)
    tfmem.fit_resumable(model, make_dataset, epochs=2, steps_per_epoch=STEPS,
                        backup_dir=arguments.backup, save_every_steps=1, callbacks=[Kill()],
                        verbose=0)
    return outcome(model)


results = {"process": (runtime.num_workers if runtime else 1,
                       int(os.environ.get("JAX_PROCESS_ID", 0))),
           "replicas": (runtime.num_replicas, runtime.local_replicas) if runtime else None}


def save():
    with open(arguments.out, "w") as file:
        json.dump(results, file)


if arguments.mode == "resumable":
    results["resumed"] = resumable()
elif single:
    model, by_epoch = fit()
    results["arrays"] = {"weights_by_epoch": by_epoch}
    if arguments.images:
        model, _ = fit(arguments.images)
        results["images"] = dict(outcome(model), batches=images_read(arguments.images))
else:
    model, _ = fit(epochs=1)
    results["arrays"] = outcome(model)
    if arguments.read:
        results["read"] = images_read(arguments.read)
    if arguments.images:
        model, _ = fit(arguments.images)
        run = model.plan_memory(make_dataset(0, arguments.images))  # counts every process's rows
        unseeded = None
        try:  # an unseeded shuffle would differ from process to process
            tfmem.image_dataset(arguments.images, image_size=(16, 16), batch_size=GLOBAL_BATCH,
                                training=True)
        except ValueError as error:
            unseeded = str(error)
        results["images"] = dict(
            outcome(model), batches=images_read(arguments.images), unseeded=unseeded,
            planned=[run.global_batch_size, run.micro_batch_size, run.accumulation_steps])
save()
if arguments.backup and arguments.mode == "accum":
    resumable()  # the caller stops it: process 1 kills itself (`--kill-at`)
