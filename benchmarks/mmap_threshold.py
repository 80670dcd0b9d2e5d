"""What a fixed glibc mmap threshold costs a CPU training step in time, and saves in RAM.

    python benchmarks/mmap_threshold.py
    python benchmarks/mmap_threshold.py --cases convnext-tiny --thresholds 1,4,32 --repeats 3

Each case an `AccumModel` (k = 1, Adam, TensorFlow, float32; `resnet50`, `convnext-tiny` and
`unet` of the registry at `--image-size` on mse to zeros; `text`: a 2-block transformer of
Keras layers, 128 tokens, width 256, 4 heads, a 8000-word next-token head on sparse
cross-entropy) in a fresh process under glibc's default `malloc` (its mmap threshold rises to
the largest block freed, up to 32 MiB) and under each fixed threshold of `--thresholds` MiB
(`MALLOC_MMAP_THRESHOLD_`, read by glibc before the process allocates: each block of that size
or more mapped on its own and given back when freed). The processes take turns: each repeat
runs every case under every heap, in a rotated order. Printed per case and heap: the median
seconds per step of `--steps` steps after one traced (wall clock, and the CPU time of all the
process's threads, which other jobs on a shared machine disturb less), the page faults a step
takes (a block mapped on its own is faulted in page by page each time), the peak resident set
above the one after import (the traced step included) and the resident set after the last
step, and the ratios to the default heap. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MIB = 2**20
CASES = {"resnet50": 16, "convnext-tiny": 32, "unet": 8, "text": 16}  # micro-batch of each


def build(case: str, image_size: int):
    """The model of `case`, its input and its target (random, fixed seed)."""
    import keras
    import numpy as np

    from tfmem import models

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batch = CASES[case]
    if case == "text":
        tokens, width, vocabulary = 128, 256, 8000
        inputs = keras.Input((tokens,), dtype="int32")
        x = keras.layers.Embedding(vocabulary, width)(inputs)
        for _ in range(2):
            h = keras.layers.LayerNormalization()(x)
            x = x + keras.layers.MultiHeadAttention(4, width // 4)(h, h, use_causal_mask=True)
            h = keras.layers.LayerNormalization()(x)
            h = keras.layers.Dense(4 * width, activation="gelu")(h)
            x = x + keras.layers.Dense(width)(h)
        model = keras.Model(inputs, keras.layers.Dense(vocabulary)(x))
        x = rng.integers(0, vocabulary, (batch, tokens)).astype("int32")
        y = rng.integers(0, vocabulary, (batch, tokens)).astype("int32")
        return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = models.build(case, num_classes=4, image_size=(image_size, image_size))
    x = rng.uniform(0, 1, (batch, image_size, image_size, 3)).astype("float32")
    y = np.zeros((batch,) + tuple(model.output_shape[1:]), "float32")
    return model, x, y, "mse"


def child(args) -> None:
    """In a fresh process: seconds per step after a traced one, the peak resident set."""
    import keras

    import tfmem
    from tfmem.runtime import memory_cap

    baseline = memory_cap.status_bytes()["VmRSS"]
    model, x, y, loss = build(args.child, args.image_size)
    accum = tfmem.AccumModel.wrap(model, accumulation_steps=1)
    accum.compile(keras.optimizers.Adam(1e-4), loss)
    accum.train_on_batch(x, y)  # traced
    seconds, cpu, faults = [], [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        accum.train_on_batch(x, y)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)
    status = memory_cap.status_bytes()
    print(json.dumps({"step": statistics.median(seconds), "cpu": statistics.median(cpu),
                      "faults": statistics.median(faults), "peak": status["VmHWM"] - baseline,
                      "after": status["VmRSS"] - baseline}))


def measured(args, case: str, heap: str) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if heap != "default":
        env["MALLOC_MMAP_THRESHOLD_"] = str(int(heap) * MIB)
    command = [sys.executable, os.path.abspath(__file__), "--child", case, "--image-size",
               str(args.image_size), "--steps", str(args.steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: {case} ({heap} heap) failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--thresholds", default="1,4", help="fixed thresholds, MiB")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cases = args.cases.split(",")
    heaps = ["default"] + args.thresholds.split(",")
    runs = {(case, heap): [] for case in cases for heap in heaps}
    for repeat in range(args.repeats):
        for case in cases:
            for i in range(len(heaps)):
                heap = heaps[(i + repeat) % len(heaps)]
                runs[case, heap].append(measured(args, case, heap))
                print(f"# {case} {heap}: {runs[case, heap][-1]}", file=sys.stderr, flush=True)
    print(f"{args.image_size} px; median of {args.repeats} processes, each the median of "
          f"{args.steps} steps")
    print("| case | micro-batch | heap | s per step | each process | time / default "
          "| CPU s per step | CPU / default | page faults per step | peak MiB | after MiB "
          "| peak / default |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        medians = {heap: {key: statistics.median(run[key] for run in runs[case, heap])
                          for key in ("step", "cpu", "faults", "peak", "after")}
                    for heap in heaps}
        for heap in heaps:
            m, base = medians[heap], medians["default"]
            name = "default" if heap == "default" else f"fixed {heap} MiB"
            each = ", ".join(f"{run['step']:.3f}" for run in runs[case, heap])
            print(f"| {case} | {CASES[case]} | {name} | {m['step']:.3f} | {each} | "
                  f"{m['step'] / base['step']:.3f} | {m['cpu']:.3f} | "
                  f"{m['cpu'] / base['cpu']:.3f} | {m['faults']:.0f} | {m['peak'] / MIB:.0f} | "
                  f"{m['after'] / MIB:.0f} | {m['peak'] / base['peak']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
