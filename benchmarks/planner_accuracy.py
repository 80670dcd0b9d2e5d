"""How close is the planner to the memory a real `fit` uses? Tables, not a test.

    python benchmarks/planner_accuracy.py                 # the zoo below, ~30-45 min on 2 cores
    python benchmarks/planner_accuracy.py --models unet   # one model
    python benchmarks/planner_accuracy.py --batches 16,128 \
        --models convnext-tiny,mobilenetv3-small,vit,subclassed-cnn   # estimate vs runs only

The setting: a machine with `--device_gib` (6) GiB of RAM for the training process, planned
with the default 80% rule, so the budget is 4.8 GiB; Adam, 64×64 inputs, synthetic data. For
each architecture:

1. The estimate (`tfmem.plan`, no run) and the probe-calibrated plan (`tfmem.probe`, its
   default sizes: ¼, ½ and all of the largest batch whose estimated peak is under half the
   budget), and the batch each recommends for one plain step (`max_micro_batch`).
2. Real `fit` steps, each in a fresh process with the device's memory as a hard limit (the
   child is stopped the moment its resident set reaches it: that is the OOM): at batch 16,
   at each recommended batch, and at the smallest batch of which the recommendation is less
   than 80% (`floor(pick / 0.8) + 1`).

Accuracy: predicted vs measured peak resident set of the whole process (what the planner
predicts and the issue's measure), and, stricter, the *training memory* above the resident set
right after `import tensorflow, keras` (the planner's own import term subtracted from its
prediction, so that constant does not hide errors). The probe's own sizes are not counted for
the calibrated plan. Targets: estimate within ±20%, calibrated within ±10%.

The recommendation: it must never OOM (its run stays under the device's memory), and it must
be ≥ 80% of the true largest batch under the budget. The second is decided by a run, not a
fit: if the batch `floor(pick / 0.8) + 1` peaks above the budget, the true largest is below
it and the pick is ≥ 80% of it. A pick whose own peak is above the budget (but under the
device) is over 100% of the true largest: the 20% headroom took the estimate's error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import keras

import tfmem
from tfmem.memory.planner import CPU_IMPORT_BYTES  # subtracted to compare
from tfmem.memory.probe import measure

IMAGE = (64, 64, 3)
GIB, MIB = 2**30, 2**20
SMALL = 16  # one small batch, where the fixed terms dominate
GLOBAL = 4096  # large enough not to cap the probe's sizes or the recommendation


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


def convnext_tiny():
    return keras.applications.ConvNeXtTiny(weights=None, input_shape=IMAGE, classes=10)


def mobilenetv3_small():
    return keras.applications.MobileNetV3Small(weights=None, input_shape=IMAGE, classes=10)


def vit():
    """A ViT-style classifier from Keras layers: 8×8 patches (64 tokens), width 192, 6 blocks
    of pre-norm 3-head attention and a GELU MLP, learned position embedding (keras.ops add)."""
    inputs = keras.Input(IMAGE)
    patches = keras.layers.Conv2D(192, 8, strides=8)(inputs)
    tokens = keras.layers.Reshape((64, 192))(patches)
    positions = keras.layers.Embedding(64, 192)(keras.ops.arange(64))
    x = tokens + positions
    for _ in range(6):
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        x = x + keras.layers.MultiHeadAttention(num_heads=3, key_dim=64)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-6)(x)
        h = keras.layers.Dense(768, activation="gelu")(h)
        x = x + keras.layers.Dense(192)(h)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(epsilon=1e-6)(x))
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="vit")


def hub_vit():
    """keras-hub's own `ViTBackbone` (ViT-S/16's shapes, 16 tokens and a class token at
    64 px), its class token into a class head. Needs keras-hub."""
    try:
        import keras_hub
    except ImportError as error:
        raise SystemExit(f"error: --models hub-vit needs keras-hub ({error}); install it "
                         "with `pip install keras-hub`") from None
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE, patch_size=16, num_layers=12, num_heads=6, hidden_dim=384,
        mlp_dim=1536)
    inputs = keras.Input(IMAGE)
    head = keras.layers.Dense(10, name="head")(backbone(inputs)[:, 0])
    return keras.Model(inputs, head, name="hub_vit")


class SubclassedCNN(keras.Model):
    """A subclassed CNN (no functional graph): four conv-BN-ReLU blocks, pooling, a head."""

    def __init__(self):
        super().__init__(name="subclassed_cnn")
        self.blocks = [(keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),
                        keras.layers.BatchNormalization()) for filters in (32, 64, 128, 256)]
        self.pool = keras.layers.MaxPooling2D()
        self.head = keras.layers.Dense(10)

    def call(self, x, training=False):
        for conv, norm in self.blocks:
            x = self.pool(keras.ops.relu(norm(conv(x), training=training)))
        return self.head(keras.ops.mean(x, axis=(1, 2)))


def subclassed_cnn():
    model = SubclassedCNN()
    model(keras.KerasTensor((None,) + IMAGE))  # a symbolic call builds its layers
    return model


ZOO = {"resnet50": resnet50, "efficientnetv2-b0": efficientnetv2_b0,
       "densenet121": densenet121, "unet": unet, "tiramisu": tiramisu,
       "convnext-tiny": convnext_tiny, "mobilenetv3-small": mobilenetv3_small, "vit": vit,
       "subclassed-cnn": subclassed_cnn}
# Held-out models from keras-hub, measured on request only (keras-hub is not a dependency).
HELD_OUT = {"hub-vit": hub_vit}


def _truth(pool, builder, batch, device):
    return pool.submit(measure, builder, micro_batch_size=batch, input_shape=IMAGE,
                       memory_limit=device, optimizer="adam", num_steps=1)


def run_model(name, builder, pool, device):
    """Plans, probes and runs one model; returns its accuracy rows and its two verdicts."""
    model = builder()
    estimate = tfmem.plan(model, global_batch_size=GLOBAL, optimizer="adam",
                          memory_budget=device)
    calibrated_future = pool.submit(tfmem.probe, model, global_batch_size=GLOBAL,
                                    optimizer="adam", memory_budget=device, num_steps=1)
    picks = {"estimate": estimate.max_micro_batch}
    checks = {"estimate": int(picks["estimate"] / 0.8) + 1}
    truths = {b: _truth(pool, builder, b, device)
              for b in sorted({SMALL, picks["estimate"], checks["estimate"]})}
    calibrated = calibrated_future.result()
    picks["calibrated"] = calibrated.max_micro_batch
    checks["calibrated"] = int(picks["calibrated"] / 0.8) + 1
    for b in (picks["calibrated"], checks["calibrated"]):
        if b not in truths:
            truths[b] = _truth(pool, builder, b, device)
    truths = {b: truths[b].result() for b in sorted(truths)}
    rows = []
    for b, truth in truths.items():
        if truth.stopped:
            rows.append((name, b, None, estimate.peak_bytes(b, 1), None, None, truth.reason))
            continue
        grown = truth.peak_bytes - truth.baseline_bytes
        fitted = (None if b in calibrated.measured.micro_batch_sizes
                  else calibrated.peak_bytes(b, 1) - truth.baseline_bytes)
        rows.append((name, b, truth, estimate.peak_bytes(b, 1),
                     None if fitted is None else fitted + truth.baseline_bytes, grown, ""))
    budget = estimate.budget_bytes
    verdicts = []
    for which in ("estimate", "calibrated"):
        pick, check = truths[picks[which]], truths[checks[which]]
        oom = pick.stopped
        over_budget = oom or pick.peak_bytes > budget
        # The check batch over the budget (or stopped) proves the true largest is below it.
        check_over = check.stopped or check.peak_bytes > budget
        verdicts.append((which, picks[which], pick, oom, over_budget, checks[which], check,
                         check_over))
    line = calibrated.measured
    return rows, verdicts, model.count_params(), line, budget


def accuracy_rows(name, builder, pool, device, batches):
    """The estimate against a real `fit` step at each batch (no probe, no recommendation)."""
    estimate = tfmem.plan(builder(), global_batch_size=GLOBAL, optimizer="adam",
                          memory_budget=device)
    truths = {b: _truth(pool, builder, b, device) for b in batches}
    return [(name, b, estimate.peak_bytes(b, 1), truths[b].result()) for b in batches]


def print_accuracy(rows, began):
    print(f"\nEstimate against the peak of a real `fit` step, Adam, {IMAGE[0]}×{IMAGE[1]}, "
          "fresh process per row; above import: both minus the resident set right after "
          "`import tensorflow, keras` (the planner's import term).\n")
    print("| model | batch | peak RSS | estimate | est./meas. | above import | est./meas. |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = 1.0
    for name, b, predicted, truth in rows:
        if truth.stopped:
            print(f"| {name} | {b} | stopped: {truth.reason} | {_gib(predicted)} | | | |")
            worst = float("inf")
            continue
        grown = truth.peak_bytes - truth.baseline_bytes
        ratio = predicted / truth.peak_bytes
        worst = max(worst, ratio, 1 / ratio)
        print(f"| {name} | {b} | {_gib(truth.peak_bytes)} | {_gib(predicted)} | {ratio:.2f} | "
              f"{grown / MIB:.0f} MiB | {(predicted - CPU_IMPORT_BYTES) / grown:.2f} |")
    verdict = "within" if worst <= 1.2 else "NOT within"
    print(f"\nEvery row {verdict} ±20% of the measured peak (worst ratio {worst:.2f} either "
          f"way); {(time.time() - began) / 60:.1f} min, load average {os.getloadavg()[0]:.1f}")


def _gib(nbytes):
    return f"{nbytes / GIB:.2f} GiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated names of the zoo, or of "
                        f"{', '.join(HELD_OUT)} (needs keras-hub)")
    parser.add_argument("--device_gib", type=float, default=6.0,
                        help="RAM of the simulated device for the training process (GiB)")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes: only the estimate against real "
                             "steps at these batches (no probe, no recommendation)")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    device = int(args.device_gib * GIB)
    # Builders are pickled by reference for the children: use this file as an importable module.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    zoo = __import__("planner_accuracy")
    began = time.time()
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            rows = [row for name in names for row in accuracy_rows(
                name, getattr(zoo, {**zoo.ZOO, **zoo.HELD_OUT}[name].__name__), pool, device, batches)]
        print_accuracy(rows, began)
        return
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        # One model at a time: its probe and its runs share the two workers.
        for name in names:
            results[name] = run_model(name, getattr(zoo, {**zoo.ZOO, **zoo.HELD_OUT}[name].__name__), pool, device)
            print(f"{name} done after {(time.time() - began) / 60:.1f} min", flush=True)
    print(f"\nPeak memory of a real `fit` step, Adam, {IMAGE[0]}×{IMAGE[1]}, fresh process per "
          "row. Peak RSS: the whole process, as the planner predicts it. Above import: the "
          "same minus the resident set after `import tensorflow, keras` (and the planner's "
          "prediction minus its import term), a stricter view. Calibrated = the probe's line, "
          "its own sizes left out.\n")
    print("| model | batch | peak RSS | estimate | est./meas. | calibrated | cal./meas. | "
          "above import | est./meas. | cal./meas. |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (rows, _, _, line, _) in results.items():
        for _, b, truth, predicted, fitted, grown, reason in rows:
            if truth is None:
                print(f"| {name} | {b} | stopped: {reason} | {_gib(predicted)} | | | | | | |")
                continue
            peak = truth.peak_bytes
            cal = (f"{_gib(fitted)} | {fitted / peak:.2f}" if fitted is not None
                   else "(probe point) | ")
            cal_grown = (f"{(fitted - truth.baseline_bytes) / grown:.2f}" if fitted is not None
                         else "")
            print(f"| {name} | {b} | {_gib(peak)} | {_gib(predicted)} | {predicted / peak:.2f} | "
                  f"{cal} | {grown / MIB:.0f} MiB | {(predicted - CPU_IMPORT_BYTES) / grown:.2f} | "
                  f"{cal_grown} |")
    print("\nProbe lines (total RSS = fixed + per-sample × batch):\n")
    for name, (_, _, _, line, _) in results.items():
        print(f"- {name}: sizes {line.micro_batch_sizes}, {line.fixed_bytes / MIB:.0f} MiB + "
              f"{line.per_sample_bytes / MIB:.2f} MiB × b")
    print(f"\nRecommended plain-step batch (`max_micro_batch`) on a {args.device_gib:g} GiB "
          f"device, budget {_gib(int(0.8 * device))} (80%): its measured peak, and the run at "
          "floor(pick / 0.8) + 1 that decides whether the pick is ≥ 80% of the true largest "
          "batch under the budget.\n")
    print("| model | parameters | plan | pick | peak at pick | OOM? | check batch | "
          "peak at check | pick ≥ 80% of true largest? |")
    print("|---|---:|---|---:|---:|---|---:|---:|---|")
    failures = 0
    for name, (_, verdicts, params, _, budget) in results.items():
        for which, pick, truth, oom, over_budget, check, check_truth, check_over in verdicts:
            peak = "stopped" if truth.stopped else _gib(truth.peak_bytes)
            if oom:
                status = "**OOM**"
            elif over_budget:
                status = "no (over the 80% line, under the device)"
            else:
                status = "no"
            check_peak = "stopped (OOM)" if check_truth.stopped else _gib(check_truth.peak_bytes)
            if over_budget:
                enough = "yes (> 100%: the pick itself is over the budget)"
            elif check_over:
                enough = "yes"
            else:
                enough = "**no** (the check batch fits too)"
            failures += oom or not (over_budget or check_over)
            print(f"| {name} | {params:,} | {which} | {pick} | {peak} | {status} | {check} | "
                  f"{check_peak} | {enough} |")
    print(f"\n{failures} recommendation(s) failing a target; {len(names)} models in "
          f"{(time.time() - began) / 60:.1f} min, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
