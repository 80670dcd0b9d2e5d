r"""tf.data's autotuning in `tfmem.image_dataset`: throughput, and the wait when an iterator ends.

    python benchmarks/data_autotune.py                  # 3 speed runs and 6 endings each
    python benchmarks/data_autotune.py --runs 1 --endings 3

`image_dataset` turns tf.data's autotuning off (`tf.data.Options().autotune.enabled`). This
runs the same reader with it off (as shipped) and on, each case in its own process, taking
turns:

1. Images/s of one epoch of a demo set (2048 PNG images of 256 px, resized to 224, batch 64).
2. How long deleting the iterator takes after an epoch that lasted 12 s (the consumer keeps
   the cores busy with matrix products between batches, as train steps would). With
   autotuning on, tf.data runs a
   model thread that optimises every period (10 ms, doubled after each pass up to 60 s); the
   iterator's deletion now and then waits for the period running to end, which after a 12 s
   epoch is at 20.47 s from its start.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_RUNS = flags.DEFINE_integer("runs", 3, "Speed runs of each setting, taking turns.")
_ENDINGS = flags.DEFINE_integer("endings", 6, "Timed iterator endings of each setting.")
_EPOCH_SECONDS = flags.DEFINE_float("epoch_seconds", 12.0, "How long each timed epoch lasts.")
_CASE = flags.DEFINE_string("case", None, "Internal: 'speed' or 'ending' in this process.")
_AUTOTUNE = flags.DEFINE_bool("autotune", False, "Internal: autotuning on in the case.")
_DIR = flags.DEFINE_string("dir", None, "Internal: the demo set the case reads.")


def _dataset(directory: str, autotune: bool):
    """`image_dataset` of the demo set, with autotuning as asked (off is what it ships)."""
    import tensorflow as tf

    import tfmem

    dataset = tfmem.image_dataset(directory, batch_size=64, training=True,
                                  image_size=(224, 224), seed=0)
    options = tf.data.Options()
    options.autotune.enabled = autotune
    return dataset.with_options(options)


def _case() -> dict:
    dataset = _dataset(_DIR.value, _AUTOTUNE.value)
    if _CASE.value == "speed":
        images, start = 0, time.perf_counter()
        for batch, _ in dataset:
            images += int(batch.shape[0])
        return {"images_per_s": images / (time.perf_counter() - start)}
    import tensorflow as tf

    batches = dataset.take(3)
    matrix = tf.random.normal((512, 512))
    start = time.perf_counter()
    iterator = iter(batches)
    for step, _ in enumerate(iterator, 1):  # busy until this step's share of the epoch
        while time.perf_counter() < start + step * _EPOCH_SECONDS.value / 3:
            float(tf.reduce_sum(tf.linalg.matmul(matrix, matrix)))
    ended = time.perf_counter()
    del iterator
    return {"epoch_s": ended - start, "deleting_s": time.perf_counter() - ended}


def _run(case: str, directory: str, autotune: bool) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, f"--case={case}", f"--dir={directory}",
         f"--autotune={autotune}", f"--epoch_seconds={_EPOCH_SECONDS.value}"],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {case} case failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if _CASE.value:
        print(json.dumps(_case()))
        return
    from tfmem.data import demo

    with tempfile.TemporaryDirectory(prefix="tfmem-autotune-") as directory:
        demo.make_demo_dataset(directory, num_examples=2048, image_size=256)
        speeds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(_RUNS.value):
            for autotune in (False, True):
                speeds[autotune].append(_run("speed", directory, autotune)["images_per_s"])
        waits: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(_ENDINGS.value):
            for autotune in (False, True):
                waits[autotune].append(_run("ending", directory, autotune)["deleting_s"])
    print("| autotuning | images/s (median; best) | deleting the iterator after a "
          f"{_EPOCH_SECONDS.value:g} s epoch: each ending, s |")
    print("|---|---:|---|")
    for autotune in (False, True):
        print(f"| {'on' if autotune else 'off (shipped)'} | "
              f"{statistics.median(speeds[autotune]):.0f}; {max(speeds[autotune]):.0f} | "
              + ", ".join(f"{wait:.2f}" for wait in waits[autotune]) + " |")


if __name__ == "__main__":
    app.run(main)
