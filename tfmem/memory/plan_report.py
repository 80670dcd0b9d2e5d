"""How a plan reads: its breakdown table, its split, and the guard's error message.

Works on any object with `MemoryPlan`'s attributes; it imports no other planner module.
"""

from __future__ import annotations

import dataclasses
import shlex

from tfmem._sizes import format_bytes


@dataclasses.dataclass(frozen=True)
class Switches:
    """How the interface a plan is used from spells the settings its messages name.

    A message names the caller's own switches: `--accumulation-steps 4` and
    `--allow-over-budget` on the command line, `accumulation_steps=4` and
    `allow_over_budget=True` (`tfmem.plan`, the guard) or `check_memory=False`
    (`AccumModel.fit`) in Python.

    Attributes:
        allow_over_budget: how to run over the budget anyway.
        flags: settings are a program's flags (`--image-size 160`, `--freeze-backbone`);
            otherwise Python arguments (`image_size=160`).
        program: the command that takes them, where the next step is a whole command.
        settings: `(name, value)` pairs that command repeats from the planned run.
    """

    allow_over_budget: str = "allow_over_budget=True"
    flags: bool = False
    program: str = ""
    settings: tuple[tuple[str, object], ...] = ()

    def spell(self, name: str, value: object) -> str:
        """One setting: `("image_size", 160)` → "--image-size 160" or "image_size=160"."""
        if not self.flags:
            return f"{name}={value!r}"
        flag = "--" + name.replace("_", "-")
        return flag if value is True else f"{flag} {shlex.quote(str(value))}"

    def run(self, accumulation_steps: int, changes: tuple[tuple[str, object], ...] = ()
            ) -> str:
        """What runs the planned split: e.g. "--accumulation-steps 4", or with `changes`
        (a lever's settings) "--precision mixed_float16 --accumulation-steps 4"."""
        settings = dict(self.settings) | dict(changes) | {
            "accumulation_steps": accumulation_steps}
        words = [self.program] + [self.spell(name, value) for name, value in settings.items()]
        return (" " if self.flags else ", ").join(word for word in words if word)


PYTHON = Switches()
COMMAND_LINE = Switches("--allow-over-budget", flags=True)


def describe_split(global_batch_size: int, micro_batch_size: int, accumulation_steps: int,
                   num_replicas: int) -> str:
    """How a global batch is made, in the one wording tfmem prints everywhere.

    Example:
        >>> describe_split(64, 8, 1, 8)
        'global batch 64 = micro-batch 8 × 1 accumulation step × 8 replicas'
    """
    replicas = "replica" if num_replicas == 1 else "replicas"
    return (f"global batch {global_batch_size} = micro-batch {micro_batch_size} × "
            f"{_steps(accumulation_steps)} × {num_replicas} {replicas}")


def _steps(accumulation_steps: int) -> str:
    """`1` → "1 accumulation step", `4` → "4 accumulation steps"."""
    return f"{accumulation_steps} accumulation step{'' if accumulation_steps == 1 else 's'}"


