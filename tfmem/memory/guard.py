"""The one path from a run's settings to its split: plan → check → choose k → warn.

`AccumModel.fit` (and `fit_resumable` through `AccumModel.plan_memory`) and
`scripts/finetune.py` decide a run's micro-batch × accumulation steps here, and nowhere else:

1. `accumulation_steps` is checked (a positive int or "auto") and the global batch split over
   the replicas (`tfmem.runtime.cluster.split_batch`, the one message);
2. the run is planned (`planner.plan`) for its budget (`tfmem.runtime.budget`);
3. the plan is checked (`planner.check`): a setting over the budget raises `MemoryPlanError`
   unless `allow_over_budget`;
4. "auto" takes the plan's k (micro-batch 1 when nothing fits and the budget may be exceeded);
   on an XLA backend (JAX) the split is then checked with XLA's figure of its compiled step,
   which confirms it, lets a split the plan refused train, or moves "auto" down;
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

__all__ = ["RunPlan", "UncheckedSplitWarning", "UnplannedRunWarning", "guard", "unplanned"]


class UnplannedRunWarning(UserWarning):
    """A run trains without its memory checked: the planner could not plan it."""


class UncheckedSplitWarning(UserWarning):
    """XLA's figure of the compiled step could not be read: the split stands on the plan."""


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
            outputs + temporaries − aliased, per device) where it was read, else None. On a
            CPU the split was checked with it plus the plan's framework runtime.
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
            runtime = self.plan.runtime_bytes if self.plan is not None else 0
            checked = ("the figure the split was checked with" if not runtime else
                       "checked with the framework runtime above: "
                       f"{format_bytes(self.compiled_peak_bytes + runtime)}")
            lines.append(f"  {'compiled step (XLA)':<34} "
                         f"{format_bytes(self.compiled_peak_bytes):>11}   arguments + outputs "
                         f"+ temporaries − aliased; {checked}")
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
    compiled_peak: Callable[[int, MemoryPlan], int] | None = None,
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
        compiled_peak: on an XLA backend, `(k, plan) →` the peak bytes per device of the
            compiled train step with k accumulation steps and the plan's segments
            (`AccumModel.compiled_peaks`). Given, the
            plan's answer is checked with XLA's figure (plus, on a CPU, the plan's framework
            runtime, which the figure leaves out): a k the plan refuses trains if that fits;
            one it accepts is refused if that does not fit, and "auto" takes the largest
            micro-batch whose compiled step fits.
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
             switches: Switches,
             compiled_peak: Callable[[int, MemoryPlan], int] | None) -> RunPlan:
    """The plan's split, confirmed or moved by XLA's compiled step where it can be read: a
    split the plan refuses trains if its compiled step fits; one it accepts whose compiled
    step does not fit is refused (a set k); "auto" takes the largest micro-batch whose
    compiled step fits, searched from the plan's."""
    try:
        run = _checked(memory_plan, steps, allow_over_budget, switches)
    except MemoryPlanError as refusal:
        if compiled_peak is None:
            raise
        try:
            return _compiled(memory_plan, steps, switches, compiled_peak)
        except MemoryPlanError:
            raise
        except Exception as error:  # noqa: BLE001 - a step not compiled ahead: the plan's no
            _not_compiled(error, "refused")
            raise refusal from error
    if compiled_peak is None:
        return run
    try:
        peak = compiled_peak(run.accumulation_steps, memory_plan)
    except Exception as error:  # noqa: BLE001 - a step not compiled ahead: the plan's yes stands
        _not_compiled(error, "chosen")
        return run
    fits = peak + memory_plan.runtime_bytes <= memory_plan.budget_bytes
    if steps != "auto" and (fits or allow_over_budget):
        return dataclasses.replace(run, compiled_peak_bytes=peak)
    try:
        return _compiled(memory_plan, steps, switches, compiled_peak,
                         known={run.accumulation_steps: peak})
    except MemoryPlanError:
        if not allow_over_budget:
            raise
        return dataclasses.replace(run, compiled_peak_bytes=peak)  # nothing smaller fits


def _not_compiled(error: Exception, decision: str) -> None:
    """Says that the plan alone decides: XLA could not compile the step (`error`)."""
    what = str(error).strip().splitlines()
    warnings.warn(f"the split was {decision} by the plan alone: XLA's figure of the compiled "
                  f"step could not be read ({type(error).__name__}"
                  f"{': ' + what[0] if what else ''})", UncheckedSplitWarning, stacklevel=4)


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
              compiled_peak: Callable[[int, MemoryPlan], int],
              known: dict[int, int] | None = None) -> RunPlan:
    """The split whose compiled step fits the budget by XLA's figure (on a CPU with the
    plan's framework runtime, which XLA's figure leaves out): a set k if it fits; with
    "auto" the smallest k that fits (the largest micro-batch). The k that divide the batch
    are searched outward from the plan's (doubling the stride, then bisecting), as the
    compiled peak grows with the micro-batch; each k is compiled once (`known`: peaks
    already read)."""
    per_replica = memory_plan.per_replica_batch_size
    options = sorted(per_replica // size for size in divisors(per_replica))  # k, ascending
    peaks: dict[int, int] = dict(known or {})

    def needs(k: int) -> int:
        if k not in peaks:
            peaks[k] = compiled_peak(k, memory_plan)
        return peaks[k] + memory_plan.runtime_bytes

    def fits(index: int) -> bool:
        return needs(options[index]) <= memory_plan.budget_bytes

    if steps != "auto":
        start = options.index(steps)
    elif memory_plan.accumulation_steps in options:
        start = options.index(memory_plan.accumulation_steps)
    else:  # the plan fits nothing: from micro-batch 1
        start = len(options) - 1
    if steps == "auto" or not fits(start):
        best = _first_fitting(len(options), fits, start)
        if steps == "auto" and best is not None:
            steps = options[best]
        else:
            refused = per_replica if steps == "auto" else steps
            fitting = (None if best is None else
                       (per_replica // options[best], options[best], needs(options[best])))
            raise MemoryPlanError(memory_plan, per_replica // refused, refused, needs(refused),
                                  switches, compiled_fit=fitting)
    return RunPlan(memory_plan.global_batch_size, memory_plan.num_replicas, steps,
                   split_batch(memory_plan.global_batch_size, memory_plan.num_replicas, steps),
                   plan=memory_plan, compiled_peak_bytes=peaks[steps])


def _first_fitting(count: int, fits: Callable[[int], bool], start: int) -> int | None:
    """The first index in `range(count)` where `fits` (false, then true) holds, or None:
    from `start`, strides of 1, 2, 4, … towards the boundary, then a bisection."""
    if fits(start):
        high, low, stride = start, 0, 1  # high fits; the answer is in [low, high]
        while high - stride >= 0:
            if not fits(high - stride):
                low = high - stride + 1
                break
            high, stride = high - stride, stride * 2
    else:
        low, high, stride = start + 1, None, 1  # low - 1 does not fit
        while low < count:
            index = min(low - 1 + stride, count - 1)
            if fits(index):
                high = index
                break
            low, stride = index + 1, stride * 2
        if high is None:
            return None
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


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
