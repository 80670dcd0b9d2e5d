"""A second opinion on the planner: XLA's own memory analysis of the same train step (JAX).

    KERAS_BACKEND=jax python benchmarks/planner_jax.py                  # the zoo, batch 32
    KERAS_BACKEND=jax python benchmarks/planner_jax.py --models vit --batches 16,64
    KERAS_BACKEND=jax python benchmarks/planner_jax.py --models hub-vit,hub-bert,hub-gpt2
    # XLA:TPU's analysis, compiled ahead of time on this machine (libtpu installed):
    KERAS_BACKEND=jax python benchmarks/planner_jax.py --device tpu-v5e-1 --ahead-of-time
    # XLA:GPU's, the same way (JAX's CUDA plugin installed; no GPU or driver needed):
    KERAS_BACKEND=jax python benchmarks/planner_jax.py --device h200 --ahead-of-time

For each model of `benchmarks/planner_accuracy.py` (Adam, 64×64, float32 or the policy
`--precision` names), keras-hub's ViT, BERT or GPT-2: the planner's estimate for one plain step
(one batch in flight) on the device `--device` names, by default this CPU with XLA:CPU's rules
(`tfmem.memory.xla_rules`) and without the host's framework runtime, and
`tfmem.memory.probe_jax.compiled_step_memory` of the model's jitted `train_step` at the same
batch: what XLA's buffer assignment holds at once (arguments + outputs − donated aliases +
temporaries). Nothing runs but one tiny step that builds the optimizer; on a CPU host this is
XLA:CPU's plan. Prints both and the ratio (2026-11-28, 2 shared cores: 0.98–1.11 for the zoo,
1.14 for keras-hub's ViT, 0.98 for BERT, 1.00 for GPT-2; the zoo takes about 16 min). Where and
why they differ: docs/planning.md.
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
from tfmem.runtime import devices  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner_accuracy as zoo  # noqa: E402
import text_backbones  # noqa: E402

MIB = 2**20


def build(name: str, image_size: int | None = None) -> keras.Model:
    """A model of the zoo, of its held-out models, keras-hub's BERT or GPT-2 ("hub-bert",
    "hub-gpt2": 4 layers, width 256, 128 tokens, a vocabulary of 2048, GPT-2 with its
    next-token head, as `benchmarks/text_backbones.py` builds them), or of tfmem's registry
    ("registry:efficientnetv2-s": 10 classes, at `image_size`, its default without)."""
    if name in ("hub-bert", "hub-gpt2"):
        return text_backbones.build(name[4:], 128, 4, 256, 2048)[0]
    if name.startswith("registry:"):
        return tfmem.models.build(name.split(":", 1)[1], num_classes=10, image_size=image_size)
    if image_size is not None:
        raise SystemExit(f"error: --image-size {image_size} is for a model of tfmem's registry "
                         f"(registry:NAME); {name} is built at {zoo.IMAGE[0]}×{zoo.IMAGE[1]}")
    return {**zoo.ZOO, **zoo.HELD_OUT}[name]()


def inputs(model: keras.Model, batch: int) -> list:
    """`(shape, dtype)` of each of the model's inputs at `batch` (a subclassed model: an
    image of the zoo's size)."""
    try:
        tensors = list(model.inputs or ())
    except AttributeError:  # a subclassed model has no symbolic inputs
        tensors = []
    if not tensors:
        return [((batch,) + zoo.IMAGE, "float32")]
    return [((batch,) + tuple(t.shape[1:]), keras.backend.standardize_dtype(t.dtype))
            for t in tensors]


def chip_ahead(device: str) -> jax.Device:
    """The TPU or GPU `--device` names (`tpu-v5e-1`, `t4`), which XLA compiles for ahead of
    time here (`probe_jax.tpu_device`, `probe_jax.gpu_device`); JAX itself runs on this
    machine's CPU."""
    jax.config.update("jax_platforms", "cpu")
    try:
        accelerator = devices.by_name(device)
    except ValueError as error:
        raise SystemExit(f"error: --device {device}: {error}; pass a TPU or GPU of tfmem's "
                         "device table, e.g. --device tpu-v5e-1 or t4") from None
    find = probe_jax.gpu_device if accelerator.kind == "gpu" else probe_jax.tpu_device
    try:
        return find(device)
    except ImportError:
        raise SystemExit(f"error: --ahead-of-time for --device {device} needs "
                         f"{probe_jax.compiler_needed(accelerator.kind)}") from None
    except ValueError:  # a GPU JAX's CUDA plugin does not compile for (a K80)
        raise SystemExit(f"error: --ahead-of-time for --device {device}: JAX does not compile "
                         f"for a {accelerator.description}; pass a GPU of compute capability "
                         "6.0 or later, e.g. --device t4") from None


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """`--precision` and `--ahead-of-time`: the policy the models are built and planned in,
    and XLA's figure for `--device`'s TPU or GPU instead of this CPU's."""
    parser.add_argument("--precision", default="float32",
                        choices=["float32", "mixed_bfloat16", "mixed_float16"],
                        help="the Keras dtype policy the models are built and planned in")
    parser.add_argument("--ahead-of-time", action="store_true",
                        help="XLA's figure for --device's TPU or GPU (e.g. tpu-v5e-1, t4), "
                        "compiled ahead of time on this machine (needs libtpu, or JAX's CUDA "
                        "plugin)")


