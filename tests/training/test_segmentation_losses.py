"""The per-image Dice losses and the multi-label IoU: values against NumPy, and one AccumModel
step (4 micro-batches) of every segmentation loss on the demo masks against keras.Model on the
whole batch."""

import keras
import numpy as np
import pytest

import tfmem
from tests.training import loss_cases
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


@pytest.mark.parametrize("name", loss_cases.SEGMENTATION_CASES)
def test_one_accumulated_step_on_the_demo_masks_is_the_whole_batch_step(name):
    # 4 micro-batches of 2 demo images (16 px, shape outlines ignored: each micro-batch its own
    # count of valid pixels); the same cases run on JAX in test_accumulation_jax.py.
    result = loss_cases.run(name)
    assert result["finite"] and result["warnings"] == []
    assert result["update"] <= RTOL
    history, plain = result["history"], result["plain_history"]
    assert history.keys() == plain.keys() == {"loss", "mean_iou"}
    for key in history:
        np.testing.assert_allclose(history[key], plain[key], rtol=RTOL, err_msg=key)


def test_the_demo_masks_tell_the_mean_of_micro_batch_means_from_the_whole_batch():
    _, masks = loss_cases.demo_masks()
    valid = (masks != IGNORE).reshape(4, -1).sum(-1)  # the 4 micro-batches of 2 images
    assert valid.max() > 4 * valid.min() > 0
    assert set(np.unique(masks)) == {*range(loss_cases.SHAPES), IGNORE}
    # Keras's own accumulation averages the micro-batches' means: far outside the bound above.
    assert loss_cases.run("demo:cross_entropy", keras_accumulation=True)["update"] > 1e3 * RTOL
