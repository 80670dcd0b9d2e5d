"""How close is the planner to the memory a real `fit` uses? A table, not a test.

    python benchmarks/planner_accuracy.py                 # the zoo below, ~15-30 min on 2 cores
    python benchmarks/planner_accuracy.py --models unet   # one model

For each architecture: the estimate (`tfmem.plan`, no run) and the probe-calibrated plan
(`tfmem.probe` at micro-batches 2 and 8) against the measured peak resident set of a real
`fit` (Adam, 64×64 inputs, synthetic data) in a fresh process at micro-batches 2, 8 and 16
(16 is held out of the probe). "Training memory" is the peak above the resident set right
after `import tensorflow, keras` (~0.75 GiB here): the planner's prediction minus its own
import term, so the framework's constant does not hide errors.

Then the recommendation: with the budget set to the measured peak at 16 (safety 1.0, so the
largest batch that truly fits is 16), which single-step batch does each plan pick? It must
not exceed 16 (that would OOM) and should be ≥ 80% of it.

Two children run at a time (each one is one model, one batch size, in its own process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import keras

import tfmem
from tfmem.probe import measure

IMAGE = (64, 64, 3)
PROBE_SIZES = (2, 8)
HELD_OUT = 16
GIB, MIB = 2**30, 2**20
_IMPORT = 750 * MIB  # the planner's own import term (tfmem/planner.py), subtracted to compare


def resnet50():
    return keras.applications.ResNet50(weights=None, input_shape=IMAGE, classes=10)


def efficientnetv2_b0():
    return keras.applications.EfficientNetV2B0(weights=None, input_shape=IMAGE, classes=10)


def densenet121():
    return keras.applications.DenseNet121(weights=None, input_shape=IMAGE, classes=10)


def _conv_block(x, filters):
    for _ in range(2):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
    return x


def unet():
    """A small U-Net (3 levels, 16-64 filters, skip concatenations, 2-class per-pixel head)."""
    inputs = keras.Input(IMAGE)
    skips, x = [], inputs
    for filters in (16, 32):
        x = _conv_block(x, filters)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = _conv_block(x, 64)
    for filters, skip in zip((32, 16), reversed(skips)):
        x = keras.layers.Conv2DTranspose(filters, 2, strides=2)(x)
        x = _conv_block(keras.layers.Concatenate()([x, skip]), filters)
    return keras.Model(inputs, keras.layers.Conv2D(2, 1, activation="softmax")(x), name="unet")


def _dense_block(x, num_layers, growth):
    new = []
    for _ in range(num_layers):
        y = keras.layers.BatchNormalization()(x)
        y = keras.layers.Activation("relu")(y)
        y = keras.layers.Conv2D(growth, 3, padding="same")(y)
        y = keras.layers.Dropout(0.2)(y)
        new.append(y)
        x = keras.layers.Concatenate()([x, y])
    return x, keras.layers.Concatenate()(new)


def tiramisu():
    """A small FC-DenseNet (Jégou et al. 2017): dense blocks of 3 layers, growth 12, 2 levels."""
    inputs = keras.Input(IMAGE)
    x = keras.layers.Conv2D(32, 3, padding="same")(inputs)
    skips = []
    for _ in range(2):
        x, _ = _dense_block(x, 3, 12)
        skips.append(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.Conv2D(x.shape[-1], 1)(x)
        x = keras.layers.MaxPooling2D()(x)
    _, x = _dense_block(x, 3, 12)
    for skip in reversed(skips):
        x = keras.layers.Conv2DTranspose(x.shape[-1], 3, strides=2, padding="same")(x)
        x, x_new = _dense_block(keras.layers.Concatenate()([x, skip]), 3, 12)
        x = x_new
    outputs = keras.layers.Conv2D(2, 1, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="tiramisu")


ZOO = {"resnet50": resnet50, "efficientnetv2-b0": efficientnetv2_b0,
       "densenet121": densenet121, "unet": unet, "tiramisu": tiramisu}


def run_model(name, builder, pool):
    model = builder()
    estimate = tfmem.plan(model, global_batch_size=HELD_OUT, optimizer="adam",
                          memory_budget=16 * GIB)
    started = time.time()
    calibrated = pool.submit(tfmem.probe, model, global_batch_size=HELD_OUT, optimizer="adam",
                             memory_budget=16 * GIB, micro_batch_sizes=PROBE_SIZES, num_steps=1)
    truths = {b: pool.submit(measure, builder, micro_batch_size=b, input_shape=IMAGE,
                             memory_limit=12 * GIB, optimizer="adam", num_steps=1)
              for b in (*PROBE_SIZES, HELD_OUT)}
    return model, estimate, calibrated, truths, started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    # Builders are pickled by reference for the children: use this file as an importable module.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    zoo = __import__("planner_accuracy")
    began = time.time()
    rows, picks = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [(name, *run_model(name, getattr(zoo, zoo.ZOO[name].__name__), pool))
                for name in names]
        for name, model, estimate, calibrated_future, truths, _ in jobs:
            calibrated = calibrated_future.result()
            line = calibrated.measured
            for b, future in truths.items():
                truth = future.result()
                if truth.stopped:
                    rows.append((name, b, None, None, None, truth.reason))
                    continue
                grown = truth.peak_bytes - truth.baseline_bytes
                predicted = estimate.peak_bytes(b, 1) - _IMPORT
                fitted = line.fixed_bytes + line.per_sample_bytes * b - truth.baseline_bytes
                rows.append((name, b, grown, predicted, fitted if b == HELD_OUT else None, ""))
            held = truths[HELD_OUT].result()
            if not held.stopped:
                budget = held.peak_bytes  # the largest batch that truly fits is HELD_OUT
                pick_estimate = estimate.replace(memory_per_replica=budget, safety=1.0).max_micro_batch
                pick_calibrated = calibrated.replace(memory_per_replica=budget,
                                                     safety=1.0).max_micro_batch
                picks.append((name, model.count_params(), budget, pick_estimate,
                              pick_calibrated))
    print(f"\nTraining memory (peak RSS above `import tensorflow`), Adam, {IMAGE[0]}×{IMAGE[1]}, "
          f"fresh process per row; probe at {PROBE_SIZES}, {HELD_OUT} held out.\n")
    print("| model | batch | measured | estimate | est./meas. | calibrated | cal./meas. |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, b, grown, predicted, fitted, reason in rows:
        if grown is None:
            print(f"| {name} | {b} | stopped: {reason} | | | | |")
            continue
        cal = (f"{fitted / MIB:.0f} MiB | {fitted / grown:.2f}" if fitted is not None
               else "(probe point) | ")
        print(f"| {name} | {b} | {grown / MIB:.0f} MiB | {predicted / MIB:.0f} MiB | "
              f"{predicted / grown:.2f} | {cal} |")
    print(f"\nRecommended single-step batch with the budget = measured peak at {HELD_OUT} "
          f"(safety 1.0; the true largest batch is {HELD_OUT}):\n")
    print("| model | parameters | budget (total RSS) | estimate picks | calibrated picks |")
    print("|---|---:|---:|---:|---:|")
    for name, params, budget, pick_estimate, pick_calibrated in picks:
        def verdict(pick):
            if pick > HELD_OUT:
                return f"{pick} (over: would OOM)"
            return f"{pick} ({pick / HELD_OUT:.0%})"
        print(f"| {name} | {params:,} | {budget / GIB:.2f} GiB | {verdict(pick_estimate)} | "
              f"{verdict(pick_calibrated)} |")
    print(f"\n{len(names)} models in {(time.time() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
