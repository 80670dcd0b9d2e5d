"""The per-image Dice losses and the multi-label IoU: values against NumPy, and one AccumModel
step (4 micro-batches) against keras.Model on the whole batch."""

import keras
import numpy as np
import pytest

import tfmem
from tests.training.loss_cases import BATCH, IGNORE, pixel_labels
from tfmem.metrics.segmentation import MultiLabelIoU
from tfmem.training.segmentation_losses import DiceLoss

RTOL = 1e-5


def _probabilities(shape, seed, multi_label=False):
    logits = np.random.default_rng(seed).normal(size=shape)
    if multi_label:
        return 1 / (1 + np.exp(-logits))
    return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def _numpy_dice(true, predicted, valid, smooth=1.0):
    """Per image: 1 − its Dice over the classes, summed over its valid pixels."""
    true, predicted = true * valid[..., None], predicted * valid[..., None]
    intersection = (true * predicted).sum(axis=(1, 2))
    totals = true.sum(axis=(1, 2)) + predicted.sum(axis=(1, 2))
    return 1 - ((2 * intersection + smooth) / (totals + smooth)).mean(-1)


def test_dice_of_class_indices_leaves_the_ignored_pixels_out():
    labels = pixel_labels()  # images 0-3 almost all ignored, images 2-3 wholly
    predicted = _probabilities((BATCH, 4, 4, 3), seed=0)
    valid = labels != IGNORE
    true = np.eye(3)[np.where(valid, labels, 0)]
    dice = _numpy_dice(true, predicted, valid)
    np.testing.assert_allclose(DiceLoss(3, ignore_class=IGNORE)(labels, predicted),
                               dice.mean(), rtol=RTOL)
    # Plus each image's mean cross-entropy over its valid pixels (0 where it has none).
    log = -np.log(np.take_along_axis(predicted, np.where(valid, labels, 0)[..., None], -1))[..., 0]
    entropy = (log * valid).sum(axis=(1, 2)) / np.maximum(valid.sum(axis=(1, 2)), 1)
    np.testing.assert_allclose(
        DiceLoss(3, ignore_class=IGNORE, cross_entropy=True)(labels, predicted),
        (dice + entropy).mean(), rtol=RTOL)


def test_dice_of_multi_label_masks_and_their_iou():
    rng = np.random.default_rng(3)
    true = rng.integers(0, 2, (BATCH, 4, 4, 3))
    true[:, :, :, 2] = 0  # a class in no mask
    predicted = _probabilities((BATCH, 4, 4, 3), seed=4, multi_label=True)
    dice = _numpy_dice(true, predicted, np.ones(true.shape[:3]))
    entropy = -(true * np.log(predicted) + (1 - true) * np.log(1 - predicted)).mean(
        axis=(1, 2, 3))
    np.testing.assert_allclose(DiceLoss(3, multi_label=True, cross_entropy=True)(
        true, predicted), (dice + entropy).mean(), rtol=RTOL)
    iou = MultiLabelIoU(3)
    iou.update_state(true, predicted)
    called = predicted >= 0.5
    hits = (called & (true == 1)).sum(axis=(0, 1, 2))
    union = (called | (true == 1)).sum(axis=(0, 1, 2))
    expected = [h / u if u else None for h, u in zip(hits, union)]
    assert iou.scores()["per_class_iou"] == pytest.approx(expected)
    assert iou.scores()["pixel_accuracy"] == pytest.approx(np.mean(called == (true == 1)))
    present = [value for value in expected if value is not None]
    assert float(iou.result()) == pytest.approx(np.mean(present), rel=1e-6)


def _model(cls, **kwargs):
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.Conv2D(4, 1, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Conv2D(3, 1, activation="softmax")(hidden), **kwargs)


def test_one_accumulated_step_is_the_whole_batch_step():
    # Class indices with the ignore value: micro-batches of 3, 0, 30 and 32 valid pixels; each
    # image's loss, averaged over the images, is the same mean in every micro-batch.
    x = np.random.default_rng(1).normal(size=(BATCH, 4, 4, 2)).astype("float32")
    y = pixel_labels()
    keras.utils.set_random_seed(1)
    accum = _model(tfmem.AccumModel, accumulation_steps=4)
    plain = _model(keras.Model)
    plain.set_weights(accum.get_weights())
    initial = accum.get_weights()
    for model in (accum, plain):
        metric = keras.metrics.MeanIoU(3, name="mean_iou", ignore_class=IGNORE,
                                       sparse_y_pred=False)
        model.compile(keras.optimizers.SGD(0.5), metrics=[metric],
                      loss=DiceLoss(3, ignore_class=IGNORE, cross_entropy=True))
    history = accum.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    plain_history = plain.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    for name in ("loss", "mean_iou"):
        np.testing.assert_allclose(history[name], plain_history[name], rtol=RTOL)
    update, plain_update = ([np.asarray(w) - w0 for w, w0 in zip(model.get_weights(), initial)]
                            for model in (accum, plain))
    scale = max(np.abs(u).max() for u in plain_update)
    assert scale > 0
    for got, want in zip(update, plain_update):
        np.testing.assert_allclose(got, want, atol=RTOL * scale)
