"""The final validation of a segmentation run, at the validation images' own size.

Keras's per-epoch validation reads the images resized to the training size; the metrics of
`metrics.json` come from the validation set as it is, when its manifest records one size for
all its images: whole images a micro-batch at a time where the plan says a forward pass of
them fits, else tiles of the training size (`tfmem.predict_tiled`).
"""

from __future__ import annotations

import dataclasses

import keras

from tfmem import models
from tfmem.data import manifest as manifest_lib, reader
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts
from tfmem.memory import guard
from tfmem.models import tiling


@dataclasses.dataclass(frozen=True)
class Choice:
    """How the validation images are predicted: at `image_size`, whole or by `tile_size`
    tiles, `batch_size` images or tiles per model call; `resized` where the set records no
    one size of its images."""

    image_size: tuple[int, int]
    tile_size: tuple[int, int] | None
    batch_size: int
    resized: bool = False

    def line(self) -> str:
        """The choice in one line, as the run prints it."""
        height, width = self.image_size
        if self.resized:
            return (f"finetune: validation: images resized to {height}×{width} (no manifest "
                    f"records one size of them), {self.batch_size} a call")
        how = ("whole" if self.tile_size is None
               else f"by {self.tile_size[0]}×{self.tile_size[1]} tiles")
        return f"finetune: validation: {height}×{width} images {how}, {self.batch_size} a call"


def choose(config: FinetuneConfig, spec, data: DataFacts, run_plan: guard.RunPlan,
           batch_size: int) -> Choice:
    """Whole images or tiles, for the validation set's own size (the training size where its
    manifest records none)."""
    full = _own_size(data.validation)
    if full is None or full == data.image_size:
        return Choice(data.image_size, None, batch_size, resized=full is None)
    # Whole images where the model takes their size and a forward pass of a micro-batch of them
    # fits; else tiles of the training size, the micro-batch a call: training showed that many
    # samples of that size fit, and a forward pass holds less than a training step.
    if config.validation_tiles or not (_model_takes(spec, full)
                                       and _forward_fits(run_plan, full, data.image_size)):
        return Choice(full, data.image_size, batch_size)
    return Choice(full, None, batch_size)


def batches(choice: Choice, data: DataFacts, options: dict):
    """The validation set's `(images, masks)` NumPy batches at `choice.image_size`."""
    dataset = reader.image_dataset(data.validation, batch_size=choice.batch_size,
                                   training=False, **{**options, "image_size": choice.image_size})
    return dataset.as_numpy_iterator()


def evaluate(model: keras.Model, choice: Choice, stride: int, validation_batches,
             loss_function, metric) -> float:
    """The model on `(images, masks)` batches as `choice` says: `metric` updated with every
    batch (reset first); returns the loss, each batch's weighted by its images (as Keras's
    `evaluate`)."""
    whole = None
    if choice.tile_size is None:
        whole = (model if tuple(model.input_shape[1:3]) == choice.image_size
                 else tiling.any_size_model(model))
    metric.reset_state()
    loss_sum, count = 0.0, 0
    for images, masks in validation_batches:
        if whole is not None:
            predicted = keras.ops.convert_to_numpy(whole.predict_on_batch(images))
        else:
            predicted = tiling.predict_tiled(model, images, choice.tile_size,
                                             batch_size=choice.batch_size, stride=stride)
        metric.update_state(masks, predicted)
        loss_sum += float(loss_function(masks, predicted)) * len(images)
        count += len(images)
    return loss_sum / max(count, 1)


def _own_size(path: str) -> tuple[int, int] | None:
    """The size all the set's images have, from its manifest; None where it records none."""
    if not manifest_lib.has_manifest(path):
        return None
    size = manifest_lib.read_manifest(path).image_size
    return tuple(size) if size else None


def _model_takes(spec, size: tuple[int, int]) -> bool:
    try:
        models.input_shape(spec.name, size)
    except ValueError:  # e.g. not a multiple of what it pools by
        return False
    return True


def _forward_fits(run_plan: guard.RunPlan, size: tuple[int, int],
                  training_size: tuple[int, int]) -> bool:
    """Whether a forward pass of a micro-batch of images of `size` fits the plan's budget,
    estimated from above by the training step at that size: the plan's fixed part plus its
    per-micro-batch part scaled by the ratio of pixels. No plan: not known to fit."""
    memory_plan = run_plan.plan
    if memory_plan is None:
        return False
    fixed = memory_plan.fixed_bytes(run_plan.accumulation_steps)
    per_micro_batch = memory_plan.peak_bytes(run_plan.micro_batch_size,
                                             run_plan.accumulation_steps) - fixed
    ratio = (size[0] * size[1]) / (training_size[0] * training_size[1])
    return fixed + ratio * per_micro_batch <= memory_plan.budget_bytes
