"""Writing image sets to sharded TFRecord files (`write_image_tfrecords`).

A classification record is a `tf.train.Example` with the encoded image (`image`: JPEG/PNG
bytes), its `label`, `height`, `width`, `channels` and an `id`; a segmentation record has
DeepLab's and the TF Model Garden's keys (`image/encoded`, `image/format`, `image/height`,
`image/width`, `image/channels`, `image/filename`, `image/segmentation/class/encoded`: a PNG
mask, `image/segmentation/class/format`), so other tools read it too. Shards are written
streaming, one example at a time, each under a temporary hidden name that is renamed when the
shard is complete; the `manifest.json` is written last, in one rename, and it alone says which
shards form the set. So a directory with a manifest is a complete set, and an interrupted run
never leaves a half-written file under a shard's name. Replacing a set (`overwrite=True`)
writes the new shards beside the old ones, under names of their own, and the new manifest's
rename is the switch: a kill at any moment leaves the old set or the new one, complete; the
files of the other are removed by the next write into the directory.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence

import numpy as np
from tfmem._tf import tf

from tfmem.data import manifest as manifest_lib
from tfmem.data import masks as masks_lib
from tfmem.data import rle, sources
from tfmem.data.options import MAX_IMAGE_PIXELS
from tfmem.data.schema import DEFAULT_IGNORE_VALUE

SHARD_PATTERN = "shard-*.tfrecord"
SCHEMA = sources.SCHEMA
FEATURE_KEYS = ("channels", "height", "id", "image", "label", "width")
_ENCODINGS = ("png", "jpeg")

Progress = Callable[[int, int, "int | None"], None]


def _example(item: sources.Encoded) -> bytes:
    def int64(value):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    def bytes_(value):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    if item.mask is None:
        feature = {
            "image": bytes_(item.data),
            "label": int64(item.label),
            "height": int64(item.height),
            "width": int64(item.width),
            "channels": int64(item.channels),
            "id": bytes_(item.id.encode()),
        }
    else:
        feature = {
            "image/encoded": bytes_(item.data),
            "image/format": bytes_(item.encoding.encode()),
            "image/height": int64(item.height),
            "image/width": int64(item.width),
            "image/channels": int64(item.channels),
            "image/filename": bytes_(item.id.encode()),
            "image/segmentation/class/encoded": bytes_(item.mask),
            "image/segmentation/class/format": bytes_(b"png"),
        }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _source(source, *, class_names, encoding, shuffle, seed, skip_unreadable, skipped,
            allow_empty_classes, max_image_pixels, ignore_value, output_dir) -> sources.Source:
    """The `sources.Source` of what `write_image_tfrecords` was given."""
    def mask_format(multi_label=False):
        return masks_lib.MaskFormat(class_names, ignore_value, multi_label)

    paths = (str, os.PathLike)
    if isinstance(source, paths):
        _check_outside(os.fspath(source), output_dir)
        return sources.folder_source(os.fspath(source), skip_unreadable, shuffle, seed, skipped,
                                     allow_empty_classes, max_image_pixels)
    if isinstance(source, (tuple, list)) and len(source) == 2:
        first, second = source
        if isinstance(first, paths) and isinstance(second, paths):
            images, targets = os.fspath(first), os.fspath(second)
            _check_outside(images, output_dir)
            if tf.io.gfile.isdir(targets) or not tf.io.gfile.exists(targets):
                _check_outside(targets, output_dir)
                return masks_lib.folder_pair_source(
                    images, targets, mask_format(), skip_unreadable, shuffle, seed, skipped,
                    max_image_pixels)
            return rle.csv_source(images, targets, class_names, ignore_value, skip_unreadable,
                                  shuffle, seed, skipped, max_image_pixels)
        images, targets = np.asarray(first), np.asarray(second)
        if targets.ndim in (3, 4) and len(targets) == len(images):
            images = sources.checked_images(images)
            return masks_lib.numpy_source(images, targets, mask_format(targets.ndim == 4), encoding,
                                          shuffle, seed)
        return sources.numpy_source(images, targets, class_names, encoding, shuffle, seed)
    if isinstance(source, tf.data.Dataset):
        return sources.dataset_source(source, class_names, encoding, max_image_pixels,
                                      mask_format)
    raise TypeError(
        "`source` must be an image folder path, a pair (images, labels or masks) of numpy "
        "arrays, a pair of folders (images, masks) or (images folder, RLE CSV file), or a "
        f"tf.data.Dataset of (image, label); got {type(source).__name__}."
    )


# ---- the writer ---------------------------------------------------------------------------


class _ShardWriter:
    """Writes records into shards of about `max_bytes`, each renamed into place when full.

    Shard names carry a write id (`shard-<id>-00000.tfrecord`), so that a new set never
    takes the name of a shard of the set it replaces.
    """

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        taken = set(tf.io.gfile.listdir(directory))
        self.write_id = secrets.token_hex(3)
        while any(name.startswith(f"shard-{self.write_id}-") for name in taken):
            self.write_id = secrets.token_hex(3)
        self.shards: list[manifest_lib.Shard] = []
        self._writer, self._count, self._bytes = None, 0, 0

    def _names(self) -> tuple[str, str]:
        name = f"shard-{self.write_id}-{len(self.shards):05d}.tfrecord"
        temporary = f".{name}.tmp-{os.getpid()}"  # hidden, and no shard pattern matches it
        return os.path.join(self.directory, name), os.path.join(self.directory, temporary)

    def write(self, record: bytes) -> None:
        if self._writer is None:
            self._writer = tf.io.TFRecordWriter(self._names()[1])
        self._writer.write(record)
        self._count += 1
        self._bytes += len(record) + 16  # TFRecord framing: length, 2 CRCs
        if self._bytes >= self.max_bytes:
            self.finish_shard()

    def finish_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        final, temporary = self._names()
        tf.io.gfile.rename(temporary, final, overwrite=True)
        self.shards.append(manifest_lib.Shard(os.path.basename(final), self._count, self._bytes))
        self._writer, self._count, self._bytes = None, 0, 0

    def abort(self) -> None:
        """Removes what this write made (its open shard and its finished ones)."""
        if self._writer is not None:
            self._writer.close()
            tf.io.gfile.remove(self._names()[1])
            self._writer = None
        for shard in self.shards:
            tf.io.gfile.remove(os.path.join(self.directory, shard.name))


def _check_outside(root: str, output_dir: str) -> None:
    """The set is not written into the folder it is made from (the next write would read
    its shards and manifest as images)."""
    def resolved(path):
        return path.rstrip("/") if "://" in path else os.path.realpath(path)

    folder, output = resolved(root), resolved(output_dir)
    if output == folder or output.startswith(folder.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"`output_dir` {output_dir!r} is inside the image folder {root!r} (`--output` "
            "inside `--source`): its shards and manifest would be read as images by the "
            "next write. Write the set to a directory outside the folder")


def _check_directory(output_dir: str, overwrite: bool) -> None:
    tf.io.gfile.makedirs(output_dir)
    existing = tf.io.gfile.glob(os.path.join(output_dir, SHARD_PATTERN))
    if tf.io.gfile.exists(os.path.join(output_dir, manifest_lib.MANIFEST_NAME)):
        existing.append(os.path.join(output_dir, manifest_lib.MANIFEST_NAME))
    if existing and not overwrite:
        raise ValueError(
            f"{output_dir!r} already holds a TFRecord set ({len(existing)} files, e.g. "
            f"{os.path.basename(existing[0])!r}). Write into an empty directory, or pass "
            "overwrite=True (`--overwrite`) to replace it."
        )


def _remove_unlisted(output_dir: str, manifest: manifest_lib.Manifest) -> None:
    """Removes the shards `manifest` does not list: the replaced set's, and the leftovers of
    writes that were killed (hidden temporary shards, shards without a manifest)."""
    listed = {shard.name for shard in manifest.shards}
    leftovers = tf.io.gfile.glob(os.path.join(output_dir, SHARD_PATTERN))
    leftovers += tf.io.gfile.glob(os.path.join(output_dir, ".shard-*.tfrecord.tmp-*"))
    for path in leftovers:
        if os.path.basename(path) not in listed:
            tf.io.gfile.remove(path)


def write_image_tfrecords(
    source,
    output_dir: str | os.PathLike,
    *,
    shard_size_mb: float = 128,
    class_names: Sequence[str] | None = None,
    encoding: str = "png",
    shuffle: bool = True,
    seed: int = 0,
    skip_unreadable: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    allow_empty_classes: bool = False,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    origin: str = "",
    ignore_value: int | None = DEFAULT_IGNORE_VALUE,
) -> manifest_lib.Manifest:
    """Writes an image set (classification or segmentation) to TFRecords + `manifest.json`.

    Args:
        source: one of
            - a folder path laid out `root/<class_name>/<image>.{jpg,jpeg,png}` (classes are
              the sorted sub-folder names; files are stored as given, not re-encoded);
            - a pair `(images, labels)` of numpy arrays: uint8 `(N, H, W[, C])` and int `(N,)`;
            - a `tf.data.Dataset` (e.g. a tfds split with `as_supervised=True`) of
              `(image, label)` or `{"image", "label"}`: uint8 images, or encoded bytes;
            segmentation sets (the records then hold a PNG mask each, DeepLab's layout):
            - a pair `(images, masks)` of numpy arrays: masks integer `(N, H, W)` class
              indices, or `(N, H, W, C)` 0/1 channels, one per class (multi-label);
            - a pair of folders `(images_dir, masks_dir)`: `masks_dir/<stem>.png` for each
              `images_dir/<stem>.{jpg,png}`, grey PNGs of class indices or palette PNGs
              (their indices are the classes, as Pascal VOC's);
            - a pair `(images_dir, csv_file)`: Kaggle's run-length-encoded masks (see
              `tfmem.data.rle`);
            - a `tf.data.Dataset` of `(image, mask)`.
        output_dir: directory for the shards (`shard-<id>-00000.tfrecord`, ...) and manifest.
        shard_size_mb: a shard is closed once it holds this many megabytes (10**6 bytes);
            100-200 MB shards read efficiently from disk and cloud storage.
        class_names: class names for numpy/dataset sources and masks (labels and mask values
            index them). Default: `"0" .. "max label"` (the largest class in the masks).
        encoding: how uint8 arrays are stored: `"png"` (lossless) or `"jpeg"` (quality 95).
        shuffle: write folder and numpy sources in a random order (seeded by `seed`), so
            shards mix classes. Datasets are written in the order they yield.
        seed: seed of that order.
        skip_unreadable: skip (and list in `manifest.skipped`) folder files that are not
            readable JPEG/PNG images instead of raising.
        overwrite: replace a set already in `output_dir` instead of raising; the old set
            stays readable until the new one is complete.
        progress: called after each example with `(examples_written, bytes_written, total)`;
            `total` is None when the source's size is unknown.
        allow_empty_classes: keep a class folder without images as a class (with a warning
            naming it) instead of raising; its label stays, so the others' do too.
        max_image_pixels: the most pixels (height × width, from the header, before decoding)
            a folder or encoded image may have; a larger one is unreadable (raised, or skipped
            with `skip_unreadable`).
        origin: what made the records, recorded as the manifest's `origin` (a writer that
            makes the same records again from it can reuse the set instead).
        ignore_value: segmentation: the mask value of pixels without a class (DeepLab's
            255), recorded in the manifest; None when every pixel has a class.

    Returns:
        The `Manifest` written beside the shards.

    Raises:
        ValueError: missing or empty folder, a class folder without images (unless
            `allow_empty_classes`), `output_dir` inside the folder, unreadable image (unless
            `skip_unreadable`; a FIFO, device or broken link is never opened), labels out of
            range or lengths that differ (numpy and folders: before anything is written);
            an image without its mask or a mask without its image (before anything is
            written), a mask of another size than its image, a mask value outside the
            classes and the ignore value: each names the file.

    Example:
        >>> manifest = tfmem.write_image_tfrecords("photos/", "/data/photos-tfrecords")
        ...                                                                # doctest: +SKIP
        >>> manifest.num_examples, manifest.class_names                    # doctest: +SKIP
        (3670, ('daisy', 'dandelion', 'roses', 'sunflowers', 'tulips'))
    """
    if encoding not in _ENCODINGS:
        raise ValueError(f"`encoding` must be one of {_ENCODINGS}, got {encoding!r}.")
    if not shard_size_mb > 0:
        raise ValueError(f"`shard_size_mb` must be positive, got {shard_size_mb}.")
    output_dir = os.fspath(output_dir)
    skipped: list[str] = []
    if isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int) or (
            max_image_pixels < 1):
        raise ValueError(f"`max_image_pixels` must be a positive int, got {max_image_pixels!r}.")
    if ignore_value is not None and (isinstance(ignore_value, bool) or not isinstance(
            ignore_value, int) or not 0 <= ignore_value <= masks_lib.MAX_VALUE):
        raise ValueError(f"`ignore_value` must be a mask value in [0, {masks_lib.MAX_VALUE}] "
                         f"or None, got {ignore_value!r}.")
    names, total, items, schema = _source(
        source, class_names=class_names, encoding=encoding, shuffle=shuffle, seed=seed,
        skip_unreadable=skip_unreadable, skipped=skipped,
        allow_empty_classes=allow_empty_classes, max_image_pixels=max_image_pixels,
        ignore_value=ignore_value, output_dir=output_dir)
    _check_directory(output_dir, overwrite)
    writer = _ShardWriter(output_dir, int(shard_size_mb * 10**6))
    num_examples, num_bytes, max_label, encodings, sizes = 0, 0, -1, set(), set()
    try:
        for item in items:
            record = _example(item)
            writer.write(record)
            num_examples += 1
            num_bytes += len(record) + 16
            max_label, encodings = max(max_label, item.label), encodings | {item.encoding}
            if len(sizes) < 2:  # one size, or "they differ"
                sizes.add((item.height, item.width))
            if progress is not None:
                progress(num_examples, num_bytes, total)
        if schema.mask_key is not None and names is None and max_label < 1:
            raise ValueError(
                f"The {num_examples} masks hold no class but 0 (background), besides the "
                f"ignore value {schema.ignore_value}: there is nothing to segment. Masks of "
                "two classes stored as 0 and 255 need 0 and 1 (or ignore_value=None, "
                "`--ignore-value none`, and class_names for 256 classes); pass class_names "
                "(`--class-names`) if class 0 alone is meant")
        writer.finish_shard()
    except BaseException:  # includes KeyboardInterrupt: leave the directory as it was
        writer.abort()
        raise
    if names is None:  # no class names given: as many as the labels (mask values) need
        names = [str(i) for i in range(max_label + 1)]
    result = manifest_lib.Manifest(
        directory=output_dir,
        num_examples=num_examples,
        class_names=tuple(names),
        shards=tuple(writer.shards),
        schema=schema,
        image_formats=tuple(sorted(encodings)),
        skipped=tuple(skipped),
        origin=origin,
        image_size=sizes.pop() if len(sizes) == 1 else None,
    )
    manifest_lib.write_manifest(result)  # the switch from the old set (if any) to this one
    _remove_unlisted(output_dir, result)
    return result
