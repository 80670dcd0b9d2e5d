"""AccumModel under MirroredStrategy with synchronized BatchNormalization: the step's cost.

    python benchmarks/synchronized_batchnorm.py --model resnet50 --image-size 64
    python benchmarks/synchronized_batchnorm.py --model mobilenetv2 --steps-list 1,2,8

A synchronized BatchNormalization all-reduces its moments by a merge call, which TensorFlow
cannot make inside the micro-step loop, so the step holds its k micro-steps one after another
(`tfmem.training.accumulation_tf`). For one model of the registry, under `MirroredStrategy` on
two logical CPUs, each `accumulation_steps` of `--steps-list` with every BatchNormalization
synchronized and not (the loop), each in a fresh process: Adam, mean squared error, one `fit`
epoch of `--steps` steps of the global batch `--batch` on random images. Printed per run:

- the seconds of the first step (tracing, graph optimization and one step) and the median of
  the later ones;
- the resident set after `fit`, above the process's after importing TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

MIB = 2**20


def _resident() -> int:
    from tfmem.runtime.devices import resident_bytes

    resident = resident_bytes()
    if resident is None:
        raise SystemExit("error: this system has no /proc/self/statm; run on Linux")
    return resident


def child(args) -> None:
    """In a fresh process: one k, synchronized or not; prints one JSON line."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np

    import tfmem
    from tfmem import models

    baseline = _resident()
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        base = models.build(args.model, num_classes=4, image_size=args.image_size)
        for layer in base._flatten_layers():
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = args.child == "synchronized"
        model = tfmem.AccumModel.wrap(base, accumulation_steps=args.k)
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    shape = (args.batch * args.steps, args.image_size, args.image_size, 3)
    x = np.random.default_rng(0).uniform(0, 1, shape).astype("float32")
    y = np.zeros((len(x),) + tuple(model.output_shape[1:]), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
    ends: list[float] = []

    class Times(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=[Times()], check_memory=False)
    print(json.dumps(dict(first=ends[0] - start, later=float(np.median(np.diff(ends))),
                          resident=_resident() - baseline)))


def _run(args, kind: str, k: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, "--k", str(k),
               "--model", args.model, "--image-size", str(args.image_size),
               "--batch", str(args.batch), "--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: the {kind} process with k = {k} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a model of tfmem.models")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (2 replicas)")
    parser.add_argument("--steps", type=int, default=4, help="steps in the epoch (≥ 2)")
    parser.add_argument("--steps-list", default="1,2,4,8",
                        help="the accumulation_steps to run, comma-separated")
    parser.add_argument("--child", choices=("synchronized", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    try:
        ks = [int(k) for k in args.steps_list.split(",")]
    except ValueError:
        parser.error(f"--steps-list must be integers separated by commas, got {args.steps_list!r}")
    if args.steps < 2 or any(k < 1 or args.batch % (2 * k) for k in ks):
        parser.error("--steps must be at least 2, and --batch a multiple of 2 × each k")
    print(f"{args.model} at {args.image_size} px, global batch {args.batch} on 2 logical CPUs "
          f"(MirroredStrategy), {args.steps} steps; {os.cpu_count()} CPU cores")
    print("| accumulation_steps | BatchNormalization | first step, s | later steps, s | "
          "resident set after fit, MiB |")
    print("|---:|---|---:|---:|---:|")
    for k in ks:
        for kind in ("loop", "synchronized"):
            run = _run(args, kind, k)
            name = "synchronized (written out)" if kind == "synchronized" and k > 1 else (
                "synchronized" if kind == "synchronized" else "per replica")
            print(f"| {k} | {name} | {run['first']:.1f} | {run['later']:.3f} | "
                  f"{run['resident'] / MIB:.0f} |", flush=True)


if __name__ == "__main__":
    main()
