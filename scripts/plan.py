"""Print the memory plan of a training run before running it.

    python scripts/plan.py --model resnet50 --global_batch_size 64 --device v100-16gb \
        --image_size 224 --optimizer adam --plot resnet50.png

Any machine, no accelerator needed (it builds the model on the CPU to read its graph; a few
seconds for ResNet50, half a minute for EfficientNetV2-XL). Prints the breakdown per replica in
the device's precision, the micro-batch × accumulation steps × replicas that reach the global
batch within 80% of the device (or, when nothing fits, the smallest change checked to fit), the
scripts/finetune.py command that runs it, and, with --plot, draws predicted memory against the
micro-batch with the budget line (needs matplotlib: `pip install -e '.[plot]'` in the
checkout). On JAX (`KERAS_BACKEND=jax`) for a TPU or GPU --device, where its compiler is
installed (`pip install "jax[tpu]"`; for a GPU `pip install "jax[cuda12]"`, no GPU or driver
needed), it also compiles the step one replica runs here ahead of time (for a large model,
minutes and gigabytes of RAM) and checks the split with XLA's own figure, as the guard does on
the device (`--nocompile`: the plan alone). Flags accept dashes or underscores.
Errors are one line on stderr (exit 2: a flag is wrong; `--debug` adds the traceback).
"""

import os

from absl import flags

import tfmem
from tfmem import cli, finetune, models
from tfmem.runtime import devices
from tfmem.memory import guard, levers, plan_report
from tfmem._install import install_command
from tfmem._sizes import format_bytes
from tfmem.remat.spec import RematSpec

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, f"Model name: {', '.join(models.MODELS)}.")
flags.DEFINE_integer("global_batch_size", None, "Samples per optimizer update, all replicas.")
flags.DEFINE_string("device", "cpu", f"cpu or one of: {', '.join(devices.ACCELERATORS)}.")
flags.DEFINE_string("image_size", "224", "Input images: one number (square) or height,width, "
                    "e.g. 360,480.")
flags.DEFINE_integer("num_classes", 1000, "Classes of the classifier head.")
flags.DEFINE_string("optimizer", "adam", "Keras optimizer name (sgd, adam, adamw, rmsprop, …).")
flags.DEFINE_enum("precision", "auto", ["auto", "float32", "mixed_float16", "mixed_bfloat16"],
                  "Keras dtype policy of the run; 'auto': the --device's (bf16 on TPU, fp16 on "
                  "GPUs of compute capability >= 7, float32 on CPU).")
flags.DEFINE_float("safety", 0.8, "Fraction of the device memory to plan for.")
flags.DEFINE_string("plot", None, "Write memory vs micro-batch to this PNG file (a name "
                    "without an extension gets .png).")
flags.DEFINE_string("rematerialize", None, "Recompute activations in the backward pass: "
                    "'full', 'auto' (as much as the micro-batch needs to fit), 'none' (the "
                    "default), or comma-separated layer names and first:last layer ranges.")
flags.DEFINE_enum("loss", "cross-entropy", list(finetune.LOSSES), "The loss the run trains "
                  "with, as scripts/finetune.py's --loss (a segmentation --model: also 'dice', "
                  "'cross-entropy+dice'); the plan counts what it and the task's metric hold.")
flags.DEFINE_boolean("compile", True, "On JAX (KERAS_BACKEND=jax) for a TPU or GPU --device, "
                     "where its compiler is installed (libtpu; JAX's CUDA plugin, no GPU "
                     "needed): check the split with XLA's own figure of the step one replica "
                     "runs, compiled here ahead of time (for a large model, minutes and "
                     "gigabytes of RAM); --nocompile: the plan alone.")
flags.mark_flags_as_required(["model", "global_batch_size"])
for _name in ("global_batch_size", "num_classes"):
    flags.register_validator(_name, lambda value: value is None or value >= 1,
                             f"--{_name.replace('_', '-')} must be a positive integer")
