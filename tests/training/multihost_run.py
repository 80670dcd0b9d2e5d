"""One process of a JAX run over several processes, or the one-process reference.

Usage: python multihost_run.py MODE OUT_JSON [BACKUP_DIR KILL_AT]

MODE "accum": this process is one of several (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID are set by the caller), each with 2 CPU devices; `tfmem.detect()` starts JAX's
distributed runtime and an AccumModel (k = 2) trains on global batches of 16 with `fit`;
given a DATA_DIR (BACKUP_DIR's place), it then records the SHA-1 of each image of each batch
of one epoch of that image set, as this process reads it (which the image modes record too).
MODE "resumable": the same with `fit_resumable(BACKUP_DIR)`, 2 epochs, a resume point after
every update; process 1 SIGKILLs itself after KILL_AT updates (0: never).
MODE "plain": one process, one device, a plain `keras.Model` trained with `fit` on the same
global batches (3 per epoch; EPOCHS from KILL_AT's place), its weights after each epoch kept.
MODES "images" (several processes, AccumModel) and "plain-images" (one process, plain model):
the global batches come from `tfmem.image_dataset(DATA_DIR, seed=epoch)` (BACKUP_DIR's place).
Each process writes its weights and its runtime to OUT_JSON (with its process index).
"""

import json
import os
import signal
import sys

os.environ["KERAS_BACKEND"] = "jax"
mode, out_path = sys.argv[1], sys.argv[2]
single = mode.startswith("plain")
if not single:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                + " --xla_force_host_platform_device_count=2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402

GLOBAL_BATCH, STEPS = 16, 3
runtime = None if single else tfmem.detect(timeout=60)
images = mode.endswith("images")
reads = mode == "accum" and len(sys.argv) > 3  # after training, reads this image set
if mode.startswith("plain-"):  # one process keeps the order the several processes keep
    tf.config.experimental.enable_op_determinism()



def images_read():
    """The SHA-1 of each image of each batch of epoch 0, as this process reads them."""
    import hashlib

    read = tfmem.image_dataset(sys.argv[3], image_size=(16, 16), batch_size=GLOBAL_BATCH,
                               training=True, augment=False, seed=0)
    return [[hashlib.sha1(image.tobytes()).hexdigest() for image in batch.numpy()]
            for batch, _ in read]


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
rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def make_dataset(epoch):
    # Each process builds the same global batches; Keras gives each process its rows.
    if images:
        return tfmem.image_dataset(sys.argv[3], image_size=(16, 16), batch_size=GLOBAL_BATCH,
                                   training=True, augment=False, seed=epoch)
    order = np.random.default_rng(epoch).permutation(len(x))
    return tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(
        GLOBAL_BATCH, drop_remainder=True)


class Kill(keras.callbacks.Callback):
    updates = 0

    def on_train_batch_end(self, batch, logs=None):
        Kill.updates += 1
        if Kill.updates == int(sys.argv[4]) and os.environ["JAX_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)


by_epoch = []  # the weights after each epoch of `fit`
if mode == "resumable":
    tfmem.fit_resumable(model, make_dataset, epochs=2, steps_per_epoch=STEPS,
                        backup_dir=sys.argv[3], save_every_steps=1, callbacks=[Kill()],
                        verbose=0)
else:
    epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for epoch in range(epochs):
        model.fit(make_dataset(epoch), epochs=1, verbose=0)
        by_epoch.append([w.tolist() for w in model.get_weights()])
unseeded = planned = None
if mode == "images":
    run = model.plan_memory(make_dataset(0))  # the guard counts every process's rows
    planned = [run.global_batch_size, run.micro_batch_size, run.accumulation_steps]
    try:  # an unseeded shuffle would differ from process to process
        tfmem.image_dataset(sys.argv[3], image_size=(16, 16), batch_size=GLOBAL_BATCH,
                            training=True)
    except ValueError as error:
        unseeded = str(error)
with open(out_path, "w") as file:
    json.dump({"unseeded": unseeded, "planned": planned,
               "batches": images_read() if images or reads else None,
               "weights": [w.tolist() for w in model.get_weights()],
               "weights_by_epoch": by_epoch,
               "process": (runtime.num_workers if runtime else 1,
                           int(os.environ.get("JAX_PROCESS_ID", 0))),
               "replicas": (runtime.num_replicas, runtime.local_replicas) if runtime else None,
               "iterations": int(model.optimizer.iterations)}, file)
