"""The supervisor of `--memory-limit`: the training runs in child processes held under it.

Each child (`python -m tfmem.finetune SPEC`) runs `attempt.run_attempt`; the two exchange JSON
files in `output/.attempts`: the attempt asked for, the split the child took, its outcome.
A child stopped at the limit is started again from the last resume point with the split the
out-of-memory policy (`tfmem.training.recovery`) gives, until it fits or the policy stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import traceback

from tfmem import cli
from tfmem.finetune.attempt import Attempt, run_attempt
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts
from tfmem._sizes import format_bytes
from tfmem.remat.spec import RematSpec
from tfmem.runtime import memory_cap
from tfmem.training import recovery

ATTEMPTS = ".attempts"
ATTEMPT_FILES = ("spec.json", "outcome.json", "split.json")


@contextlib.contextmanager
def _attempts_directory(output: str):
    """`output/.attempts`, where the supervising process and its training processes exchange
    their files: in the run directory (nothing is left in /tmp by a killed run), emptied of
    those files at every start and at the end."""
    workdir = os.path.join(output, ATTEMPTS)

    def clear():
        for name in ATTEMPT_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(workdir, name))
        with contextlib.suppress(OSError):  # not empty: what else is there is left alone
            os.rmdir(workdir)

    clear()  # what a killed run left
    os.makedirs(workdir, exist_ok=True)
    try:
        yield workdir
    finally:
        clear()


def supervise(config: FinetuneConfig, cap: int, data: DataFacts, output: str) -> dict:
    """Trains in child processes held under `cap`; after each stop at it, goes on from the last
    resume point with the split the out-of-memory policy gives (`recovery.next_split`)."""
    attempt = Attempt(config.accumulation_steps, locked=True, data=dataclasses.asdict(data),
                      memory_limit=cap)
    with _attempts_directory(output) as workdir:
        while True:
            status, watch, outcome, split = _attempt(config, attempt, cap, workdir)
            config = dataclasses.replace(config, overwrite=False)  # the next one resumes
            if status == 0 and outcome is not None:
                return outcome["results"]
            if not watch.reason:
                raise _child_failure(status, outcome)
            if split is None:
                raise cli.UsageError(
                    f"the training process reached --memory-limit {format_bytes(cap)} before "
                    f"its first step ({watch.reason}): the framework and the model alone need "
                    "more; raise --memory-limit (or pass --memory-limit none)")
            before = recovery.Split(split["micro_batch_size"], split["accumulation_steps"],
                                    RematSpec.from_flag(config.rematerialize).mode == "full")
            after = recovery.next_split(
                before, recomputes_more=lambda: bool(split.get("recompute_more")),
                ran_out=lambda tried: (f"{tried} still reached --memory-limit "
                                       f"{format_bytes(cap)} ({format_bytes(watch.highest)} "
                                       "held)"),
                advice=lambda: _plan_under(config, attempt, cap, workdir),
                full="--rematerialize full")
            if isinstance(after, recovery.Stop):
                raise cli.UsageError(after.message)
            print(_resuming(before, after, cap, watch.highest, config.global_batch_size),
                  flush=True)
            if after.rematerialize_full and not before.rematerialize_full:
                config = dataclasses.replace(config, rematerialize="full")
            else:
                attempt = dataclasses.replace(attempt, accumulation_steps=after.accumulation_steps)
            attempt = dataclasses.replace(attempt, recoveries=(
                *attempt.recoveries,
                {**recovery.record(before, after), "held_bytes": watch.highest,
                 "limit_bytes": cap}))


def _resuming(before: recovery.Split, after: recovery.Split, cap: int, held: int,
              global_batch_size: int) -> str:
    """The line a stop at the limit prints: where it was reached, and the split to go on with."""
    k = before.accumulation_steps
    reached = (f"finetune: memory limit {format_bytes(cap)} reached at micro-batch "
               f"{before.micro_batch_size} × {k} accumulation step{'s' if k > 1 else ''} "
               f"({format_bytes(held)} held); resuming from the last resume point with ")
    if after.rematerialize_full and not before.rematerialize_full:
        return (f"{reached}--rematerialize full ({recovery.RECOMPUTED}), micro-batch "
                f"{after.micro_batch_size} × {after.accumulation_steps}")
    return (f"{reached}micro-batch {after.micro_batch_size} × {after.accumulation_steps} "
            f"accumulation steps, the same global batch {global_batch_size}")


def _plan_under(config: FinetuneConfig, attempt: Attempt, cap: int, workdir: str) -> str:
    """What the plan for a budget of `cap` says fits: a dry run in this process (no training
    process runs any more, and this one has the framework imported already)."""
    path = os.path.join(workdir, "split.json")
    with contextlib.suppress(FileNotFoundError):  # the last training process's
        os.remove(path)
    run_attempt(dataclasses.replace(config, dry_run=True, allow_over_budget=True),
                dataclasses.replace(attempt, accumulation_steps="auto", plan_budget=cap,
                                    split_file=path))
    split = _read_json(path)
    if split and split["nothing_fits"]:
        # The plan's reasons (its terms, the changes it tried) make a paragraph: the error
        # keeps their first clause, a few lines in all.
        reason, tried, _ = split["nothing_fits"].partition(". None of the changes checked fits")
        reason = re.sub(r" \([^)]*\)", "", reason).split(": ")[0].split(". ")[0]
        return f"the plan for that budget: {reason}" + (
            ", nor any change it checked: raise --memory-limit (scripts/plan.py lists them)"
            if tried else " (scripts/plan.py shows what fits)")
    if split:
        return (f"the plan for that budget picks micro-batch {split['micro_batch_size']} × "
                f"{split['accumulation_steps']}, which is over it here (its estimate is low "
                "for this run): use --precision mixed_bfloat16, --freeze-backbone, a smaller "
                "--image-size or model, or raise --memory-limit")
    return ("use --precision mixed_bfloat16, --freeze-backbone, a smaller --image-size or "
            "model, or raise --memory-limit (scripts/plan.py shows what fits)")


def _attempt(config: FinetuneConfig, attempt: Attempt, cap: int, workdir: str):
    """Runs one training process under `cap`; returns its exit status, its watch, its outcome
    and the split it took (each None when it wrote none)."""
    paths = {name.removesuffix(".json"): os.path.join(workdir, name) for name in ATTEMPT_FILES}
    for path in paths.values():  # nothing of an earlier attempt is read as this one's
        if os.path.exists(path):
            os.remove(path)
    attempt = dataclasses.replace(attempt, split_file=paths["split"])
    with open(paths["spec"], "w") as file:
        json.dump({"config": dataclasses.asdict(config), "attempt": dataclasses.asdict(attempt),
                   "outcome_file": paths["outcome"]}, file)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-m", "tfmem.finetune", paths["spec"]], env=env,
                             preexec_fn=_die_with_parent)
    watch = memory_cap.MemoryWatch(child.pid, cap)
    watch.start()
    try:
        status = child.wait()
    except BaseException:  # Ctrl-C or a kill of this process: the child goes too
        child.kill()
        child.wait()
        raise
    finally:
        watch.stop()
    return status, watch, _read_json(paths["outcome"]), _read_json(paths["split"])


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervising process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
        pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


class _ChildTraceback(Exception):
    """The training process's own traceback, chained under its error (shown by --debug)."""


