"""Fine-tuning an image classifier or a segmentation network from TFRecords, as one call:
`run(FinetuneConfig(...))`.

What `scripts/finetune.py` runs (its flags are `FinetuneConfig`'s fields, with hyphens): the
settings and their checks (config.py), the data's facts (data_facts.py), the run directory
(outputs.py), one training in this process: build → plan → train → evaluate (attempt.py), the
`--memory-limit` supervisor of training processes (supervisor.py), what is printed
(messages.py); `run` (main.py) puts them together. Checks and recovery: docs/failure-model.md.

    >>> from tfmem import finetune
    >>> finetune.run(finetune.FinetuneConfig(epochs=1, output="runs/demo"))  # doctest: +SKIP
"""

from tfmem.finetune.config import (LOSSES, OPTIMIZERS, TASKS, FinetuneConfig,
                                   memory_limit_bytes)
from tfmem.finetune.data_facts import DEMO_SPLITS
from tfmem.finetune.main import compiled_ahead, run, task_loss
from tfmem.finetune.outputs import WRITES

__all__ = ["DEMO_SPLITS", "LOSSES", "OPTIMIZERS", "TASKS", "WRITES", "FinetuneConfig",
           "compiled_ahead", "memory_limit_bytes", "run", "task_loss"]
