r"""The main job on the embedded demo data: write TFRecords, stream them, train, report.

    python scripts/demo.py

Writes the procedurally generated shapes set (2048 training + 512 held-out 32×32 images, four
classes) as TFRecords to a temporary directory (or `--output`), streams it through a tiny CNN
for one epoch with `tfmem.image_dataset`, and prints the held-out accuracy next to chance.
On 2 shared CPU cores it takes 10-30 s and prints e.g.
`demo: held-out accuracy 0.99 after 1 epoch (chance 0.25) on 512 images; 2048 training images
streamed from 6 shards in 2.2 s`.
"""

import os
import shutil
import tempfile
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402

import tfmem  # noqa: E402

_OUTPUT = flags.DEFINE_string("output", None, "Keep the TFRecords here (default: a temporary "
                              "directory, deleted at the end).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 2048, "Training images.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 32, "Image height and width.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Training batch size.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Training epochs.")


def tiny_cnn(image_size: int, num_classes: int) -> keras.Model:
    return keras.Sequential([
        keras.Input((image_size, image_size, 3)),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPool2D(),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPool2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalMaxPooling2D(),  # "is the shape anywhere": position does not matter
        keras.layers.Dense(num_classes),
    ])


def main(argv):
    del argv
    output = _OUTPUT.value or tempfile.mkdtemp(prefix="tfmem-demo-")
    try:
        train = tfmem.make_demo_dataset(os.path.join(output, "train"), overwrite=True,
                                        num_examples=_NUM_EXAMPLES.value,
                                        image_size=_IMAGE_SIZE.value, seed=0)
        held_out = tfmem.make_demo_dataset(os.path.join(output, "validation"), overwrite=True,
                                           num_examples=512, image_size=_IMAGE_SIZE.value,
                                           seed=1)
        options = dict(image_size=(_IMAGE_SIZE.value,) * 2, data_range=(0, 1))
        keras.utils.set_random_seed(0)
        model = tiny_cnn(_IMAGE_SIZE.value, train.num_classes)
        model.compile(keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        start = time.perf_counter()
        # shuffle=False: the dataset shuffles itself (Keras cannot shuffle a stream).
        model.fit(tfmem.image_dataset(train.directory, batch_size=_BATCH_SIZE.value,
                                      training=True, seed=0, **options),
                  epochs=_EPOCHS.value, verbose=2, shuffle=False)
        seconds = time.perf_counter() - start
        _, accuracy = model.evaluate(tfmem.image_dataset(held_out.directory, batch_size=128,
                                                         training=False, **options), verbose=0)
    finally:
        if not _OUTPUT.value:
            shutil.rmtree(output, ignore_errors=True)
    epochs = f"{_EPOCHS.value} epoch" + ("s" if _EPOCHS.value > 1 else "")
    print(f"demo: held-out accuracy {accuracy:.2f} after {epochs} (chance "
          f"{1 / train.num_classes:.2f}) on {held_out.num_examples} images; "
          f"{train.num_examples} training images streamed from {len(train.shards)} shards "
          f"in {seconds:.1f} s")


if __name__ == "__main__":
    app.run(main)
