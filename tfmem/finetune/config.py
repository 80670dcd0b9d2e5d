"""A fine-tuning run's settings (`FinetuneConfig`) and the checks that need no work done.

Each field is a flag of `scripts/finetune.py` of the same name (hyphens for underscores); the
messages name it as that flag, the way the script and `run` report it.
"""

from __future__ import annotations

import dataclasses
import math

from tfmem import cli, models
from tfmem._install import install_command
from tfmem.data.options import MAX_IMAGE_PIXELS
from tfmem.runtime import devices, memory_cap

OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
TASKS = ("classification", "segmentation")
LOSSES = ("cross-entropy", "dice", "cross-entropy+dice")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """The settings of a fine-tuning run; `scripts/finetune.py --help` describes each flag.

    Attributes:
        model: a name of `tfmem.models.MODELS`.
        task: "segmentation" (a class per pixel: a segmentation network on masks) or
            "classification" (a label per image); default: the --data set's (its manifest),
            else classification (the demo too).
        data: "demo" (the embedded demo set, written under `output`), a directory of
            TFRecords, or a glob such as "gs://bucket/train-*.tfrec".
        validation_data: TFRecords to evaluate on (with "demo": the demo's held-out set).
        num_classes, num_examples: for data without a tfmem manifest.json.
        global_batch_size: samples per optimizer update, over all replicas; default 64 (16
            for the segmentation demo: more, smaller updates learn its masks faster).
        accumulation_steps: "auto" (the plan's choice) or k micro-batches per global batch.
        loss: "cross-entropy", or for segmentation "dice" or "cross-entropy+dice" (each
            image's Dice loss, and its cross-entropy, averaged over the images).
        epochs: training epochs; default 2 (1 for the segmentation demo).
        image_size: an int (square), `(height, width)` or "360,480"; default: the --data
            set's own size (its manifest), else the model's (the demo's 32 for "demo").
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
        compile: a dry run on JAX for a TPU or GPU `device` checks its split with XLA's
            figure of the step, compiled here ahead of time where that device's compiler is
            installed (libtpu; JAX's CUDA plugin, no GPU needed) (for a large model, minutes
            and gigabytes of RAM); False: the plan alone.
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
        validation_tiles: validate a segmentation run at the validation images' own size by
            tiles of the training size even where whole images fit (by default: whole
            images where a forward pass of a micro-batch of them fits, else tiles).
    """

    model: str = "small-cnn"
    task: str | None = None
    data: str = "demo"
    validation_data: str | None = None
    num_classes: int | None = None
    num_examples: int | None = None
    global_batch_size: int | None = None
    accumulation_steps: int | str = "auto"
    loss: str = "cross-entropy"
    epochs: int | None = None
    image_size: int | tuple[int, int] | str | None = None
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
    compile: bool = True
    save_every_steps: int | None = None
    seed: int = 0
    deterministic: bool = False
    memory_limit: str = "auto"
    rematerialize: str | None = None
    max_image_pixels: int = MAX_IMAGE_PIXELS
    verbose: bool = False
    validation_tiles: bool = False

    def __post_init__(self):
        segmentation_demo = self.data == "demo" and self.task == "segmentation"
        for name, default, demo_default in (("global_batch_size", 64, 16), ("epochs", 2, 1)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, demo_default if segmentation_demo else default)
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
        if self.image_size is not None:  # (height, width) from here on
            object.__setattr__(self, "image_size", cli.image_size(self.image_size))
        if self.task is not None and self.task not in TASKS:
            raise cli.UsageError(f"--task {self.task!r} is not one of {', '.join(TASKS)}; "
                                 "pick one of them")
        if self.loss not in LOSSES:
            raise cli.UsageError(f"--loss {self.loss!r} is not one of {', '.join(LOSSES)}; "
                                 "pick one of them")
        if self.optimizer not in OPTIMIZERS:
            raise cli.UsageError(f"--optimizer {self.optimizer!r} is not one of "
                                 f"{', '.join(OPTIMIZERS)}; pick one of them")


def check_combinations(config: FinetuneConfig) -> None:
    """Combinations of settings that cannot work together."""
    if config.device and not config.dry_run:
        raise cli.UsageError(f"--device {config.device} plans for another machine; it only goes "
                             "with --dry-run (training always runs on the detected runtime)")
    if not config.compile and not (config.dry_run and config.device):
        raise cli.UsageError("--nocompile leaves out the compile of a dry run for another "
                             "--device; it only goes with --dry-run --device (a run on JAX "
                             "compiles the step it trains, and checks its split with it)")
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


def model_spec(config: FinetuneConfig):
    """The registry entry of `config.model`: an image classifier, or a segmentation network
    (per pixel with `--task segmentation`, else a classifier of its pooled last features)."""
    with cli.usage_errors():  # unknown name → the list of valid ones
        spec = models.spec(config.model)
    if config.task is not None:
        check_task(config.task, spec, "--task")
    if spec.task != "classification" and config.weights and config.task != "segmentation":
        raise cli.UsageError(
            f"--weights: {spec.name} is a {spec.task} network, trained here as a classifier "
            "of its pooled last features from scratch; leave --weights out, or pass --task "
            "segmentation (its own weights, `model.save_weights`)")
    return spec


def check_loss(config: FinetuneConfig, task: str) -> None:
    """Dice scores masks: a classification run trains with cross-entropy only."""
    if config.loss != "cross-entropy" and task != "segmentation":
        raise cli.UsageError(f"--loss {config.loss} scores masks, and this run is "
                             f"{task} (a label per image); leave --loss out, or pass "
                             "--task segmentation with a segmentation --model and set")


def check_task(task: str, spec, source: str) -> None:
    """A segmentation task needs a model that predicts per pixel; `source` names where the
    task came from (the flag, or the data's manifest)."""
    if task == "segmentation" and spec.task != "segmentation":
        networks = ", ".join(name for name, entry in models.MODELS.items()
                             if entry.task == "segmentation")
        raise cli.UsageError(
            f"--task segmentation ({source}) predicts a class per pixel, and --model "
            f"{spec.name} is an image classifier (one label per image); pass a segmentation "
            f"network as --model ({networks}), or --task classification on data with labels")


def check_named_files_and_devices(config: FinetuneConfig) -> None:
    """The things the flags name exist as what they should be, before any work."""
    model_spec(config)  # the model first: one that takes no --weights says so
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


def check_installed() -> None:
    """The optional packages a training run needs, before any work: TensorBoard's, for the
    run's logs (not part of the `tpu` extra, nor of tfmem without extras)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError("a training run writes TensorBoard logs, and the tensorboard "
                          "package is not installed; pip install tensorboard (or "
                          f"{install_command('cpu')}, or its `tensorflow` extra, which bring "
                          "it)") from None


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
