"""The run directory (`--output`): what a run writes there, its settings, its results."""

from __future__ import annotations

import glob
import json
import os
import shutil

from tfmem import cli
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts
from tfmem.training import resume, run_directory

# What a run writes in its --output (its run.json lists them): nothing else there is deleted or
# replaced. Beside them, two working entries of tfmem's own: `.lock` and `.attempts/` (the
# supervising process's files, only those of its own names ever removed).
WRITES = (run_directory.CONFIG_FILE, "backup", "logs", "model.keras", "metrics.json",
          "demo-data", ".tmp-model.keras", ".tmp-metrics.json")
DISCARDED = ("backup", "logs", "model.keras", "metrics.json", run_directory.CONFIG_FILE)


def output_directory(config: FinetuneConfig, spec) -> str:
    """The run directory; each model has its own default, so a demo and an XL run never share
    one."""
    return config.output or os.path.join("runs", spec.name)


def check_output(config: FinetuneConfig, output: str) -> None:
    """Before anything is written: `--output` can hold the run, and nothing of the run's
    names there is something no tfmem run wrote."""
    with cli.usage_errors():
        run_directory.check_writable(output, WRITES, what="--output",
                                     overwrite="--overwrite" if config.overwrite else None)


def discard(output: str) -> None:
    """--overwrite: the run's resume points, logs and results go (only what its run.json says
    it wrote); the demo data stays."""
    for name in run_directory.written(output, DISCARDED):  # run.json last
        path = os.path.join(output, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def recorded_settings(config: FinetuneConfig, spec, precision: str, data: DataFacts,
                      output: str) -> dict:
    """run.json's settings, checked against this run's (a restart with others is refused)."""
    holds_run = bool(glob.glob(os.path.join(output, "backup", "backup-*.json"))) or any(
        os.path.exists(os.path.join(output, name)) for name in ("model.keras", "metrics.json"))
    return run_directory.check_config(
        output, run_settings(config, spec, precision, data),
        holds_run=holds_run, writes=WRITES, how_to_fix=(
            "start it with its own settings to resume it, use a new --output for a new "
            "run, or pass --overwrite to discard it and start again"))


def run_settings(config: FinetuneConfig, spec, precision: str, data: DataFacts) -> dict:
    """What defines the run: a restart with any of these changed is another run."""
    return {
        # One number for a square size, as runs recorded it before sizes had two.
        "model": spec.name, "task": data.task, "image_size": (
            data.image_size[0] if len(set(data.image_size)) == 1 else list(data.image_size)),
        "num_classes": data.num_classes,
        "optimizer": config.optimizer, "learning_rate": config.learning_rate,
        "global_batch_size": config.global_batch_size,
        "accumulation_steps": str(config.accumulation_steps), "precision": precision,
        "seed": config.seed, "freeze_backbone": config.freeze_backbone,
        "weights": os.path.abspath(config.weights) if config.weights else None,
        "data": data.identity, "validation_data": data.validation_identity,
        # Recorded where it is not the default, as runs recorded before it was a setting.
        **({"loss": config.loss} if config.loss != "cross-entropy" else {}),
    }


def check_epochs_done(config: FinetuneConfig, output: str) -> None:
    """A restart asks for at least the epochs the run has begun (fewer would train nothing
    and call the run complete at more epochs than it says)."""
    trained = resume.trained_so_far(os.path.join(output, "backup"))
    if trained is not None and trained > (config.epochs, 0):
        raise cli.UsageError(
            f"--epochs {config.epochs}, but the run in {output} has trained "
            f"{resume.describe_trained(*trained)} already; pass --epochs "
            f"{resume.epochs_needed(*trained)} or more to go on with it, or use a new --output "
            "(or --overwrite) to start again")


def save_results(accum, results: dict, output: str) -> None:
    """model.keras and metrics.json, each under a temporary name, then renamed."""
    temporary = os.path.join(output, ".tmp-model.keras")
    accum.save(temporary)
    os.replace(temporary, os.path.join(output, "model.keras"))
    temporary = os.path.join(output, ".tmp-metrics.json")
    with open(temporary, "w") as file:
        json.dump(results, file, indent=2)
    os.replace(temporary, os.path.join(output, "metrics.json"))
