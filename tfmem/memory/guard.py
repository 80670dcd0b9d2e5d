"""The one path from a run's settings to its split: plan → check → choose k → warn.

`AccumModel.fit` (and `fit_resumable` through `AccumModel.plan_memory`) and
`scripts/finetune.py` decide a run's micro-batch × accumulation steps here, and nowhere else:

1. `accumulation_steps` is checked (a positive int or "auto") and the global batch split over
   the replicas (`tfmem.runtime.cluster.split_batch`, the one message);
2. the run is planned (`planner.plan`) for its budget (`tfmem.runtime.budget`);
3. the plan is checked (`planner.check`): a setting over the budget raises `MemoryPlanError`
   unless `allow_over_budget`;
4. "auto" takes the plan's k (micro-batch 1 when nothing fits and the budget may be exceeded);
5. a run that cannot be planned (the device's memory is unknown, a model the planner cannot
   size, data without a static batch size) still trains with its own k, after one
   `UnplannedRunWarning` per model, unless it asked for "auto", which needs a plan.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfmem.memory import planner
from tfmem.memory.memory_plan import MemoryPlan
from tfmem.memory.plan_report import PYTHON, Switches, describe_split
from tfmem.runtime.budget import UnknownMemoryError, budget_for
from tfmem.runtime.cluster import check_accumulation_steps, check_count, split_batch

__all__ = ["RunPlan", "UnplannedRunWarning", "guard", "unplanned"]


class UnplannedRunWarning(UserWarning):
    """A run trains without its memory checked: the planner could not plan it."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How a run splits its global batch, and the memory plan that chose or checked it.

    Attributes:
        global_batch_size: samples per optimizer update, over all replicas.
        num_replicas: replicas the global batch is split over.
        accumulation_steps: micro-batches per replica and update (k).
        micro_batch_size: samples one replica runs at once.
        plan: the checked `MemoryPlan`; None when the run could not be planned.
        skipped: why there is no plan (said in an `UnplannedRunWarning`), else None.
    """

    global_batch_size: int
    num_replicas: int
    accumulation_steps: int
    micro_batch_size: int
    plan: MemoryPlan | None = None
    skipped: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        """The planned peak per replica of this split, or None without a plan."""
        if self.plan is None:
            return None
        return self.plan.peak_bytes(self.micro_batch_size, self.accumulation_steps)

    def describe(self) -> str:
        """"global batch 64 = micro-batch 16 × 4 accumulation steps × 1 replica"."""
        return describe_split(self.global_batch_size, self.micro_batch_size,
                              self.accumulation_steps, self.num_replicas)


def guard(
    model: keras.Model,
    *,
    global_batch_size: int,
    accumulation_steps: int | str = "auto",
    allow_over_budget: bool = False,
    runtime: Any = None,
    memory_budget: int | None = None,
    device: str | None = None,
    num_replicas: int | None = None,
    smaller_variants: Sequence[tuple[str, Callable[[], keras.Model]]] = (),
    batch_of_the_data: bool = False,
    switches: Switches = PYTHON,
    **plan_arguments: Any,
) -> RunPlan:
    """Plans a run, stops it before the first step if it cannot fit, and picks its split.

    Args:
        model: the model about to train (or built in `tfmem.models.shapes_only()`).
        global_batch_size: samples per update over all replicas.
        accumulation_steps: the k the run will use, or "auto" for the plan's choice.
        allow_over_budget: True returns a setting over the budget instead of raising (the
            explicit override); with "auto" and nothing fitting, micro-batch 1.
        runtime, memory_budget, device, num_replicas: where the run is planned for, as in
            `tfmem.plan` (default: this host's CPU).
        smaller_variants: as in `tfmem.plan`: named in the error when nothing fits.
        batch_of_the_data: the global batch is the data's own batch (`fit`'s), so a batch that
            does not split is also advised `drop_remainder=True`.
        switches: how the caller's interface spells k and the override of the check,
            named in its messages (`tfmem.memory.plan_report.COMMAND_LINE` for a program's
            flags; `AccumModel.fit` names its `check_memory=False`).
        **plan_arguments: the other arguments of `tfmem.plan` (optimizer, precision, safety,
            input_shape, input_batches_in_flight).

    Returns:
        A `RunPlan`: the split to train with and the plan that checked it.

    Raises:
        MemoryPlanError: the setting (with "auto": every setting) exceeds the budget.
        ValueError: `accumulation_steps` is neither a positive int nor "auto"; the global
            batch does not split over replicas × k (naming the nearest sizes that do); "auto"
            for a run that cannot be planned; bad plan arguments.

    Example:
        >>> run = guard(model, global_batch_size=64, device="t4")
        >>> run.describe()  # doctest: +SKIP
        'global batch 64 = micro-batch 16 × 4 accumulation steps × 1 replica'
    """
    steps = check_accumulation_steps(accumulation_steps)
    check_count("global_batch_size", global_batch_size)
    try:
        budget = budget_for(runtime=runtime, memory_budget=memory_budget, device=device,
                            num_replicas=num_replicas)
    except UnknownMemoryError as error:
        budget, reason = None, str(error)
        replicas = num_replicas or runtime.num_replicas
    else:
        replicas = budget.num_replicas
    split_batch(global_batch_size, replicas, 1 if steps == "auto" else steps,
                in_a_step=batch_of_the_data)
    if budget is not None:
        if steps != "auto":  # the micro-batch "auto" rematerialization makes fit
            plan_arguments.setdefault("micro_batch_target",
                                      split_batch(global_batch_size, replicas, steps))
        plan_settings = planner.settings(global_batch_size=global_batch_size, budget=budget,
                                         **plan_arguments)
        try:
            memory_plan = planner.plan(model, plan_settings, smaller_variants=smaller_variants)
        except Exception as error:  # noqa: BLE001 - a model the planner cannot size still trains
            reason = (f"the planner could not plan this run ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''})")
        else:
            return _checked(memory_plan, steps, allow_over_budget, switches)
    unplanned(model, reason, auto=steps == "auto",
              per_replica_batch=global_batch_size // replicas, switches=switches)
    return RunPlan(global_batch_size, replicas, steps,
                   split_batch(global_batch_size, replicas, steps), skipped=reason)


def _checked(memory_plan: MemoryPlan, steps: int | str, allow_over_budget: bool,
             switches: Switches) -> RunPlan:
    planner.check(memory_plan, accumulation_steps=None if steps == "auto" else steps,
                  allow_over_budget=allow_over_budget, switches=switches)
    if steps == "auto":
        # Nothing fits and the budget may be exceeded: the smallest micro-batch is the best try.
        steps = memory_plan.accumulation_steps or memory_plan.per_replica_batch_size
    return RunPlan(memory_plan.global_batch_size, memory_plan.num_replicas, steps,
                   split_batch(memory_plan.global_batch_size, memory_plan.num_replicas, steps),
                   plan=memory_plan)


# Models already warned about: one warning per model, not one per `fit`.
_WARNED: weakref.WeakSet = weakref.WeakSet()


def unplanned(model: Any, reason: str, *, auto: bool, per_replica_batch: int | None = None,
              switches: Switches = PYTHON) -> None:
    """The one policy for a run that cannot be planned: "auto" stops (it needs the plan's k);
    any other k trains without the check, after one `UnplannedRunWarning` per model.

    Raises:
        ValueError: `auto`, naming `reason` and what to set instead in the caller's `switches`.
    """
    if auto:
        divides = (f" that divides the per-replica batch ({per_replica_batch})"
                   if per_replica_batch else "")
        raise ValueError(
            f"`{switches.spell('accumulation_steps', 'auto')}` takes k from the memory plan, "
            f"and there is none: {reason}. Set k to a number{divides}, e.g. "
            f"`{switches.spell('accumulation_steps', 1)}`.")
    try:
        if model in _WARNED:
            return
        _WARNED.add(model)
    except TypeError:  # not weakly referable: warned every time
        pass
    warnings.warn(f"memory check skipped, {reason}; training without the check.",
                  UnplannedRunWarning, stacklevel=3)
