"""The `manifest.json` written beside TFRecord shards, and `read_manifest` to load it.

The manifest is what lets a training script know the size of a dataset (number of examples,
number of classes, steps per epoch) without scanning every shard, and what lets the reader
check that each shard was read whole. It is written last, after every shard was renamed to
its final name, so a directory with a manifest holds a complete dataset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from tfmem._tf import tf

from tfmem._version import __version__
from tfmem.data.schema import Schema

MANIFEST_NAME = "manifest.json"
_FORMAT = "tfmem.image_tfrecords/1"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One complete TFRecord shard.

    Attributes:
        name: file name relative to the manifest's directory.
        num_examples: records in the shard.
        num_bytes: size of the file in bytes.
    """

    name: str
    num_examples: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What `write_image_tfrecords` wrote: sizes, classes, schema and shard list.

    Attributes:
        directory: the directory holding the shards and `manifest.json`.
        num_examples: total records over all shards.
        class_names: class names; a label `i` (or mask value `i`) means `class_names[i]`.
        shards: the shards, in writing order.
        schema: the feature keys of each record (see `tfmem.Schema`); a segmentation set's
            also says its ignore value and whether its masks are multi-label.
        image_formats: encodings found among the stored images, e.g. `("jpeg", "png")`.
        pixel_range: range of the stored (decoded, uint8) pixel values; `image_dataset`'s
            `data_range` rescales from it.
        skipped: source files left out as unreadable (`skip_unreadable=True`).
        tfmem_version: the tfmem version that wrote the set.
        origin: what made the records, when the writer was told (e.g. the demo set's
            `make_demo_dataset(num_examples=2048, image_size=32, seed=0)`); empty otherwise.
        image_size: `(height, width)` of every image, when all have one size; None when
            their sizes differ (or for sets written before tfmem recorded it).

    Example:
        >>> manifest = tfmem.read_manifest("/data/flowers/train")   # doctest: +SKIP
        >>> steps_per_epoch = manifest.num_examples // global_batch_size  # doctest: +SKIP
    """

    directory: str
    num_examples: int
    class_names: tuple[str, ...]
    shards: tuple[Shard, ...]
    schema: Schema
    image_formats: tuple[str, ...]
    pixel_range: tuple[int, int] = (0, 255)
    skipped: tuple[str, ...] = ()
    tfmem_version: str = __version__
    origin: str = ""
    image_size: tuple[int, int] | None = None

    @property
    def task(self) -> str:
        """`"segmentation"` (records hold masks) or `"classification"` (labels)."""
        return self.schema.task

    @property
    def ignore_value(self) -> int | None:
        """The mask value of pixels without a class (segmentation sets), else None."""
        return self.schema.ignore_value

    @property
    def num_classes(self) -> int:
        """Number of classes (`len(class_names)`)."""
        return len(self.class_names)

    @property
    def files(self) -> list[str]:
        """Full paths of the shards, in writing order."""
        return [os.path.join(self.directory, shard.name) for shard in self.shards]

    @property
    def num_bytes(self) -> int:
        """Total size of the shards in bytes."""
        return sum(shard.num_bytes for shard in self.shards)

    @property
    def fingerprint(self) -> str:
        """A short hash of the manifest's content: the identity of the set, wherever it lies
        (a rewrite of the set, even of the same images, gets a new one)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The manifest as the JSON text stored in `manifest.json`."""
        # "origin" is written only when known, and "task" only for segmentation, so that a
        # classification set without an origin keeps its fingerprint.
        origin = {"origin": self.origin} if self.origin else {}
        size = {"image_size": list(self.image_size)} if self.image_size else {}
        task = {"task": self.task} if self.task != "classification" else {}
        return json.dumps(
            {
                "format": _FORMAT,
                **task,
                "tfmem_version": self.tfmem_version,
                "num_examples": self.num_examples,
                "num_classes": self.num_classes,
                "class_names": list(self.class_names),
                "image_formats": list(self.image_formats),
                "pixel_range": list(self.pixel_range),
                "schema": self.schema.to_dict(),
                "shards": [dataclasses.asdict(shard) for shard in self.shards],
                "skipped": list(self.skipped),
            } | origin | size,
            indent=1,
        )


def _image_size(value) -> tuple[int, int] | None:
    """The manifest's `"image_size"` as `(height, width)`; None where it has none."""
    if value is None:
        return None
    height, width = value  # a damaged one (not two ints) is reported by read_manifest
    return int(height), int(width)


