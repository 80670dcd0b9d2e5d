"""What a fine-tuning run prints: the environment, the demo, the end; its errors in flags."""

from __future__ import annotations

import os

from tfmem.data import demo
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts, demo_splits
from tfmem.runtime import report
from tfmem.runtime.runtime import Runtime
from tfmem.training.resume import TrainingDivergedError


def print_environment(config: FinetuneConfig, runtime: Runtime) -> None:
    """The environment: one line, or with `--verbose` the whole table."""
    print(report.describe(runtime) if config.verbose
          else f"{report.summary(runtime)} (--verbose: the whole table)")


def demo_line(spec, config: FinetuneConfig, data: DataFacts) -> str:
    """What the demo trains, on what, in one line."""
    held_out = demo_splits(data.task)[1][1]
    segmentation = data.task == "segmentation"
    classes = demo.SEGMENTATION_CLASS_NAMES if segmentation else demo.CLASS_NAMES
    return (f"finetune: the demo trains {spec.name} for {config.epochs} epoch"
            f"{'s' if config.epochs != 1 else ''} on tfmem's built-in shapes data: "
            f"{data.num_examples:,} {data.image_size[0]}×{data.image_size[1]} images "
            f"{'with masks ' if segmentation else ''}of {data.num_classes} classes"
            f"{' per pixel' if segmentation else ''} ({', '.join(classes)}), {held_out} held "
            "out to validate")


def complete_line(output: str, epochs: int) -> str:
    """A finished run started again: left as it is, in one line."""
    return (f"finetune: the run in {output} is complete ({epochs} epochs); "
            f"its results are {os.path.join(output, 'metrics.json')} and "
            f"{os.path.join(output, 'model.keras')}. Nothing was changed: use a new "
            "--output for another run, or more --epochs to train this one further.")


def validation_line(accuracy: float, epochs: int, num_classes: int) -> str:
    """The validation accuracy after training, beside chance."""
    trained = f"{epochs} epoch{'s' if epochs != 1 else ''}"
    return (f"finetune: validation accuracy {accuracy:.3f} after {trained} "
            f"(chance {1 / num_classes:.3f})")


def segmentation_line(mean_iou: float, pixel_accuracy: float, epochs: int) -> str:
    """The validation mean IoU and pixel accuracy after training."""
    trained = f"{epochs} epoch{'s' if epochs != 1 else ''}"
    return (f"finetune: validation mean IoU {mean_iou:.3f}, pixel accuracy "
            f"{pixel_accuracy:.3f} after {trained} (metrics.json: the IoU of each class)")


def summary(output: str) -> str:
    """The run's last lines: what it wrote, and how to look at its training curves."""
    return (f"finetune: done. The trained model: {os.path.join(output, 'model.keras')}; its "
            f"results: {os.path.join(output, 'metrics.json')}; its training curves: "
            f"tensorboard --logdir {os.path.join(output, 'logs')}")


def diverged_run(config: FinetuneConfig, output: str,
                 error: TrainingDivergedError) -> TrainingDivergedError:
    """The library's error in the command's terms: its flags, and how to start again."""
    return TrainingDivergedError(
        f"{error.facts}; no model.keras or metrics.json was written",
        f"lower --learning-rate (now {config.learning_rate:g} with {config.optimizer}) and "
        "start again with --overwrite or a new --output", epoch=error.epoch,
        step=error.step, loss=error.loss, resume_point=error.resume_point)
