"""What Grappler's dependency optimizer is worth to a rematerialized step on TensorFlow.

    python benchmarks/dependency_optimizer.py --model efficientnetv2-s --image-size 384 \
        --batch 4 --steps 4 --rounds 2
    python benchmarks/dependency_optimizer.py --model tiramisu-56 --image-size 64 --batch 8

tfmem leaves the rewrite on: each variable's gradient waits, through its data, for the
recomputation that reads the variable (docs/rematerialization.md, "Exact"). Three settings,
each in a fresh process, taking turns for `--rounds` rounds: `none` (no rematerialization),
`full` (rematerialized, as tfmem runs it) and `full, rewrite off` (the same step with the
rewrite turned off for the process, `tf.config.optimizer.set_experimental_options(
{"dependency_optimization": False})`, which is how the recomputation was once kept exact).
Each times `--steps` `train_on_batch` calls of one micro-batch (k = 1, SGD) after 3 that trace
and warm up. Prints seconds per step, each round's and their mean, and the ratios of the means.
With `--live SMALL,LARGE`, also the bytes per sample of the tensors live at a step's peak
(TensorFlow's own allocator, `TF_CPU_ALLOCATOR_USE_BFC=true`, from the peaks at the two
micro-batches), one fresh process per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = ("none", "full", "full, rewrite off")


def _model(setting: str, model_name: str, image_size: int):
    """The compiled AccumModel of `setting` (k = 1, SGD), the process's Grappler options set
    for it."""
    import keras
    import tensorflow as tf

    import tfmem

    if setting == "full, rewrite off":
        tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    keras.utils.set_random_seed(0)
    model = tfmem.models.build(model_name, num_classes=4, image_size=image_size)
    accum = tfmem.AccumModel.wrap(model, accumulation_steps=1,
                                  rematerialize=None if setting == "none" else "full")
    accum.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy())
    return accum


def _batch(accum, image_size: int, batch: int):
    import numpy as np

    x = np.random.default_rng(0).uniform(0, 1, (batch, image_size, image_size, 3))
    y = np.arange(batch) % 4
    if len(accum.outputs[0].shape) == 4:  # a segmentation network: a label per pixel
        y = np.broadcast_to(y[:, None, None], (batch, image_size, image_size)).copy()
    return x.astype("float32"), y


def live(setting: str, model_name: str, image_size: int, batches: tuple[int, int]) -> float:
    """Bytes per sample live at a step's peak, from TensorFlow's allocator (in a child started
    with `TF_CPU_ALLOCATOR_USE_BFC=true`)."""
    import tensorflow as tf

    peaks = []
    for batch in batches:
        accum = _model(setting, model_name, image_size)
        x, y = _batch(accum, image_size, batch)
        accum.train_on_batch(x, y)  # traced
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        accum.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return (peaks[1] - peaks[0]) / (batches[1] - batches[0])


def child(setting: str, model_name: str, image_size: int, batch: int, steps: int) -> float:
    accum = _model(setting, model_name, image_size)
    x, y = _batch(accum, image_size, batch)
    for _ in range(3):
        accum.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        accum.train_on_batch(x, y)
    return (time.perf_counter() - start) / steps


def _in_child(flags: list[str], name: str, **env) -> float:
    """The number a fresh process of this script started with `flags` prints last; exits with
    its stderr's end if it fails."""
    result = subprocess.run([sys.executable, __file__, *flags], env=dict(os.environ, **env),
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"error: {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (0: none)")
    parser.add_argument("--live", help="two micro-batches, e.g. 2,8: also the live tensors' "
                        "bytes per sample at a step's peak")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--live-child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    live_batches = tuple(int(b) for b in args.live.split(",")) if args.live else None
    if args.live_child:
        print(json.dumps(live(args.live_child, args.model, args.image_size, live_batches)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.model, args.image_size, args.batch,
                               args.steps)))
        return
    model = ["--model", args.model, "--image-size", str(args.image_size)]
    per_sample = {}
    for setting in SETTINGS if live_batches else ():
        per_sample[setting] = _in_child(["--live-child", setting, *model, "--live", args.live],
                                        f"the {setting!r} allocator process",
                                        TF_CPU_ALLOCATOR_USE_BFC="true")
        print(f"{setting}: {per_sample[setting] / 2**20:.1f} MiB per sample live at the peak",
              flush=True)
    times = {setting: [] for setting in SETTINGS}
    for round_ in range(args.rounds):
        for setting in SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]:
            times[setting].append(_in_child(
                ["--child", setting, *model, "--batch", str(args.batch), "--steps",
                 str(args.steps)], f"the {setting!r} process"))
            print(f"round {round_ + 1}, {setting}: {times[setting][-1]:.3f} s per step",
                  flush=True)
    if per_sample:
        print(f"live bytes per sample, none / full: "
              f"{per_sample['none'] / per_sample['full']:.2f}×; none / full with the rewrite off: "
              f"{per_sample['none'] / per_sample['full, rewrite off']:.2f}×")
    if not args.rounds:
        return
    mean = {setting: sum(values) / len(values) for setting, values in times.items()}
    print(f"\n{args.model}, {args.image_size} px, micro-batch {args.batch}")
    print("| setting | s per step (rounds) | mean |\n|---|---|---:|")
    for setting in SETTINGS:
        rounds = ", ".join(f"{value:.3f}" for value in times[setting])
        print(f"| {setting} | {rounds} | {mean[setting]:.3f} |")
    print(f"full / none: {mean['full'] / mean['none']:.2f}×; with the rewrite off: "
          f"{mean['full, rewrite off'] / mean['none']:.2f}× "
          f"({mean['full, rewrite off'] / mean['full']:.2f}× the time of full)")


if __name__ == "__main__":
    main()