def write_manifest(manifest: Manifest) -> str:
    """Writes `manifest.json` atomically (temporary name, then rename); returns its path."""
    path = os.path.join(manifest.directory, MANIFEST_NAME)
    temporary = os.path.join(manifest.directory, f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    with tf.io.gfile.GFile(temporary, "w") as file:
        file.write(manifest.to_json())
    tf.io.gfile.rename(temporary, path, overwrite=True)
    return path


def manifest_directory(dir_or_pattern: str) -> str:
    """The directory a manifest for `dir_or_pattern` (a directory, file or glob) would live in."""
    dir_or_pattern = os.fspath(dir_or_pattern)
    if tf.io.gfile.isdir(dir_or_pattern):
        return dir_or_pattern
    return os.path.dirname(dir_or_pattern) or "."


def has_manifest(dir_or_pattern: str) -> bool:
    """Whether `manifest.json` exists for `dir_or_pattern`."""
    directory = manifest_directory(dir_or_pattern)
    if os.path.basename(os.fspath(dir_or_pattern)) == MANIFEST_NAME:
        return tf.io.gfile.exists(dir_or_pattern)
    return tf.io.gfile.exists(os.path.join(directory, MANIFEST_NAME))


def read_manifest(dir_or_pattern: str | os.PathLike) -> Manifest:
    """Loads the manifest of a dataset written by `write_image_tfrecords`.

    Args:
        dir_or_pattern: the dataset directory, its `manifest.json`, or a glob of its shards
            (the manifest is looked up in the shards' directory).

    Returns:
        A frozen `Manifest`: `num_examples`, `num_classes`, `class_names`, `shards`, `schema`.

    Raises:
        ValueError: no `manifest.json` there, or it is not a tfmem manifest.

    Example:
        >>> m = tfmem.read_manifest("/tmp/demo/train")                      # doctest: +SKIP
        >>> m.num_examples, m.num_classes                                   # doctest: +SKIP
        (2048, 4)
    """
    dir_or_pattern = os.fspath(dir_or_pattern)
    if os.path.basename(dir_or_pattern) == MANIFEST_NAME:
        path = dir_or_pattern
    else:
        path = os.path.join(manifest_directory(dir_or_pattern), MANIFEST_NAME)
    if not tf.io.gfile.exists(path):
        raise ValueError(
            f"No {MANIFEST_NAME} at {path!r}: expected a directory written by "
            "`tfmem.write_image_tfrecords` (or `scripts/make_tfrecords.py`), which writes the "
            "manifest after its last shard. If the write was interrupted, write the set again; "
            "for TFRecords written by other tools, pass the shards to `tfmem.image_dataset` "
            "(it detects their feature keys) instead of reading a manifest."
        )
    with tf.io.gfile.GFile(path, "r") as file:
        try:
            data = json.loads(file.read())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path!r} is not valid JSON ({error}); write the set again.") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(
            f"{path!r} is not a tfmem manifest (expected \"format\": {_FORMAT!r}); "
            "write the set again with `tfmem.write_image_tfrecords`."
        )
    try:
        shards = tuple(Shard(**shard) for shard in data["shards"])
        manifest = Manifest(
            directory=os.path.dirname(path) or ".",
            num_examples=int(data["num_examples"]),
            class_names=tuple(data["class_names"]),
            shards=shards,
            schema=Schema.from_dict(data["schema"]),
            image_formats=tuple(data["image_formats"]),
            pixel_range=tuple(data["pixel_range"]),
            skipped=tuple(data["skipped"]),
            tfmem_version=data["tfmem_version"],
            origin=str(data.get("origin", "")),  # optional: older sets and most writers lack it
            image_size=_image_size(data.get("image_size")),  # optional: sizes differ, or older
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path!r} is damaged ({type(error).__name__}: {error}); write the "
                         "set again.") from None
    if data.get("task", "classification") != manifest.task:
        raise ValueError(f"{path!r} is damaged: its task is {data.get('task')!r} but its schema "
                         f"describes {manifest.task}; write the set again.")
    listed = sum(shard.num_examples for shard in shards)
    if listed != manifest.num_examples:
        raise ValueError(
            f"{path!r} is damaged: it says {manifest.num_examples} examples, but its shards "
            f"add up to {listed}; write the set again.")
    return manifest
