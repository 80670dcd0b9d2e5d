"""How a `MemoryPlan` reads: its breakdown table and the guard's error message."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # planner imports this module; the name is only for annotations
    from tfmem.memory.planner import MemoryPlan

# Where each breakdown term comes from, printed next to it.
_SOURCES = {
    "parameters": "all variables × their dtype size",
    "gradients": "trainable variables, float32 (alive until apply)",
    "optimizer slots": "Keras optimizer build(): slots × trainable bytes",
    "accumulation buffers": "AccumModel float32 gradient sums, k > 1",
    "mixed-precision copies": "compute-dtype kernel casts (+ unscaled grads, fp16)",
    "framework runtime": "CPU: TF import + traced step per variable (measured)",
    "input data": "global batch per replica × in-flight batches",
    "activations": "tensors the backward reads, from the model graph",
    "backward workspace": "2 × the largest tensor (its grads)",
    "measured fixed (probe)": "tfmem.probe: intercept of the measured line",
    "measured per-sample × micro-batch": "tfmem.probe: slope of the measured line",
    "input data beyond the probe": "extra input of the k-times larger batch",
}


def format_bytes(num_bytes: float) -> str:
    """`1536 * 2**20` → "1.50 GiB"; below 1 GiB in MiB."""
    if abs(num_bytes) >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def format_table(p: MemoryPlan, micro_batch_size: int | None = None,
                  accumulation_steps: int | None = None) -> str:
    b = micro_batch_size or p.micro_batch_size or 1
    k = accumulation_steps or max(p.per_replica_batch_size // b, 1)
    rows = p.breakdown(b, k)
    lines = [f"{p.model_name}: {p.num_parameters:,} parameters, {p.optimizer}, {p.precision}, "
             f"global batch {p.global_batch_size} = {p.num_replicas} replica(s) × micro-batch "
             f"{b} × {k} step(s), on {p.device}"]
    lines += [f"  {name:<34} {format_bytes(value):>11}   {_SOURCES[name]}"
              for name, value in rows.items()]
    total = sum(rows.values())
    lines.append(f"  {'total (peak per replica)':<34} {format_bytes(total):>11}   "
                 f"budget {format_bytes(p.budget_bytes)} = {p.safety:.0%} of "
                 f"{format_bytes(p.memory_per_replica)}")
    lines += [f"  note: {note}" for note in p.notes]
    return "\n".join(lines)


class MemoryPlanError(ValueError):
    """A training setting does not fit its memory budget (raised by `check`).

    Attributes:
        plan: the `MemoryPlan` that was checked.
        micro_batch_size, accumulation_steps: the setting that does not fit.
        needed_bytes: its predicted peak per replica.
    """

    def __init__(self, plan: MemoryPlan, micro_batch_size: int, accumulation_steps: int,
                 needed_bytes: int):
        self.plan, self.needed_bytes = plan, needed_bytes
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        head = (f"global batch {plan.global_batch_size} (micro-batch {micro_batch_size} × "
                f"{accumulation_steps} step(s) × {plan.num_replicas} replica(s)) needs "
                f"{format_bytes(needed_bytes)} per replica on {plan.device}, over the budget of "
                f"{format_bytes(plan.budget_bytes)} ({plan.safety:.0%} of "
                f"{format_bytes(plan.memory_per_replica)})")
        if plan.fits:
            fit = plan.peak_bytes(plan.micro_batch_size, plan.accumulation_steps)
            advice = (f"; micro-batch {plan.micro_batch_size} × {plan.accumulation_steps} steps "
                      f"fits in {format_bytes(fit)} (accumulation_steps="
                      f"{plan.accumulation_steps}).")
        else:
            state = plan.fixed_bytes(plan.per_replica_batch_size)
            advice = (f"; nothing fits, not even micro-batch 1: the model state, runtime, "
                      f"accumulation buffers and input data alone take {format_bytes(state)}. "
                      "Use a smaller "
                      "model or images, SGD (no slots) or mixed precision, more replicas, or "
                      "a device with more memory.")
        super().__init__(head + advice + " Pass `allow_over_budget=True` to run anyway.\n"
                         + format_table(plan, micro_batch_size, accumulation_steps))
