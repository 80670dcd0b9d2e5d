"""Rematerialization, measured: XLA's memory of the train step with and without, and time.

    KERAS_BACKEND=jax python benchmarks/rematerialization.py                     # tiramisu-56, 128 px
    KERAS_BACKEND=jax python benchmarks/rematerialization.py --model tiramisu-103 --image-size 224

For one model of the registry whose blocks are layers (FC-DenseNet's dense blocks), trained as
an `AccumModel` with and without `rematerialize=[every block]`, side by side in one run:

- XLA's memory analysis of the compiled train step (`probe_jax.compiled_step_memory`: what the
  step holds at once) at two micro-batches, and from them the bytes per sample and the largest
  micro-batch that fits `--budget`;
- the planner's peak for the same step (an accelerator plan: no host runtime term, one batch
  in flight), and its ratio to XLA's;
- seconds per sample over `--steps` timed steps at the smaller micro-batch (after one untimed).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmem  # noqa: E402
from tfmem import models  # noqa: E402
from tfmem.memory import probe_jax  # noqa: E402

GIB = 2**30


def measure(name: str, image_size: int, blocks: bool, batches: tuple[int, int],
            steps: int) -> dict:
    keras.utils.set_random_seed(0)
    base = models.build(name, num_classes=4, image_size=image_size)
    names = [layer.name for layer in base.layers if layer.name.endswith("_dense")]
    accum = tfmem.AccumModel.wrap(base, accumulation_steps=1,
                                  rematerialize=names if blocks else None)
    accum.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy())
    small, large = batches
    shape = (image_size, image_size, 3)
    output = accum.compute_output_spec(keras.KerasTensor((1,) + shape))
    label_shape = tuple(output.shape[1:-1])
    x = np.random.default_rng(0).uniform(0, 255, (small,) + shape).astype("float32")
    y = np.zeros((small,) + label_shape, "int32")
    accum.train_on_batch(x, y)  # builds the optimizer; the first (traced) step
    xla = {}
    for batch in batches:
        data = (jax.ShapeDtypeStruct((batch,) + shape, np.float32),
                jax.ShapeDtypeStruct((batch,) + label_shape, np.int32))
        xla[batch] = probe_jax.compiled_step_memory(accum, data)["peak_bytes"]
    per_sample = (xla[large] - xla[small]) / (large - small)
    start = time.perf_counter()
    for _ in range(steps):
        accum.train_on_batch(x, y)
    seconds = (time.perf_counter() - start) / (steps * small)
    plan = tfmem.plan(accum, global_batch_size=small, optimizer=accum.optimizer,
                      device="a100-80gb", input_batches_in_flight=1)
    return dict(blocks=len(names) if blocks else 0, xla=xla, per_sample=per_sample,
                fixed=xla[small] - per_sample * small, seconds=seconds,
                planned=plan.peak_bytes(small, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batches", default="1,4", help="two micro-batches, small,large")
    parser.add_argument("--budget", type=float, default=16.0, help="GiB per device")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    small, large = (int(b) for b in args.batches.split(","))
    print(f"{args.model} at {args.image_size} px, Adam, float32, JAX {jax.__version__} on "
          f"{jax.devices()[0].device_kind}; budget {args.budget:g} GiB per device")
    rows = [measure(args.model, args.image_size, blocks, (small, large), args.steps)
            for blocks in (False, True)]
    print(f"| rematerialized | XLA peak @{small} | XLA peak @{large} | per sample | "
          f"largest micro-batch in budget | planned @{small} / XLA | s per sample |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        fits = int((args.budget * GIB - row["fixed"]) // row["per_sample"])
        row["fits"] = fits
        print(f"| {row['blocks'] or 'none'} {'blocks' if row['blocks'] else ''} | "
              f"{row['xla'][small] / GIB:.2f} GiB | {row['xla'][large] / GIB:.2f} GiB | "
              f"{row['per_sample'] / 2**20:.0f} MiB | {fits} | "
              f"{row['planned'] / row['xla'][small]:.2f} | {row['seconds']:.2f} |")
    plain, recomputed = rows
    print(f"ratios: micro-batch {recomputed['fits'] / max(plain['fits'], 1):.2f}×, time per "
          f"sample {recomputed['seconds'] / plain['seconds']:.2f}×")


if __name__ == "__main__":
    main()