def _child_failure(status: int, outcome: dict | None) -> BaseException:
    """The error of a training process that failed on its own (not stopped by the limit)."""
    if outcome is None or "error" not in outcome:
        how = (f"was killed by {signal.Signals(-status).name}" if status < 0
               else f"ended with exit status {status}")
        return RuntimeError(f"the training process {how} without saying why; run again to "
                            "resume from its last resume point")
    kind = cli.UsageError if outcome["usage"] else RuntimeError
    error = kind(outcome["error"])
    try:  # raised, so that `--debug` prints it as a traceback, the child's inside
        raise _ChildTraceback("the training process's traceback:\n" + outcome["traceback"])
    except _ChildTraceback as cause:
        error.__cause__ = cause
    return error


def child_main(spec_path: str) -> None:
    """A training process of `supervise`: runs the attempt, reports its outcome in a file."""
    with open(spec_path) as file:
        spec = json.load(file)
    attempt = Attempt(**spec["attempt"])
    try:  # as a program: other libraries' warnings are shown only if it ends well
        with cli.one_line_warnings(), cli.held_warnings() as held:
            results = run_attempt(FinetuneConfig(**spec["config"]), attempt)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the supervisor
        outcome = {"error": cli.one_line(error), "usage": cli.is_usage_error(error),
                   "traceback": "".join(held) + traceback.format_exc()}
        status = 1
    else:
        outcome, status = {"results": results}, 0
    with open(spec["outcome_file"], "w") as file:
        json.dump(outcome, file)
    sys.exit(status)
