"""`detect()` on the TensorFlow backend: TPU, several workers, several GPUs, or one device.

The order, the memory per replica and the TPU messages are described in docs/runtime.md;
on `KERAS_BACKEND=jax`, `tfmem.detect` is `tfmem.runtime.distribute_jax.detect` instead.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import tensorflow as tf

from tfmem._install import install_command
from tfmem.runtime import tpu
from tfmem.runtime.cluster import workers_in_tf_config
from tfmem.runtime.hardware import Hardware, inspect_hardware
from tfmem.runtime.runtime import KINDS, Runtime, UnavailableDeviceError, describe_strategy


def choose_layout(prefer: str | None, hardware: Hardware) -> tuple[str, str]:
    """The (kind, layout) to use once no TPU is taken; pure, so every branch is testable.

    Layouts: "multi_worker" (MultiWorkerMirroredStrategy), "mirrored" (MirroredStrategy over
    all GPUs), "cpu_only" (OneDeviceStrategy on the CPU although GPUs exist), "default".

    Raises:
        UnavailableDeviceError: `prefer="gpu"` on a machine without a visible GPU.
    """
    if prefer == "gpu" and not hardware.gpus:
        raise UnavailableDeviceError(
            "detect(prefer='gpu') found no GPU that TensorFlow can see "
            "(tf.config.get_visible_devices('GPU') is empty). Install TensorFlow with GPU "
            f"support ({install_command('tensorflow')}, not tensorflow-cpu), check "
            "`nvidia-smi` and CUDA_VISIBLE_DEVICES, or call detect() without `prefer`."
        )
    use_gpus = bool(hardware.gpus) and prefer != "cpu"
    kind = "gpu" if use_gpus else "cpu"
    if hardware.num_workers > 1:
        return kind, "multi_worker"
    if use_gpus:
        return kind, "mirrored" if len(hardware.gpus) > 1 else "default"
    return kind, "cpu_only" if hardware.gpus else "default"


class OneProcess:
    """The processes `fit_resumable` coordinates on TensorFlow: only this one."""

    index, count = 0, 1

    def barrier(self, name: str) -> None:
        pass

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def global_batch(self, batch_size: int, dataset) -> int:
        return batch_size


processes = OneProcess()


def detect(
    prefer: str | None = None,
    *,
    hardware: Hardware | None = None,
    connect_tpu: Callable[[str], tf.distribute.Strategy] | None = None,
) -> Runtime:
    """Finds the best way to train here: TPU, several workers, several GPUs, or one device.

    Args:
        prefer: None to pick automatically, or "tpu", "gpu", "cpu" to force a kind (an
            `UnavailableDeviceError` says why when it is not available).
        hardware: what the machine has; read with `inspect_hardware()` when None. Passing one
            is for tests and for overriding a wrong reading.
        connect_tpu: connects to the TPU of a given name and returns its strategy; defaults
            to `tfmem.runtime.tpu.connect` (resolver, `initialize_tpu_system`, `TPUStrategy`).

    Returns:
        A `Runtime`. Call it at program start: multi-worker and TPU set-up must come first.

    Raises:
        UnavailableDeviceError: the preferred kind is not available; a TPU that is attached
            but unusable with `prefer="tpu"` (with `prefer=None` this is a warning and a note,
            and training falls back to GPU/CPU).
        RuntimeError: multi-worker `TF_CONFIG`, but TensorFlow already ran an op.

    Example:
        >>> runtime = tfmem.detect()
        >>> runtime.kind, runtime.num_replicas
        ('cpu', 1)
    """
    if prefer not in (None, *KINDS):
        raise ValueError(f"`prefer` must be None, 'tpu', 'gpu' or 'cpu', got {prefer!r}.")
    hardware = inspect_hardware() if hardware is None else hardware
    notes: tuple[str, ...] = ()
    if prefer == "tpu" or (prefer is None and hardware.tpu_signals):
        strategy, failures = tpu.connect_first(hardware.tpu_names, connect_tpu or tpu.connect)
        if strategy is not None:
            return describe_strategy("tpu", strategy, hardware, ())
        message = tpu.unavailable_message(hardware.tpu_signals, failures)
        if prefer == "tpu":
            raise UnavailableDeviceError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        notes = (tpu.short_note(failures),)

    kind, layout = choose_layout(prefer, hardware)
    strategy = _build_strategy(layout, hide_gpus=bool(hardware.gpus) and kind == "cpu")
    return describe_strategy(kind, strategy, hardware, notes)


def current_runtime(model=None) -> Runtime:
    """The `Runtime` a model trains under: its strategy's (or the current strategy's)."""
    strategy = model.distribute_strategy if model is not None else tf.distribute.get_strategy()
    return Runtime.from_strategy(strategy)


def _build_strategy(layout: str, *, hide_gpus: bool) -> tf.distribute.Strategy:
    if layout == "multi_worker":
        return _multi_worker_strategy(os.environ.get("TF_CONFIG", ""), hide_gpus)
    if layout == "mirrored":
        return tf.distribute.MirroredStrategy()
    if layout == "cpu_only":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    return tf.distribute.get_strategy()


@functools.lru_cache(maxsize=None)
def _multi_worker_strategy(tf_config: str, hide_gpus: bool) -> tf.distribute.Strategy:
    # Cached per TF_CONFIG: TensorFlow allows this strategy once per process, so a second
    # detect() must return the same one rather than fail.
    try:
        if hide_gpus:
            tf.config.set_visible_devices([], "GPU")
        return tf.distribute.MultiWorkerMirroredStrategy()
    except RuntimeError as error:
        raise RuntimeError(
            f"TF_CONFIG names {workers_in_tf_config(tf_config)} workers, so detect() creates a "
            "MultiWorkerMirroredStrategy, and TensorFlow only allows that before any other "
            f"TensorFlow op has run ({error}). Call tfmem.detect() first in your program, "
            "right after the imports; or unset TF_CONFIG to train on this machine alone."
        ) from error
