"""Runtime: which devices train, how many replicas they are, their memory, and the global batch.

`detect()` replaces the TPU-detection snippet that notebooks copy around. It looks, in order, for

1. a **TPU** (only where one seems attached, see `tfmem.runtime.tpu`, or with `prefer="tpu"`):
   `TPUClusterResolver(tpu="local")` (TPU VMs: Kaggle, Colab v2-8/v5e/v6e, Cloud), then the
   TPU name the environment gives (`TPU_NAME`, Colab's legacy `COLAB_TPU_ADDR`) → `TPUStrategy`;
2. **several workers** when `TF_CONFIG` names more than one chief/worker task →
   `MultiWorkerMirroredStrategy` (TensorFlow only allows it at program start: call `detect()`
   before any other TensorFlow op runs);
3. **several GPUs** → `MirroredStrategy` over all of them;
4. otherwise the **default strategy** on the one GPU or the CPU.

On `KERAS_BACKEND=jax`, `detect()` hands over to `tfmem.runtime.distribute_jax`, whose `Runtime.strategy`
is a `keras.distribution.Distribution` instead of a `tf.distribute.Strategy`.

Memory per replica comes from the device where it can be read (`nvidia-smi`'s total for GPUs;
TensorFlow's own `get_memory_info` only reports usage, not the total), else from the table in
`tfmem.runtime.devices` (TPUs, whose memory TensorFlow does not expose); on CPU it is the host's
available RAM shared by the replicas of one process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfmem.runtime import devices
from tfmem.runtime import tpu
from tfmem.runtime.hardware import GPU, Hardware, cpu_name, inspect_hardware, workers_in_tf_config

KINDS = ("tpu", "gpu", "cpu")


class UnavailableDeviceError(RuntimeError):
    """The device kind asked for (or a TPU that is attached) cannot be used by this install."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where training runs: device kind, replicas, their memory and the distribution strategy.

    Build one with `detect()` (or `Runtime.from_strategy(strategy)` for a strategy you made).

    Attributes:
        kind: `"tpu"`, `"gpu"` or `"cpu"`.
        strategy: a `tf.distribute.Strategy`; on `KERAS_BACKEND=jax` (built by
            `tfmem.runtime.distribute_jax`) a `keras.distribution.Distribution`. Both have `scope()`.
        num_replicas: replicas that train in sync, over all workers.
        num_workers: processes (hosts) that take part; 1 unless multi-worker.
        memory_per_replica: bytes of memory one replica can use, or None where it is unknown
            (an unlisted GPU without `nvidia-smi`): pass a device name to the planner then.
        device_name: what the device calls itself ("Tesla T4", "TPU v3-8", the CPU's model).
        compute_capability: the GPU's CUDA compute capability, e.g. `(7, 5)`; None otherwise.
        notes: what the user should know about how this runtime was chosen (e.g. a TPU that is
            attached but unusable), printed by `describe()`.

    Example:
        >>> runtime = tfmem.detect()
        >>> runtime.global_batch_size(32, accumulation_steps=4)  # 1 CPU replica
        128
        >>> with runtime.scope():
        ...     model = build_model()
    """

    kind: str
    strategy: Any
    num_replicas: int
    num_workers: int = 1
    memory_per_replica: int | None = None
    device_name: str = ""
    compute_capability: tuple[int, int] | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {self.kind!r}.")
        _check_count("num_replicas", self.num_replicas)
        _check_count("num_workers", self.num_workers)

    def scope(self):
        """The strategy's scope: create the model and optimizer inside it."""
        return self.strategy.scope()

    def global_batch_size(self, per_replica_batch: int, accumulation_steps: int = 1) -> int:
        """Examples per optimizer update: per-replica micro-batch × replicas × accumulation steps.

        Args:
            per_replica_batch: examples one replica processes at once (the micro-batch).
            accumulation_steps: micro-batches accumulated before each update.

        Example:
            >>> runtime.num_replicas
            8
            >>> runtime.global_batch_size(16, accumulation_steps=4)
            512
        """
        _check_count("per_replica_batch", per_replica_batch)
        _check_count("accumulation_steps", accumulation_steps)
        return per_replica_batch * self.num_replicas * accumulation_steps

    def split_global_batch(self, global_batch_size: int, accumulation_steps: int = 1) -> int:
        """The per-replica micro-batch that gives `global_batch_size` (inverse of the above).

        Raises:
            ValueError: `global_batch_size` is not a multiple of replicas × accumulation steps;
                the message names the nearest sizes that are.

        Example:
            >>> runtime.num_replicas
            8
            >>> runtime.split_global_batch(96, accumulation_steps=3)
            4
        """
        _check_count("global_batch_size", global_batch_size)
        _check_count("accumulation_steps", accumulation_steps)
        divisor = self.num_replicas * accumulation_steps
        if global_batch_size % divisor:
            raise ValueError(
                f"`global_batch_size` ({global_batch_size}) must be divisible by replicas × "
                f"accumulation_steps ({self.num_replicas} × {accumulation_steps} = {divisor}). "
                f"Try {nearest_multiples(global_batch_size, divisor)}."
            )
        return global_batch_size // divisor

    @classmethod
    def from_strategy(
        cls, strategy: tf.distribute.Strategy, *, hardware: Hardware | None = None
    ) -> Runtime:
        """Describes a strategy you created yourself (kind, replicas, workers, memory).

        This is also how to run on several logical CPUs, which `detect()` never picks (they
        share one CPU; they exist to test multi-replica code).

        Example:
            >>> strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> Runtime.from_strategy(strategy).num_replicas
            2
        """
        hardware = inspect_hardware() if hardware is None else hardware
        try:
            device_types = {
                tf.DeviceSpec.from_string(name).device_type
                for name in strategy.extended.worker_devices
            }
        except RuntimeError:  # the default strategy has no device list: it uses GPU:0 if any
            device_types = {"GPU" if hardware.gpus else "CPU"}
        kind = "tpu" if "TPU" in device_types else "gpu" if "GPU" in device_types else "cpu"
        return _describe_strategy(kind, strategy, hardware, ())


def nearest_multiples(size: int, divisor: int) -> str:
    """The multiples of `divisor` on either side of `size`, for error messages.

    Example:
        >>> nearest_multiples(100, 24)
        '96 or 120'
    """
    below = size // divisor * divisor
    return f"{below} or {below + divisor}" if below else f"{below + divisor}"


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")


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
            "support (`pip install 'tfmem[tensorflow]'`, not tensorflow-cpu), check "
            "`nvidia-smi` and CUDA_VISIBLE_DEVICES, or call detect() without `prefer`."
        )
    use_gpus = bool(hardware.gpus) and prefer != "cpu"
    kind = "gpu" if use_gpus else "cpu"
    if hardware.num_workers > 1:
        return kind, "multi_worker"
    if use_gpus:
        return kind, "mirrored" if len(hardware.gpus) > 1 else "default"
    return kind, "cpu_only" if hardware.gpus else "default"


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
    # ---- JAX dispatch point: on KERAS_BACKEND=jax, tfmem/runtime/distribute_jax.py (owned by the
    # "jax" helper) builds the Runtime; TensorFlow strategies cannot place JAX variables.
    # Imported lazily, so TensorFlow users never import JAX. ----
    if _keras_backend() == "jax":
        return _detect_with_jax(prefer)
    hardware = inspect_hardware() if hardware is None else hardware
    notes: tuple[str, ...] = ()
    if prefer == "tpu" or (prefer is None and hardware.tpu_signals):
        strategy, failures = tpu.connect_first(hardware.tpu_names, connect_tpu or tpu.connect)
        if strategy is not None:
            return _describe_strategy("tpu", strategy, hardware, ())
        message = tpu.unavailable_message(hardware.tpu_signals, failures)
        if prefer == "tpu":
            raise UnavailableDeviceError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        notes = (tpu.short_note(failures),)

    kind, layout = choose_layout(prefer, hardware)
    strategy = _build_strategy(layout, hide_gpus=bool(hardware.gpus) and kind == "cpu")
    return _describe_strategy(kind, strategy, hardware, notes)


