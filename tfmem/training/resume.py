"""Training that survives a killed process: resume from the last step, not the last epoch.

Notebooks get disconnected and preemptible VMs get killed (`kill -9`, no warning). Keras's
`BackupAndRestore` restores the weights after such a kill, but it starts the interrupted epoch
again from its first batch, so the batches already trained on are trained on twice and the run
no longer matches an uninterrupted one. `fit_resumable` keeps, every `save_every_steps` updates,
a resume point: the model's weights *and* the optimizer's state (`model.save_weights` includes
both in Keras 3), and the position (epoch, step inside the epoch). On restart it loads both and
**skips the batches that were already consumed**, so with a deterministic pipeline a resumed
run ends with exactly the weights of an uninterrupted one.

A resume point is never trusted blindly: its weights are written under a temporary name,
flushed to disk, read back for their size and SHA-256, renamed, and only then is its
`backup-<n>.json` written (temporary name, fsync, rename). The previous point stays until the
new one is complete. On restart the newest point whose record and weights check out is used; a
damaged newest one falls back to the previous one with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

if TYPE_CHECKING:  # only in annotations: resuming needs no TensorFlow of its own
    import tensorflow as tf

from tfmem import _keras_internals as internals
from tfmem._sizes import itemsize
from tfmem.runtime.current import current_runtime, processes
from tfmem.training import recovery, run_directory
from tfmem.training.accumulation import global_batch_size

_POINT = re.compile(r"^backup-(\d+)\.json$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class TrainingDivergedError(RuntimeError):
    """The loss (or the weights) stopped being finite numbers: the run is stopped there.

    No resume point is saved from that update on, so the newest one in `backup_dir` holds the
    last finite weights. Lower the learning rate (or clip the gradients) and start again.

    Attributes:
        epoch: the epoch (from 1) of the update that diverged.
        step: that update's number in its epoch (from 1).
        loss: the loss reported there (nan or inf; a finite loss when the weights diverged).
        resume_point: `(epoch, step)` of the newest resume point (finite weights), counted
            as in the message (epoch from 1), or None when none was saved.
        facts: what happened and what is kept, without the advice that ends the message.
    """

    def __init__(self, facts: str, advice: str, *, epoch: int, step: int, loss: float,
                 resume_point: tuple[int, int] | None):
        super().__init__(f"{facts}; {advice}")
        self.facts = facts
        self.epoch, self.step, self.loss, self.resume_point = epoch, step, loss, resume_point


def _diverged(backup: _Backup, epoch: int, step: int, loss: float,
              what: str) -> TrainingDivergedError:
    """`epoch` from 0, `step` the update's number in it (from 1; 0: the epoch's end)."""
    at = f"at epoch {epoch + 1}, step {step}" if step else f"at the end of epoch {epoch + 1}"
    point = backup.latest
    kept = (point["epoch"] + 1, point["step"]) if point else None
    where = (f"the newest resume point in {backup.directory} (epoch {point['epoch'] + 1}, step "
             f"{point['step']}) holds the last finite weights" if point
             else "no resume point was saved")
    return TrainingDivergedError(
        f"training diverged: {what} {at}, and the run stopped there; {where}",
        "lower the learning rate (or clip the gradients) and start again",
        epoch=epoch + 1, step=step, loss=loss, resume_point=kept)


def _finite(model: keras.Model) -> bool:
    """Whether every floating weight of the model is a finite number."""
    return all(np.isfinite(weight).all() for weight in model.get_weights()
               if np.issubdtype(np.asarray(weight).dtype, np.inexact))


def _digest(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _state_bytes(model: keras.Model) -> int:
    """Bytes of the weights and optimizer variables: about the size of a weights file."""
    variables = list(model.weights)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    return sum(math.prod(v.shape) * itemsize(v.dtype) for v in variables)


class _Saver(keras.callbacks.Callback):
    """Saves a resume point every `save_every_steps` updates of one epoch; counts updates."""

    def __init__(self, backup: _Backup, epoch: int, first_step: int, save_every_steps: int,
                 steps_per_epoch: int):
        super().__init__()
        self._backup = backup
        self._epoch = epoch
        self._first_step = first_step
        self._save_every_steps = save_every_steps
        self._steps_per_epoch = steps_per_epoch
        self.updates = 0
        self.validating = False  # between the start and the end of the validation pass
        self.diverged: TrainingDivergedError | None = None

    def on_test_begin(self, logs=None):
        self.validating = True

    def on_test_end(self, logs=None):
        self.validating = False

    def on_train_batch_end(self, batch, logs=None):
        self.updates = batch + 1
        step = self._first_step + batch + 1
        loss = (logs or {}).get("loss")
        # The epoch's running mean: it is not finite from the first update whose loss is not.
        if loss is not None and not math.isfinite(float(loss)):
            self.diverged = _diverged(self._backup, self._epoch, step, float(loss),
                                      f"the loss is {float(loss)}")
            self.model.stop_training = True
            return
        # The epoch's last step is saved after `fit` returns, with the epoch's history.
        if step % self._save_every_steps == 0 and step < self._steps_per_epoch:
            self._backup.save(self.model, epoch=self._epoch, step=step)


class _Backup:
    """The backup directory: `backup-<n>.weights.h5` + `backup-<n>.json`, the newest two."""

    def __init__(self, directory: str, recoveries: list[dict] | None = None,
                 writer: bool = True):
        self.directory = directory
        # With several processes, one writes the points and every one reads them.
        self.writer = writer
        self.latest: dict[str, Any] | None = None
        # The run's recoveries from out of memory, recorded with each point.
        self.recoveries = [] if recoveries is None else recoveries

    def generations(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        found = (_POINT.match(name) for name in os.listdir(self.directory))
        return sorted((int(match.group(1)) for match in found if match), reverse=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _check(self, generation: int) -> dict[str, Any]:
        """The record of one point, or ValueError saying what is damaged."""
        name = f"backup-{generation}.json"
        try:
            with open(self._path(name)) as file:
                state = json.load(file)
            weights, size, digest = state["weights"], state["weights_bytes"], state["sha256"]
            missing = [key for key in ("generation", "epoch", "step", "history")
                       if key not in state]
            if missing:
                raise KeyError(", ".join(missing))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{name} is damaged ({type(error).__name__}: {error})") from None
        path = self._path(weights)
        if not os.path.exists(path):
            raise ValueError(f"{weights} is missing")
        if os.path.getsize(path) != size:
            raise ValueError(f"{weights} has {os.path.getsize(path)} bytes, {name} says {size}")
        if _digest(path) != digest:
            raise ValueError(f"{weights} does not match the SHA-256 recorded in {name}")
        return state

    def restore(self, model: keras.Model) -> dict[str, Any] | None:
        damaged = []
        for generation in self.generations():
            try:
                state = self._check(generation)
            except ValueError as error:
                damaged.append(str(error))
                continue
            # The optimizer's slots must exist before `load_weights` can fill them.
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
            try:
                model.load_weights(self._path(state["weights"]))
            except Exception as error:  # an intact file that does not fit: another model
                raise ValueError(
                    f"the resume point {self._path(state['weights'])} does not fit this model "
                    f"({type(error).__name__}: {str(error).splitlines()[0]}); it belongs to "
                    f"another run: use another backup directory, or delete {self.directory} "
                    "to start this run from the beginning") from None
            if damaged:
                print(f"tfmem: warning: the newest resume point in {self.directory} is "
                      f"damaged ({'; '.join(damaged)}); resuming from the one before it "
                      f"(epoch {state['epoch'] + 1}, step {state['step']})", file=sys.stderr)
            self.latest = state
            self._adopt_recoveries(model, state)
            return state
        if damaged:
            raise ValueError(
                f"no usable resume point in {self.directory}: {'; '.join(damaged)}; delete "
                f"{self.directory} to start the run again from its beginning")
        return None

    def _adopt_recoveries(self, model: keras.Model, state: dict[str, Any]) -> None:
        """After running out of memory, a run keeps the smaller micro-batch it went on with."""
        recorded = state.get("memory_recoveries") or []
        self.recoveries.extend(entry for entry in recorded if entry not in self.recoveries)
        steps = state.get("accumulation_steps")
        if recorded and recovery.can_recover(model) and isinstance(steps, int) and (
                steps > model.accumulation_steps):
            print(f"tfmem: resuming with accumulation_steps={steps} (instead of "
                  f"{model.accumulation_steps}), which this run took after running out of "
                  "memory", file=sys.stderr)
            _set_accumulation_steps(model, steps)
        if (any(entry.get("to_rematerialize") == "full" for entry in recorded)
                and recovery.can_recover(model)
                and recovery.rematerialization_left(model)):
            print('tfmem: resuming with rematerialize="full", which this run took after '
                  "running out of memory at micro-batch 1", file=sys.stderr)
            recovery.rematerialize_all(model)

    def save(self, model: keras.Model, *, epoch: int, step: int, history=None) -> None:
        if not _finite(model):  # an update with a finite loss can still make them inf or nan
            # A point at the start of an epoch follows the previous epoch's last update.
            raise _diverged(self, epoch - (step == 0), step, math.nan,
                            "the weights are no longer finite numbers")
        if not self.writer:
            # Saving takes part in collectives (Keras makes variables while it saves), so every
            # process saves; only the writer's file is kept.
            with tempfile.TemporaryDirectory(prefix="tfmem-resume-") as scratch:
                model.save_weights(os.path.join(scratch, "point.weights.h5"))
            return
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # leftovers of a save that was killed
            if name.startswith(".tmp-"):
                os.remove(self._path(name))
        generations = self.generations()
        generation = generations[0] + 1 if generations else 0
        weights = f"backup-{generation}.weights.h5"
        temporary = self._path(f".tmp-{weights}")
        needed = max(_state_bytes(model), os.path.getsize(self._path(self.latest["weights"]))
                     if self.latest else 0)
        free = shutil.disk_usage(self.directory).free
        if free < needed * 1.1 + (1 << 16):  # a margin for the file's own structure
            raise self._no_space(f"{free / 1e6:.1f} MB free, a resume point needs about "
                                 f"{needed / 1e6:.1f} MB")
        state = {
            "generation": generation, "weights": weights, "epoch": epoch, "step": step,
            "history": history if history is not None else (self.latest or {}).get(
                "history", {}),
            "accumulation_steps": getattr(model, "accumulation_steps", None),
            "memory_recoveries": list(self.recoveries),
        }
        try:
            model.save_weights(temporary)
            with open(temporary, "rb+") as file:
                os.fsync(file.fileno())
            state["weights_bytes"], state["sha256"] = os.path.getsize(temporary), _digest(
                temporary)
            os.replace(temporary, self._path(weights))
            record = self._path(f".tmp-backup-{generation}.json")
            with open(record, "w") as file:
                json.dump(state, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(record, self._path(f"backup-{generation}.json"))
            _fsync_directory(self.directory)
        except Exception as error:
            for path in (temporary, self._path(weights),
                         self._path(f".tmp-backup-{generation}.json")):
                if os.path.exists(path):
                    os.remove(path)
            cause = getattr(error, "errno", None)
            if cause in _NO_SPACE or os.strerror(errno.ENOSPC) in str(error):
                raise self._no_space(os.strerror(cause if cause in _NO_SPACE
                                                 else errno.ENOSPC)) from None
            raise
        # Kept: this point and the last good one before it; gone: older and damaged ones.
        keep = {generation} | ({self.latest["generation"]} if self.latest else set())
        self.latest = state
        for old in set(generations) - keep:
            for name in (f"backup-{old}.json", f"backup-{old}.weights.h5"):
                if os.path.exists(self._path(name)):
                    os.remove(self._path(name))

    def _no_space(self, detail: str) -> OSError:
        kept = (f"the resume point of epoch {self.latest['epoch'] + 1}, step "
                f"{self.latest['step']} is intact" if self.latest else
                "no resume point was written yet")
        return OSError(errno.ENOSPC, f"no space to save a resume point in {self.directory} "
                                     f"({detail}); {kept}; free some space and start again")


def _one_process() -> bool:
    return processes.count == 1


def _check_same_point(backup: _Backup, state: dict[str, Any] | None) -> None:
    """With several processes: each must have found the same resume point."""
    if _one_process():
        return
    found = processes.gather([-1, 0, 0] if state is None else
                             [state["generation"], state["epoch"], state["step"]])
    if any(point != found[0] for point in found):
        where = "; ".join(
            f"process {index}: " + ("none" if point[0] < 0 else
                                    f"epoch {point[1] + 1}, step {point[2]}")
            for index, point in enumerate(found))
        raise ValueError(
            f"the processes found different resume points in {backup.directory} ({where}): "
            "backup_dir must be one directory that every process sees (a shared file system, "
            "e.g. NFS or a mounted bucket), not a local one on each host")
    # Every process has read the point before the first one writes the next.
    processes.barrier("tfmem.fit_resumable.restored")


def _set_accumulation_steps(model: keras.Model, steps: int) -> None:
    model.accumulation_steps = steps  # the step functions are traced again
    model._auto_accumulation = False  # `fit` keeps this k, it no longer picks one


def _recover(model, backup, rows, failure, epoch) -> None:
    """After a step ran out of memory: the smaller split, said and recorded."""
    internals.drop_jax_state(model)
    split = recovery.smaller_split(model, rows,
                                   current_runtime(model).num_replicas, failure)
    split.update(epoch=epoch + 1, in_process=True)
    _set_accumulation_steps(model, split["to_accumulation_steps"])
    recomputed = ""
    if split.get("to_rematerialize") == "full":
        recovery.rematerialize_all(model)
        recomputed = f' and rematerialize="full" ({recovery.RECOMPUTED})'
    backup.recoveries.append(split)
    point = backup.latest
    print(f"tfmem: a train step of epoch {epoch + 1} ran out of memory at micro-batch "
          f"{split['micro_batch_size']} × {split['accumulation_steps']} ({split['error']}); "
          f"going on from the resume point of epoch {point['epoch'] + 1}, step "
          f"{point['step']} with micro-batch {split['to_micro_batch_size']} × "
          f"{split['to_accumulation_steps']}{recomputed}, the same global batch",
          file=sys.stderr, flush=True)


def _validation_out_of_memory(model, train_rows, validation_data, epoch, failure) -> str:
    """What to do when the validation pass, not a train step, ran out of memory: a smaller
    micro-batch of training would not help."""
    rows = global_batch_size(validation_data)
    at = f"at its batch of {rows} rows" if rows else "at its batch"
    steps = getattr(model, "accumulation_steps", 1)
    advice = "batch the validation data smaller"
    if train_rows and isinstance(steps, int):
        micro = train_rows // steps  # over all replicas
        advice += (f", e.g. at {micro} rows: the training's micro-batch over its replicas, "
                   "which the train steps ran")
    return (f"out of memory in the validation pass of epoch {epoch + 1} {at} "
            f"({recovery.what_it_said(failure)}): "
            f"the train steps fit; {advice}, and start again (the run resumes from its last "
            "resume point)")


class _FromBatch(keras.utils.PyDataset):
    """A `PyDataset` from its `first` batch on (its batches are indexed)."""

    def __init__(self, dataset: keras.utils.PyDataset, first: int):
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset, self.first = dataset, first

    def __getitem__(self, index):
        return self.dataset[self.first + index]

    @property
    def num_batches(self):
        total = self.dataset.num_batches
        return None if total is None else max(total - self.first, 0)

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


def _from_step(data, step: int, batch_size: int | None) -> dict[str, Any]:
    """`fit`'s data arguments for an epoch's data from its `step`-th batch on: a tf.data
    dataset skips (`.skip`), a `PyDataset` is indexed from there, arrays are sliced.

    Raises:
        TypeError: `data` is none of these.
    """
    if hasattr(data, "skip"):  # a tf.data.Dataset
        return {"x": data.skip(step)}
    if isinstance(data, keras.utils.PyDataset):
        return {"x": _FromBatch(data, step) if step else data}
    if isinstance(data, tuple) and 2 <= len(data) <= 3:
        start = step * (batch_size or 32)  # Keras's default batch is 32
        parts = [keras.tree.map_structure(lambda array: array[start:], part) for part in data]
        return dict(zip(("x", "y", "sample_weight"), parts))
    raise TypeError(
        f"`make_dataset` returned a {type(data).__name__}; return a tf.data.Dataset, a "
        "keras.utils.PyDataset, or a tuple (x, y) or (x, y, sample_weight) of arrays (batched "
        "by `batch_size`, passed to fit_resumable)")


def _rows_per_step(data: dict[str, Any], batch_size: int | None) -> int | None:
    """Rows of one step of `fit` over `_from_step`'s arguments (None: not known)."""
    return global_batch_size(data["x"], batch_size)


