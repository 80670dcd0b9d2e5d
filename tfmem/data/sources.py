"""What `write_image_tfrecords` writes from: each source yields `Encoded` examples.

A source is an image folder (`root/<class_name>/<image>`), numpy arrays or a `tf.data.Dataset`
(`masks` adds the segmentation sources: arrays and folder pairs; `rle` Kaggle's CSV masks).
Each gives `Source(class_names, total, items, schema)`: class names when known before the
examples are read, their number when known, the iterator of examples and the record layout.
"""

from __future__ import annotations

import os
import random
import stat
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
from tfmem._tf import tf

from tfmem.data.schema import Schema, image_format

# The layout of tfmem's classification records (the reader recognises it to catch sets
# without a manifest), and of its segmentation records: DeepLab's and the Model Garden's keys.
SCHEMA = Schema(image_key="image", label_key="label", id_key="id")
SEGMENTATION_SCHEMA = Schema(image_key="image/encoded", label_key=None, id_key="image/filename",
                             mask_key="image/segmentation/class/encoded")
FOLDER_FORMATS = ("jpeg", "png")


class Encoded(NamedTuple):
    """One example, encoded; `label` of a mask is its largest class (-1: none)."""

    data: bytes
    label: int
    height: int
    width: int
    channels: int
    encoding: str
    id: str
    mask: bytes | None = None


class Source(NamedTuple):
    class_names: Sequence[str] | None  # None: "0" .. the largest label written
    total: int | None
    items: Iterator[Encoded]
    schema: Schema = SCHEMA


def encoded_shape(data: bytes, encoding: str) -> tuple[int, int, int]:
    """(height, width, channels) from the header, without decoding the pixels."""
    if encoding == "png":  # IHDR: width, height (big-endian uint32), bit depth, colour type
        width, height, _, colour = struct.unpack(">IIBB", data[16:26])
        return height, width, {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}[colour]
    height, width, channels = tf.image.extract_jpeg_shape(data).numpy().tolist()
    return height, width, channels


def folder_source(root: str, skip_unreadable: bool, shuffle: bool, seed: int, skipped: list,
                  allow_empty_classes: bool, max_image_pixels: int) -> Source:
    if not tf.io.gfile.isdir(root):
        raise ValueError(
            f"Image folder {root!r} does not exist or is not a directory: expected "
            "root/<class_name>/<image>.{jpg,jpeg,png}."
        )
    class_names = sorted(
        name.rstrip("/") for name in tf.io.gfile.listdir(root)
        if not name.startswith(".") and tf.io.gfile.isdir(os.path.join(root, name))
    )
    files = []
    for label, name in enumerate(class_names):
        for directory, _, names in tf.io.gfile.walk(os.path.join(root, name)):
            for path in (os.path.join(directory, f) for f in sorted(names)
                         if not f.startswith(".")):
                reason = not_a_file(path)
                if reason is None:
                    files.append((path, label))
                else:  # told before anything is written; opening a FIFO would wait forever
                    unreadable(path, root, reason, skip_unreadable, skipped)
    if not files:
        raise ValueError(
            f"Found no images in {root!r} (class folders: {class_names or 'none'}): expected "
            "root/<class_name>/<image>.{jpg,jpeg,png}, one sub-folder per class."
        )
    check_empty_classes(root, class_names, {label for _, label in files}, allow_empty_classes)
    # Folders list one class after another; shuffled once here so that every shard (and so
    # every window of the reader's shuffle buffer) holds a mix of classes.
    if shuffle:
        random.Random(seed).shuffle(files)

    def items():
        for path, label in files:
            read = read_image(path, root, skip_unreadable, skipped, max_image_pixels)
            if read is not None:
                data, encoding, shape = read
                yield Encoded(data, label, *shape, encoding, os.path.relpath(path, root))

    return Source(class_names, len(files), items())


