"""A segmentation run's final validation at the validation images' own size: whole images where
a forward pass of them fits the plan, else tiles of the training size."""

import dataclasses

import keras
import numpy as np
import pytest

import tfmem
from tfmem import models
from tfmem.finetune import validation
from tfmem.finetune.attempt import loss_and_metrics, segmentation_scores
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts
from tfmem.memory import guard


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """8 demo shapes with masks at 48×48 (a size U-Net takes), validating a run at 32."""
    path = tmp_path_factory.mktemp("held-out") / "validation"
    tfmem.make_demo_dataset(path, num_examples=8, image_size=48, seed=3, task="segmentation")
    return DataFacts(False, (32, 32), 5, 128, validation=str(path), task="segmentation",
                     ignore_value=255)


@pytest.fixture(scope="module")
def unet():
    keras.utils.set_random_seed(0)
    return models.build("unet", num_classes=5, image_size=32)


@pytest.fixture(scope="module")
def run_plan(unet):
    return guard.guard(unet, global_batch_size=4, accumulation_steps=1, memory_budget=2**33,
                       num_replicas=1, precision="float32")


def test_whole_images_where_a_forward_pass_of_a_micro_batch_fits_else_tiles(held_out,
                                                                            run_plan,
                                                                            tmp_path):
    config, spec = FinetuneConfig(model="unet"), models.spec("unet")
    whole = validation.choose(config, spec, held_out, run_plan, 4)
    assert whole == validation.Choice((48, 48), None, 4)
    assert whole.line() == "finetune: validation: 48×48 images whole, 4 a call"
    tiles = validation.Choice((48, 48), (32, 32), 4)
    assert validation.choose(dataclasses.replace(config, validation_tiles=True), spec,
                             held_out, run_plan, 4) == tiles
    assert tiles.line() == "finetune: validation: 48×48 images by 32×32 tiles, 4 a call"
    # The estimate: the plan's fixed bytes + its micro-batch's bytes × (48 × 48) / (32 × 32).
    plan = run_plan.plan
    fixed = plan.fixed_bytes(1)
    needed = fixed + (plan.peak_bytes(4, 1) - fixed) * 48 * 48 / (32 * 32)
    for budget, expected in ((needed, whole), (needed - 1, tiles)):
        tight = dataclasses.replace(run_plan, plan=dataclasses.replace(
            plan, memory_per_replica=budget / plan.safety + 1))
        assert plan.peak_bytes(4, 1) < tight.plan.budget_bytes  # training fits either way
        assert validation.choose(config, spec, held_out, tight, 4) == expected, budget
    # No plan: not known to fit.
    assert validation.choose(config, spec, held_out, dataclasses.replace(run_plan, plan=None),
                             4) == tiles
    # Records without a manifest (so without one size): read at the training size.
    unsized = validation.choose(config, spec, dataclasses.replace(
        held_out, validation=str(tmp_path)), run_plan, 4)
    assert unsized == validation.Choice((32, 32), None, 4, resized=True)
    assert unsized.line() == ("finetune: validation: images resized to 32×32 (no manifest "
                              "records one size of them), 4 a call")


def test_whole_images_are_the_network_at_their_size_counted_as_numpy_does(held_out, unet):
    images, masks = map(np.stack, zip(*tfmem.demo_examples(8, 48, seed=3,
                                                           task="segmentation")))
    images = images.astype("float32")
    loss_function, (metric,) = loss_and_metrics(held_out)
    loss = validation.evaluate(unet, validation.Choice((48, 48), None, 4), 16,
                               [(images[:4], masks[:4]), (images[4:], masks[4:])],
                               loss_function, metric)
    # The reference: U-Net built for 48×48 with the same weights.
    at_48 = models.build("unet", num_classes=5, image_size=48)
    at_48.set_weights(unet.get_weights())
    predicted = at_48.predict(images, verbose=0)
    confusion = np.bincount(masks.ravel() * 5 + predicted.argmax(-1).ravel(),
                            minlength=25).reshape(5, 5)
    hits = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - hits
    scores = segmentation_scores(metric.total_cm)
    np.testing.assert_allclose(scores["per_class_iou"],
                               [h / u if u else None for h, u in zip(hits, union)], atol=1e-6)
    np.testing.assert_allclose(scores["pixel_accuracy"], hits.sum() / confusion.sum())
    # Each batch's loss weighted by its images, as Keras's `evaluate` counts it.
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(ignore_class=255)
    np.testing.assert_allclose(loss, np.mean([float(cross_entropy(masks[i:i + 4],
                                                                  predicted[i:i + 4]))
                                              for i in (0, 4)]), rtol=1e-5)