def _check_learning_rate(model: keras.Model) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    rate = optimizer.learning_rate  # a variable, or a schedule's value now
    value = float(np.asarray(getattr(rate, "value", rate)))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"the optimizer's learning rate is {value}; pass a finite learning "
                         "rate >= 0 (e.g. 1e-3)")


def describe_trained(epoch: int, step: int) -> str:
    """What a run at `(epoch, step)` has trained: `(2, 0)` → "2 epochs", `(2, 5)` → "2 epochs
    and 5 updates of epoch 3"."""
    done = f"{epoch} epoch{'s' if epoch != 1 else ''}"
    return done + (f" and {step} update{'s' if step != 1 else ''} of epoch {epoch + 1}"
                   if step else "")


def epochs_needed(epoch: int, step: int) -> int:
    """The fewest epochs a run resumed at `(epoch, step)` can have: those it has begun."""
    return epoch + (step > 0)


def trained_so_far(backup_dir: str | os.PathLike) -> tuple[int, int] | None:
    """`(epoch, step)` of the newest resume point in `backup_dir` whose record reads (its
    weights unchecked: a quick look before a run starts), or None."""
    backup = _Backup(os.fspath(backup_dir))
    for generation in backup.generations():
        try:
            with open(backup._path(f"backup-{generation}.json")) as file:
                state = json.load(file)
            return int(state["epoch"]), int(state["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None



def fit_resumable(
    model: keras.Model,
    make_dataset: Callable[[int], Any],
    *,
    epochs: int,
    steps_per_epoch: int,
    backup_dir: str | os.PathLike,
    save_every_steps: int | None = None,
    validation_data: tf.data.Dataset | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = "auto",
    run_config: Mapping[str, Any] | None = None,
    memory_recoveries: list[dict] | None = None,
    **fit_kwargs: Any,
) -> dict[str, list[float]]:
    """Trains a compiled model for `epochs`, resuming from `backup_dir` if a run was killed.

    Args:
        model: a compiled, built Keras model (e.g. an `AccumModel`).
        make_dataset: `epoch ->` that epoch's (global) batches, in an order that depends only
            on `epoch` (e.g. `image_dataset(..., seed=seed + epoch)`): a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, or a tuple `(x, y)` / `(x, y, sample_weight)` of arrays
            (batched by a `batch_size` in `fit_kwargs`, default 32). Called once per epoch;
            the batches a killed run already trained on are skipped (`.skip`, by index, or by
            slicing), so none needs TensorFlow.
        epochs: total number of epochs of the run (not the number still to do).
        steps_per_epoch: optimizer updates per epoch (`num_examples // global_batch_size`).
        backup_dir: where the resume points live. Use the same directory to resume; one
            process at a time (a second one raises `RunDirectoryBusyError`).
        save_every_steps: save every this many updates; default `steps_per_epoch` (the end of
            each epoch). Smaller loses less work to a kill but writes more often.
        validation_data: evaluated at the end of each epoch, as in `fit`.
        callbacks: further Keras callbacks, passed to each epoch's `fit`.
        verbose: as in `fit`.
        run_config: the settings that define the run (JSON values, e.g. the learning rate
            and batch size); recorded in `backup_dir` and compared on every restart.
        memory_recoveries: a list to which each recovery of the run from out of memory is
            appended, as a dict (those of earlier processes of the run, read from the resume
            point, included). When a train step of an `AccumModel` runs out of memory (JAX on
            any device, TensorFlow on a GPU), the step is dropped, the micro-batch halved and
            `accumulation_steps` doubled (the same global batch), and training goes on from
            the last resume point; one line on stderr says so. A run that starts with no
            resume point saves one first, so that there is one to go back to.
        **fit_kwargs: further arguments of the model's `fit` (e.g. `AccumModel.fit`'s
            `check_memory=False` when the plan was already checked).

    Returns:
        The history over all epochs of the run, resumed ones included: `{"loss": [...], ...}`.

    Raises:
        ValueError: a count is not a positive int; the learning rate is not finite or is
            negative; `backup_dir` is a file or cannot be written; `epochs` is fewer than the
            run in `backup_dir` has begun; `run_config` differs from the recorded one
            (naming each difference); no resume point in `backup_dir` is usable (naming the
            damage); `make_dataset` gave fewer than `steps_per_epoch` batches.
        OSError: no space left to save a resume point (`errno.ENOSPC`); the previous resume
            point is left intact.
        TrainingDivergedError: the loss or the weights stopped being finite numbers; the run
            stopped at that update, and the newest resume point holds finite weights.
        tfmem.training.recovery.OutOfMemoryError: a step ran out of memory at micro-batch 1,
            with what the memory plan says would fit; or the validation pass ran out of
            memory (a smaller micro-batch would not help), with a batch to evaluate at.

    Example:
        >>> history = tfmem.fit_resumable(
        ...     model, lambda epoch: tfmem.image_dataset(..., seed=epoch),
        ...     epochs=10, steps_per_epoch=500, backup_dir="run/backup", save_every_steps=50)
    """
    save_every_steps = steps_per_epoch if save_every_steps is None else save_every_steps
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch),
                        ("save_every_steps", save_every_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    _check_learning_rate(model)
    backup = _Backup(os.fspath(backup_dir), memory_recoveries, writer=processes.index == 0)
    if backup.writer:  # a file in the way, a read-only disk: said before any work
        run_directory.check_writable(backup.directory, (), what="backup_dir")
    with (run_directory.lock(backup.directory, "backup_dir") if backup.writer
          else contextlib.nullcontext()):
        if run_config is not None and backup.writer:
            run_directory.check_config(
                backup.directory, run_config, holds_run=bool(backup.generations()),
                how_to_fix=f"use another backup_dir, or delete {backup.directory} to start "
                "this run from the beginning")
        return _train(model, make_dataset, backup, epochs, steps_per_epoch, save_every_steps,
                      validation_data, callbacks, verbose, fit_kwargs)


def _train(model, make_dataset, backup, epochs, steps_per_epoch, save_every_steps,
           validation_data, callbacks, verbose, fit_kwargs) -> dict[str, list[float]]:
    state = backup.restore(model)
    _check_same_point(backup, state)
    epoch, step = (0, 0) if state is None else (state["epoch"], state["step"])
    if (epoch, step) > (epochs, 0):
        raise ValueError(
            f"`epochs` is {epochs}, but the run in {backup.directory} has trained "
            f"{describe_trained(epoch, step)} already; pass epochs={epochs_needed(epoch, step)} "
            "or more to go on with it, or another backup_dir for a new run")
    history: dict[str, list[float]] = {} if state is None else state["history"]
    if state is not None:  # said whatever `verbose` is: a resumed run is never silent
        print(f"Resuming from {backup.directory}: epoch {epoch + 1}, step {step} "
              f"of {steps_per_epoch}.")
    elif recovery.can_recover(model) and backup.writer and _one_process():
        # The point a step that runs out of memory goes back to.
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        backup.save(model, epoch=0, step=0, history={})
    while epoch < epochs:
        if step >= steps_per_epoch:  # killed between the epoch's last update and its save
            epoch, step = epoch + 1, 0
            continue
        batch_size = fit_kwargs.get("batch_size")
        data = _from_step(make_dataset(epoch), step, batch_size)
        saver = _Saver(backup, epoch, step, save_every_steps, steps_per_epoch)
        # JAX reports an out-of-memory when a value is read, which may be after `fit` returns
        # (the history, the resume point): all of the epoch is inside.
        try:
            result = model.fit(
                **data,
                initial_epoch=epoch,
                epochs=epoch + 1,
                steps_per_epoch=steps_per_epoch - step,
                validation_data=validation_data,
                shuffle=False,  # each epoch's order comes from make_dataset(epoch)
                callbacks=[saver, *callbacks],
                verbose=verbose,
                **fit_kwargs,
            )
            if saver.diverged is not None:
                raise saver.diverged
            if model.stop_training:  # a callback stopped the run (e.g. TerminateOnNaN)
                return history
            if saver.updates < steps_per_epoch - step:
                raise ValueError(
                    f"the data of epoch {epoch + 1} ran out after {step + saver.updates} of "
                    f"{steps_per_epoch} updates: steps_per_epoch (`num_examples // "
                    "global_batch_size`) is more than the data gives; pass the real number of "
                    "examples (`--num-examples`)")
            for key, values in result.history.items():
                history.setdefault(key, []).extend(float(value) for value in values)
            backup.save(model, epoch=epoch + 1, step=0, history=history)
        except Exception as error:
            failure = recovery.out_of_memory(error)
            if failure is not None and saver.validating:
                raise recovery.OutOfMemoryError(
                    _validation_out_of_memory(model, _rows_per_step(data, batch_size),
                                              validation_data, epoch, failure)) from error
            if (failure is None or not recovery.can_recover(model) or backup.latest is None
                    or not _one_process()):
                raise
            _recover(model, backup, _rows_per_step(data, batch_size), failure, epoch)
            state = backup.restore(model)
            epoch, step, history = state["epoch"], state["step"], state["history"]
            continue
        epoch, step = epoch + 1, 0
    return history
