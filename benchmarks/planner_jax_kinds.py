"""The plan against XLA per layer kind: bytes per sample of one train step, on JAX.

    KERAS_BACKEND=jax python benchmarks/planner_jax_kinds.py                 # every kind
    KERAS_BACKEND=jax python benchmarks/planner_jax_kinds.py --kinds conv_relu,attention
    # XLA:TPU's figures, compiled ahead of time here (libtpu installed), and a TPU's plan:
    KERAS_BACKEND=jax python benchmarks/planner_jax_kinds.py --device tpu-v5e-1 --ahead-of-time
    # ... at batches where a TPU's layouts pad nothing and the maps are far above its vector
    # memory (float32 from 1024, bfloat16 from 2048), in the TPU's precision:
    KERAS_BACKEND=jax python benchmarks/planner_jax_kinds.py --device tpu-v5e-1 --ahead-of-time \
        --batches 2048,4096 --precision mixed_bfloat16

Each kind is a small model of four blocks (3×3 convolutions on 32×32×32, or 256 tokens of
64 features) with a pooled Dense head, Adam, float32 (`--precision`: another policy). For
each: the per-sample slope of XLA's compiled figure of `train_step`
(`tfmem.memory.probe_jax.compiled_step_memory`, between batches 16 and 32) and of the
planner's peak (one batch in flight) for `--device` (by default an A100: XLA:GPU's rules) and
for this CPU (XLA:CPU's rules), with their ratios. With `--ahead-of-time` XLA's figure is the
`--device`'s own, compiled here (`--device h200 --ahead-of-time`: XLA:GPU's, where JAX's CUDA
plugin is installed). The fixed parts agree
within a few KiB, so the slope is where the kinds differ. The rules drawn from it:
`tfmem/memory/xla_rules.py`; the table: docs/planning.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmem  # noqa: E402
from tfmem.memory import probe_jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner_jax import add_target_arguments, chip_ahead  # noqa: E402

L = keras.layers
BATCHES = (16, 32)


def _head(x):
    pool = L.GlobalAveragePooling2D() if len(x.shape) == 4 else L.GlobalAveragePooling1D()
    return L.Dense(10)(pool(x))


def _convolutions(activation=None, batch_norm=False, bias=True, depthwise=False):
    def build():
        inputs = keras.Input((32, 32, 32))
        x = inputs
        for _ in range(4):
            x = (L.DepthwiseConv2D(3, padding="same", use_bias=bias) if depthwise
                 else L.Conv2D(32, 3, padding="same", use_bias=bias))(x)
            if batch_norm:
                x = L.BatchNormalization()(x)
            if activation:
                x = L.Activation(activation)(x)
        return keras.Model(inputs, _head(x))
    return build


def _max_pooling():
    inputs = keras.Input((32, 32, 32))
    x = inputs
    for _ in range(4):
        x = L.Activation("relu")(L.Conv2D(32, 3, padding="same")(x))
        x = L.MaxPooling2D(3, strides=1, padding="same")(x)
    return keras.Model(inputs, _head(x))


def _concatenations():
    inputs = keras.Input((32, 32, 32))
    x = inputs
    for _ in range(4):
        x = L.Concatenate()([x, L.Conv2D(16, 3, padding="same", activation="relu")(x)])
    return keras.Model(inputs, _head(x))


def _dense_gelu():
    inputs = keras.Input((256, 64))
    x = inputs
    for _ in range(4):
        x = L.Dense(64)(L.Dense(256, activation="gelu")(x))
    return keras.Model(inputs, _head(x))


def _attention():
    inputs = keras.Input((256, 64))
    x = inputs
    for _ in range(2):
        x = L.LayerNormalization()(L.MultiHeadAttention(4, 16)(x, x))
    return keras.Model(inputs, _head(x))


def _efficientnet_blocks(fused: bool):
    """EfficientNetV2's blocks as tfmem builds them (`tfmem.models.efficientnetv2_xl`), whose
    calls the planner traces: expansion 4, stochastic depth; MBConv with squeeze-excite."""
    from tfmem.models.efficientnetv2_xl import FusedMBConv, MBConv

    def build():
        inputs = keras.Input((32, 32, 32))
        x = inputs
        for _ in range(4):
            x = (FusedMBConv(32, 32, expand_ratio=4, drop_rate=0.1) if fused else
                 MBConv(32, 32, expand_ratio=4, se_ratio=0.25, drop_rate=0.1))(x)
        return keras.Model(inputs, _head(x))
    return build


KINDS = {
    "conv": _convolutions(),
    "conv_relu": _convolutions("relu"),
    "conv_bn": _convolutions(batch_norm=True),
    "conv_bn_relu": _convolutions("relu", True),
    "conv_bn_relu_no_bias": _convolutions("relu", True, bias=False),
    "conv_swish": _convolutions("swish"),
    "conv_bn_swish": _convolutions("swish", True),
    "conv_bn_hard_swish": _convolutions("hard_swish", True, bias=False),
    "depthwise_bn_relu": _convolutions("relu", True, depthwise=True),
    "conv_relu_max_pool": _max_pooling,
    "concatenate": _concatenations,
    "dense_gelu": _dense_gelu,
    "attention": _attention,
    "mbconv": _efficientnet_blocks(fused=False),
    "fused_mbconv": _efficientnet_blocks(fused=True),
}


def slopes(name: str, device: str = "a100-80gb", chip: jax.Device | None = None,
           batches: tuple[int, int] = BATCHES, precision: str = "float32"
           ) -> tuple[float, float, float]:
    """Bytes per sample of XLA's figure (for `chip`, else this CPU) and of the plans for
    `device` (no XLA:CPU rules) and for this CPU (XLA:CPU's), between the two batches, for
    the kind built under the dtype policy `precision`."""
    keras.mixed_precision.set_dtype_policy(precision)  # clear_session resets it
    model = KINDS[name]()
    model.compile(optimizer="adam", loss="mse")
    shape = tuple(model.input_shape[1:])
    model.train_on_batch(np.zeros((2,) + shape, "float32"), np.zeros((2, 10), "float32"))
    xla, gpu, cpu = [], [], []
    for batch in batches:
        data = (jax.ShapeDtypeStruct((batch,) + shape, np.float32),
                jax.ShapeDtypeStruct((batch, 10), np.float32))
        xla.append(probe_jax.compiled_step_memory(model, data, device=chip)["peak_bytes"])
        for planned, where in ((gpu, dict(device=device)),
                               (cpu, dict(memory_budget=2**40))):
            plan = tfmem.plan(model, global_batch_size=batch, optimizer=model.optimizer,
                              input_batches_in_flight=1, precision=precision, **where)
            planned.append(plan.peak_bytes(batch, 1))
    keras.backend.clear_session()
    step = batches[1] - batches[0]
    return tuple((figures[1] - figures[0]) / step for figures in (xla, gpu, cpu))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="the two batch sizes the slope is taken between (on a TPU, "
                        "multiples of 128: its layouts pad a small batch dimension)")
    parser.add_argument("--device", default="a100-80gb",
                        help="the accelerator of tfmem's device table the second plan is for")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit("error: run with KERAS_BACKEND=jax; this compares with XLA's analysis")
    chip = chip_ahead(args.device) if args.ahead_of_time else None
    batches = tuple(int(b) for b in args.batches.split(","))
    if len(batches) != 2 or not 0 < batches[0] < batches[1]:
        raise SystemExit(f"error: --batches {args.batches}: give two batch sizes, the smaller "
                         "first, e.g. --batches 16,32")
    began = time.time()
    print(f"Per-sample bytes of one train step, batches {batches}, Adam, "
          f"{args.precision}, "
          f"{chip.device_kind if chip else jax.devices()[0].platform}\n")
    print(f"| kind | XLA KiB/sample | plan for {args.device} | plan for XLA:CPU |")
    print("|---|---:|---:|---:|")
    for name in args.kinds.split(","):
        xla, gpu, cpu = slopes(name, args.device, chip, batches, args.precision)
        print(f"| {name} | {xla / 1024:.0f} | {gpu / 1024:.0f} ({gpu / xla:.2f}) | "
              f"{cpu / 1024:.0f} ({cpu / xla:.2f}) |", flush=True)
    print(f"\n{(time.time() - began) / 60:.1f} min, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
