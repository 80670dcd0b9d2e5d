"""Fine-tuning an image classifier from TFRecords, as one call: `run(FinetuneConfig(...))`.

This is what `scripts/finetune.py` runs (its flags are `FinetuneConfig`'s fields, with hyphens):
detect the runtime and its precision, build the model in the strategy's scope, plan and check
the memory (`tfmem.memory.guard`), stream the TFRecords, train an `AccumModel` with
`fit_resumable`, evaluate, and write the run directory: `run.json` (the settings a restart
must match), `backup/` (resume points), `logs/` (TensorBoard), `model.keras` and
`metrics.json`. What is checked and recovered: docs/failure-model.md.

Errors a user can fix by changing the settings are `tfmem.cli.UsageError`s naming the
command-line option; the rest are the library's own.

Example:
    >>> from tfmem import finetune
    >>> results = finetune.run(finetune.FinetuneConfig(epochs=1, output="runs/demo"))
    >>> results["validation"]["accuracy"]  # doctest: +SKIP
    0.98
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

import keras

from tfmem import cli, models
from tfmem._install import install_command
from tfmem.data import demo, manifest as manifest_lib, reader
from tfmem.data.integrity import SkippedRecords
from tfmem.data.options import MAX_IMAGE_PIXELS
from tfmem.memory import guard, levers
from tfmem.memory import plan_report
from tfmem._sizes import format_bytes
from tfmem.memory.memory_plan import MemoryPlanError
from tfmem.remat.spec import Ranges, RematSpec
from tfmem.runtime import current, devices, memory_cap, precision as precision_lib, report
from tfmem.runtime.cluster import split_batch
from tfmem.runtime.runtime import Runtime
from tfmem.training import recovery, resume, run_directory
from tfmem.training.accumulation import AccumModel
from tfmem.training.progress import RunProgress
from tfmem.training.resume import TrainingDivergedError, fit_resumable

# The demo set: 2048 training + 512 held-out shapes (tfmem.make_demo_dataset), 4 classes.
DEMO_SPLITS = (("train", 2048, 0), ("validation", 512, 1))
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
# What a run writes in its --output (its run.json lists them): nothing else there is deleted or
# replaced. Beside them, two working entries of tfmem's own: `.lock` and `.attempts/` (the
# supervising process's files, only those of its own names ever removed).
WRITES = (run_directory.CONFIG_FILE, "backup", "logs", "model.keras", "metrics.json",
          "demo-data", ".tmp-model.keras", ".tmp-metrics.json")
DISCARDED = ("backup", "logs", "model.keras", "metrics.json", run_directory.CONFIG_FILE)
ATTEMPTS = ".attempts"
ATTEMPT_FILES = ("spec.json", "outcome.json", "split.json")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """The settings of a fine-tuning run; `scripts/finetune.py --help` describes each flag.

    Attributes:
        model: a name of `tfmem.models.MODELS` (an image classifier).
        data: "demo" (the embedded demo set, written under `output`), a directory of
            TFRecords, or a glob such as "gs://bucket/train-*.tfrec".
        validation_data: TFRecords to evaluate on (with "demo": the demo's held-out set).
        num_classes, num_examples: for data without a tfmem manifest.json.
        global_batch_size: samples per optimizer update, over all replicas.
        accumulation_steps: "auto" (the plan's choice) or k micro-batches per global batch.
        epochs: training epochs.
        image_size: height and width; default: the model's (the demo's 32 for "demo").
        precision: "auto", "float32", "mixed_float16" or "mixed_bfloat16".
        weights: a local weights file.
        freeze_backbone: train only the new head.
        optimizer: one of `OPTIMIZERS`.
        learning_rate: a finite number > 0.
        output: the run directory (default runs/<model>).
        overwrite: discard the run in `output` and start again.
        skip_corrupt: skip records that cannot be read, naming each.
        device: plan for this device of the table instead of the detected one (dry run only).
        prefer: force a device kind ("tpu", "gpu", "cpu").
        allow_over_budget: train even when the plan exceeds the memory budget.
        dry_run: build, plan and print; train nothing.
        save_every_steps: updates between resume points (default: 4 per epoch).
        seed: seed of weights, shuffling and augmentation.
        deterministic: deterministic ops (a resumed run ends bit-identical).
        memory_limit: "auto" (80% of the RAM available at the start), "none", or a size
            ("3GB", "2.5GiB") this run's training process may hold in RAM and swap.
        rematerialize: what is recomputed in the backward pass instead of kept: "full",
            "auto" (as much as the micro-batch needs to fit), or comma-separated layer names
            and `first:last` ranges (docs/rematerialization.md).
        max_image_pixels: the most pixels an image of the data (read from its header) and
            `image_size`² may have.
        verbose: print the whole environment table (default: one line of it).
    """

    model: str = "small-cnn"
    data: str = "demo"
    validation_data: str | None = None
    num_classes: int | None = None
    num_examples: int | None = None
    global_batch_size: int = 64
    accumulation_steps: int | str = "auto"
    epochs: int = 2
    image_size: int | None = None
    precision: str = "auto"
    weights: str | None = None
    freeze_backbone: bool = False
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    output: str | None = None
    overwrite: bool = False
    skip_corrupt: bool = False
    device: str | None = None
    prefer: str | None = None
    allow_over_budget: bool = False
    dry_run: bool = False
    save_every_steps: int | None = None
    seed: int = 0
    deterministic: bool = False
    memory_limit: str = "auto"
    rematerialize: str | None = None
    max_image_pixels: int = MAX_IMAGE_PIXELS
    verbose: bool = False

    def __post_init__(self):
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise cli.UsageError(f"--learning-rate {self.learning_rate}: the learning rate must "
                                 "be a finite number > 0, e.g. --learning-rate=1e-3")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                0 <= self.seed < 2**32):
            raise cli.UsageError(f"--seed {self.seed}: a seed is an int from 0 to 2**32 - 1, "
                                 "e.g. --seed 0")
        if (isinstance(self.max_image_pixels, bool) or not isinstance(self.max_image_pixels, int)
                or self.max_image_pixels < 1):
            raise cli.UsageError(f"--max-image-pixels {self.max_image_pixels}: the limit must be "
                                 f"a positive number of pixels, e.g. {MAX_IMAGE_PIXELS}")
        if self.optimizer not in OPTIMIZERS:
            raise cli.UsageError(f"--optimizer {self.optimizer!r} is not one of "
                                 f"{', '.join(OPTIMIZERS)}; pick one of them")


def run(config: FinetuneConfig) -> dict:
    """Runs (or with `dry_run`, plans) one fine-tuning; returns metrics.json's dict.

    Under a memory limit (`memory_limit`, by default 80% of the RAM available at the start) the
    training runs in a child process that `tfmem.runtime.memory_cap.MemoryWatch` stops at the
    limit; this process then resumes it from its last resume point with the micro-batch halved
    and twice the accumulation steps (the same global batch), until it fits or micro-batch 1
    does not (docs/out-of-memory.md).

    Returns:
        The results written to metrics.json; `{}` for a dry run or a run found complete.

    Raises:
        tfmem.cli.UsageError: the settings cannot work (a flag combination, the data's facts,
            a run directory made with other settings, a plan over the budget, a memory limit
            that even micro-batch 1 exceeds).
        ValueError, OSError, RuntimeError: the data, the disk or the training process failed
            (`docs/failure-model.md`).
    """
    _check(config)
    _check_named_files_and_devices(config)
    with cli.usage_errors():  # "3 GB", "lots"
        cap = memory_limit_bytes(config.memory_limit)
    if config.dry_run:
        return _run(config, _Attempt(config.accumulation_steps))
    _check_installed()
    spec = _spec(config)
    _check_output(config, _output(config, spec))
    if cap is None:
        return _run(config, _Attempt(config.accumulation_steps))
    note = memory_cap.limit_note_here()
    if note:  # once, before any work: what the limit cannot see here
        print(f"warning: {note}", file=sys.stderr)
    data = _Data.of(config, spec)  # a wrong model or data stops here, before any process
    _check_sizes(config, spec, data)
    # This process holds the run directory for its training processes, one after the other.
    with run_directory.lock(_output(config, spec), "--output"):
        return _supervise(config, cap, data, _output(config, spec))


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """What one training process is asked to do: the k to use, the recoveries before it, where
    to say which split it took (`_supervise` reads it), and the data's facts already found."""

    accumulation_steps: int | str
    recoveries: tuple = ()
    split_file: str | None = None
    locked: bool = False  # the run directory is held by the supervising process
    plan_budget: int | None = None  # plan for these bytes instead of the device's memory
    data: dict | None = None  # the data's facts, as the supervising process found them
    memory_limit: int | None = None  # the limit the process runs under, checked against the plan


def _run(config: FinetuneConfig, attempt: _Attempt) -> dict:
    """The run itself, in this process (no memory limit enforced here)."""
    spec = _spec(config)
    if config.deterministic:
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(config.seed)
    runtime = current.detect(prefer=config.prefer)
    precision = (precision_lib.policy_for(runtime) if config.precision == "auto"
                 else config.precision)
    precision_lib.set_policy(policy=precision)

    output = _output(config, spec)
    data = _Data(**attempt.data) if attempt.data else _Data.of(config, spec)
    if not config.dry_run:  # nothing is written for a run these refuse
        _check_sizes(config, spec, data)
    if config.dry_run:
        if not config.device:  # the plan is for this machine: say what it is
            _print_environment(config, runtime)
        _build_and_plan(config, spec, runtime, precision, data, attempt)
        return {}
    held = contextlib.nullcontext() if attempt.locked else run_directory.lock(output, "--output")
    with held:  # one process per run directory
        if config.overwrite:
            _discard(output)
        holds_run = bool(glob.glob(os.path.join(output, "backup", "backup-*.json"))) or any(
            os.path.exists(os.path.join(output, name)) for name in ("model.keras",
                                                                    "metrics.json"))
        recorded = run_directory.check_config(
            output, _run_settings(config, spec, precision, data),
            holds_run=holds_run, writes=WRITES, how_to_fix=(
                "start it with its own settings to resume it, use a new --output for a new "
                "run, or pass --overwrite to discard it and start again"))
        finished = recorded.get("complete")
        if finished and config.epochs <= finished["epochs"]:
            print(f"finetune: the run in {output} is complete ({finished['epochs']} epochs); "
                  f"its results are {os.path.join(output, 'metrics.json')} and "
                  f"{os.path.join(output, 'model.keras')}. Nothing was changed: use a new "
                  "--output for another run, or more --epochs to train this one further.")
            return {}
        _check_epochs_done(config, output)
        if recorded.get("epochs") != config.epochs:  # a later start may train on further
            recorded = {**recorded, "epochs": config.epochs}
            run_directory.write_config(output, recorded)
        if not attempt.recoveries:  # once per run, not again in each training process
            _print_environment(config, runtime)
        if data.demo:
            data = dataclasses.replace(data, **_demo_data(output, data.image_size))
            if not attempt.recoveries:
                print(_demo_line(spec, config, data))
        results = _train(config, spec, runtime, precision, output, data, attempt)
        run_directory.write_config(output, {**recorded, "complete": {
            "epochs": config.epochs, "metrics": os.path.join(output, "metrics.json")}})
        print(_summary(output))
        if results.get("skipped"):
            print(results["skipped"])
        return results


def _print_environment(config: FinetuneConfig, runtime: Runtime) -> None:
    """The environment: one line, or with `--verbose` the whole table."""
    print(report.describe(runtime) if config.verbose
          else f"{report.summary(runtime)} (--verbose: the whole table)")


def _demo_line(spec, config: FinetuneConfig, data: _Data) -> str:
    """What the demo trains, on what, in one line."""
    held_out = DEMO_SPLITS[1][1]
    return (f"finetune: the demo trains {spec.name} for {config.epochs} epoch"
            f"{'s' if config.epochs != 1 else ''} on tfmem's built-in shapes data: "
            f"{data.num_examples:,} {data.image_size}×{data.image_size} images of "
            f"{data.num_classes} classes ({', '.join(demo.CLASS_NAMES)}), {held_out} held out "
            "to validate")


def _summary(output: str) -> str:
    """The run's last lines: what it wrote, and how to look at its training curves."""
    return (f"finetune: done. The trained model: {os.path.join(output, 'model.keras')}; its "
            f"results: {os.path.join(output, 'metrics.json')}; its training curves: "
            f"tensorboard --logdir {os.path.join(output, 'logs')}")


def _output(config: FinetuneConfig, spec) -> str:
    """The run directory; each model has its own default, so a demo and an XL run never share
    one."""
    return config.output or os.path.join("runs", spec.name)


def _spec(config: FinetuneConfig):
    """The registry entry of `config.model`: an image classifier, or a segmentation network
    that classifies from its pooled last features."""
    with cli.usage_errors():  # unknown name → the list of valid ones
        spec = models.spec(config.model)
    if spec.task != "classification" and config.weights:
        raise cli.UsageError(
            f"--weights: {spec.name} is a {spec.task} network, trained here as a classifier "
            "of its pooled last features from scratch; leave --weights out")
    return spec


@dataclasses.dataclass(frozen=True)
class _Data:
    """What the run knows of its data before training: its size, classes and identity."""

    demo: bool
    image_size: int
    num_classes: int
    num_examples: int | None
    identity: str | None = None
    validation_identity: str | None = None
    train: str | None = None
    validation: str | None = None

    @classmethod
    def of(cls, config: FinetuneConfig, spec) -> _Data:
        image_size = config.image_size or spec.default_image_size
        if config.data == "demo" and config.num_classes:  # a dry run for data elsewhere
            print(f"finetune: no data given: a dry run plans for --num-classes "
                  f"{config.num_classes}; training needs --data")
            return cls(False, image_size, config.num_classes, config.num_examples)
        if config.data == "demo":  # written only when training starts
            return cls(True, config.image_size or 32, len(demo.CLASS_NAMES),
                       DEMO_SPLITS[0][1], "demo", "demo")
        num_classes, num_examples, identity = _dataset_facts(config)
        # Not read either when the training data was not (a dry run for another machine).
        validation = config.validation_data
        validation_identity = validation and identity and _validation_identity(validation)
        return cls(False, image_size, num_classes, num_examples, identity,
                   validation_identity, config.data, validation)


def _check_sizes(config: FinetuneConfig, spec, data: _Data) -> None:
    """The sizes a run asks of its model and data, checked before anything is written: an
    image size the model takes and within the pixel limit, a global batch the data holds."""
    with cli.usage_errors():  # an image size the model cannot take
        models.input_shape(spec.name, data.image_size)
    pixels = data.image_size**2
    if pixels > config.max_image_pixels:
        raise cli.UsageError(
            f"--image-size {data.image_size}: images of {data.image_size}×{data.image_size} = "
            f"{pixels:,} pixels are above the limit of {config.max_image_pixels:,} per image "
            f"(--max-image-pixels); use a smaller --image-size ({spec.name} is made for "
            f"{spec.default_image_size}), or raise --max-image-pixels")
    if data.num_examples is not None and config.global_batch_size > data.num_examples:
        where = "the demo set" if data.demo else data.train
        raise cli.UsageError(
            f"--global-batch-size {config.global_batch_size} is larger than the "
            f"{data.num_examples} training examples of {where}; use at most "
            f"{data.num_examples}")


def _check(config: FinetuneConfig) -> None:
    """Combinations of settings that cannot work together."""
    if config.device and not config.dry_run:
        raise cli.UsageError(f"--device {config.device} plans for another machine; it only goes "
                             "with --dry-run (training always runs on the detected runtime)")
    if config.data == "demo":
        # A dry run may name the classes of data it does not have (planning for another machine).
        names = ("validation_data",) if config.dry_run else ("validation_data", "num_classes",
                                                             "num_examples")
        for name in names:
            if getattr(config, name) is not None:
                raise cli.UsageError(
                    f"--{name.replace('_', '-')} goes with your own --data; the demo "
                    "brings its own classes, examples and held-out set")
        if config.dry_run and config.num_examples is not None and config.num_classes is None:
            raise cli.UsageError("--num-examples without --data plans for data that is "
                                 "elsewhere; pass its --num-classes too")


def _demo_data(output: str, image_size: int) -> dict:
    """Writes the demo train/validation sets once under `output`; returns their paths."""
    paths = []
    for split, num_examples, seed in DEMO_SPLITS:
        path = os.path.join(output, "demo-data", f"{image_size}px", split)
        try:
            manifest_lib.read_manifest(path)
        except ValueError:  # none yet, or damaged: (re)write it; it is the same every time
            demo.make_demo_dataset(path, num_examples=num_examples, image_size=image_size,
                                   seed=seed, overwrite=True)
        paths.append(path)
    return {"train": paths[0], "validation": paths[1]}


def _dataset_facts(config: FinetuneConfig) -> tuple[int, int, str | None]:
    """(num_classes, num_examples, identity) from the manifest, or from the records and flags.

    The identity goes into the run's settings: the manifest's fingerprint (the set wherever
    it lies), or for foreign records their path and count.
    """
    data = config.data
    # A dry run given both counts plans for another machine, whose data may live there (a TPU
    # VM, a bucket): a remote path is not looked at, a local manifest is still used.
    counted = config.dry_run and config.num_classes and config.num_examples
    has_manifest = not (counted and "://" in data) and manifest_lib.has_manifest(data)
    if counted and not has_manifest:
        print(f"finetune: data not checked: a dry run plans from --num-classes "
              f"{config.num_classes} and --num-examples {config.num_examples} without reading "
              f"{data}; training checks it before it starts")
        return config.num_classes, config.num_examples, None
    if has_manifest:
        manifest = manifest_lib.read_manifest(data)  # a damaged one stops here, naming it
        for name, value in (("num_classes", manifest.num_classes),
                            ("num_examples", manifest.num_examples)):
            given, option = getattr(config, name), "--" + name.replace("_", "-")
            if given is not None and given != value:
                raise cli.UsageError(
                    f"{option} {given}, but the manifest of {data} says {value}; leave "
                    f"{option} out (the manifest gives it)")
        return manifest.num_classes, manifest.num_examples, f"manifest {manifest.fingerprint}"
    if config.num_classes is None:
        raise cli.UsageError(
            f"{data!r} has no tfmem manifest.json, so its classes are unknown; pass "
            "--num-classes (e.g. from the dataset's description)")
    try:  # no files there, or files that are no TFRecords: the path is wrong
        count = reader.count_records(data)
    except ValueError as error:
        raise cli.UsageError(f"--data {data}: {cli.one_line(error)}") from error
    if count is None and config.num_examples is None:
        raise cli.UsageError(f"{data!r} is remote and has no manifest.json, so its size is "
                             "unknown; pass --num-examples")
    if count is not None and config.num_examples is not None and config.num_examples > count:
        raise cli.UsageError(f"--num-examples {config.num_examples} is more than the {count} "
                             f"records of {data}; pass --num-examples {count} or fewer")
    num_examples = config.num_examples or count
    return config.num_classes, num_examples, f"{os.path.abspath(data)}, {num_examples} examples"


def _validation_identity(data: str) -> str:
    """The validation set's identity in the run's settings (as `_dataset_facts` gives it)."""
    if manifest_lib.has_manifest(data):
        return f"manifest {manifest_lib.read_manifest(data).fingerprint}"
    with cli.usage_errors():  # no files there: the path is wrong
        return f"{os.path.abspath(data)}, {reader.count_records(data)} records"


def _run_settings(config: FinetuneConfig, spec, precision: str, data: _Data) -> dict:
    """What defines the run: a restart with any of these changed is another run."""
    return {
        "model": spec.name, "image_size": data.image_size, "num_classes": data.num_classes,
        "optimizer": config.optimizer, "learning_rate": config.learning_rate,
        "global_batch_size": config.global_batch_size,
        "accumulation_steps": str(config.accumulation_steps), "precision": precision,
        "seed": config.seed, "freeze_backbone": config.freeze_backbone,
        "weights": os.path.abspath(config.weights) if config.weights else None,
        "data": data.identity, "validation_data": data.validation_identity,
    }


def _check_named_files_and_devices(config: FinetuneConfig) -> None:
    """The things the flags name exist as what they should be, before any work."""
    _spec(config)  # the model first: one that takes no --weights says so
    if config.weights is not None:
        try:
            models.check_weights(config.model, config.weights)
        except ValueError as error:
            raise cli.UsageError(f"--weights: {error}") from None
    if config.device is not None and config.device.strip().lower() != "cpu":
        try:
            devices.by_name(config.device)
        except ValueError as error:
            raise cli.UsageError(f"--device: {error}") from None


def _check_installed() -> None:
    """The optional packages a training run needs, before any work: TensorBoard's, for the
    run's logs (not part of the `tpu` extra, nor of tfmem without extras)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError("a training run writes TensorBoard logs, and the tensorboard "
                          "package is not installed; pip install tensorboard (or "
                          f"{install_command('cpu')}, or its `tensorflow` extra, which bring "
                          "it)") from None


def _check_epochs_done(config: FinetuneConfig, output: str) -> None:
    """A restart asks for at least the epochs the run has begun (fewer would train nothing
    and call the run complete at more epochs than it says)."""
    trained = resume.trained_so_far(os.path.join(output, "backup"))
    if trained is not None and trained > (config.epochs, 0):
        raise cli.UsageError(
            f"--epochs {config.epochs}, but the run in {output} has trained "
            f"{resume.describe_trained(*trained)} already; pass --epochs "
            f"{resume.epochs_needed(*trained)} or more to go on with it, or use a new --output "
            "(or --overwrite) to start again")


def _check_output(config: FinetuneConfig, output: str) -> None:
    """Before anything is written: `--output` can hold the run, and nothing of the run's
    names there is something no tfmem run wrote."""
    with cli.usage_errors():
        run_directory.check_writable(output, WRITES, what="--output",
                                     overwrite="--overwrite" if config.overwrite else None)


def _discard(output: str) -> None:
    """--overwrite: the run's resume points, logs and results go (only what its run.json says
    it wrote); the demo data stays."""
    for name in run_directory.written(output, DISCARDED):  # run.json last
        path = os.path.join(output, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _save_results(accum, results: dict, output: str) -> None:
    """model.keras and metrics.json, each under a temporary name, then renamed."""
    temporary = os.path.join(output, ".tmp-model.keras")
    accum.save(temporary)
    os.replace(temporary, os.path.join(output, "model.keras"))
    temporary = os.path.join(output, ".tmp-metrics.json")
    with open(temporary, "w") as file:
        json.dump(results, file, indent=2)
    os.replace(temporary, os.path.join(output, "metrics.json"))


def _build_and_plan(config: FinetuneConfig, spec, runtime: Runtime, precision: str,
                    data: _Data, attempt: _Attempt) -> tuple[keras.Model,
                                                             keras.optimizers.Optimizer,
                                                             guard.RunPlan]:
    """The model and optimizer (in the strategy's scope), and the run's checked split."""
    # A dry run reads only shapes: its model's weights are never initialised (no RAM for them).
    deferred = config.dry_run and not config.weights
    with runtime.scope(), cli.usage_errors():  # e.g. an image size the model cannot take
        with models.shapes_only() if deferred else contextlib.nullcontext():
            if spec.task == "classification":
                model = models.build(spec.name, num_classes=data.num_classes,
                                     image_size=data.image_size, weights=config.weights,
                                     freeze_backbone=config.freeze_backbone)
            else:
                model = _pooled_classifier(spec, data, config.freeze_backbone)
        optimizer = keras.optimizers.get({"class_name": config.optimizer,
                                          "config": {"learning_rate": config.learning_rate}})
    planned = model
    if config.rematerialize:  # the plan counts what is recomputed
        with runtime.scope(), cli.usage_errors():  # a name that is no layer of the model
            planned = AccumModel.wrap(model,
                                      rematerialize=RematSpec.from_flag(config.rematerialize))
    # --device plans for that device (its replicas and, with precision "auto", its policy).
    where = (dict(device=config.device, precision=config.precision) if config.device
             else dict(runtime=runtime, precision=precision))
    if attempt.plan_budget is not None:  # what fits under a memory limit
        where = dict(memory_budget=attempt.plan_budget, num_replicas=runtime.num_replicas,
                     precision=precision)
    with cli.usage_errors():  # a batch that does not split, a plan over the budget, "auto"
        try:
            run_plan = guard.guard(
                planned, global_batch_size=config.global_batch_size,
                accumulation_steps=attempt.accumulation_steps,
                allow_over_budget=config.allow_over_budget, optimizer=optimizer,
                smaller_variants=levers.registry_variants(
                    spec.name, image_size=data.image_size, num_classes=data.num_classes),
                switches=plan_report.COMMAND_LINE, **where)
        except MemoryPlanError as error:  # the plan it refused, then the one-line refusal
            print(error.plan.table(error.accumulation_steps))
            raise
    if attempt.memory_limit is not None and run_plan.plan is not None:
        _check_memory_limit(run_plan.plan, attempt.memory_limit)
    if attempt.split_file:  # the supervising process halves this split if memory runs out
        memory_plan = run_plan.plan
        with open(attempt.split_file, "w") as file:
            json.dump({"micro_batch_size": run_plan.micro_batch_size,
                       "accumulation_steps": run_plan.accumulation_steps,
                       "nothing_fits": (plan_report.format_nothing_fits(memory_plan)
                                        if memory_plan is not None and not memory_plan.fits
                                        else None),
                       "recompute_more": _recomputes_more(config, model, run_plan,
                                                          runtime)}, file)
    if run_plan.plan is not None:  # its first line: parameters and the split
        print(run_plan.plan.table(run_plan.accumulation_steps))
    else:
        print(f"{spec.name}: {model.count_params():,} parameters, {run_plan.describe()}")
    return model, optimizer, run_plan


def _check_memory_limit(memory_plan, limit: int) -> None:
    """Before training: a `--memory-limit` below what the framework and the model's state need
    (the plan's terms that no smaller micro-batch changes) stops here, naming the smallest limit
    the plan sees working (micro-batch 1)."""
    fixed = memory_plan.fixed_bytes()
    if fixed <= limit:
        return
    smallest = memory_plan.peak_bytes(1)
    raise cli.UsageError(
        f"--memory-limit {format_bytes(limit)} is below what the framework and the model's "
        f"state need before any batch ({format_bytes(fixed)} as planned), so no micro-batch "
        f"can fit; the smallest limit that could work is about {format_bytes(smallest)} (the "
        "plan at micro-batch 1): raise --memory-limit, or pass --memory-limit none")


def _recomputes_more(config: FinetuneConfig, model: keras.Model, run_plan: guard.RunPlan,
                     runtime: Runtime) -> bool:
    """At micro-batch 1: whether `--rematerialize full` would recompute more than this run
    (what the supervising process tries when micro-batch 1 reaches the memory limit)."""
    if run_plan.micro_batch_size != 1:
        return False
    setting = RematSpec.from_flag(config.rematerialize).value
    chosen = run_plan.plan.rematerialized if run_plan.plan is not None else ()
    return recovery.rematerialization_left(model, setting, chosen if setting else (),
                                           runtime.kind)


def _pooled_classifier(spec, data: _Data, freeze_backbone: bool) -> keras.Model:
    """A segmentation network (FC-DenseNet, U-Net) as an image classifier: its last feature
    maps (per pixel), averaged over the image, then a softmax layer."""
    features = models.build(spec.name, num_classes=None, image_size=data.image_size,
                            include_top=False, freeze_backbone=freeze_backbone)
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(features.output)
    outputs = keras.layers.Dense(data.num_classes, activation="softmax", dtype="float32",
                                 name="predictions")(pooled)
    print(f"{spec.name} is a {spec.task} network: its last feature maps are averaged into a "
          f"{data.num_classes}-class classifier")
    return keras.Model(features.input, outputs, name=spec.name)


def _train(config: FinetuneConfig, spec, runtime: Runtime, precision: str, output: str,
           data: _Data, attempt: _Attempt) -> dict:
    """Builds, plans, trains and evaluates; returns metrics.json's dict."""
    model, optimizer, run_plan = _build_and_plan(config, spec, runtime, precision, data,
                                                 attempt)
    steps_per_epoch = data.num_examples // config.global_batch_size  # >= 1: _check_sizes
    setting = RematSpec.from_flag(config.rematerialize).value
    if setting in ("full", "auto") and run_plan.plan is not None:
        # The segments the plan chose: the run cuts the same ones.
        chosen = run_plan.plan.rematerialized
        setting = Ranges(chosen) if chosen else None
    with runtime.scope():
        accum = AccumModel.wrap(model, accumulation_steps=run_plan.accumulation_steps,
                                rematerialize=setting)
        accum.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(),
                      metrics=["accuracy"])
    skipped = SkippedRecords() if config.skip_corrupt else None
    options = dict(image_size=(data.image_size, data.image_size), data_range=spec.data_range,
                   num_classes=data.num_classes, skip_corrupt=config.skip_corrupt,
                   skipped=skipped, max_image_pixels=config.max_image_pixels)

    def make_dataset(epoch):
        dataset = reader.image_dataset(data.train, batch_size=config.global_batch_size,
                                       training=True, seed=config.seed + epoch, **options)
        # Skipped records would end the epoch early: an epoch is steps_per_epoch updates.
        return dataset.repeat() if config.skip_corrupt else dataset

    # Evaluated a micro-batch per replica at a time, as the plan trains: a validation batch
    # of the global batch's size would run its forward pass on all of it at once.
    validation_batch = run_plan.micro_batch_size * runtime.num_replicas
    validation = (reader.image_dataset(data.validation, batch_size=validation_batch,
                                       training=False, **options)
                  if data.validation else None)
    progress = RunProgress(epochs=config.epochs, steps_per_epoch=steps_per_epoch,
                           global_batch_size=config.global_batch_size)
    recoveries = list(attempt.recoveries)  # this run's stops at the limit, and those in-process
    start = time.perf_counter()
    try:
        history = fit_resumable(
            accum, make_dataset, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
            backup_dir=os.path.join(output, "backup"),
            save_every_steps=config.save_every_steps or max(steps_per_epoch // 4, 1),
            validation_data=validation,
            callbacks=[progress, keras.callbacks.TensorBoard(os.path.join(output, "logs"))],
            verbose=0, memory_recoveries=recoveries,
            check_memory=False)  # the guard above checked it
    except TrainingDivergedError as error:
        raise _diverged_run(config, output, error) from error
    seconds = time.perf_counter() - start
    results = {
        "model": spec.name, "num_parameters": model.count_params(), "data": data.train,
        "num_examples": data.num_examples, "num_classes": data.num_classes,
        "epochs": config.epochs, "global_batch_size": config.global_batch_size,
        # After running out of memory in a step, the run goes on with a larger k.
        "micro_batch_size": split_batch(config.global_batch_size, run_plan.num_replicas,
                                        accum.accumulation_steps),
        "accumulation_steps": accum.accumulation_steps,
        "num_replicas": run_plan.num_replicas, "device": runtime.device_name,
        "precision": precision, "planned_peak_bytes": run_plan.peak_bytes,
        "budget_bytes": run_plan.plan.budget_bytes if run_plan.plan else None,
        "history": history, "train_seconds_this_run": seconds,
        "memory_recoveries": recoveries,
    }
    if validation is not None:
        loss, accuracy = accum.evaluate(validation, verbose=0)
        results["validation"] = {"loss": loss, "accuracy": accuracy,
                                 "batch_size": validation_batch}
        epochs = f"{config.epochs} epoch{'s' if config.epochs != 1 else ''}"
        print(f"finetune: validation accuracy {accuracy:.3f} after {epochs} "
              f"(chance {1 / data.num_classes:.3f})")
    if skipped is not None:
        results["skipped"] = skipped.summary()
    _save_results(accum, results, output)
    return results


def _diverged_run(config: FinetuneConfig, output: str,
                  error: TrainingDivergedError) -> TrainingDivergedError:
    """The library's error in the command's terms: its flags, and how to start again."""
    return TrainingDivergedError(
        f"{error.facts}; no model.keras or metrics.json was written",
        f"lower --learning-rate (now {config.learning_rate:g} with {config.optimizer}) and "
        "start again with --overwrite or a new --output", epoch=error.epoch,
        step=error.step, loss=error.loss, resume_point=error.resume_point)


def memory_limit_bytes(memory_limit: str | None) -> int | None:
    """`"auto"` → 80% of the RAM available now, `"none"` (or None) → no limit, `"3GB"` → bytes.

    Raises:
        ValueError: not "auto", "none" or a size.
    """
    if memory_limit is None or str(memory_limit).lower() == "none":
        return None
    if str(memory_limit).lower() == "auto":
        return memory_cap.default_cap()
    try:
        return memory_cap.parse_size(memory_limit)
    except ValueError as error:
        raise ValueError(f"--memory-limit {memory_limit}: {error}, or auto or none") from None


@contextlib.contextmanager
def _attempts_directory(output: str):
    """`output/.attempts`, where the supervising process and its training processes exchange
    their files: in the run directory (nothing is left in /tmp by a killed run), emptied of
    those files at every start and at the end."""
    workdir = os.path.join(output, ATTEMPTS)

    def clear():
        for name in ATTEMPT_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(workdir, name))
        with contextlib.suppress(OSError):  # not empty: what else is there is left alone
            os.rmdir(workdir)

    clear()  # what a killed run left
    os.makedirs(workdir, exist_ok=True)
    try:
        yield workdir
    finally:
        clear()


def _supervise(config: FinetuneConfig, cap: int, data: _Data, output: str) -> dict:
    """Trains in child processes held under `cap`, halving the micro-batch after each stop."""
    attempt = _Attempt(config.accumulation_steps, locked=True, data=dataclasses.asdict(data),
                       memory_limit=cap)
    with _attempts_directory(output) as workdir:
        while True:
            status, watch, outcome, split = _attempt(config, attempt, cap, workdir)
            config = dataclasses.replace(config, overwrite=False)  # the next one resumes
            if status == 0 and outcome is not None:
                return outcome["results"]
            if not watch.reason:
                raise _child_failure(status, outcome)
            if split is None:
                raise cli.UsageError(
                    f"the training process reached --memory-limit {format_bytes(cap)} before "
                    f"its first step ({watch.reason}): the framework and the model alone need "
                    "more; raise --memory-limit (or pass --memory-limit none)")
            micro, k = split["micro_batch_size"], split["accumulation_steps"]
            smaller = recovery.halved(micro)
            reached = {"micro_batch_size": micro, "accumulation_steps": k,
                       "held_bytes": watch.highest, "limit_bytes": cap}
            resuming = (f"finetune: memory limit {format_bytes(cap)} reached at micro-batch "
                        f"{micro} × {k} accumulation step{'s' if k > 1 else ''} "
                        f"({format_bytes(watch.highest)} held); resuming from the last resume "
                        "point with ")
            if smaller is None and split.get("recompute_more"):
                config = dataclasses.replace(config, rematerialize="full")
                attempt = dataclasses.replace(attempt, recoveries=(
                    *attempt.recoveries,
                    {**reached, "to_micro_batch_size": micro, "to_accumulation_steps": k,
                     "to_rematerialize": "full"}))
                print(f"{resuming}--rematerialize full ({recovery.RECOMPUTED}), micro-batch "
                      f"1 × {k}", flush=True)
                continue
            if smaller is None:
                recomputed = " with --rematerialize full" if (
                    config.rematerialize or "").strip() == "full" else ""
                raise cli.UsageError(
                    f"micro-batch 1 × {k} accumulation steps{recomputed} still reached "
                    f"--memory-limit {format_bytes(cap)} ({format_bytes(watch.highest)} held), "
                    "and nothing smaller can be tried; "
                    + _plan_under(config, attempt, cap, workdir))
            steps = k * micro // smaller
            attempt = dataclasses.replace(attempt, accumulation_steps=steps, recoveries=(
                *attempt.recoveries,
                {**reached, "to_micro_batch_size": smaller, "to_accumulation_steps": steps}))
            print(f"{resuming}micro-batch {smaller} × {steps} accumulation steps, the same "
                  f"global batch {config.global_batch_size}", flush=True)


def _plan_under(config: FinetuneConfig, attempt: _Attempt, cap: int, workdir: str) -> str:
    """What the plan for a budget of `cap` says fits (made in a dry-run process)."""
    planned = dataclasses.replace(config, dry_run=True, allow_over_budget=True)
    _, _, _, split = _attempt(planned, dataclasses.replace(
        attempt, accumulation_steps="auto", plan_budget=cap), None, workdir)
    if split and split["nothing_fits"]:
        # The plan's reasons (its terms, the changes it tried) make a paragraph: the error
        # keeps their first clause, a few lines in all.
        reason, tried, _ = split["nothing_fits"].partition(". None of the changes checked fits")
        reason = re.sub(r" \([^)]*\)", "", reason).split(": ")[0].split(". ")[0]
        return f"the plan for that budget: {reason}" + (
            ", nor any change it checked: raise --memory-limit (scripts/plan.py lists them)"
            if tried else " (scripts/plan.py shows what fits)")
    if split:
        return (f"the plan for that budget picks micro-batch {split['micro_batch_size']} × "
                f"{split['accumulation_steps']}, which is over it here (its estimate is low "
                "for this run): use --precision mixed_bfloat16, --freeze-backbone, a smaller "
                "--image-size or model, or raise --memory-limit")
    return ("use --precision mixed_bfloat16, --freeze-backbone, a smaller --image-size or "
            "model, or raise --memory-limit (scripts/plan.py shows what fits)")


def _attempt(config: FinetuneConfig, attempt: _Attempt, cap: int | None, workdir: str):
    """Runs one training process under `cap` (None: watched, not limited); returns its exit
    status, its watch, its outcome and the split it took (each None when it wrote none)."""
    paths = {name.removesuffix(".json"): os.path.join(workdir, name) for name in ATTEMPT_FILES}
    for path in paths.values():  # nothing of an earlier attempt is read as this one's
        if os.path.exists(path):
            os.remove(path)
    attempt = dataclasses.replace(attempt, split_file=paths["split"])
    with open(paths["spec"], "w") as file:
        json.dump({"config": dataclasses.asdict(config), "attempt": dataclasses.asdict(attempt),
                   "outcome_file": paths["outcome"]}, file)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-m", "tfmem.finetune", paths["spec"]], env=env,
                             preexec_fn=_die_with_parent)
    watch = memory_cap.MemoryWatch(child.pid, cap)
    watch.start()
    try:
        status = child.wait()
    except BaseException:  # Ctrl-C or a kill of this process: the child goes too
        child.kill()
        child.wait()
        raise
    finally:
        watch.stop()
    return status, watch, _read_json(paths["outcome"]), _read_json(paths["split"])


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervising process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
        pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


