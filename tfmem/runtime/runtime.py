"""`Runtime`: where training runs (device kind, replicas, workers, memory per replica, scope).

Backend-neutral: `tfmem.runtime.distribute` builds one from a `tf.distribute.Strategy`,
`tfmem.runtime.distribute_jax` from a `keras.distribution`; the batch arithmetic is the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfmem.runtime.cluster import check_count, split_batch

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
        # The TensorFlow side is loaded on use, so the JAX backend never needs TensorFlow.
        from tfmem.runtime import distribute

        return distribute.runtime_from_strategy(strategy, hardware=hardware)
