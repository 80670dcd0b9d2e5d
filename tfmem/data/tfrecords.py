"""Writing image-classification sets to sharded TFRecord files (`write_image_tfrecords`).

Each record is a `tf.train.Example` with the encoded image (`image`: JPEG/PNG bytes), its
`label`, `height`, `width`, `channels` and an `id`. Shards are written streaming, one example
at a time, each under a temporary hidden name that is renamed when the shard is complete; the
`manifest.json` is written last, in one rename, and it alone says which shards form the set.
So a directory with a manifest is a complete set, and an interrupted run never leaves a
half-written file under a shard's name. Replacing a set (`overwrite=True`) writes the new
shards beside the old ones, under names of their own, and the new manifest's rename is the
switch: a kill at any moment leaves the old set or the new one, complete; the files of the
other are removed by the next write into the directory.
"""

from __future__ import annotations

import os
import random
import secrets
import stat
import struct
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from tfmem._tf import tf

from tfmem.data import manifest as manifest_lib
from tfmem.data.options import MAX_IMAGE_PIXELS
from tfmem.data.schema import Schema, image_format

SHARD_PATTERN = "shard-*.tfrecord"
# The layout of our own records; the reader recognises it to catch sets without a manifest.
SCHEMA = Schema(image_key="image", label_key="label", id_key="id")
FEATURE_KEYS = ("channels", "height", "id", "image", "label", "width")
_FOLDER_FORMATS = ("jpeg", "png")
_ENCODINGS = ("png", "jpeg")

Progress = Callable[[int, int, "int | None"], None]


class _Encoded(NamedTuple):
    data: bytes
    label: int
    height: int
    width: int
    channels: int
    encoding: str
    id: str


