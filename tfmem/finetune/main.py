"""`run(FinetuneConfig)`: the checks that need no work, then the training, in this process or
under the `--memory-limit` supervisor."""

from __future__ import annotations

import sys

from tfmem import cli
from tfmem.finetune import attempt as attempt_lib, config as config_lib, outputs
from tfmem.finetune.attempt import Attempt, loss_and_metrics, run_attempt
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DEFAULT_IGNORE_VALUE, DataFacts, check_sizes
from tfmem.finetune.supervisor import supervise
from tfmem.runtime import current, memory_cap
from tfmem.training import run_directory


def run(config: FinetuneConfig) -> dict:
    """Runs (or with `dry_run`, plans) one fine-tuning; returns metrics.json's dict.

    Under a memory limit (`memory_limit`, by default 80% of the RAM available at the start) the
    training runs in a child process that `tfmem.runtime.memory_cap.MemoryWatch` stops at the
    limit; this process then resumes it from its last resume point with the micro-batch halved
    and twice the accumulation steps (the same global batch), until it fits or micro-batch 1
    does not (docs/out-of-memory.md).

    Returns:
        The results written to metrics.json; `{}` for a dry run or a run found complete.

    Raises:
        tfmem.cli.UsageError: the settings cannot work (a flag combination, the data's facts,
            a run directory made with other settings, a plan over the budget, a memory limit
            that even micro-batch 1 exceeds).
        ValueError, OSError, RuntimeError: the data, the disk or the training process failed
            (`docs/failure-model.md`).
    """
    config_lib.check_combinations(config)
    config_lib.check_named_files_and_devices(config)
    with cli.usage_errors():  # "3 GB", "lots"
        cap = config_lib.memory_limit_bytes(config.memory_limit)
    if config.dry_run:
        return run_attempt(config, Attempt(config.accumulation_steps))
    config_lib.check_installed()
    spec = config_lib.model_spec(config)
    output = outputs.output_directory(config, spec)
    outputs.check_output(config, output)
    if cap is None:
        return run_attempt(config, Attempt(config.accumulation_steps))
    note = memory_cap.limit_note_here()
    if note:  # once, before any work: what the limit cannot see here
        print(f"warning: {note}", file=sys.stderr)
    data = DataFacts.of(config, spec)  # a wrong model or data stops here, before any process
    check_sizes(config, spec, data)
    config_lib.check_loss(config, data.task)
    # This process holds the run directory for its training processes, one after the other.
    with run_directory.lock(output, "--output"):
        return supervise(config, cap, data, output)


def task_loss(task: str, num_classes: int, loss: str = "cross-entropy") -> tuple:
    """The loss and metrics `run` trains a `task` with (`loss`: its `--loss`) on data of
    `num_classes` (masks of class indices with the ignore value 255, for segmentation): what
    `scripts/plan.py` plans a run with.

    Example:
        >>> loss, metrics = task_loss("segmentation", 12, "dice")  # tfmem.DiceLoss, MeanIoU
    """
    facts = DataFacts(False, (1, 1), num_classes, None, task=task,
                      ignore_value=DEFAULT_IGNORE_VALUE if task == "segmentation" else None)
    return loss_and_metrics(facts, loss)


def compiled_ahead(config: FinetuneConfig, program: str = "plan"):
    """XLA's own figure of the step of the run `config` describes, for a TPU or GPU `device`
    on JAX: `(k, plan) →` the peak bytes of the step one replica runs with k accumulation steps,
    compiled here ahead of time for a model built for its shapes in the plan's precision
    (for a large model, minutes and gigabytes of RAM; a line begun with `program` before
    each compile): what `tfmem.memory.guard.guard` takes as `compiled_peak`. The data are
    `config`'s classes, image size and task (the model's by default), read from no file.

    Returns:
        The function; None, after a line that gives the install command, where the
        device's compiler (libtpu; JAX's CUDA plugin) is not installed; None on TensorFlow.
    """
    spec = config_lib.model_spec(config)
    task = config.task or spec.task
    facts = DataFacts(False, config.image_size or (spec.default_image_size,) * 2,
                      config.num_classes or 1000, None, task=task,
                      ignore_value=DEFAULT_IGNORE_VALUE if task == "segmentation" else None)
    return attempt_lib.compiled_ahead(config, spec, current.detect(prefer=config.prefer), facts,
                                      program)
