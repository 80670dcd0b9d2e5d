"""Out of memory inside a train step: the same global batch, in smaller micro-batches.

Where the framework raises when memory runs out (JAX on any device, TensorFlow on a GPU),
`fit_resumable` catches the error, drops the failed step, halves the micro-batch and doubles
`accumulation_steps` (the global batch, and so the training, stay the same), and goes on from
its last resume point. AccumModel is exact for any `k` and resuming is exact, so the run ends
with the weights of a run that used the smaller micro-batch from its start. At micro-batch 1
it turns on `rematerialize="full"` where that cuts segments the run does not cut yet (exact
too: only time changes). This module holds the decisions (`next_split`, the one policy, also
used by `scripts/finetune.py`'s `--memory-limit` supervisor); `tfmem.training.resume` does
the restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from tfmem import _keras_internals as internals
from tfmem.memory import guard, plan_report, remat_search
from tfmem.remat import runner
from tfmem.remat.spec import RematSpec
from tfmem.runtime import current
from tfmem.runtime.cluster import largest_divisor, split_batch
from tfmem.training.accumulation import plan_precision

# How each framework says it: TensorFlow's `tf.errors.ResourceExhaustedError` (by class name:
# no TensorFlow import on the JAX backend); JAX's runtime errors with XLA's status code, or
# with the allocator's words (a failure found when an asynchronously dispatched step's result
# is read is reported as INTERNAL: "Error dispatching computation: Out of memory allocating").
_ERROR_CLASSES = ("ResourceExhaustedError",)
_RUNTIME_ERROR_CLASSES = ("JaxRuntimeError", "XlaRuntimeError")
_RUNTIME_ERROR_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory")
_SAYS_WHAT = ("OOM when allocating", *_RUNTIME_ERROR_MARKS)


_OWN = object()  # `rematerialization_left`: the model's own setting or segments

# What a run that goes on rematerialized is told it changes.
RECOMPUTED = "activations recomputed in the backward pass: the same training, more time"


class OutOfMemoryError(RuntimeError):
    """Memory ran out where tfmem has nothing smaller to try: a train step at micro-batch 1,
    or the validation pass (whose batch is the data's)."""


def out_of_memory(error: BaseException) -> BaseException | None:
    """The framework's out-of-memory error in `error` or in what it was raised from, or None.

    JAX's trainer can raise a second error while cleaning up after the first (its donated
    state is gone), so the causes and contexts are searched too.
    """
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        name = type(current).__name__
        if name in _ERROR_CLASSES or (name in _RUNTIME_ERROR_CLASSES and any(
                mark in str(current) for mark in _RUNTIME_ERROR_MARKS)):
            return current
        pending += [current.__cause__, current.__context__]
    return None


def what_it_said(error: BaseException) -> str:
    """What could not be allocated, from the error's words (at most 160 characters)."""
    text = str(error)
    found = [text.find(mark) for mark in _SAYS_WHAT if mark in text]
    said = (text[min(found):] if found else text).strip()
    said = said.splitlines()[0] if said else type(error).__name__
    return said if len(said) <= 160 else said[:157] + "..."


# How Python spells the setting the policy turns on at micro-batch 1 (a program: its flag).
FULL_IN_PYTHON = 'rematerialize="full"'


@dataclasses.dataclass(frozen=True)
class Split:
    """How a train step splits its global batch: micro-batch × k, and whether it recomputes
    every segment it can (`rematerialize="full"`)."""

    micro_batch_size: int
    accumulation_steps: int
    rematerialize_full: bool = False

    def describe(self, full: str = FULL_IN_PYTHON) -> str:
        """E.g. 'micro-batch 1 × 4 accumulation steps with rematerialize="full"'."""
        return (f"micro-batch {self.micro_batch_size} × {self.accumulation_steps} "
                f"accumulation steps" + (f" with {full}" if self.rematerialize_full else ""))


@dataclasses.dataclass(frozen=True)
class Stop:
    """Nothing smaller can be tried: what to stop with."""

    message: str


def next_split(split: Split, *, recomputes_more: Callable[[], bool],
               ran_out: Callable[[str], str], advice: Callable[[], str],
               full: str = FULL_IN_PYTHON) -> Split | Stop:
    """The one out-of-memory policy: the split to go on with after `split` ran out, or a Stop.

    First the micro-batch halves (`halved`) and k grows so that the global batch stays the
    same; at micro-batch 1, `rematerialize="full"` once, where it recomputes more than the run
    does (`recomputes_more()`, asked only then); after that, a Stop whose message is
    `ran_out(what was tried)`, "and nothing smaller can be tried", and `advice()`.
    `full` spells the rematerialization setting in the caller's terms.

    Example:
        >>> next_split(Split(6, 2), recomputes_more=lambda: False, ran_out=str,
        ...            advice=str)
        Split(micro_batch_size=3, accumulation_steps=4, rematerialize_full=False)
    """
    micro, k = split.micro_batch_size, split.accumulation_steps
    smaller = halved(micro)
    if smaller is not None:
        return dataclasses.replace(split, micro_batch_size=smaller,
                                   accumulation_steps=k * micro // smaller)
    if not split.rematerialize_full and recomputes_more():
        return dataclasses.replace(split, rematerialize_full=True)
    return Stop(f"{ran_out(split.describe(full))}, and nothing smaller can be tried; "
                f"{advice()}")


def record(before: Split, after: Split) -> dict[str, Any]:
    """A recovery as a run records it (in its resume points and metrics.json)."""
    entry = {"micro_batch_size": before.micro_batch_size,
             "accumulation_steps": before.accumulation_steps,
             "to_micro_batch_size": after.micro_batch_size,
             "to_accumulation_steps": after.accumulation_steps}
    if after.rematerialize_full and not before.rematerialize_full:
        entry["to_rematerialize"] = "full"
    return entry


def halved(micro_batch_size: int) -> int | None:
    """The micro-batch after running out of memory: the largest divisor of `micro_batch_size`
    up to its half (so replicas × micro-batch × k still make the global batch); None below 2."""
    if micro_batch_size < 2:
        return None
    return largest_divisor(micro_batch_size, micro_batch_size // 2)


def can_recover(model: keras.Model) -> bool:
    """Whether `model` splits its batch into micro-batches (an AccumModel with a set `k`)."""
    return isinstance(getattr(model, "accumulation_steps", None), int) and hasattr(
        model, "plan_memory")


def smaller_split(model: keras.Model, global_batch_size: int | None, num_replicas: int,
                  error: BaseException) -> dict[str, Any]:
    """The next split of the global batch after `error`: `{"micro_batch_size", ...}`.

    Raises:
        OutOfMemoryError: the micro-batch is already 1, with what the plan says would fit.
    """
    k = model.accumulation_steps
    said = what_it_said(error)
    if global_batch_size is None:
        raise OutOfMemoryError(
            f"out of memory in a train step with accumulation_steps={k} ({said}); the data "
            "has no static batch size, so the micro-batch cannot be halved: batch it with "
            "drop_remainder=True")
    recomputing = RematSpec.parse(getattr(model, "rematerialize", None)).mode == "full"
    now = Split(split_batch(global_batch_size, num_replicas, k), k, recomputing)
    after = next_split(now, recomputes_more=lambda: rematerialization_left(model),
                       ran_out=lambda tried: f"out of memory in a train step at {tried} ({said})",
                       advice=lambda: what_would_fit(model, global_batch_size))
    if isinstance(after, Stop):
        raise OutOfMemoryError(after.message)
    return {**record(now, after), "error": said}


def rematerialization_left(model: keras.Model, setting=_OWN, cut=_OWN,
                           device_kind: str | None = None) -> bool:
    """Whether `rematerialize="full"` would recompute what `model` keeps now: its setting is
    None, "auto" or segments a plan chose (names and pairs are the user's choice), its graph
    is functional, its backend and device save memory by recomputing (not JAX on a CPU), and
    "full" cuts segments it does not cut already.

    `setting` and `cut` (the segments cut) default to an AccumModel's own; `device_kind` to the
    kind of the devices it runs on.
    """
    if setting is _OWN and not hasattr(model, "rematerialize"):
        return False  # not an AccumModel
    setting = RematSpec.parse(model.rematerialize if setting is _OWN else setting)
    if cut is _OWN:  # a plan's segments are cut at the next `fit`
        cut = (setting.chosen if setting.mode == "chosen"
               else getattr(model, "rematerialized_segments", ()))
    if setting.mode not in (None, "auto", "chosen"):
        return False
    if not internals.is_graph_network(internals.functional_of(model)):
        return False
    kind = current.current_runtime(model).kind if device_kind is None else device_kind
    if not runner.saves_memory(kind):
        return False
    try:
        full = remat_search.full(model)
    except ValueError:  # a graph the planner's walk cannot size
        return False
    return bool(full) and tuple(full) != tuple(cut)


def rematerialize_all(model: keras.Model) -> None:
    """Sets `model`'s `rematerialize` to "full" (an AccumModel); its next `fit` cuts it."""
    model._rematerialize = RematSpec("full")


def what_would_fit(model: keras.Model, global_batch_size: int) -> str:
    """What the memory plan of this device says about the run (shapes only, no allocation)."""
    advice = ("use mixed precision, freeze part of the model, or a smaller input or model "
              "(tfmem.plan shows what fits)")
    try:
        run = guard.guard(model, global_batch_size=global_batch_size,
                          accumulation_steps="auto", allow_over_budget=True,
                          runtime=current.current_runtime(model), optimizer=model.optimizer,
                          precision=plan_precision(model))
    except Exception as error:  # noqa: BLE001 - the out-of-memory error is the one to report
        return f"{advice}; the plan could not be made ({type(error).__name__}: {error})"
    plan = run.plan
    if plan is None:
        return advice
    if not plan.fits:
        return f"the plan for this device: {plan_report.format_nothing_fits(plan)}"
    return (f"the plan for this device picks micro-batch {run.micro_batch_size} × "
            f"{run.accumulation_steps}, which ran out of memory here (its estimate is low for "
            f"this run): {advice}")
