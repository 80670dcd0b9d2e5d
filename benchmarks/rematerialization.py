"""Rematerialization, measured on a CPU: peak RAM of training steps with and without, and time.

    python benchmarks/rematerialization.py                           # tiramisu-56 at 64 px
    python benchmarks/rematerialization.py --model tiramisu-103 --image-size 128 --batches 2,8
    python benchmarks/rematerialization.py --model efficientnetv2-s --image-size 384 \
        --batches 1,4 --settings none,full
    python benchmarks/rematerialization.py --model vit-s16 --image-size 224 --settings none,full
    python benchmarks/rematerialization.py --model hub-vit-s16 --image-size 224 \
        --settings none,full
    python benchmarks/rematerialization.py --model tiramisu-103 --image-size 352,480 \
        --task segmentation --num-classes 12 --batches 1,2 --settings none,full

For one model of the registry (or `vit-s16`: ViT-S/16 built from Keras layers, keras-hub's
shapes; `hub-vit-s16`: keras-hub's own `ViTBackbone`, which needs keras-hub), trained as an
`AccumModel` (k = 1, Adam, float32, TensorFlow) without rematerialization and with each of
`--settings` (`blocks`: every layer named `*_dense`, FC-DenseNet's dense blocks; `full`:
`rematerialize="full"`), side by side in one run, on mse to zeros shaped like its output, or
with `--task segmentation` on sparse cross-entropy (ignoring 255) to random int class masks
(the registry's segmentation networks have their per-pixel head of `--num-classes`):

- the peak resident set of a fresh process running 2 training steps (`tfmem.memory.probe.
  measure`), above its baseline after importing TensorFlow, at two micro-batches (the median
  of `--repeats` processes each); from them the bytes per sample and the largest micro-batch
  whose growth fits `--budget`;
- the planner's bytes per sample for the same model (its activations, workspace, and the run's
  loss beyond the workspace);
- seconds per sample over `--steps` timed steps at the larger micro-batch (after one untimed;
  the smaller one times per-call overheads more than the compute), each setting in fresh
  processes that take turns, the median of `--time-rounds`;
- with `--live`, the bytes per sample of the tensors live at the step's peak, from
  TensorFlow's own allocator in a child (`TF_CPU_ALLOCATOR_USE_BFC=true`): what the plan
  counts, without the process heap's caching and fragmentation that the resident set adds
  (a GPU's allocator is of this kind); with `--serial` too, the step's ops one at a time (one
  inter-op thread) and its graph not rewritten (Grappler off): the order the plan counts in.

With `KERAS_BACKEND=jax`, each setting in a fresh process: the step's peak at both
micro-batches (the device's `peak_bytes_in_use` on a GPU/TPU, XLA's memory analysis of the
compiled step on a CPU), the bytes per sample beside the plan's, the largest micro-batch in
`--budget`, time per sample, and how far the weights after the same steps are from those
without rematerialization. XLA:CPU's analysis does not show what `jax.checkpoint` saves (a
plain JAX chain of 12 tanh layers under 4 checkpoints plans 256 MiB of temporaries instead of
208): JAX's savings are for a GPU or TPU to measure. On a GPU, the compiler's autotuning
allocates on the device while it compiles and counts in the same peak: choose micro-batches
whose steps hold more than that (gigabytes), or the slope between them means nothing, or turn
it off (`XLA_FLAGS=--xla_gpu_autotune_level=0`: it also compiles a deep model's step in
minutes, but runs the convolutions with default algorithms, the same for every setting).
`--parallel` compiles the settings at once, each then timing its steps alone:

    KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS=--xla_gpu_autotune_level=0 python benchmarks/rematerialization.py \
        --model tiramisu-103 --image-size 224 --batches 4,12 --settings none,full --steps 5 \
        --budget 16 --parallel
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmem  # noqa: E402
from tfmem import models  # noqa: E402
from tfmem.memory.planner import CPU_IMPORT_BYTES  # noqa: E402
from tfmem.memory.probe import measure  # noqa: E402

GIB, MIB = 2**30, 2**20


IGNORE_VALUE = 255  # of the segmentation masks: a value no random mask holds


def vit_s16(image_size: tuple[int, int], num_classes: int) -> keras.Model:
    """ViT-S/16 from Keras layers (keras-hub's ViT-S/16 shapes): 16×16 patches, width 384,
    12 pre-norm blocks of 6-head attention and a 1536-wide GELU MLP, a class head."""
    tokens = (image_size[0] // 16) * (image_size[1] // 16)
    inputs = keras.Input(image_size + (3,))
    patches = keras.layers.Conv2D(384, 16, strides=16, name="patches")(inputs)
    x = keras.layers.Reshape((tokens, 384))(patches)
    x = x + keras.layers.Embedding(tokens, 384, name="positions")(keras.ops.arange(tokens))
    for i in range(12):
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_norm1")(x)
        h = keras.layers.MultiHeadAttention(6, 64, name=f"block{i}_attention")(h, h)
        x = keras.layers.Add(name=f"block{i}_add1")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_norm2")(x)
        h = keras.layers.Dense(1536, activation="gelu", name=f"block{i}_mlp1")(h)
        h = keras.layers.Dense(384, name=f"block{i}_mlp2")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="head")(x), name="vit-s16")


def hub_vit_s16(image_size: tuple[int, int], num_classes: int) -> keras.Model:
    """keras-hub's own `ViTBackbone` with ViT-S/16's shapes (random weights), its class
    token into a class head. Needs keras-hub (`pip install keras-hub`)."""
    try:
        import keras_hub
    except ImportError as error:
        raise SystemExit(f"error: --model hub-vit-s16 needs keras-hub ({error}); "
                         "install it with `pip install keras-hub`") from None
    backbone = keras_hub.models.ViTBackbone(
        image_shape=image_size + (3,), patch_size=16, num_layers=12, num_heads=6,
        hidden_dim=384, mlp_dim=1536)
    inputs = keras.Input(image_size + (3,))
    tokens = backbone(inputs)
    head = keras.layers.Dense(num_classes, name="head")(tokens[:, 0])
    return keras.Model(inputs, head, name="hub-vit-s16")


def parse_size(text: str) -> tuple[int, int]:
    """`--image-size`: one number (square) or height,width."""
    sizes = tuple(int(side) for side in text.split(","))
    if len(sizes) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not N or H,W (e.g. 224 or 352,480)")
    return sizes * 2 if len(sizes) == 1 else sizes


def size_text(size: tuple[int, int]) -> str:
    return f"{size[0]}" if size[0] == size[1] else f"{size[0]}×{size[1]}"


def task_loss(task: str):
    return ("mse" if task == "regression"
            else keras.losses.SparseCategoricalCrossentropy(ignore_class=IGNORE_VALUE))


def child_flags(args) -> list[str]:
    """The flags that say what a child process measures."""
    return ["--model", args.model, "--image-size", ",".join(map(str, args.image_size)),
            "--task", args.task, "--num-classes", str(args.num_classes)]


def build(args, setting: str | None) -> tfmem.AccumModel:
    keras.utils.set_random_seed(0)
    builders = {"vit-s16": vit_s16, "hub-vit-s16": hub_vit_s16}
    name = args.model
    base = (builders[name](args.image_size, args.num_classes) if name in builders
            else models.build(name, num_classes=args.num_classes, image_size=args.image_size))
    if setting == "blocks":
        setting = [layer.name for layer in base.layers if layer.name.endswith("_dense")]
    return tfmem.AccumModel.wrap(base, accumulation_steps=1, rematerialize=setting)


def seconds_per_sample(accum, args, batch: int) -> float:
    accum.compile(keras.optimizers.Adam(1e-4), task_loss(args.task))
    x, y = _batch(accum, args, batch)
    accum.train_on_batch(x, y)  # traced
    start = time.perf_counter()
    for _ in range(args.steps):
        accum.train_on_batch(x, y)
    return (time.perf_counter() - start) / (args.steps * batch)


def _batch(accum, args, batch: int):
    """Random images; zeros shaped like the output, or (segmentation) random class masks."""
    shape = (batch,) + args.image_size + (3,)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, shape).astype("float32")
    output = tuple(accum.compute_output_spec(keras.KerasTensor(shape)).shape[1:])
    y = (np.zeros((batch,) + output, "float32") if args.task == "regression"
         else rng.integers(0, output[-1], (batch,) + output[:-1]).astype("int32"))
    return x, y


def time_child(args, batches: tuple[int, int]) -> None:
    """In a fresh process: prints the seconds per sample of one setting (`seconds_per_sample`
    at the larger micro-batch)."""
    accum = build(args, None if args.settings == "none" else args.settings)
    print(seconds_per_sample(accum, args, batches[1]))


def timed(args, settings: list[str]) -> dict[str, float]:
    """Seconds per sample of each setting: each timed in fresh processes, the settings taking
    turns (`--time-rounds` rounds, the order reversed every other round, so that a machine
    whose speed drifts slows each alike), the median of each one's rounds."""
    times: dict[str, list[float]] = {setting: [] for setting in settings}
    for round_ in range(args.time_rounds):
        for setting in settings if round_ % 2 == 0 else settings[::-1]:
            command = [sys.executable, os.path.abspath(__file__), *child_flags(args),
                       "--batches", args.batches, "--steps", str(args.steps), "--settings",
                       setting, "--time-child"]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise SystemExit(f"error: timing {setting} failed: {last}")
            times[setting].append(float(done.stdout.strip().splitlines()[-1]))
    return {setting: float(np.median(values)) if values else None  # `--time-rounds 0`
            for setting, values in times.items()}


def live_child(args, batches: tuple[int, int]) -> None:
    """In a child with `TF_CPU_ALLOCATOR_USE_BFC=true`: prints the bytes per sample of the
    tensors live at a training step's peak (TensorFlow's allocator: no caching, no
    fragmentation of the process's heap), from the peaks at both micro-batches."""
    import tensorflow as tf

    if args.serial:  # one op at a time, in the order of the graph as built: as the plan counts
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    peaks = []
    for batch in batches:
        accum = build(args, None if args.settings == "none" else args.settings)
        accum.compile(keras.optimizers.Adam(1e-4), task_loss(args.task))
        x, y = _batch(accum, args, batch)
        accum.train_on_batch(x, y)  # traced
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        accum.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    print((peaks[1] - peaks[0]) / (batches[1] - batches[0]))


def live_per_sample(args, setting: str, batches: tuple[int, int], serial: bool = False) -> float:
    """`live_child`'s answer: the allocator must be chosen before TensorFlow starts."""
    command = [sys.executable, os.path.abspath(__file__), *child_flags(args), "--batches",
               ",".join(map(str, batches)), "--settings", setting,
               "--live-child"] + (["--serial"] if serial else [])
    done = subprocess.run(command, env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true"),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: the allocator measurement of {setting} failed: {last}")
    return float(done.stdout.strip().splitlines()[-1])


def row(args, setting: str | None, batches: tuple[int, int], budget: float, live: bool | str,
        repeats: int = 1) -> dict:
    accum = build(args, setting)
    growth = {}
    for batch in batches:
        runs = []
        for _ in range(repeats):  # the median: one process's resident set moves by ±10-30%
            result = measure(accum, micro_batch_size=batch, input_shape=args.image_size + (3,),
                             memory_limit=int(20 * GIB), optimizer="adam",
                             loss=task_loss(args.task), num_steps=2,
                             targets="zeros" if args.task == "regression" else "class_indices")
            if result.stopped:
                raise SystemExit(f"the step at micro-batch {batch} was stopped: "
                                 f"{result.reason}")
            runs.append(result.peak_bytes - result.baseline_bytes)
        growth[batch] = float(np.median(runs))
    small, large = batches
    per_sample = (growth[large] - growth[small]) / (large - small)
    fixed = growth[small] - per_sample * small
    plan = tfmem.plan(accum, global_batch_size=small, memory_budget=int(20 * GIB),
                      loss=task_loss(args.task))  # the run's loss, traced
    return dict(setting=setting or "none",
                # The plan's whole peak less its import term, against the growth above import.
                planned_growth={b: plan.peak_bytes(b, 1) - CPU_IMPORT_BYTES for b in batches},
                segments=sum(len(ranges) for _, ranges in plan.rematerialized),
                growth=growth, per_sample=per_sample,
                fits=int((budget * GIB - fixed) // per_sample),
                planned=(plan.activation_bytes_per_sample + plan.workspace_bytes_per_sample
                         + plan.loss_row_bytes_per_sample),
                live=(live_per_sample(args, setting or "none", batches, serial=live == "serial")
                      if live else None),
                seconds=None)  # timed afterwards, alone: `timed`


def jax_child(args, batches: tuple[int, int]) -> None:
    """On JAX, one setting in a fresh process (the device's peak counter cannot be reset):
    XLA's memory analysis of the compiled step and the device's peak after two steps at each
    micro-batch (smaller first, so each peak is that micro-batch's), the planner's bytes per
    sample for a device of this kind, seconds per sample at the larger one; the weights after
    all these steps go to `--weights-out` so that the parent can compare the settings'
    arithmetic. With `--sync-dir`, it times only once all `--sync-count` processes have
    measured, one at a time."""
    import json

    import jax

    from tfmem.memory.probe_jax import compiled_step_memory, peak_bytes_in_use
    from tfmem.runtime.budget import Budget

    setting = None if args.settings == "none" else args.settings
    accum = build(args, setting)
    accum.compile(keras.optimizers.Adam(1e-4), task_loss(args.task))
    initial = _flat_weights(accum)
    xla, device = [], []
    for batch in batches:
        x, y = _batch(accum, args, batch)
        accum.train_on_batch(x, y)
        accum.train_on_batch(x, y)
        device.append(peak_bytes_in_use())
        # On a GPU/TPU the device's peak is the measurement; XLA's analysis would compile
        # the step a second time (minutes for a deep model).
        xla.append(None if device[-1] is not None
                   else compiled_step_memory(accum, (x, y))["peak_bytes"])
        print(f"{args.settings}: micro-batch {batch} done", file=sys.stderr, flush=True)
    # Planned for this device's kind (a budget in bytes alone would be planned as host RAM).
    first = jax.devices()[0]
    plan = tfmem.plan(accum, global_batch_size=batches[0],
                      budget=Budget(first.device_kind, first.platform, int(20 * GIB), 1))
    with _measured_then_alone(args.sync_dir, args.sync_count, args.settings):
        start = time.perf_counter()
        for _ in range(args.steps):
            accum.train_on_batch(x, y)
        seconds = (time.perf_counter() - start) / (args.steps * batches[1])
    np.save(args.weights_out, np.stack([initial, _flat_weights(accum)]))
    print(json.dumps(dict(
        xla=xla, device=device, seconds=seconds,
        segments=sum(len(ranges) for _, ranges in accum.rematerialized_segments),
        planned=plan.activation_bytes_per_sample + plan.workspace_bytes_per_sample)))


@contextlib.contextmanager
def _measured_then_alone(folder: str | None, count: int, name: str):
    """With `folder` (processes run at once): says this one has measured, waits until all
    `count` have, then holds a lock, so that each times its steps alone on the device."""
    if folder is None:
        yield
        return
    import fcntl

    open(os.path.join(folder, f"measured.{name}"), "w").close()
    while sum(entry.startswith("measured.") for entry in os.listdir(folder)) < count:
        time.sleep(0.5)
    with open(os.path.join(folder, "timing.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _flat_weights(model) -> np.ndarray:
    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(w))
                           for w in model.trainable_weights])


def jax_table(args, batches: tuple[int, int]) -> None:
    """On JAX: per setting, in a child each (`jax_child`): the step's peak at both micro-batches
    (the device's on a GPU/TPU, XLA's memory analysis of the compiled step on a CPU), the
    per-sample slope beside the plan's, the largest micro-batch in `--budget`, time per
    sample; and how far each setting's weights after the same steps are from the first's."""
    import json
    import tempfile

    import jax

    platform = jax.devices()[0].platform
    small, large = batches
    print(f"{args.model} at {size_text(args.image_size)} px, Adam, float32, JAX on {platform} "
          f"({jax.devices()[0].device_kind}); budget {args.budget:g} GiB")
    print(f"| rematerialize | segments | peak @{small} | peak @{large} | per sample, measured "
          f"| per sample, planned | largest micro-batch in budget | ms per sample |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory() as folder:

        def weights_file(setting):
            return os.path.join(folder, f"{setting}.npy")

        def start(setting):
            command = [sys.executable, os.path.abspath(__file__), *child_flags(args),
                       "--batches", args.batches, "--steps", str(args.steps), "--settings",
                       setting, "--jax-child", "--weights-out", weights_file(setting)]
            if args.parallel:
                command += ["--sync-dir", folder, "--sync-count", str(len(settings))]
            return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

        started = {s: start(s) for s in settings} if args.parallel else {}
        for setting in settings:
            child = started.get(setting) or start(setting)
            output, _ = child.communicate()
            if child.returncode:
                for other in started.values():
                    other.kill()
                raise SystemExit(f"error: the JAX measurement of {setting} failed (exit "
                                 f"{child.returncode}); its messages are above")
            r = json.loads(output.strip().splitlines()[-1])
            r["setting"] = setting
            r["weights"] = np.load(weights_file(setting))
            r["peaks"] = r["device"] if r["device"][0] is not None else r["xla"]
            r["per_sample"] = (r["peaks"][1] - r["peaks"][0]) / (large - small)
            fixed = r["peaks"][0] - r["per_sample"] * small
            r["fits"] = int((args.budget * GIB - fixed) // r["per_sample"])
            rows.append(r)
            print(f"| {r['setting']} | {r['segments']} | {r['peaks'][0] / GIB:.2f} GiB | "
                  f"{r['peaks'][1] / GIB:.2f} GiB | {r['per_sample'] / MIB:.0f} MiB | "
                  f"{r['planned'] / MIB:.0f} MiB | {r['fits']} | {r['seconds'] * 1000:.3f} |",
                  flush=True)
    where = "the device's peak" if rows[0]["device"][0] is not None else "XLA's analysis"
    print(f"(peaks: {where})")
    plain = rows[0]
    initial, trained = plain["weights"]
    update = float(np.linalg.norm(trained - initial))
    for r in rows:
        line = (f"{r['setting']}: planned / measured per sample "
                f"{r['planned'] / r['per_sample']:.2f}")
        if r is not plain:
            if np.any(r["weights"][0] != initial):
                raise SystemExit(f"error: {r['setting']} did not start from {plain['setting']}'s "
                                 "weights; the comparison would mean nothing")
            difference = float(np.linalg.norm(r["weights"][1] - trained)) / update
            line += (f"; / {plain['setting']}: micro-batch {r['fits'] / plain['fits']:.2f}×, "
                     f"time per sample {r['seconds'] / plain['seconds']:.2f}×; weights after "
                     f"{2 * len(batches) + args.steps} steps differ by {difference:.1e} of "
                     f"the training's update (‖Δw‖ / ‖w − w₀‖)")
        print(line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56")
    parser.add_argument("--image-size", type=parse_size, default=(64, 64),
                        help="one number (square) or height,width, e.g. 352,480")
    parser.add_argument("--task", choices=("regression", "segmentation"), default="regression",
                        help="regression: mse to zeros shaped like the output; segmentation: "
                             f"sparse cross-entropy ignoring {IGNORE_VALUE} to random int "
                             "class masks")
    parser.add_argument("--num-classes", type=int, default=4,
                        help="classes of the head (per pixel for a segmentation network)")
    parser.add_argument("--batches", default="2,8", help="two micro-batches: small,large")
    parser.add_argument("--budget", type=float, default=8.0, help="GiB of growth allowed")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3,
                        help="fresh processes measured per micro-batch (TensorFlow, resident "
                             "set): the median of their growths")
    parser.add_argument("--settings", default="none,blocks,full",
                        help="rematerialize settings compared (none, blocks, full)")
    parser.add_argument("--live", action="store_true",
                        help="also the live tensors' bytes per sample at the step's peak, "
                             "from TensorFlow's own allocator (a child process each)")
    parser.add_argument("--serial", action="store_true",
                        help="with --live: the step's ops one at a time (one inter-op thread) "
                             "and its graph not rewritten (Grappler off), the order the plan "
                             "counts in")
    parser.add_argument("--time-rounds", type=int, default=3,
                        help="TensorFlow: fresh processes timed per setting, taking turns")
    parser.add_argument("--parallel", action="store_true",
                        help="JAX: the settings' processes at once (a deep model's step "
                             "compiles for minutes on a GPU); each times its steps alone, "
                             "once all have measured")
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--sync-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--live-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--time-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jax-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--weights-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.serial and not (args.live or args.live_child):
        parser.error("--serial is a way to measure the live tensors; add --live")
    if args.live_child:
        live_child(args, batches)
        return
    if args.time_child:
        time_child(args, batches)
        return
    if args.jax_child:
        jax_child(args, batches)
        return
    if args.parallel and keras.backend.backend() != "jax":
        parser.error("--parallel is for KERAS_BACKEND=jax; TensorFlow's "
                     "processes are measured one at a time")
    if keras.backend.backend() == "jax":
        jax_table(args, batches)
        return
    print(f"{args.model} at {size_text(args.image_size)} px, Adam, float32, TensorFlow on "
          f"{os.cpu_count()} CPU cores; budget {args.budget:g} GiB of growth")
    rows = [row(args, None if setting == "none" else setting, batches, args.budget,
                args.live and ("serial" if args.serial else "default"), args.repeats)
            for setting in args.settings.split(",")]
    for r, seconds in zip(rows, timed(args, args.settings.split(",")).values()):
        r["seconds"] = seconds
    small, large = batches
    live_head, live_rule = ((f" per sample, live (allocator{', serial' * args.serial}) |",
                             "---:|") if args.live else ("", ""))
    print(f"| rematerialize | segments | RAM growth @{small} | RAM growth @{large} | per "
          f"sample, measured |{live_head} per sample, planned | largest micro-batch in budget | "
          f"s per sample |")
    print("|---|---:|---:|---:|---:|" + live_rule + "---:|---:|---:|")
    for r in rows:
        live = f" {r['live'] / MIB:.0f} MiB |" if args.live else ""
        print(f"| {r['setting']} | {r['segments']} | "
              f"{r['growth'][small] / GIB:.2f} GiB | {r['growth'][large] / GIB:.2f} GiB | "
              f"{r['per_sample'] / MIB:.0f} MiB |{live} {r['planned'] / MIB:.0f} MiB | "
              f"{r['fits']} | {'—' if r['seconds'] is None else format(r['seconds'], '.3f')} |")
    plain = rows[0]
    for r in rows:
        line = (f"{r['setting']}: planned / measured per sample "
                f"{r['planned'] / r['per_sample']:.2f}")
        if args.live:
            line += f", planned / live {r['planned'] / r['live']:.2f}"
        line += "; planned / measured growth " + ", ".join(
            f"@{b} {r['planned_growth'][b] / r['growth'][b]:.2f}" for b in batches)
        if r is not plain:
            line += f"; / {plain['setting']}: micro-batch {r['fits'] / plain['fits']:.2f}×"
            if r["seconds"] is not None and plain["seconds"] is not None:
                line += f", time per sample {r['seconds'] / plain['seconds']:.2f}×"
            if args.live:
                line += f", live per sample {plain['live'] / r['live']:.2f}× less"
        print(line)


if __name__ == "__main__":
    main()