def _setting(p, micro_batch_size, accumulation_steps) -> tuple[int, int]:
    b = micro_batch_size or p.micro_batch_size or 1
    return b, accumulation_steps or max(p.per_replica_batch_size // b, 1)


def format_split(p, accumulation_steps: int | None = None) -> str:
    """"global batch 64 = micro-batch 8 × 1 accumulation step × 8 replicas"."""
    k = accumulation_steps or p.accumulation_steps or p.per_replica_batch_size
    return describe_split(p.global_batch_size, p.per_replica_batch_size // k, k, p.num_replicas)


def format_table(p, micro_batch_size: int | None = None,
                 accumulation_steps: int | None = None, switches: Switches = PYTHON) -> str:
    """The breakdown of one setting (default: the plan's choice, or micro-batch 1); for the
    plan's choice, followed by why it was chosen and the switch to run it with."""
    b, k = _setting(p, micro_batch_size, accumulation_steps)
    rows = p.breakdown(b, k)
    lines = [f"{p.model_name}: {p.num_parameters:,} parameters, {p.optimizer}, {p.precision} "
             f"on {p.device}, {describe_split(p.global_batch_size, b, k, p.num_replicas)}"]
    lines += [f"  {term.label:<34} {format_bytes(value):>11}   {term.source}"
              for term, value in rows.items()]
    lines.append(f"  {'total (peak per replica)':<34} {format_bytes(sum(rows.values())):>11}   "
                 f"budget {format_bytes(p.budget_bytes)} = {p.safety:.0%} of "
                 f"{format_bytes(p.memory_per_replica)}")
    lines += [f"  note: {note}" for note in p.notes]
    if micro_batch_size is None and accumulation_steps is None:
        lines.append(format_choice(p, switches))
    return "\n".join(lines)


def format_choice(p, switches: Switches = PYTHON) -> str:
    """Why the plan chose its micro-batch × k (or that nothing fits), and what to run next.

    The chosen micro-batch divides the per-replica batch; the largest plain step that fits
    (`max_micro_batch`) need not, so the two are told apart.
    """
    if not p.fits:
        alternative = p.alternative
        text = format_nothing_fits(p)
        if alternative is not None and alternative.changes:
            if len(alternative.settings) == len(alternative.changes):
                text += "\nnext: " + switches.run(alternative.accumulation_steps,
                                                   alternative.settings)
            else:  # a change the caller named in words only
                text += (f"\nnext: {' + '.join(alternative.changes)}, with "
                         f"{switches.run(alternative.accumulation_steps)}")
        return text
    b, k, per_replica = p.micro_batch_size, p.accumulation_steps, p.per_replica_batch_size
    peak = format_bytes(p.peak_bytes(b, k))
    if k == 1:
        why = (f"chosen: one step of micro-batch {b} (no accumulation), {peak} of the "
               f"{format_bytes(p.budget_bytes)} budget")
    else:
        why = (f"chosen: micro-batch {b} × {_steps(k)}, {peak} of the "
               f"{format_bytes(p.budget_bytes)} budget: the largest micro-batch that divides "
               f"the {per_replica} samples per replica and fits")
        larger = min(d for d in range(b + 1, per_replica + 1) if per_replica % d == 0)
        needed = p.peak_bytes(larger, per_replica // larger)
        if needed > p.budget_bytes:
            why += (f" (the next, {larger} × {per_replica // larger}, needs "
                    f"{format_bytes(needed)})")
    if p.max_micro_batch != b:
        why += (f"; a plain step without accumulation fits up to micro-batch "
                f"{p.max_micro_batch}")
    return f"{why}\nnext: {switches.run(k)}"


def plot_lines(p) -> dict[str, tuple[list[int], list[float]]]:
    """The lines `scripts/plan.py --plot` draws, `{label: (micro-batches, peaks in GiB)}`: one
    plain step of micro-batch b and, when the plan accumulates, b × its k steps, the chosen
    point's own line (its accumulation buffers and k micro-batches of input count)."""
    top = max(p.per_replica_batch_size, int(1.25 * max(p.max_micro_batch, 1)), 2)
    sizes = sorted({1 + (top - 1) * i // 255 for i in range(256)})  # at most 256 points
    lines = {"one step of micro-batch b": (sizes, [p.peak_bytes(b, 1) / 2**30 for b in sizes])}
    if p.fits and p.accumulation_steps > 1:
        k = p.accumulation_steps
        lines[f"micro-batch b × {_steps(k)}"] = (sizes, [p.peak_bytes(b, k) / 2**30
                                                        for b in sizes])
    return lines


def format_nothing_fits(p) -> str:
    """Why no micro-batch fits, and the smallest change the planner checked to fit."""
    state = (f"parameters {format_bytes(p.parameter_bytes)} + gradients "
             f"{format_bytes(p.gradient_bytes)} + {p.optimizer} slots "
             f"{format_bytes(p.optimizer_bytes)} = {format_bytes(p.state_bytes)}")
    if p.state_bytes > p.budget_bytes:
        text = (f"the model state alone ({state}) exceeds the budget of "
                f"{format_bytes(p.budget_bytes)} per replica")
    else:
        text = (f"nothing fits, not even micro-batch 1: the model state ({state}), runtime, "
                f"accumulation buffers and input data take "
                f"{format_bytes(p.fixed_bytes(p.per_replica_batch_size))}")
    alternative = p.alternative
    if alternative is None:
        return text + ". Use a smaller model or images, or a device with more memory."
    if not alternative.changes:
        return (text + f". None of the changes checked fits ({'; '.join(alternative.tried)}): "
                "the model needs a device with more memory per replica, or more replicas.")
    return (text + f". Smallest change checked to fit: {' + '.join(alternative.changes)} → "
            f"micro-batch {alternative.micro_batch_size} × "
            f"{_steps(alternative.accumulation_steps)}, {format_bytes(alternative.peak_bytes)} "
            f"of the {format_bytes(p.budget_bytes)} budget")


def format_error(p, micro_batch_size: int, accumulation_steps: int, needed_bytes: int,
                 switches: Switches = PYTHON, compiled_fit: tuple | None = None) -> str:
    """The guard's message: what was asked, what it needs, and what would fit, in the
    caller's `switches`; with `compiled_fit` (micro-batch, k, peak of the split XLA fits),
    the figures are those of XLA's compiled step."""
    asked = describe_split(p.global_batch_size, micro_batch_size, accumulation_steps,
                           p.num_replicas)
    by_xla = " by XLA's compiled step" if compiled_fit else ""
    head = (f"{asked} needs {format_bytes(needed_bytes)} per replica on {p.device}{by_xla}, "
            f"over the "
            f"budget of {format_bytes(p.budget_bytes)} ({p.safety:.0%} of "
            f"{format_bytes(p.memory_per_replica)})")
    if compiled_fit:
        micro, k, peak = compiled_fit
        advice = (f"; micro-batch {micro} × {_steps(k)} fits in {format_bytes(peak)} by XLA's "
                  f"figure ({switches.run(k)}).")
    elif p.fits:
        fit = p.peak_bytes(p.micro_batch_size, p.accumulation_steps)
        advice = (f"; micro-batch {p.micro_batch_size} × {_steps(p.accumulation_steps)} fits "
                  f"in {format_bytes(fit)} ({switches.run(p.accumulation_steps)}).")
    else:
        advice = "; " + format_nothing_fits(p).rstrip(".") + "."
    return (head + advice + f" Pass `{switches.allow_over_budget}` to run anyway.\n"
            + format_table(p, micro_batch_size, accumulation_steps))