def read_image(path: str, root: str, skip_unreadable: bool, skipped: list,
               max_image_pixels: int) -> tuple[bytes, str, tuple[int, int, int]] | None:
    """`(bytes, encoding, (height, width, channels))` of an image file; None when it is
    unreadable and `skip_unreadable` (then listed in `skipped`)."""
    try:
        data = tf.io.gfile.GFile(path, "rb").read()
        encoding = image_format(data)
        if encoding not in FOLDER_FORMATS:
            raise ValueError(f"not a JPEG or PNG file (starts with {data[:8]!r})")
        check_pixels(encoded_shape(data, encoding), max_image_pixels)
        # Decoded in full (not only the header) so that a damaged file fails here,
        # naming itself, instead of in the middle of someone's training run.
        shape = tf.io.decode_image(data, expand_animations=False).shape
    except (ValueError, OSError, tf.errors.OpError) as error:
        unreadable(path, root, getattr(error, "message", str(error)), skip_unreadable, skipped)
        return None
    return data, encoding, tuple(shape)


def not_a_file(path: str) -> str | None:
    """Why `path` is no image file to open (a FIFO, a device, a broken link), or None."""
    if "://" in path:  # object stores hold files only
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        link = " (a symbolic link to nothing)" if os.path.islink(path) else ""
        return f"it cannot be opened{link}: {error.strerror}"
    if not stat.S_ISREG(mode):
        return "not a regular file (a FIFO, socket or device): it was not opened"
    return None


def unreadable(path: str, root: str, reason: str, skip_unreadable: bool, skipped: list) -> None:
    """Skips `path` (counted) with `skip_unreadable`, else raises naming it."""
    if skip_unreadable:
        skipped.append(os.path.relpath(path, root))
        return
    raise ValueError(
        f"Cannot read image {path!r}: {reason}. Remove or fix the file, or pass "
        "skip_unreadable=True (`--skip_unreadable`) to skip and count such files."
    )


def check_pixels(shape: tuple[int, int, int], max_image_pixels: int) -> None:
    height, width = shape[:2]
    if height * width > max_image_pixels:
        raise ValueError(
            f"its header says {width}×{height} = {height * width:,} pixels, above the limit of "
            f"{max_image_pixels:,} (max_image_pixels, `--max-image-pixels`); it was not "
            "decoded. Raise the limit if such images are meant")


def check_empty_classes(root: str, class_names: Sequence[str], used: set[int],
                         allow_empty_classes: bool) -> None:
    """A class folder without images keeps its label (the others' stay as sorted), but is
    refused unless allowed, and then said."""
    empty = [name for label, name in enumerate(class_names) if label not in used]
    if not empty:
        return
    said = (f"{len(empty)} class folder(s) of {root!r} hold no images: "
            f"{', '.join(repr(name) for name in empty[:10])}")
    if not allow_empty_classes:
        raise ValueError(
            f"{said}; each would be a class without examples. Add images to it, remove it, "
            "or pass allow_empty_classes=True (`--allow-empty-classes`) to keep it as a class")
    warnings.warn(f"{said}; kept as classes without examples (allow_empty_classes)",
                  stacklevel=3)


def check_labels(labels: np.ndarray, class_names: Sequence[str] | None) -> list[str]:
    if labels.size and (labels.min() < 0):
        raise ValueError(f"Labels must be class indices >= 0; found {labels.min()}.")
    if class_names is None:
        return [str(i) for i in range(int(labels.max()) + 1 if labels.size else 0)]
    if labels.size and labels.max() >= len(class_names):
        bad = np.flatnonzero(labels >= len(class_names))
        raise ValueError(
            f"Label {labels[bad[0]]} (at index {bad[0]}; {len(bad)} such labels) is out of range "
            f"for {len(class_names)} class names {list(class_names)[:10]}: labels must lie in "
            f"[0, {len(class_names) - 1}]. Pass the full class list or fix the labels."
        )
    return list(class_names)


def checked_images(images: np.ndarray) -> np.ndarray:
    """`images` as uint8 `(N, H, W, C)`, C in 1, 3, 4; raises saying what it got."""
    if images.ndim not in (3, 4) or images.dtype != np.uint8:
        raise ValueError(
            f"Images must be a uint8 array of shape (N, H, W) or (N, H, W, C); got {images.dtype} "
            f"{images.shape}. Convert with e.g. `np.clip(x * 255, 0, 255).astype(np.uint8)`."
        )
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[-1] not in (1, 3, 4):
        raise ValueError(f"Images need 1, 3 or 4 channels; got shape {images.shape}.")
    return images


