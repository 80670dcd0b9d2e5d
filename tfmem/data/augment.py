"""What a decoded batch goes through before it is returned (`batch_transform`).

Classification: random left-right flips when training with `augment`. Segmentation: with
`augment`, each image and its mask get the same random scale, crop and flip (one box per
example, sampled by `tf.image.crop_and_resize`: bilinear for the image, nearest-neighbour for
the mask, so a mask only ever holds values it had, plus the ignore value where the box leaves
the image); then masks become int32, a multi-label mask's bits its channels.
"""

from __future__ import annotations

from collections.abc import Callable

from tfmem._tf import tf

from tfmem.data.options import ReaderOptions
from tfmem.data.schema import Schema

# Random zoom of the segmentation augmentation: < 1 shows more than the image (the rest
# filled with 0 in the image and the ignore value in the mask), > 1 a part of it.
SCALE_RANGE = (0.5, 2.0)


def batch_transform(schema: Schema, options: ReaderOptions,
                    num_classes: int | None) -> Callable | None:
    """The function mapped over decoded batches, or None when they stay as they are."""
    augment = options.training and options.augment
    if schema.mask_key is None:
        if not augment:
            return None
        return lambda images, *rest: (
            tf.image.random_flip_left_right(images, options.seed), *rest)
    if schema.multi_label and num_classes is None:
        raise ValueError("Multi-label masks need their number of classes (their channels): "
                         "pass num_classes (`--num-classes`) or the Schema's class_names.")
    # Pixels outside the image: ignored when there is an ignore value, else no class.
    fill = schema.ignore_value if schema.ignore_value is not None else 0

    def transform(images, masks):
        if augment:
            images, masks = jointly_augmented(images, masks, options.image_size, fill,
                                              options.seed)
        masks = tf.cast(masks, tf.int32)
        if schema.multi_label:
            masks = tf.bitwise.bitwise_and(
                tf.bitwise.right_shift(masks[..., None], tf.range(num_classes)), 1)
        return images, masks

    return transform


def jointly_augmented(images: tf.Tensor, masks: tf.Tensor, size: tuple[int, int],
                      fill: int, seed: int | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Images `(B, H, W, C)` float and masks `(B, H, W)` scaled, cropped and flipped alike."""
    # The static batch size when there is one (drop_remainder): TPUs need static shapes.
    batch = images.shape[0] if images.shape[0] is not None else tf.shape(images)[0]
    # One draw per example: scale, the box's two offsets and the flip.
    draw = tf.random.uniform([batch, 4], seed=seed)
    low, high = SCALE_RANGE
    extent = 1.0 / (low + (high - low) * draw[:, 0])  # the box's side, 1 = the whole image
    start = tf.minimum(0.0, 1.0 - extent[:, None]) + tf.abs(1.0 - extent[:, None]) * draw[:, 1:3]
    top, left = start[:, 0], start[:, 1]
    flip = draw[:, 3] < 0.5
    # A box whose x1 > x2 is sampled right to left: the crop comes out flipped.
    boxes = tf.stack([top, tf.where(flip, left + extent, left), top + extent,
                      tf.where(flip, left, left + extent)], axis=1)
    rows = tf.range(batch)
    images = tf.image.crop_and_resize(images, boxes, rows, size, method="bilinear",
                                      extrapolation_value=0.0)
    masks = tf.image.crop_and_resize(tf.cast(masks[..., None], tf.float32), boxes, rows, size,
                                     method="nearest", extrapolation_value=float(fill))
    return images, tf.cast(masks[..., 0], tf.uint8)
