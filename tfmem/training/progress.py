"""`RunProgress`: progress of a whole run, resumed epochs included, that one can plan by.

In a terminal it redraws one line per update (epoch, updates, loss, effective batch,
images/s, time left for the run); in logs and notebooks it prints one line per epoch. After
the first few updates it prints an estimate of the whole run's time on this machine. Speed is
measured from the end of the first update of the process, so tracing and compilation do not
count, and over wall time, so validation and saving do.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import keras
import numpy as np

from tfmem.memory.plan_report import describe_split


def format_duration(seconds: float) -> str:
    """`95` → `"1m35s"`, `7260` → `"2h01m"`."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RunProgress(keras.callbacks.Callback):
    """Keras callback: run-level progress for `fit_resumable` (one `fit` per epoch).

    Args:
        epochs: epochs of the whole run.
        steps_per_epoch: optimizer updates per epoch.
        global_batch_size: examples per update.
        micro_batch_size, accumulation_steps, num_replicas: how the global batch is made,
            shown as `tfmem.describe_split` words it; default: the global batch alone.
        stream: where to write; default stdout.
        live: redraw a line per update; default: when `stream` is a terminal.
        estimate_after: updates measured before the run's time is estimated.

    Example:
        >>> progress = tfmem.RunProgress(epochs=10, steps_per_epoch=500, global_batch_size=64)
        >>> tfmem.fit_resumable(model, make_dataset, epochs=10, steps_per_epoch=500,
        ...                     backup_dir="run/backup", callbacks=[progress], verbose=0)
        ...                                                              # doctest: +SKIP
    """

    def __init__(self, *, epochs: int, steps_per_epoch: int, global_batch_size: int,
                 micro_batch_size: int | None = None, accumulation_steps: int = 1,
                 num_replicas: int = 1, stream: TextIO | None = None, live: bool | None = None,
                 estimate_after: int = 5):
        super().__init__()
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.global_batch_size = global_batch_size
        self.batch_text = (f"global batch {global_batch_size}" if micro_batch_size is None
                           else describe_split(global_batch_size, micro_batch_size,
                                               accumulation_steps, num_replicas))
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.estimate_after = estimate_after
        self._warm: tuple[float, int] | None = None  # (time, updates done) after update 1
        self._estimated = False
        self._epoch, self._base, self._done = 0, 0, 0
        self._epoch_start: tuple[float, int] = (time.perf_counter(), 0)
        self._last_draw = 0.0

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    def _rate(self) -> float | None:
        """Updates per second since the warm start, or None before two updates."""
        if self._warm is None or self._done <= self._warm[1]:
            return None
        return (self._done - self._warm[1]) / max(time.perf_counter() - self._warm[0], 1e-9)

    def _speed_text(self, rate: float | None) -> str:
        if rate is None:
            return "measuring speed"
        left = (self.total - self._done) / rate
        return (f"{rate * self.global_batch_size:,.0f} images/s, "
                f"{format_duration(left)} left for the run")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        # Updates done before this `fit` call: earlier epochs and a resumed epoch's first steps.
        self._base = int(np.asarray(self.model.optimizer.iterations.value))
        self._done = self._base
        self._epoch_start = (time.perf_counter(), self._base)

    def on_train_batch_end(self, batch, logs=None):
        self._done = self._base + batch + 1
        now = time.perf_counter()
        if self._warm is None:
            self._warm = (now, self._done)
            return
        rate = self._rate()
        measured = self._done - self._warm[1]
        if not self._estimated and measured >= min(self.estimate_after,
                                                   self.total - self._warm[1] - 1):
            self._estimated = True
            whole = self.total / rate
            self._write(f"estimate: the run's {self.total:,} updates take about "
                        f"{format_duration(whole)} on this machine at "
                        f"{rate * self.global_batch_size:,.0f} images/s "
                        f"({format_duration((self.total - self._done) / rate)} from now)",
                        end="\n")
        if self.live and now - self._last_draw >= 0.1:
            self._last_draw = now
            step = self._done - self._epoch * self.steps_per_epoch
            loss = f"loss {logs['loss']:.4f}, " if logs and "loss" in logs else ""
            width = 20
            filled = int(width * step / self.steps_per_epoch)
            self._write(f"epoch {self._epoch + 1}/{self.epochs} [{'#' * filled}"
                        f"{'.' * (width - filled)}] {step}/{self.steps_per_epoch}, {loss}"
                        f"{self.batch_text}, {self._speed_text(rate)}", end="")

    def on_epoch_end(self, epoch, logs=None):
        start, done_before = self._epoch_start
        updates = self._done - done_before
        metrics = ", ".join(f"{key} {float(value):.4f}" for key, value in (logs or {}).items())
        self._write(f"epoch {epoch + 1}/{self.epochs}: {metrics or 'done'}; {updates} "
                    f"updates in {format_duration(time.perf_counter() - start)}, "
                    f"{self.batch_text}, {self._speed_text(self._rate())}", end="\n")

    def _write(self, text: str, end: str) -> None:
        if self.live:
            text = "\r\x1b[2K" + text  # back to the line's start, clear it
        self.stream.write(text + end)
        self.stream.flush()
