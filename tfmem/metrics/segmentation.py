"""IoU of multi-label masks (a 0/1 channel per class), each class on its own channel.

Keras's `BinaryIoU` pools every channel into one pair of classes (0 and 1), and `MeanIoU`
takes one class per pixel; here each class has its own true/false positive counts.
"""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfmem")
class MultiLabelIoU(keras.metrics.Metric):
    """Mean over the classes of each class's IoU, a pixel being of the class where its
    channel's probability is ≥ `threshold`; classes in neither the masks nor the predictions
    are left out of the mean.

    Args:
        num_classes: the channels of masks and predictions.
        threshold: the probability from which a pixel counts as of the class.

    Example:
        >>> iou = MultiLabelIoU(2)
        >>> iou.update_state([[[[1, 0], [1, 1]]]], [[[[0.9, 0.2], [0.3, 0.6]]]])
        >>> round(float(iou.result()), 4)  # class 0: 1 of 2 pixels; class 1: 1 of 1
        0.75
    """

    def __init__(self, num_classes: int, threshold: float = 0.5, name: str = "mean_iou",
                 dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.num_classes, self.threshold = num_classes, threshold
        # Per class: true positives, predicted, true; and the channel decisions right, all.
        # float32 counts as Keras's MeanIoU keeps them (JAX has no float64 by default).
        self.counts = self.add_variable((num_classes, 3), initializer="zeros",
                                        dtype="float32", name="counts")
        self.decisions = self.add_variable((2,), initializer="zeros", dtype="float32",
                                           name="decisions")

    def update_state(self, y_true, y_pred, sample_weight=None):
        true = ops.reshape(ops.cast(y_true, "float32"), (-1, self.num_classes))
        predicted = ops.reshape(ops.cast(ops.greater_equal(
            ops.convert_to_tensor(y_pred), self.threshold), "float32"), (-1, self.num_classes))
        hits = ops.sum(true * predicted, axis=0)
        self.counts.assign_add(ops.stack([hits, ops.sum(predicted, axis=0),
                                          ops.sum(true, axis=0)], axis=1))
        right = ops.sum(ops.cast(ops.equal(true, predicted), "float32"))
        self.decisions.assign_add(ops.stack([right, ops.cast(ops.size(true), "float32")]))

    def result(self):
        hits, predicted, true = (self.counts[:, i] for i in range(3))
        union = predicted + true - hits
        present = ops.greater(union, 0)
        iou = ops.where(present, hits / ops.maximum(union, 1.0), 0.0)
        return ops.cast(ops.sum(iou) / ops.maximum(ops.sum(ops.cast(present, "float32")), 1.0),
                        self.dtype)

    def scores(self) -> dict:
        """metrics.json's `per_class_iou` (None for a class in neither) and `pixel_accuracy`
        (the share of the per-class decisions that are right)."""
        hits, predicted, true = (ops.convert_to_numpy(self.counts)[:, i] for i in range(3))
        union = predicted + true - hits
        right, total = ops.convert_to_numpy(self.decisions)
        return {"pixel_accuracy": float(right / max(total, 1.0)),
                "per_class_iou": [float(h / u) if u else None for h, u in zip(hits, union)]}

    def reset_state(self):
        self.counts.assign(ops.zeros(self.counts.shape, self.counts.dtype))
        self.decisions.assign(ops.zeros(self.decisions.shape, self.decisions.dtype))

    def get_config(self) -> dict:
        return {**super().get_config(), "num_classes": self.num_classes,
                "threshold": self.threshold}