def _keras_backend() -> str:
    import keras  # here, not at the top: importing tfmem.runtime.distribute need not import Keras

    return keras.backend.backend()


def _detect_with_jax(prefer: str | None) -> Runtime:
    try:
        from tfmem.runtime import distribute_jax
    except ModuleNotFoundError as error:
        if error.name != "tfmem.runtime.distribute_jax":
            raise
        raise UnavailableDeviceError(
            "KERAS_BACKEND is 'jax', but this tfmem has no JAX runtime (tfmem.distribute_jax "
            "is missing). Upgrade tfmem, or set KERAS_BACKEND=tensorflow before importing keras."
        ) from error
    return distribute_jax.detect(prefer=prefer)


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


def _describe_strategy(
    kind: str, strategy: tf.distribute.Strategy, hardware: Hardware, notes: tuple[str, ...]
) -> Runtime:
    num_replicas = strategy.num_replicas_in_sync
    num_workers = _workers_of(strategy)
    compute_capability = None
    if kind == "tpu":
        accelerator_type = hardware.tpu_accelerator_type
        memory = tpu.memory_per_replica(accelerator_type)
        device_name = f"TPU {accelerator_type}" if accelerator_type else "TPU"
    elif kind == "gpu":
        memories = [gpu.memory for gpu in hardware.gpus]
        memory = None if None in memories else min(memories)
        device_name = " + ".join(sorted({gpu.name for gpu in hardware.gpus}))
        capabilities = [gpu.compute_capability for gpu in hardware.gpus]
        compute_capability = None if None in capabilities else min(capabilities)
    else:
        # Replicas in one process (logical CPUs) share the host's RAM.
        memory = devices.host_available_memory() // max(1, num_replicas // num_workers)
        device_name = cpu_name()
    return Runtime(
        kind=kind,
        strategy=strategy,
        num_replicas=num_replicas,
        num_workers=num_workers,
        memory_per_replica=memory,
        device_name=device_name,
        compute_capability=compute_capability,
        notes=notes,
    )


def _workers_of(strategy: tf.distribute.Strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    jobs = resolver.cluster_spec().as_dict()
    return max(1, len(jobs.get("chief", [])) + len(jobs.get("worker", [])))
