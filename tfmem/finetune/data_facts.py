"""What a run knows of its data before training: size, classes, identity; the demo set."""

from __future__ import annotations

import dataclasses
import os

from tfmem import cli, models
from tfmem.data import demo, manifest as manifest_lib, reader
from tfmem.data.schema import DEFAULT_IGNORE_VALUE
from tfmem.finetune.config import FinetuneConfig, check_task

# The demo set: 2048 training + 512 held-out shapes (tfmem.make_demo_dataset), 4 classes.
DEMO_SPLITS = (("train", 2048, 0), ("validation", 512, 1))
# The segmentation demo, the same shapes as masks: half as many images (a U-Net's step costs
# many times the small CNN's), one epoch of 64 updates of 16.
SEGMENTATION_DEMO_SPLITS = (("train", 1024, 0), ("validation", 256, 1))


def demo_splits(task: str) -> tuple:
    """The demo's `(split, images, seed)` for `task`."""
    return SEGMENTATION_DEMO_SPLITS if task == "segmentation" else DEMO_SPLITS


@dataclasses.dataclass(frozen=True)
class DataFacts:
    """What the run knows of its data before training: its size, classes and identity, and
    its task (masks hold `ignore_value` where a pixel has no class)."""

    demo: bool
    image_size: tuple[int, int]  # (height, width)
    num_classes: int
    num_examples: int | None
    identity: str | None = None
    validation_identity: str | None = None
    train: str | None = None
    validation: str | None = None
    task: str = "classification"
    ignore_value: int | None = None
    size_source: str = "--image-size"  # where image_size came from, for messages
    multi_label: bool = False  # masks of a 0/1 channel per class (classes may overlap)

    def __post_init__(self):  # read back from JSON (the supervisor's), a list
        object.__setattr__(self, "image_size", tuple(self.image_size))

    @classmethod
    def of(cls, config: FinetuneConfig, spec) -> DataFacts:
        image_size = config.image_size or (spec.default_image_size,) * 2
        source = "--image-size" if config.image_size else f"the training size of {spec.name}"
        # Data without a manifest (or none at all) has the task the flag says.
        task = config.task or "classification"
        ignore_value = DEFAULT_IGNORE_VALUE if task == "segmentation" else None
        if config.data == "demo" and config.num_classes:  # a dry run for data elsewhere
            print(f"finetune: no data given: a dry run plans for --num-classes "
                  f"{config.num_classes}; training needs --data")
            return cls(False, image_size, config.num_classes, config.num_examples,
                       task=task, ignore_value=ignore_value, size_source=source)
        if config.data == "demo":  # written only when training starts
            classes = demo.SEGMENTATION_CLASS_NAMES if task == "segmentation" else (
                demo.CLASS_NAMES)
            return cls(True, config.image_size or (32, 32), len(classes),
                       demo_splits(task)[0][1],
                       "demo", "demo", task=task, ignore_value=ignore_value,
                       size_source="--image-size" if config.image_size else "the demo's size")
        num_classes, num_examples, identity, manifest = _dataset_facts(config)
        multi_label = False
        if manifest is not None:
            task, ignore_value = _manifest_task(config, manifest), manifest.ignore_value
            multi_label = manifest.schema.multi_label
            check_task(task, spec, f"the task of --data {config.data}")
            # Without --image-size, the size all the set's images have (where they have one).
            if not config.image_size and manifest.image_size:
                image_size = manifest.image_size
                source = f"the size of the images of --data {config.data}, from its manifest"
        elif identity is not None and not config.image_size:  # records read, no manifest
            size = _first_records_size(config.data, spec)
            if size is not None:
                image_size = size
                source = (f"the size of the images of --data {config.data}, from its first "
                          "records")
        # Not read either when the training data was not (a dry run for another machine).
        validation = config.validation_data
        validation_identity = validation and identity and _validation_identity(validation)
        return cls(False, image_size, num_classes, num_examples, identity,
                   validation_identity, config.data, validation, task, ignore_value, source,
                   multi_label)


