"""`PlanSettings`: what a memory plan depends on besides the model, frozen.

Made by `tfmem.memory.planner.settings`, taken by `planner.plan`, `planner.estimate`,
`tfmem.probe` and the levers, which change it with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmem.runtime.budget import Budget


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Everything a plan depends on besides the model: frozen, so a lever is a `replace`.

    Build one with `settings(...)` (which checks the values and resolves "auto" precision);
    `plan`, `probe` and the levers take it.

    Attributes:
        global_batch_size: samples per optimizer update, over all replicas.
        budget: the memory it is planned in (`tfmem.runtime.budget.Budget`).
        optimizer: a Keras optimizer instance or name; decides the slot count.
        precision: "float32", "mixed_float16" or "mixed_bfloat16" (never "auto" here).
        safety: fraction of the budget's memory to plan for.
        input_batches_in_flight: global batches of input resident at once.
        input_shape: one sample's shape (or a list of them) for a never-built subclassed model.
        frozen: ids of layers and weights planned as not trained (a frozen backbone).
        rematerialize: what is recomputed in the backward pass (a `tfmem.remat.spec.RematSpec`:
            None, "full", "auto", layer names and `(first, last)` pairs, or segments chosen
            already); None plans the model's own setting.
        micro_batch_target: the micro-batch "auto" rematerialization makes fit (a run with
            a set k); None: the rule of `planner.plan`.
        loss: the run's loss (a Keras loss instance, name or function; a list or dict of
            them for several outputs); None plans the model's compiled loss, if any.
        metrics: the run's metrics; None plans the model's compiled metrics.
        notes: lines the plan prints with its table.
    """

    global_batch_size: int
    budget: Budget
    optimizer: Any = "adam"
    precision: str = "float32"
    safety: float = 0.8
    input_batches_in_flight: int = 2
    input_shape: Any = None
    frozen: frozenset = frozenset()
    rematerialize: Any = None
    micro_batch_target: int | None = None
    loss: Any = None
    metrics: tuple | None = None
    notes: tuple[str, ...] = ()