flags.register_validator("safety", lambda value: 0 < value <= 1,
                         "--safety is the fraction of the device to plan for, in (0, 1]")

def plot_path(path: str) -> str:
    """The file `--plot` writes (a name without an extension gets ".png"), checked before any
    work: matplotlib installed, not a directory, in a directory that exists."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(f"--plot needs matplotlib: {install_command('plot')}.") from None
    if os.path.isdir(path):
        raise cli.UsageError(f"--plot {path} is a directory; pass a file name, e.g. --plot "
                             f"{os.path.join(path, 'plan.png')}")
    if not os.path.splitext(path)[1]:
        path += ".png"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise cli.UsageError(f"--plot {path}: the directory {parent} does not exist; make it "
                             "first, or pass a file name in an existing directory")
    return path


def draw(plan, path: str, run: guard.RunPlan | None = None) -> None:
    """Predicted peak per replica against the micro-batch, with the budget and the choice;
    with `run` (checked with XLA's figure of the compiled step), its split at that figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gib = 2**30
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, (sizes, peaks) in plan_report.plot_lines(plan).items():
        axes.plot(sizes, peaks, label=label)
    axes.axhline(plan.budget_bytes / gib, color="tab:red", linestyle="--",
                 label=f"budget ({plan.safety:.0%} of {plan.memory_per_replica / gib:.1f} GiB)")
    axes.axhline(plan.memory_per_replica / gib, color="tab:gray", linestyle=":",
                 label=f"{plan.device} memory per replica")
    compiled = run is not None and run.compiled_peak_bytes is not None
    if plan.fits:
        chosen = plan.peak_bytes(plan.micro_batch_size, plan.accumulation_steps) / gib
        axes.plot([plan.micro_batch_size], [chosen], "o", color="tab:green",
                  label=f"{'the plan alone' if compiled else 'chosen'}: "
                  f"{plan.micro_batch_size} × {plan.accumulation_steps} steps")
    if compiled:
        axes.plot([run.micro_batch_size], [run.compiled_peak_bytes / gib], "s", color="black",
                  label=f"XLA's figure of {run.micro_batch_size} × {run.accumulation_steps} "
                  "steps, compiled")
    axes.set_xlabel("micro-batch size per replica")
    axes.set_ylabel("predicted peak memory (GiB)")
    axes.set_title(f"{plan.model_name}, {plan.optimizer}, {plan.precision}, "
                   f"global batch {plan.global_batch_size}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def finetune_switches(image_size: tuple[int, int]) -> plan_report.Switches:
    """The plan's next step spelled as the scripts/finetune.py command of the planned run."""
    settings = [("model", FLAGS.model), ("data", "PATH"),
                ("image_size", cli.image_size_text(image_size)),
                ("global_batch_size", FLAGS.global_batch_size)]
    for name, default in (("optimizer", "adam"), ("precision", "auto"),
                          ("rematerialize", None), ("loss", "cross-entropy")):
        if getattr(FLAGS, name) not in (default, ""):
            settings.append((name, getattr(FLAGS, name)))
    return plan_report.Switches("--allow-over-budget", flags=True,
                                program="python scripts/finetune.py", settings=tuple(settings))


def main(argv):
    with cli.usage_errors():  # every value plan.py checks comes from its flags
        return _plan(argv)


def _plan(argv):
    del argv
    plot = plot_path(FLAGS.plot) if FLAGS.plot else None
    image_size = cli.image_size(FLAGS.image_size)
    spec = models.spec(FLAGS.model)  # an unknown name: the list of valid ones
    if FLAGS.loss != "cross-entropy" and spec.task != "segmentation":
        raise cli.UsageError(f"--loss {FLAGS.loss} scores masks, and {FLAGS.model} is a "
                             f"{spec.task} network; leave --loss out, or pass a segmentation "
                             "--model (unet, tiramisu-*)")
    try:
        models.input_shape(FLAGS.model, image_size)
    except ValueError as error:  # a size the model cannot take
        raise cli.UsageError(f"--image-size {FLAGS.image_size}: {cli.one_line(error)}") from None
    if FLAGS.device.strip().lower() != "cpu":
        try:
            devices.by_name(FLAGS.device)
        except ValueError as error:
            raise cli.UsageError(f"--device: {error}") from None
    # Only shapes are read: the weights are never initialised (no RAM for them).
    with models.shapes_only():
        model = models.build(FLAGS.model, num_classes=FLAGS.num_classes,
                             image_size=image_size)
    setting = RematSpec.from_flag(FLAGS.rematerialize)
    if setting:  # the plan counts what is recomputed
        model = tfmem.AccumModel.wrap(model, rematerialize=setting)
    loss, metrics = finetune.task_loss(spec.task, FLAGS.num_classes, FLAGS.loss)
    arguments = dict(global_batch_size=FLAGS.global_batch_size, loss=loss, metrics=metrics,
                     optimizer=FLAGS.optimizer, precision=FLAGS.precision,
                     device=FLAGS.device, safety=FLAGS.safety,
                     smaller_variants=levers.registry_variants(
                         FLAGS.model, image_size=image_size, num_classes=FLAGS.num_classes))
    switches = finetune_switches(image_size)
    compiled_peak = compiled_ahead(image_size) if FLAGS.compile else None
    run = None
    if compiled_peak is not None:  # the plan's split, confirmed or moved by XLA:TPU's figure
        run = guard.guard(model, accumulation_steps="auto", allow_over_budget=True,
                          switches=switches, compiled_peak=compiled_peak, **arguments)
    if run is None or run.compiled_peak_bytes is None:
        # The guard's own plan where it planned (its compile could not be read).
        plan = run.plan if run is not None and run.plan is not None else tfmem.plan(
            model, **arguments)
        print(plan_report.format_table(plan, switches=switches))
        fits = plan.fits
    else:
        plan = run.plan
        print(run.table())
        fits = run.compiled_peak_bytes + plan.runtime_bytes <= plan.budget_bytes
        print(compiled_choice(run, switches, fits))
    if plot:
        draw(plan, plot, run)
        print(f"wrote {plot}")
    return 0 if fits else 1


def compiled_ahead(image_size: tuple[int, int]):
    """`(k, plan) →` XLA's figure of the planned run's step (`tfmem.finetune
    .compiled_ahead`), for a TPU or GPU --device on JAX where its compiler is installed; else
    None (without it, after a line that gives the install command)."""
    if FLAGS.device.strip().lower() == "cpu":
        return None
    config = finetune.FinetuneConfig(
        model=FLAGS.model, global_batch_size=FLAGS.global_batch_size, image_size=image_size,
        num_classes=FLAGS.num_classes, device=FLAGS.device, precision=FLAGS.precision,
        optimizer=FLAGS.optimizer, rematerialize=FLAGS.rematerialize or None,
        loss=FLAGS.loss, dry_run=True)
    return finetune.compiled_ahead(config, program="plan")


def compiled_choice(run: guard.RunPlan, switches: plan_report.Switches, fits: bool) -> str:
    """Why the split checked with XLA's figure was taken, against the plan's own choice, and
    what to run next."""
    plan, peak = run.plan, format_bytes(run.compiled_peak_bytes)
    budget = format_bytes(plan.budget_bytes)
    alone = (f"micro-batch {plan.micro_batch_size} × {plan.accumulation_steps}" if plan.fits
             else "nothing fits")
    if not fits:
        return (f"nothing fits by XLA's figure either: micro-batch {run.micro_batch_size} × "
                f"{run.accumulation_steps} needs {peak}, over the {budget} budget (the plan "
                f"alone: {alone})")
    return (f"chosen by XLA's figure of the compiled step: micro-batch "
            f"{run.micro_batch_size} × {run.accumulation_steps}, {peak} of the {budget} "
            f"budget (the plan alone: {alone})\nnext: {switches.run(run.accumulation_steps)}")


if __name__ == "__main__":
    cli.run(main)