def numpy_source(images, labels, class_names, encoding, shuffle, seed) -> Source:
    images, labels = np.asarray(images), np.asarray(labels)
    if len(images) != len(labels):
        raise ValueError(
            f"Got {len(images)} images but {len(labels)} labels; expected one label per image "
            "(or one mask: integer (N, H, W) class indices)."
        )
    images = checked_images(images)
    if not np.issubdtype(labels.dtype, np.integer) or labels.ndim != 1:
        raise ValueError(f"Labels must be a 1-D integer array; got {labels.dtype} {labels.shape}.")
    class_names = check_labels(labels, class_names)
    order = np.arange(len(images))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(images))

    def items():
        encode = tf.io.encode_png if encoding == "png" else (
            lambda x: tf.io.encode_jpeg(x, quality=95))
        for index in order:
            image = images[index]
            yield Encoded(encode(image).numpy(), int(labels[index]), *image.shape, encoding,
                          str(index))

    return Source(class_names, len(images), items())


def dataset_source(dataset: tf.data.Dataset, class_names, encoding, max_image_pixels: int,
                   mask_format: Callable | None = None) -> Source:
    """`(image, label)` elements, or `(image, mask)` (a mask has 2 or 3 dimensions; then
    `mask_format(multi_label)` gives its `masks.MaskFormat`)."""
    cardinality = int(dataset.cardinality())
    total = cardinality if cardinality >= 0 else None
    names = list(class_names) if class_names is not None else None
    if isinstance(dataset.element_spec, dict):  # tfds without as_supervised
        dataset = dataset.map(lambda element: (element["image"], element["label"]))
    image_spec, target_spec = dataset.element_spec
    encoded = image_spec.dtype == tf.string  # e.g. tfds with decoders=SkipDecoding()
    masks = None
    if target_spec.shape.rank in (2, 3):
        if encoded:
            raise ValueError("A dataset of (image, mask) needs uint8 image arrays, not encoded "
                             f"bytes; got {image_spec}.")
        masks = mask_format(target_spec.shape.rank == 3)
    if not encoded:
        if image_spec.dtype != tf.uint8 or image_spec.shape.rank not in (2, 3):
            raise ValueError(
                f"Dataset images must be uint8 (H, W[, C]) arrays or encoded bytes; got "
                f"{image_spec}. Cast with `tf.image.convert_image_dtype(image, tf.uint8)`."
            )

        def encode(image, target):
            image = image if image.shape.rank == 3 else image[..., None]
            data = (tf.io.encode_png(image) if encoding == "png"
                    else tf.io.encode_jpeg(image, quality=95))
            return data, tf.shape(image), target

        # Encoded inside tf.data, in parallel, rather than one eager call per image.
        dataset = dataset.map(encode, num_parallel_calls=tf.data.AUTOTUNE)

    def items():
        for index, element in enumerate(dataset.as_numpy_iterator()):
            data, mask = element[0], None
            if masks is not None:
                mask = element[-1]
                if mask.shape[:2] != tuple(element[1][:2]):
                    raise ValueError(f"The mask of example {index} is {mask.shape[:2]}, its "
                                     f"image {tuple(element[1][:2])}: a mask needs its "
                                     "image's height and width.")
                label = masks.check(mask, f"the mask of example {index}")
                mask = masks.encode(mask)
            else:
                label = int(element[-1])
            if masks is None and (label < 0 or (names is not None and label >= len(names))):
                raise ValueError(
                    f"Label {label} of example {index} is out of range for "
                    f"{len(names) if names else 0} class names; labels must lie in "
                    "[0, num_classes - 1]. Pass the full `class_names`."
                )
            kind = image_format(data) if encoded else encoding
            if kind not in FOLDER_FORMATS:
                raise ValueError(f"Example {index}: its bytes are not a JPEG or PNG image.")
            shape = encoded_shape(data, kind) if encoded else tuple(element[1].tolist())
            try:
                check_pixels(shape, max_image_pixels)
            except ValueError as error:
                raise ValueError(f"Example {index}: {error}.") from None
            yield Encoded(data, label, *shape, kind, str(index), mask)

    return Source(names, total, items(), SCHEMA if masks is None else masks.schema)
