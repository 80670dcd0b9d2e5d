"""`Runtime`: where training runs (device kind, replicas, workers, memory per replica, scope).

Backend-neutral: `tfmem.runtime.distribute` builds one from a `tf.distribute.Strategy` (described
here, from the strategy's attributes, with no TensorFlow call), `tfmem.runtime.distribute_jax`
from a `keras.distribution`; the batch arithmetic is the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmem.runtime import devices, tpu
from tfmem.runtime.cluster import check_count, split_batch
from tfmem.runtime.hardware import Hardware, inspect_hardware

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
        check_count("num_replicas", self.num_replicas)
        check_count("num_workers", self.num_workers)

    @property
    def local_replicas(self) -> int:
        """Replicas of this process (host): `num_replicas ÷ num_workers`."""
        return max(self.num_replicas // self.num_workers, 1)

    def scope(self):
        """The strategy's scope: create the model and optimizer inside it."""
        if self.strategy is None:
            raise RuntimeError(
                f"This runtime describes {self.device_name or self.kind} for planning and has "
                "no strategy to train under; train with `tfmem.detect()` on that machine.")
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
        check_count("per_replica_batch", per_replica_batch)
        check_count("accumulation_steps", accumulation_steps)
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
        check_count("global_batch_size", global_batch_size)
        check_count("accumulation_steps", accumulation_steps)
        return split_batch(global_batch_size, self.num_replicas, accumulation_steps)

    @classmethod
    def from_strategy(cls, strategy, *, hardware=None) -> Runtime:
        """Describes a `tf.distribute.Strategy` you created yourself (kind, replicas, workers, memory).

        This is also how to run on several logical CPUs, which `detect()` never picks (they
        share one CPU; they exist to test multi-replica code). TensorFlow only.

        Example:
            >>> strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> Runtime.from_strategy(strategy).num_replicas
            2
        """
        hardware = inspect_hardware() if hardware is None else hardware
        try:
            device_types = {_device_type(name) for name in strategy.extended.worker_devices}
        except RuntimeError:  # the default strategy has no device list: it uses GPU:0 if any
            device_types = {"GPU" if hardware.gpus else "CPU"}
        kind = "tpu" if "TPU" in device_types else "gpu" if "GPU" in device_types else "cpu"
        return describe_strategy(kind, strategy, hardware, ())

    @classmethod
    def of_device(cls, name: str) -> Runtime:
        """The runtime of a device of `tfmem.runtime.devices.ACCELERATORS`, for planning only:
        its kind, replicas, memory and compute capability, and no strategy (`scope()` fails).

        Raises:
            ValueError: the name is not in the table; the message lists the valid names.

        Example:
            >>> Runtime.of_device("tpu-v3-8").num_replicas
            8
        """
        accelerator = devices.by_name(name)
        return cls(kind=accelerator.kind, strategy=None, num_replicas=accelerator.num_replicas,
                   num_workers=accelerator.num_hosts,
                   memory_per_replica=accelerator.memory_per_replica,
                   device_name=accelerator.name,
                   compute_capability=accelerator.compute_capability)


def _device_type(name: str) -> str:
    """`"/job:localhost/replica:0/task:0/device:GPU:1"` (or `"/gpu:1"`) → `"GPU"`."""
    last = name.rsplit("/", 1)[-1]
    return last.removeprefix("device:").split(":")[0].upper()


def describe_strategy(kind: str, strategy, hardware: Hardware, notes: tuple[str, ...]) -> Runtime:
    """The `Runtime` of a `tf.distribute.Strategy` of `kind` on `hardware` (no TensorFlow call:
    it reads the strategy's replicas, workers and devices, and the hardware's memory)."""
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
        memory = devices.host_memory_for_process() // max(1, num_replicas // num_workers)
        device_name = devices.cpu_name()
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


def _workers_of(strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    jobs = resolver.cluster_spec().as_dict()
    return max(1, len(jobs.get("chief", [])) + len(jobs.get("worker", [])))
