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
from tfmem.memory.memory_plan import MemoryPlan, MemoryPlanError
from tfmem.memory.plan_report import PYTHON, Switches, describe_split, format_bytes
from tfmem.runtime.budget import UnknownMemoryError, budget_for
from tfmem.runtime.cluster import check_accumulation_steps, check_count, divisors, split_batch

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
        compiled_peak_bytes: XLA's figure for the compiled step of this split (arguments +
            outputs + temporaries − aliased, per device) when it decided the split, else None.
    """

    global_batch_size: int
    num_replicas: int
    accumulation_steps: int
    micro_batch_size: int
    plan: MemoryPlan | None = None
    skipped: str | None = None
    compiled_peak_bytes: int | None = None

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

    def table(self) -> str:
        """The plan's breakdown of this split and, where XLA decided it, XLA's figure."""
        lines = [self.plan.table(self.accumulation_steps)] if self.plan is not None else [
            self.describe()]
        if self.compiled_peak_bytes is not None:
            lines.append(f"  {'compiled step (XLA)':<34} "
                         f"{format_bytes(self.compiled_peak_bytes):>11}   arguments + outputs "
                         "+ temporaries − aliased: the figure the split was checked with")
        return "\n".join(lines)


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
    compiled_peak: Callable[[int], int] | None = None,
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
        compiled_peak: on an XLA backend, the peak bytes per device of the compiled train
            step with k accumulation steps (`AccumModel.compiled_step_memory`). Given, a
            setting the plan refuses is checked again with XLA's figure: a k that fits
            trains, and "auto" takes the largest micro-batch whose compiled step fits.
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
            return _decided(memory_plan, steps, allow_over_budget, switches, compiled_peak)
    unplanned(model, reason, auto=steps == "auto",
              per_replica_batch=global_batch_size // replicas, switches=switches)
    return RunPlan(global_batch_size, replicas, steps,
                   split_batch(global_batch_size, replicas, steps), skipped=reason)


def _decided(memory_plan: MemoryPlan, steps: int | str, allow_over_budget: bool,
             switches: Switches, compiled_peak: Callable[[int], int] | None) -> RunPlan:
    """The plan's split; one it refuses, XLA's compiled step decides where it can be read."""
    try:
        return _checked(memory_plan, steps, allow_over_budget, switches)
    except MemoryPlanError as refusal:
        if compiled_peak is None:
            raise
        try:
            return _compiled(memory_plan, steps, switches, compiled_peak)
        except MemoryPlanError:
            raise
        except Exception as error:  # noqa: BLE001 - a step not compiled ahead: the plan's no
            raise refusal from error


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


def _compiled(memory_plan: MemoryPlan, steps: int | str, switches: Switches,
              compiled_peak: Callable[[int], int]) -> RunPlan:
    """The split whose compiled step fits the budget by XLA's figure: a set k if it fits;
    with "auto" the smallest k that fits (the largest micro-batch), bisected over the k that
    divide the batch, as the compiled peak grows with the micro-batch; each k compiled once."""
    per_replica = memory_plan.per_replica_batch_size
    options = sorted(per_replica // size for size in divisors(per_replica))  # k, ascending
    peaks: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in peaks:
            peaks[k] = compiled_peak(k)
        return peaks[k] <= memory_plan.budget_bytes

    def smallest_fitting() -> int | None:
        if not fits(options[-1]):
            return None
        low, high = 0, len(options) - 1  # options[high] fits
        while low < high:
            middle = (low + high) // 2
            if fits(options[middle]):
                high = middle
            else:
                low = middle + 1
        return options[high]

    if steps == "auto" or not fits(steps):
        best = smallest_fitting()
        if steps == "auto" and best is not None:
            steps = best
        else:
            refused = per_replica if steps == "auto" else steps
            fitting = None if best is None else (per_replica // best, best, peaks[best])
            raise MemoryPlanError(memory_plan, per_replica // refused, refused, peaks[refused],
                                  switches, compiled_fit=fitting)
    return RunPlan(memory_plan.global_batch_size, memory_plan.num_replicas, steps,
                   split_batch(memory_plan.global_batch_size, memory_plan.num_replicas, steps),
                   plan=memory_plan, compiled_peak_bytes=peaks[steps])


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
