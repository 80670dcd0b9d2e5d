"""Per-image segmentation losses: Dice, and Dice plus cross-entropy.

Dice is a ratio of sums over pixels, so the Dice of a batch is not the mean of its parts'. Here
each image gets its own loss and the batch's loss is the mean over its images (Keras's
"sum_over_batch_size" of per-image values): the same count in every micro-batch of equal
size, so `AccumModel` accumulates it exactly (docs/segmentation.md).
"""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfmem")
class DiceLoss(keras.losses.Loss):
    """1 − the Dice coefficient of each image averaged over the classes, averaged over images.

    For class c of one image, with `p` the predicted probabilities and `t` the true one-hot (or
    multi-label 0/1) masks, summed over the image's pixels that have a class:
    `dice_c = (2 Σ p·t + smooth) / (Σ p + Σ t + smooth)`; the image's loss is
    `1 − mean_c dice_c`, plus, with `cross_entropy=True`, the mean cross-entropy of its pixels
    that have a class (binary, over the channels, for multi-label masks).

    Args:
        num_classes: the classes (the last axis of the predictions).
        ignore_class: the mask value of pixels without a class: they count in no sum.
        multi_label: masks are `(…, H, W, num_classes)` 0/1 channels (the predictions are
            per-channel sigmoids) instead of `(…, H, W)` class indices (softmax).
        cross_entropy: add each image's mean cross-entropy.
        smooth: added to the numerator and denominator: a class in neither the mask nor the
            predictions scores 1, not 0/0.

    Example:
        >>> loss = DiceLoss(num_classes=2, ignore_class=255)
        >>> round(float(loss([[[0, 1]]], [[[[0.8, 0.2], [0.3, 0.7]]]])), 4)
        0.1669
    """

    def __init__(self, num_classes: int, ignore_class: int | None = None,
                 multi_label: bool = False, cross_entropy: bool = False, smooth: float = 1.0,
                 name: str | None = None, reduction: str = "sum_over_batch_size", dtype=None):
        super().__init__(name=name or ("dice_cross_entropy" if cross_entropy else "dice"),
                         reduction=reduction, dtype=dtype)
        if multi_label and ignore_class is not None:
            raise ValueError("`ignore_class` goes with masks of class indices; multi-label "
                             "masks (`multi_label=True`) have no ignore value: pass one or the "
                             "other")
        self.num_classes, self.ignore_class = num_classes, ignore_class
        self.multi_label, self.cross_entropy, self.smooth = multi_label, cross_entropy, smooth

    def call(self, y_true, y_pred):
        """Per image: its loss, shape `(batch,)`."""
        y_pred = ops.convert_to_tensor(y_pred, self.dtype)
        if self.multi_label:
            true = ops.cast(y_true, y_pred.dtype)
            valid = ops.ones_like(true[..., :1])
        else:
            labels = ops.cast(y_true, "int32")
            if len(labels.shape) == len(y_pred.shape):  # (…, H, W, 1) as Keras's sparse losses
                labels = ops.squeeze(labels, -1)
            valid = (ops.ones_like(labels, y_pred.dtype) if self.ignore_class is None else
                     ops.cast(ops.not_equal(labels, self.ignore_class), y_pred.dtype))
            labels = ops.where(ops.cast(valid, "bool"), labels, 0)
            valid = valid[..., None]
            true = ops.one_hot(labels, self.num_classes, dtype=y_pred.dtype) * valid
        predicted = y_pred * valid
        pixels = tuple(range(1, len(y_pred.shape) - 1))  # all but the image and the class
        intersection = ops.sum(true * predicted, axis=pixels)
        totals = ops.sum(true, axis=pixels) + ops.sum(predicted, axis=pixels)
        dice = (2.0 * intersection + self.smooth) / (totals + self.smooth)
        loss = 1.0 - ops.mean(dice, axis=-1)
        if self.cross_entropy:
            loss = loss + self._cross_entropy(true, y_pred, valid, pixels)
        return loss

    def _cross_entropy(self, true, y_pred, valid, pixels):
        """Each image's mean cross-entropy over its pixels that have a class."""
        epsilon = keras.backend.epsilon()
        probabilities = ops.clip(y_pred, epsilon, 1.0 - epsilon)
        if self.multi_label:  # binary per channel, the mean over the channels
            per_pixel = -ops.mean(true * ops.log(probabilities)
                                  + (1.0 - true) * ops.log(1.0 - probabilities), axis=-1)
        else:
            per_pixel = -ops.sum(true * ops.log(probabilities), axis=-1)
        valid = valid[..., 0]
        return ops.sum(per_pixel * valid, axis=pixels) / ops.maximum(
            ops.sum(valid, axis=pixels), 1.0)

    def get_config(self) -> dict:
        return {**super().get_config(), "num_classes": self.num_classes,
                "ignore_class": self.ignore_class, "multi_label": self.multi_label,
                "cross_entropy": self.cross_entropy, "smooth": self.smooth}
