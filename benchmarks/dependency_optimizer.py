"""What turning off Grappler's dependency optimizer costs a rematerialized step on TensorFlow.

    python benchmarks/dependency_optimizer.py --model efficientnetv2-s --image-size 384 \
        --batch 4 --steps 4 --rounds 2
    python benchmarks/dependency_optimizer.py --model tiramisu-56 --image-size 64 --batch 8

tfmem's first rematerialized training step turns the rewrite off for the process
(docs/rematerialization.md, "Exact"). Three settings, each in a fresh process, taking turns
for `--rounds` rounds: `none` (no rematerialization, the rewrite on), `full` (rematerialized,
the rewrite off: what tfmem runs) and `full, rewrite on` (the same step with the call that
turns the rewrite off made a no-op, which is not exact: it is here only for its time).
Each times `--steps` `train_on_batch` calls of one micro-batch (k = 1, SGD) after 3 that trace
and warm up. Prints seconds per step, each round's and their mean, and the ratios of the means.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = ("none", "full", "full, rewrite on")


def child(setting: str, model_name: str, image_size: int, batch: int, steps: int) -> float:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import tfmem
    from tfmem.training import remat_tf

    if setting == "full, rewrite on":
        remat_tf._keep_dependencies = lambda: None
    keras.utils.set_random_seed(0)
    model = tfmem.models.build(model_name, num_classes=4, image_size=image_size)
    accum = tfmem.AccumModel.wrap(model, accumulation_steps=1,
                                  rematerialize=None if setting == "none" else "full")
    accum.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy())
    x = np.random.default_rng(0).uniform(0, 1, (batch, image_size, image_size, 3))
    y = np.arange(batch) % 4
    if len(accum.outputs[0].shape) == 4:  # a segmentation network: a label per pixel
        y = np.broadcast_to(y[:, None, None], (batch, image_size, image_size)).copy()
    x = x.astype("float32")
    for _ in range(3):
        accum.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        accum.train_on_batch(x, y)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.image_size, args.batch,
                               args.steps)))
        return
    times = {setting: [] for setting in SETTINGS}
    for round_ in range(args.rounds):
        for setting in SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]:
            result = subprocess.run(
                [sys.executable, __file__, "--child", setting, "--model", args.model,
                 "--image-size", str(args.image_size), "--batch", str(args.batch),
                 "--steps", str(args.steps)], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                sys.exit(f"error: the {setting!r} process failed:\n{result.stderr[-3000:]}")
            times[setting].append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}, {setting}: {times[setting][-1]:.3f} s per step",
                  flush=True)
    mean = {setting: sum(values) / len(values) for setting, values in times.items()}
    print(f"\n{args.model}, {args.image_size} px, micro-batch {args.batch}")
    print("| setting | s per step (rounds) | mean |\n|---|---|---:|")
    for setting in SETTINGS:
        rounds = ", ".join(f"{value:.3f}" for value in times[setting])
        print(f"| {setting} | {rounds} | {mean[setting]:.3f} |")
    print(f"full / full with the rewrite on: {mean['full'] / mean['full, rewrite on']:.2f}×; "
          f"full / none: {mean['full'] / mean['none']:.2f}× (with the rewrite on: "
          f"{mean['full, rewrite on'] / mean['none']:.2f}×)")


if __name__ == "__main__":
    main()