def compare(name: str, batch: int, device: str, chip: jax.Device | None = None,
            image_size: int | None = None, precision: str = "float32") -> dict:
    """The plan and XLA's analysis of one model's train step at `batch`, the model built
    and planned under the dtype policy `precision`."""
    keras.mixed_precision.set_dtype_policy(precision)  # clear_session resets it
    model = build(name, image_size)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    def one_or_all(values):  # a model of one input takes it alone (a subclassed call too)
        return values[0] if len(values) == 1 else values

    output = model.compute_output_spec(one_or_all(
        [keras.KerasTensor(shape, dtype) for shape, dtype in inputs(model, 2)]))
    model.train_on_batch(one_or_all([np.zeros(shape, dtype) for shape, dtype in inputs(model, 2)]),
                         np.zeros((2,) + tuple(output.shape[1:]), "float32"))
    batch_x = one_or_all([jax.ShapeDtypeStruct(shape, np.dtype(dtype))
                          for shape, dtype in inputs(model, batch)])
    batch_y = jax.ShapeDtypeStruct((batch,) + tuple(output.shape[1:]), np.float32)
    xla = probe_jax.compiled_step_memory(model, (batch_x, batch_y), device=chip)
    # The plan for the device XLA compiled for ("cpu": XLA:CPU's rules), with the batch held
    # once, as XLA's arguments; without the host's framework runtime, which XLA's figure
    # does not hold.
    where = dict(memory_budget=2**40) if device == "cpu" else dict(device=device)
    plan = tfmem.plan(model, global_batch_size=batch, optimizer=model.optimizer,
                      input_batches_in_flight=1, precision=precision, **where)
    rows = plan.breakdown(batch, 1)
    state = plan.parameter_bytes + plan.gradient_bytes + plan.optimizer_bytes
    per_batch = sum(v for t, v in rows.items() if t.per_micro_batch)
    planned = plan.peak_bytes(batch, 1) - plan.runtime_bytes
    return dict(name=name, batch=batch, xla=xla, state=state,
                kept=per_batch, planned=planned, notes=plan.notes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo.ZOO),
                        help="comma-separated names of the zoo, or of "
                        f"{', '.join(zoo.HELD_OUT)}, hub-bert, hub-gpt2 (need keras-hub), or "
                        "registry:NAME (a model of tfmem's registry, e.g. "
                        "registry:efficientnetv2-s)")
    parser.add_argument("--batches", default="32", help="comma-separated batch sizes")
    parser.add_argument("--image-size", type=int,
                        help="the image size of the registry's models (registry:NAME)")
    parser.add_argument("--device", default="cpu",
                        help='the device the plan is for: "cpu" (XLA:CPU, what compiles here) '
                        "or a name of tfmem's device table (an accelerator plan)")
    add_target_arguments(parser)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit("error: run with KERAS_BACKEND=jax; this compares with XLA's analysis")
    chip = chip_ahead(args.device) if args.ahead_of_time else None
    began = time.time()
    target = chip.device_kind if chip else jax.devices()[0].platform
    print(f"Planner vs XLA's compiled memory analysis of `train_step`, Adam, "
          f"{args.image_size or zoo.IMAGE[0]} px (the registry's models without "
          f"--image-size: their own), {args.precision}, {target}\n")
    print("| model | batch | XLA arguments | XLA temporaries | XLA peak | plan: state | "
          "plan: activations + workspace | plan peak | plan / XLA |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            r = compare(name, batch, args.device, chip, args.image_size, args.precision)
            xla = r["xla"]
            print(f"| {name} | {batch} | {xla['argument_bytes'] / MIB:.0f} MiB | "
                  f"{xla['temp_bytes'] / MIB:.0f} MiB | {xla['peak_bytes'] / MIB:.0f} MiB | "
                  f"{r['state'] / MIB:.0f} MiB | {r['kept'] / MIB:.0f} MiB | "
                  f"{r['planned'] / MIB:.0f} MiB | {r['planned'] / xla['peak_bytes']:.2f} |",
                  flush=True)
            keras.backend.clear_session()
    print(f"\n{(time.time() - began) / 60:.1f} min, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