def check_sizes(config: FinetuneConfig, spec, data: DataFacts) -> None:
    """The sizes a run asks of its model and data, checked before anything is written: an
    image size the model takes and within the pixel limit, a global batch the data holds."""
    height, width = data.image_size
    # Without --image-size the size is the data's (or the model's): say so.
    given = f"--image-size {cli.image_size_text(data.image_size)}"
    if data.size_source != "--image-size":
        given += f" ({data.size_source}; none given)"
    try:  # an image size the model cannot take
        models.input_shape(spec.name, data.image_size)
    except ValueError as error:
        raise cli.UsageError(f"{given}: {cli.one_line(error)} Pass --image-size "
                             "HEIGHT,WIDTH that it takes") from None
    pixels = height * width
    if pixels > config.max_image_pixels:
        raise cli.UsageError(
            f"{given}: images of {height}×{width} = "
            f"{pixels:,} pixels are above the limit of {config.max_image_pixels:,} per image "
            f"(--max-image-pixels); use a smaller --image-size ({spec.name} is made for "
            f"{spec.default_image_size}), or raise --max-image-pixels")
    if data.num_examples is not None and config.global_batch_size > data.num_examples:
        where = "the demo set" if data.demo else data.train
        raise cli.UsageError(
            f"--global-batch-size {config.global_batch_size} is larger than the "
            f"{data.num_examples} training examples of {where}; use at most "
            f"{data.num_examples}")


def demo_data(output: str, image_size: tuple[int, int], task: str = "classification") -> dict:
    """Writes the demo train/validation sets (of `task`) once under `output`; returns their
    paths and the masks' ignore value."""
    splits = demo_splits(task)
    paths = []
    variant = "" if task == "classification" else f"-{task}-{splits[0][1]}"
    height, width = image_size
    size = f"{height}px" if height == width else f"{height}x{width}px"
    for split, num_examples, seed in splits:
        path = os.path.join(output, "demo-data", f"{size}{variant}", split)
        try:
            manifest = manifest_lib.read_manifest(path)
        except ValueError:  # none yet, or damaged: (re)write it; it is the same every time
            manifest = demo.make_demo_dataset(path, num_examples=num_examples,
                                              image_size=image_size, seed=seed,
                                              overwrite=True, task=task)
        paths.append(path)
    return {"train": paths[0], "validation": paths[1], "ignore_value": manifest.ignore_value}


def _manifest_task(config: FinetuneConfig, manifest) -> str:
    """The manifest's task; a `--task` that its records cannot serve is refused."""
    if config.task is not None and config.task != manifest.task:
        held = "masks" if manifest.task == "segmentation" else "a label per image"
        raise cli.UsageError(
            f"--task {config.task}, but {config.data} is a {manifest.task} set (its records "
            f"hold {held}, says its manifest); leave --task out (the manifest gives it)")
    return manifest.task


def _dataset_facts(config: FinetuneConfig) -> tuple[int, int, str | None, object]:
    """(num_classes, num_examples, identity, manifest or None) from the manifest, or from the
    records and flags.

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
        return config.num_classes, config.num_examples, None, None
    if has_manifest:
        manifest = manifest_lib.read_manifest(data)  # a damaged one stops here, naming it
        for name, value in (("num_classes", manifest.num_classes),
                            ("num_examples", manifest.num_examples)):
            given, option = getattr(config, name), "--" + name.replace("_", "-")
            if given is not None and given != value:
                raise cli.UsageError(
                    f"{option} {given}, but the manifest of {data} says {value}; leave "
                    f"{option} out (the manifest gives it)")
        return (manifest.num_classes, manifest.num_examples,
                f"manifest {manifest.fingerprint}", manifest)
    return (*_records_facts(config), None)


def _records_facts(config: FinetuneConfig) -> tuple[int, int, str]:
    """(num_classes, num_examples, identity) of records without a manifest: from the flags,
    and the records counted where they are local."""
    data = config.data
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


def _first_records_size(data: str, spec) -> tuple[int, int] | None:
    """The size the first records' images share (their headers), or None: they differ, or
    the layout is not recognised (reading names why)."""
    try:
        sizes = sorted(set(reader.first_image_sizes(data)))
    except ValueError:
        return None
    if len(sizes) > 1:
        listed = ", ".join(f"{height}×{width}" for height, width in sizes)
        print(f"finetune: the first images of --data {data} differ in size ({listed}); "
              f"training at the size of {spec.name}, {spec.default_image_size}: pass "
              "--image-size to choose")
    return sizes[0] if len(sizes) == 1 else None


def _validation_identity(data: str) -> str:
    """The validation set's identity in the run's settings (as `_dataset_facts` gives it)."""
    if manifest_lib.has_manifest(data):
        return f"manifest {manifest_lib.read_manifest(data).fingerprint}"
    with cli.usage_errors():  # no files there: the path is wrong
        return f"{os.path.abspath(data)}, {reader.count_records(data)} records"