def _example(item: _Encoded) -> bytes:
    def int64(value):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    def bytes_(value):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    feature = {
        "image": bytes_(item.data),
        "label": int64(item.label),
        "height": int64(item.height),
        "width": int64(item.width),
        "channels": int64(item.channels),
        "id": bytes_(item.id.encode()),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _encoded_shape(data: bytes, encoding: str) -> tuple[int, int, int]:
    """(height, width, channels) from the header, without decoding the pixels."""
    if encoding == "png":  # IHDR: width, height (big-endian uint32), bit depth, colour type
        width, height, _, colour = struct.unpack(">IIBB", data[16:26])
        return height, width, {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}[colour]
    height, width, channels = tf.image.extract_jpeg_shape(data).numpy().tolist()
    return height, width, channels


# ---- sources: each yields _Encoded items and knows its class names -----------------------


def _folder_source(root: str, skip_unreadable: bool, shuffle: bool, seed: int, skipped: list,
                   allow_empty_classes: bool, max_image_pixels: int):
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
                reason = _not_a_file(path)
                if reason is None:
                    files.append((path, label))
                else:  # told before anything is written; opening a FIFO would wait forever
                    _unreadable(path, root, reason, skip_unreadable, skipped)
    if not files:
        raise ValueError(
            f"Found no images in {root!r} (class folders: {class_names or 'none'}): expected "
            "root/<class_name>/<image>.{jpg,jpeg,png}, one sub-folder per class."
        )
    _check_empty_classes(root, class_names, {label for _, label in files}, allow_empty_classes)
    # Folders list one class after another; shuffled once here so that every shard (and so
    # every window of the reader's shuffle buffer) holds a mix of classes.
    if shuffle:
        random.Random(seed).shuffle(files)

    def items():
        for path, label in files:
            try:
                data = tf.io.gfile.GFile(path, "rb").read()
                encoding = image_format(data)
                if encoding not in _FOLDER_FORMATS:
                    raise ValueError(f"not a JPEG or PNG file (starts with {data[:8]!r})")
                _check_pixels(_encoded_shape(data, encoding), max_image_pixels)
                # Decoded in full (not only the header) so that a damaged file fails here,
                # naming itself, instead of in the middle of someone's training run.
                shape = tf.io.decode_image(data, expand_animations=False).shape
            except (ValueError, OSError, tf.errors.OpError) as error:
                _unreadable(path, root, getattr(error, "message", str(error)), skip_unreadable,
                            skipped)
                continue
            yield _Encoded(data, label, shape[0], shape[1], shape[2], encoding,
                           os.path.relpath(path, root))

    return class_names, len(files), items()


def _not_a_file(path: str) -> str | None:
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


def _unreadable(path: str, root: str, reason: str, skip_unreadable: bool, skipped: list) -> None:
    """Skips `path` (counted) with `skip_unreadable`, else raises naming it."""
    if skip_unreadable:
        skipped.append(os.path.relpath(path, root))
        return
    raise ValueError(
        f"Cannot read image {path!r}: {reason}. Remove or fix the file, or pass "
        "skip_unreadable=True (`--skip_unreadable`) to skip and count such files."
    )


def _check_pixels(shape: tuple[int, int, int], max_image_pixels: int) -> None:
    height, width = shape[:2]
    if height * width > max_image_pixels:
        raise ValueError(
            f"its header says {width}×{height} = {height * width:,} pixels, above the limit of "
            f"{max_image_pixels:,} (max_image_pixels, `--max-image-pixels`); it was not "
            "decoded. Raise the limit if such images are meant")


def _check_empty_classes(root: str, class_names: Sequence[str], used: set[int],
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


def _check_labels(labels: np.ndarray, class_names: Sequence[str] | None) -> list[str]:
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


def _numpy_source(images, labels, class_names, encoding, shuffle, seed):
    images, labels = np.asarray(images), np.asarray(labels)
    if len(images) != len(labels):
        raise ValueError(
            f"Got {len(images)} images but {len(labels)} labels; expected one label per image."
        )
    if images.ndim not in (3, 4) or images.dtype != np.uint8:
        raise ValueError(
            f"Images must be a uint8 array of shape (N, H, W) or (N, H, W, C); got {images.dtype} "
            f"{images.shape}. Convert with e.g. `np.clip(x * 255, 0, 255).astype(np.uint8)`."
        )
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[-1] not in (1, 3, 4):
        raise ValueError(f"Images need 1, 3 or 4 channels; got shape {images.shape}.")
    if not np.issubdtype(labels.dtype, np.integer) or labels.ndim != 1:
        raise ValueError(f"Labels must be a 1-D integer array; got {labels.dtype} {labels.shape}.")
    class_names = _check_labels(labels, class_names)
    order = np.arange(len(images))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(images))

    def items():
        encode = tf.io.encode_png if encoding == "png" else (
            lambda x: tf.io.encode_jpeg(x, quality=95))
        for index in order:
            image = images[index]
            yield _Encoded(encode(image).numpy(), int(labels[index]), *image.shape, encoding,
                           str(index))

    return class_names, len(images), items()


def _dataset_source(dataset: tf.data.Dataset, class_names, encoding, max_image_pixels: int):
    cardinality = int(dataset.cardinality())
    total = cardinality if cardinality >= 0 else None
    names = list(class_names) if class_names is not None else None
    if isinstance(dataset.element_spec, dict):  # tfds without as_supervised
        dataset = dataset.map(lambda element: (element["image"], element["label"]))
    image_spec = dataset.element_spec[0]
    encoded = image_spec.dtype == tf.string  # e.g. tfds with decoders=SkipDecoding()
    if not encoded:
        if image_spec.dtype != tf.uint8 or image_spec.shape.rank not in (2, 3):
            raise ValueError(
                f"Dataset images must be uint8 (H, W[, C]) arrays or encoded bytes; got "
                f"{image_spec}. Cast with `tf.image.convert_image_dtype(image, tf.uint8)`."
            )

        def encode(image, label):
            image = image if image.shape.rank == 3 else image[..., None]
            data = (tf.io.encode_png(image) if encoding == "png"
                    else tf.io.encode_jpeg(image, quality=95))
            return data, tf.shape(image), label

        # Encoded inside tf.data, in parallel, rather than one eager call per image.
        dataset = dataset.map(encode, num_parallel_calls=tf.data.AUTOTUNE)

    def items():
        for index, element in enumerate(dataset.as_numpy_iterator()):
            data, label = element[0], int(element[-1])
            if label < 0 or (names is not None and label >= len(names)):
                raise ValueError(
                    f"Label {label} of example {index} is out of range for "
                    f"{len(names) if names else 0} class names; labels must lie in "
                    "[0, num_classes - 1]. Pass the full `class_names`."
                )
            kind = image_format(data) if encoded else encoding
            if kind not in _FOLDER_FORMATS:
                raise ValueError(f"Example {index}: its bytes are not a JPEG or PNG image.")
            shape = _encoded_shape(data, kind) if encoded else tuple(element[1].tolist())
            try:
                _check_pixels(shape, max_image_pixels)
            except ValueError as error:
                raise ValueError(f"Example {index}: {error}.") from None
            yield _Encoded(data, label, *shape, kind, str(index))

    return names, total, items()


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
) -> manifest_lib.Manifest:
    """Writes an image-classification set to sharded TFRecords plus a `manifest.json`.

    Args:
        source: one of
            - a folder path laid out `root/<class_name>/<image>.{jpg,jpeg,png}` (classes are
              the sorted sub-folder names; files are stored as given, not re-encoded);
            - a pair `(images, labels)` of numpy arrays: uint8 `(N, H, W[, C])` and int `(N,)`;
            - a `tf.data.Dataset` (e.g. a tfds split with `as_supervised=True`) of
              `(image, label)` or `{"image", "label"}`: uint8 images, or encoded bytes.
        output_dir: directory for the shards (`shard-<id>-00000.tfrecord`, ...) and manifest.
        shard_size_mb: a shard is closed once it holds this many megabytes (10**6 bytes);
            100-200 MB shards read efficiently from disk and cloud storage.
        class_names: class names for numpy/dataset sources (labels index them). Default:
            `"0" .. "max label"`.
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

    Returns:
        The `Manifest` written beside the shards.

    Raises:
        ValueError: missing or empty folder, a class folder without images (unless
            `allow_empty_classes`), `output_dir` inside the folder, unreadable image (unless
            `skip_unreadable`; a FIFO, device or broken link is never opened), labels out of
            range or lengths that differ (numpy and folders: before anything is written).

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
    if isinstance(source, (str, os.PathLike)):
        _check_outside(os.fspath(source), output_dir)
        names, total, items = _folder_source(os.fspath(source), skip_unreadable, shuffle, seed,
                                             skipped, allow_empty_classes, max_image_pixels)
    elif isinstance(source, (tuple, list)) and len(source) == 2:
        names, total, items = _numpy_source(*source, class_names, encoding, shuffle, seed)
    elif isinstance(source, tf.data.Dataset):
        names, total, items = _dataset_source(source, class_names, encoding, max_image_pixels)
    else:
        raise TypeError(
            "`source` must be an image folder path, a pair (images, labels) of numpy arrays "
            f"or a tf.data.Dataset of (image, label); got {type(source).__name__}."
        )
    _check_directory(output_dir, overwrite)
    writer = _ShardWriter(output_dir, int(shard_size_mb * 10**6))
    num_examples, num_bytes, max_label, encodings = 0, 0, -1, set()
    try:
        for item in items:
            record = _example(item)
            writer.write(record)
            num_examples += 1
            num_bytes += len(record) + 16
            max_label, encodings = max(max_label, item.label), encodings | {item.encoding}
            if progress is not None:
                progress(num_examples, num_bytes, total)
        writer.finish_shard()
    except BaseException:  # includes KeyboardInterrupt: leave the directory as it was
        writer.abort()
        raise
    if names is None:  # a dataset source without class names: as many as the labels need
        names = [str(i) for i in range(max_label + 1)]
    result = manifest_lib.Manifest(
        directory=output_dir,
        num_examples=num_examples,
        class_names=tuple(names),
        shards=tuple(writer.shards),
        schema=SCHEMA,
        image_formats=tuple(sorted(encodings)),
        skipped=tuple(skipped),
        origin=origin,
    )
    manifest_lib.write_manifest(result)  # the switch from the old set (if any) to this one
    _remove_unlisted(output_dir, result)
    return result
