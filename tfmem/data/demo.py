"""The embedded demo data: a procedurally generated, learnable image-classification set.

Four classes of filled shapes (disk, square, triangle, plus) drawn at a random position, size
and colour on a noisy background of another random colour. Every pixel follows from the seed,
so the set is the same on every machine, and a tiny CNN tells the shapes apart after one short
epoch, which makes it a quick end-to-end check that data, model and training all work. The
segmentation variant holds the same pictures with the shape drawn as a mask: its class
(1 + the shape's index) on its pixels, 0 (background) elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from tfmem._tf import tf

from tfmem.data import manifest as manifest_lib
from tfmem.data import tfrecords

CLASS_NAMES = ("disk", "square", "triangle", "plus")
SEGMENTATION_CLASS_NAMES = ("background", *CLASS_NAMES)
TASKS = ("classification", "segmentation")


def _mask(shape: str, size: tuple[int, int], cy: float, cx: float, radius: float
          ) -> np.ndarray:
    y, x = np.mgrid[0:size[0], 0:size[1]].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    if shape == "disk":
        return dy**2 + dx**2 <= radius**2
    if shape == "square":
        return (np.abs(dy) <= 0.8 * radius) & (np.abs(dx) <= 0.8 * radius)
    if shape == "triangle":  # apex up: width grows linearly from the top
        return (np.abs(dy) <= radius) & (np.abs(dx) <= 0.6 * (dy + radius))
    bar = 0.3 * radius  # plus: two bars crossing at the centre
    return ((np.abs(dy) <= bar) & (np.abs(dx) <= radius)) | (
        (np.abs(dx) <= bar) & (np.abs(dy) <= radius))


def _size(image_size: int | tuple[int, int]) -> tuple[int, int]:
    """`(height, width)` of an int (square) or a pair."""
    if isinstance(image_size, (tuple, list)) and len(image_size) == 2:
        return int(image_size[0]), int(image_size[1])
    return int(image_size), int(image_size)


def demo_examples(num_examples: int, image_size: int | tuple[int, int], seed: int = 0,
                  task: str = "classification") -> Iterator[tuple[np.ndarray, int | np.ndarray]]:
    """Yields `(uint8 image (height, width, 3), label)` pairs, the same ones for the same seed;
    with `task="segmentation"`, `(image, uint8 mask (height, width))`: the same images, the
    shape's pixels holding its class in `SEGMENTATION_CLASS_NAMES`, the others 0.

    Example:
        >>> image, label = next(tfmem.demo_examples(1, image_size=32))
        >>> image.shape, tfmem.DEMO_CLASS_NAMES[label]
        ((32, 32, 3), 'disk')
    """
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}.")
    height, width = _size(image_size)
    rng = np.random.default_rng(seed)
    for index in range(num_examples):
        label = index % len(CLASS_NAMES)  # balanced classes; the writer's order mixes them
        radius = rng.uniform(0.18, 0.32) * min(height, width)
        cy, cx = rng.uniform(radius, np.array([height, width]) - radius, size=2)
        # Random colours, but the shape is always the brighter one: a tiny model then learns
        # the shapes in one epoch instead of first having to learn both contrast polarities.
        background = rng.uniform(0, 100, size=3)
        foreground = rng.uniform(150, 255, size=3)
        mask = _mask(CLASS_NAMES[label], (height, width), cy, cx, radius)
        image = np.where(mask[..., None], foreground, background)
        image = image + rng.normal(0, 20, size=image.shape)
        image = np.clip(image, 0, 255).astype(np.uint8)
        if task == "segmentation":
            yield image, (mask * (label + 1)).astype(np.uint8)
        else:
            yield image, label


def make_demo_dataset(
    output_dir: str | os.PathLike,
    *,
    num_examples: int = 2048,
    image_size: int | tuple[int, int] = 32,
    seed: int = 0,
    shard_size_mb: float = 1,
    overwrite: bool = False,
    progress: tfrecords.Progress | None = None,
    task: str = "classification",
) -> manifest_lib.Manifest:
    """Writes the demo set (PNG TFRecords + manifest) to `output_dir`.

    Args:
        output_dir: where the shards and `manifest.json` go.
        num_examples: number of images (balanced over the four classes).
        image_size: height and width of the images: an int (square) or `(height, width)`.
        seed: the same seed gives the same pixels; use another seed for a held-out set.
        shard_size_mb: shard size; small by default so that even the demo has several
            shards, as real sets do.
        overwrite: replace a set already in `output_dir`. Without it, a demo set already
            there with the same `num_examples`, `image_size`, `seed` and `task` (its
            manifest's `origin`) is reused as it is, and any other set raises `ValueError`.
        progress: called after each example, as in `write_image_tfrecords`.
        task: `"classification"` (a label per image) or `"segmentation"` (a mask per image:
            the shape's class, 1..4, on its pixels, 0 elsewhere; classes
            `SEGMENTATION_CLASS_NAMES`).

    Returns:
        The `Manifest` of the written (or reused) set.

    Example:
        >>> manifest = tfmem.make_demo_dataset("/tmp/demo/train", num_examples=2048)
        ...                                                              # doctest: +SKIP
        >>> manifest.class_names                                         # doctest: +SKIP
        ('disk', 'square', 'triangle', 'plus')
    """
    height, width = _size(image_size)
    if num_examples < 1 or min(height, width) < 8:
        raise ValueError(
            f"The demo set needs num_examples >= 1 and image_size >= 8 (shapes need a few "
            f"pixels), got num_examples={num_examples}, image_size={image_size}."
        )
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}.")
    segmentation = task == "segmentation"
    size = height if height == width else (height, width)
    origin = (f"tfmem.make_demo_dataset(num_examples={num_examples}, image_size={size}, "
              f"seed={seed}{', task=' + repr(task) if segmentation else ''})")
    if not overwrite and manifest_lib.has_manifest(os.fspath(output_dir)):
        try:
            existing = manifest_lib.read_manifest(output_dir)
        except ValueError:  # damaged: the writer's own check below says what to do
            existing = None
        if existing is not None and existing.origin == origin:
            return existing  # the same seed draws the same pixels: nothing to write

    def chunks(size: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # A few hundred images per trip from Python into tf.data, not one: an element of
        # `from_generator` costs about as much as drawing a 32-pixel image.
        images, targets = [], []
        for image, target in demo_examples(num_examples, (height, width), seed, task):
            images.append(image)
            targets.append(target)
            if len(images) == size:
                yield np.stack(images), np.array(targets, target_spec.dtype.as_numpy_dtype)
                images, targets = [], []
        if images:
            yield np.stack(images), np.array(targets, target_spec.dtype.as_numpy_dtype)

    target_spec = (tf.TensorSpec((None, height, width), tf.uint8) if segmentation
                   else tf.TensorSpec((None,), tf.int64))
    examples = tf.data.Dataset.from_generator(
        chunks,
        output_signature=(tf.TensorSpec((None, height, width, 3), tf.uint8), target_spec),
    ).unbatch().apply(tf.data.experimental.assert_cardinality(num_examples))
    return tfrecords.write_image_tfrecords(
        examples, output_dir, shard_size_mb=shard_size_mb,
        class_names=SEGMENTATION_CLASS_NAMES if segmentation else CLASS_NAMES,
        overwrite=overwrite, progress=progress, origin=origin)
