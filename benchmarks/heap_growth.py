"""What the process heap adds to a CPU training step's resident set, beside the tensors.

    python benchmarks/heap_growth.py --model convnext-tiny --batches 8,32,64,128 \
        --settings none,full
    python benchmarks/heap_growth.py --model grouped-conv --batches 8,32,64,128
    python benchmarks/heap_growth.py --model resnext-mini --batches 8,32,64 --settings none,full \
        --heaps default

An `AccumModel` (k = 1, Adam, mse to zeros, TensorFlow, float32) of `--model` (one of the
registry's at `--image-size`; `grouped-conv`: a 1×1 convolution and one 7×7
`Conv2D(groups=96)` on 16×16×96, the convolution Keras's TensorFlow backend runs as an XLA
call; `depthwise-conv`: the same as `DepthwiseConv2D`; `resnext-mini`: a small ResNeXt of
plain Keras layers, 3×3 `Conv2D(groups=32)` in four bottleneck blocks at 32² and 16²),
each micro-batch and setting in a
fresh process, twice: under glibc's default `malloc` (its mmap threshold moves up to the
largest block freed, up to 32 MiB, so that blocks below it are then kept in the heap when
freed) and with the threshold fixed (`MALLOC_MMAP_THRESHOLD_=1048576`: every block over 1 MiB
mapped on its own and given back when freed). Printed: the peak resident set of the second
step above the resident set after import (the first step traces), the resident set after
that step (and, with `--heap-free`, the bytes glibc's heap holds free then), the MiB per
sample between consecutive micro-batches, and the plan's growth
(`tfmem.plan` less its import term, planned for a process with that heap) against the peak.
Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MIB = 2**20
HEAPS = {"default": {}, "fixed": {"MALLOC_MMAP_THRESHOLD_": str(MIB)}}


def _resnext_mini(image_size: int):
    """Four ResNeXt bottlenecks (1×1, 3×3 with 32 groups, 1×1; BatchNorm, ReLU, shortcut)."""
    import keras

    layers = keras.layers

    def unit(x, filters, kernel=1, strides=1, groups=1, relu=True):
        x = layers.Conv2D(filters, kernel, strides, padding="same", groups=groups,
                          use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inputs = keras.Input((image_size, image_size, 3))
    x = unit(inputs, 64, 3, strides=2)
    for width, out, strides in ((128, 256, 1), (128, 256, 1), (256, 512, 2), (256, 512, 1)):
        shortcut = (x if x.shape[-1] == out and strides == 1
                    else unit(x, out, strides=strides, relu=False))
        y = unit(x, width)
        y = unit(y, width, 3, strides=strides, groups=32)
        y = unit(y, out, relu=False)
        x = layers.ReLU()(layers.Add()([y, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(4)(x), name="resnext_mini")


def build(name: str, image_size: int):
    import keras

    from tfmem import models

    keras.utils.set_random_seed(0)
    if name == "resnext-mini":
        return _resnext_mini(image_size)
    if name not in ("grouped-conv", "depthwise-conv"):
        return models.build(name, num_classes=4, image_size=(image_size, image_size))
    inputs = keras.Input((16, 16, 96))
    x = keras.layers.Conv2D(96, 1)(inputs)
    x = (keras.layers.Conv2D(96, 7, groups=96, padding="same")(x) if name == "grouped-conv"
         else keras.layers.DepthwiseConv2D(7, padding="same")(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def _resident() -> dict[str, int]:
    from tfmem.runtime import memory_cap

    return memory_cap.status_bytes()


def step_case(model: str, image_size: int, batch: int, setting: str):
    """The AccumModel (Adam, one micro-batch a step, `setting` of rematerialize) and a batch
    `(x, y)` of `batch` random images and zero targets, that each measured step trains on."""
    import keras
    import numpy as np

    import tfmem

    accum = tfmem.AccumModel.wrap(build(model, image_size), accumulation_steps=1,
                                  rematerialize=None if setting == "none" else setting)
    accum.compile(keras.optimizers.Adam(1e-4), "mse")
    shape = (batch,) + tuple(accum.input_shape[1:])
    x = np.random.default_rng(0).uniform(0, 1, shape).astype("float32")
    y = np.zeros((batch,) + tuple(accum.compute_output_spec(keras.KerasTensor(shape)).shape[1:]),
                 "float32")
    return accum, x, y


def child(args, batch: int, setting: str) -> None:
    """In a fresh process: the second step's peak and the resident set after it."""
    baseline = _resident()["VmRSS"]
    accum, x, y = step_case(args.model, args.image_size, batch, setting)
    accum.train_on_batch(x, y)  # traced
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM back to the resident set now
    accum.train_on_batch(x, y)
    status = _resident()
    print(json.dumps({"peak": status["VmHWM"] - baseline, "after": status["VmRSS"] - baseline,
                      "heap_free": _heap_free()}))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_free() -> int | None:
    """Bytes glibc's heap holds free (in all arenas), or None (not glibc 2.33+)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def measured(args, batch: int, setting: str, heap: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--model", args.model,
               "--image-size", str(args.image_size), "--child", f"{batch},{setting}"]
    done = subprocess.run(command, env=dict(os.environ, **HEAPS[heap]), capture_output=True,
                          text=True, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: micro-batch {batch} ({setting}, {heap} heap) failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned(args, batches: list[int], setting: str, heap: str) -> dict[int, float]:
    """The plan's growth for a process with `heap` (the budget reads the threshold from the
    environment, as a process started with it would)."""
    import tfmem
    from tfmem.memory.planner import CPU_IMPORT_BYTES

    accum = tfmem.AccumModel.wrap(build(args.model, args.image_size), accumulation_steps=1,
                                  rematerialize=None if setting == "none" else setting)
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.update(HEAPS[heap])
    try:
        plan = tfmem.plan(accum, global_batch_size=batches[0], memory_budget=64 * 2**30,
                          loss="mse")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return {b: plan.peak_bytes(b, 1) - CPU_IMPORT_BYTES for b in batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="grouped-conv")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batches", default="8,32,64,128")
    parser.add_argument("--settings", default="none")
    parser.add_argument("--heaps", default=",".join(HEAPS),
                        help="of: " + ", ".join(HEAPS))
    parser.add_argument("--heap-free", action="store_true",
                        help="print the heap's free MiB after the step too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        batch, setting = args.child.split(",")
        child(args, int(batch), setting)
        return
    batches = [int(b) for b in args.batches.split(",")]
    unknown = set(args.heaps.split(",")) - set(HEAPS)
    if unknown:
        parser.error(f"--heaps: unknown {', '.join(sorted(unknown))}; "
                     f"use one or more of {', '.join(HEAPS)}")
    print(f"{args.model}: MiB above import (peak of step 2 / resident after it); "
          "MiB per sample since the previous micro-batch")
    print("| setting | heap | " + " | ".join(f"@{b}" for b in batches)
          + " | per sample | planned / peak |")
    print("|---|---|" + "---:|" * len(batches) + "---|---|")
    for setting in args.settings.split(","):
        for heap in args.heaps.split(","):
            plan = planned(args, batches, setting, heap)
            runs = [measured(args, b, setting, heap) for b in batches]
            slopes = [(runs[i + 1]["peak"] - runs[i]["peak"]) / (batches[i + 1] - batches[i])
                      / MIB for i in range(len(batches) - 1)]
            ratios = ", ".join(f"{plan[b] / run['peak']:.2f}" for b, run in zip(batches, runs))
            print(f"| {setting} | {heap} | "
                  + " | ".join(f"{r['peak'] / MIB:.0f} / {r['after'] / MIB:.0f}"
                               + (f" ({r['heap_free'] / MIB:.0f} free)"
                                  if args.heap_free and r["heap_free"] is not None else "")
                               for r in runs)
                  + f" | {', '.join(f'{s:.1f}' for s in slopes)} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