class _ChildTraceback(Exception):
    """The training process's own traceback, chained under its error (shown by --debug)."""


def _child_failure(status: int, outcome: dict | None) -> BaseException:
    """The error of a training process that failed on its own (not stopped by the limit)."""
    if outcome is None or "error" not in outcome:
        how = (f"was killed by {signal.Signals(-status).name}" if status < 0
               else f"ended with exit status {status}")
        return RuntimeError(f"the training process {how} without saying why; run again to "
                            "resume from its last resume point")
    kind = cli.UsageError if outcome["usage"] else RuntimeError
    error = kind(outcome["error"])
    try:  # raised, so that `--debug` prints it as a traceback, the child's inside
        raise _ChildTraceback("the training process's traceback:\n" + outcome["traceback"])
    except _ChildTraceback as cause:
        error.__cause__ = cause
    return error


def _child_main(spec_path: str) -> None:
    """A training process of `_supervise`: runs the attempt, reports its outcome in a file."""
    with open(spec_path) as file:
        spec = json.load(file)
    attempt = _Attempt(**spec["attempt"])
    try:
        results = _run(FinetuneConfig(**spec["config"]), attempt)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the supervisor
        outcome = {"error": cli.one_line(error), "usage": cli.is_usage_error(error),
                   "traceback": traceback.format_exc()}
        status = 1
    else:
        outcome, status = {"results": results}, 0
    with open(spec["outcome_file"], "w") as file:
        json.dump(outcome, file)
    sys.exit(status)


if __name__ == "__main__":
    _child_main(sys.argv[1])
