"""Peak memory and throughput of gradient accumulation on a real model (CPU).

Compares, each case in its own process so that peak RSS is its own:

* plain(32): `fit` with batch 32;
* keras(32x8): Keras's built-in `optimizer(gradient_accumulation_steps=8)`, batch 32;
* AccumModel(32x8): `tfmem.AccumModel`, global batch 256 split into 8 × 32;
* plain(256): `fit` with batch 256;

on EfficientNetV2B0 (weights=None, 10 classes) at 96×96, SGD, synthetic data in
memory. Throughput counts samples after one warm-up window of 256 samples
(tracing); peak RSS is the child's `ru_maxrss`.

Run (about 10 minutes per round on 2 shared CPU cores, ~4 GB RAM for plain(256)):

    PYTHONPATH=. python benchmarks/accumulation.py --windows=3 --rounds=2

Expected: AccumModel's peak RSS within 1.10× plain(32) and below 0.45×
plain(256), samples/s at least 0.95× plain(32) on an otherwise idle machine.
"""

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("windows", 3, "Timed windows of 256 samples per case (after 1 warm-up).")
flags.DEFINE_integer("image_size", 96, "Square input size.")
flags.DEFINE_integer(
    "rounds", 1, "Run all cases this many times, interleaved; report the best samples/s "
    "and the highest peak RSS of each case (a shared machine's load comes and goes)."
)
flags.DEFINE_string("case", None, "Internal: run one case in this process and print JSON.")

MICRO_BATCH, ACCUMULATION_STEPS = 32, 8
WINDOW = MICRO_BATCH * ACCUMULATION_STEPS
# name: (batch given to fit, AccumModel k, optimizer gradient_accumulation_steps)
CASES = {
    "plain(32)": (MICRO_BATCH, None, None),
    "keras(32x8)": (MICRO_BATCH, None, ACCUMULATION_STEPS),
    "AccumModel(32x8)": (WINDOW, ACCUMULATION_STEPS, None),
    "plain(256)": (WINDOW, None, None),
}


def run_case(name: str, windows: int, image_size: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmem

    batch_size, accumulation_steps, keras_steps = CASES[name]
    keras.utils.set_random_seed(0)
    model = keras.applications.EfficientNetV2B0(
        weights=None, input_shape=(image_size, image_size, 3), classes=10
    )
    if accumulation_steps:
        model = tfmem.AccumModel.wrap(model, accumulation_steps=accumulation_steps)
    model.compile(
        keras.optimizers.SGD(0.01, gradient_accumulation_steps=keras_steps),
        keras.losses.SparseCategoricalCrossentropy(),
    )
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (WINDOW, image_size, image_size, 3)).astype("float32")
    labels = rng.integers(0, 10, (WINDOW,))
    dataset = (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .repeat()
        .batch(batch_size, drop_remainder=True)  # static shapes, as in training
        .prefetch(1)
    )
    batches_per_window = WINDOW // batch_size
    times = []
    timer = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: times.append(time.perf_counter())
    )
    model.fit(
        dataset, steps_per_epoch=(windows + 1) * batches_per_window, verbose=0,
        callbacks=[timer],
    )
    warm = times[batches_per_window - 1]  # end of the warm-up window
    return {
        "samples_per_s": windows * WINDOW / (times[-1] - warm),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "updates": int(model.optimizer.iterations.numpy()),
    }


def _run_child(name: str) -> dict:
    command = [
        sys.executable, os.path.abspath(__file__), f"--case={name}",
        f"--windows={FLAGS.windows}", f"--image_size={FLAGS.image_size}",
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=False)
    line = [l for l in output.stdout.splitlines() if l.startswith("RESULT ")]
    if output.returncode or not line:
        sys.exit(f"case {name} failed:\n{output.stdout[-2000:]}\n{output.stderr[-4000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main(argv):
    del argv
    if FLAGS.case:
        print("RESULT " + json.dumps(run_case(FLAGS.case, FLAGS.windows, FLAGS.image_size)))
        return
    results = {}
    for _ in range(FLAGS.rounds):
        for name in CASES:
            result = _run_child(name)
            print(f"{name}: {result}", file=sys.stderr, flush=True)
            best = results.setdefault(name, result)
            best["samples_per_s"] = max(best["samples_per_s"], result["samples_per_s"])
            best["peak_rss_gb"] = max(best["peak_rss_gb"], result["peak_rss_gb"])

    base, big = results["plain(32)"], results["plain(256)"]
    print(f"\nEfficientNetV2B0 {FLAGS.image_size}x{FLAGS.image_size}, SGD, CPU, "
          f"{FLAGS.windows} timed windows of {WINDOW} samples per case, best of "
          f"{FLAGS.rounds} interleaved round(s)\n")
    print("| case | samples/s | × plain(32) | peak RSS (GB) | × plain(32) | × plain(256) | optimizer.iterations |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base['samples_per_s']:.2f} "
            f"| {r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / base['peak_rss_gb']:.2f} "
            f"| {r['peak_rss_gb'] / big['peak_rss_gb']:.2f} | {r['updates']} |"
        )
    accum = results["AccumModel(32x8)"]
    checks = [
        ("peak RSS <= 1.10 x plain(32)", accum["peak_rss_gb"] <= 1.10 * base["peak_rss_gb"]),
        ("peak RSS <= 0.45 x plain(256)", accum["peak_rss_gb"] <= 0.45 * big["peak_rss_gb"]),
        ("samples/s >= 0.95 x plain(32)", accum["samples_per_s"] >= 0.95 * base["samples_per_s"]),
    ]
    print()
    for text, ok in checks:
        print(f"AccumModel {text}: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    app.run(main)
