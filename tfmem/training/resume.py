"""Training that survives a killed process: resume from the last step, not the last epoch.

Notebooks get disconnected and preemptible VMs get killed (`kill -9`, no warning). Keras's
`BackupAndRestore` restores the weights after such a kill, but it starts the interrupted epoch
again from its first batch, so the batches already trained on are trained on twice and the run
no longer matches an uninterrupted one. `fit_resumable` keeps, every `save_every_steps` updates,

- the model's weights *and* the optimizer's state (`model.save_weights` includes both in
  Keras 3: slots, `iterations`, the loss scale), and
- the position: epoch and step inside the epoch,

and on restart it loads both and **skips the batches that were already consumed**. Each epoch's
data comes from `make_dataset(epoch)`, so the order of an epoch does not depend on how many
epochs ran earlier in the same process: with a deterministic pipeline (a seed per epoch and
`tf.config.experimental.enable_op_determinism()`), a resumed run ends with exactly the weights of
an uninterrupted one.

A checkpoint is never half-written: the weights go to a new file, then `state.json` is replaced
atomically (`os.replace`) to point at it, then the previous weights file is removed. A kill at
any moment leaves a `state.json` whose weights file is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import keras

if TYPE_CHECKING:  # only in annotations: resuming needs no TensorFlow of its own
    import tensorflow as tf

STATE_FILE = "state.json"


class _Saver(keras.callbacks.Callback):
    """Saves weights + position every `save_every_steps` updates of one epoch."""

    def __init__(self, backup: "_Backup", epoch: int, first_step: int, save_every_steps: int,
                 steps_per_epoch: int):
        super().__init__()
        self._backup = backup
        self._epoch = epoch
        self._first_step = first_step
        self._save_every_steps = save_every_steps
        self._steps_per_epoch = steps_per_epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self._first_step + batch + 1
        # The epoch's last step is saved after `fit` returns, with the epoch's history.
        if step % self._save_every_steps == 0 and step < self._steps_per_epoch:
            self._backup.save(self.model, epoch=self._epoch, step=step)


class _Backup:
    """The backup directory: a `state.json` pointing at one complete weights file."""

    def __init__(self, directory: str):
        self.directory = directory
        self.state_path = os.path.join(directory, STATE_FILE)

    def load_state(self) -> dict[str, Any] | None:
        if not os.path.exists(self.state_path):
            return None
        with open(self.state_path) as file:
            return json.load(file)

    def restore(self, model: keras.Model) -> dict[str, Any] | None:
        state = self.load_state()
        if state is None:
            return None
        # The optimizer's slots must exist before `load_weights` can fill them.
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(os.path.join(self.directory, state["weights"]))
        return state

    def save(self, model: keras.Model, *, epoch: int, step: int, history=None) -> None:
        os.makedirs(self.directory, exist_ok=True)
        previous = self.load_state()
        generation = 0 if previous is None else previous["generation"] + 1
        weights = f"backup-{generation}.weights.h5"
        model.save_weights(os.path.join(self.directory, weights), overwrite=True)
        state = {
            "generation": generation,
            "weights": weights,
            "epoch": epoch,
            "step": step,
            "history": history if history is not None else (previous or {}).get("history", {}),
        }
        temporary = self.state_path + ".tmp"
        with open(temporary, "w") as file:
            json.dump(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.state_path)
        if previous is not None and previous["weights"] != weights:
            stale = os.path.join(self.directory, previous["weights"])
            if os.path.exists(stale):
                os.remove(stale)


def fit_resumable(
    model: keras.Model,
    make_dataset: Callable[[int], tf.data.Dataset],
    *,
    epochs: int,
    steps_per_epoch: int,
    backup_dir: str | os.PathLike,
    save_every_steps: int | None = None,
    validation_data: tf.data.Dataset | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = "auto",
    **fit_kwargs: Any,
) -> dict[str, list[float]]:
    """Trains a compiled model for `epochs`, resuming from `backup_dir` if a run was killed.

    Args:
        model: a compiled, built Keras model (e.g. an `AccumModel`).
        make_dataset: `epoch -> tf.data.Dataset` of that epoch's (global) batches, in an order
            that depends only on `epoch` (e.g. `image_dataset(..., seed=seed + epoch)`).
            Called once per epoch; the batches a killed run already trained on are skipped.
        epochs: total number of epochs of the run (not the number still to do).
        steps_per_epoch: optimizer updates per epoch (`num_examples // global_batch_size`).
        backup_dir: where the backup lives. Use the same directory to resume.
        save_every_steps: save every this many updates; default `steps_per_epoch` (the end of
            each epoch). Smaller loses less work to a kill but writes more often.
        validation_data: evaluated at the end of each epoch, as in `fit`.
        callbacks: further Keras callbacks, passed to each epoch's `fit`.
        verbose: as in `fit`.
        **fit_kwargs: further arguments of the model's `fit` (e.g. `AccumModel.fit`'s
            `check_memory=False` when the plan was already checked).

    Returns:
        The history over all epochs of the run, resumed ones included: `{"loss": [...], ...}`.

    Raises:
        ValueError: `epochs`, `steps_per_epoch` or `save_every_steps` is not a positive int.

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
    backup = _Backup(os.fspath(backup_dir))
    state = backup.restore(model)
    epoch, step = (0, 0) if state is None else (state["epoch"], state["step"])
    history: dict[str, list[float]] = {} if state is None else state["history"]
    if state is not None and verbose:
        print(f"Resuming from {backup.directory}: epoch {epoch + 1}, step {step} "
              f"of {steps_per_epoch}.")
    while epoch < epochs:
        if step >= steps_per_epoch:  # killed between the epoch's last update and its save
            epoch, step = epoch + 1, 0
            continue
        dataset = make_dataset(epoch).skip(step)
        saver = _Saver(backup, epoch, step, save_every_steps, steps_per_epoch)
        result = model.fit(
            dataset,
            initial_epoch=epoch,
            epochs=epoch + 1,
            steps_per_epoch=steps_per_epoch - step,
            validation_data=validation_data,
            shuffle=False,  # each epoch's order comes from make_dataset(epoch)
            callbacks=[saver, *callbacks],
            verbose=verbose,
            **fit_kwargs,
        )
        for key, values in result.history.items():
            history.setdefault(key, []).extend(float(value) for value in values)
        epoch, step = epoch + 1, 0
        backup.save(model, epoch=epoch, step=0, history=history)
    return history
