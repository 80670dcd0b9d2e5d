"""`Budget`: the memory a plan is for, built here on the runtime side and handed to the planner.

The planner is arithmetic over a model and a `Budget`; what a budget is made from (a detected
`Runtime`, a device of the table, bytes given by the user, or this host's free RAM, which is read
live) is decided here, once.
"""

from __future__ import annotations

import dataclasses

from tfmem.runtime import devices, heap
from tfmem.runtime.cluster import check_count
from tfmem.runtime.runtime import Runtime


class UnknownMemoryError(ValueError):
    """A runtime does not know its device's memory (an unlisted GPU without `nvidia-smi`)."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """Where a plan is for.

    Attributes:
        device: the label the plan prints ("Tesla T4", "v100-32gb", "cpu (this host)").
        kind: "cpu", "gpu" or "tpu"; a "cpu" plan counts the framework's own host RAM.
        memory_per_replica: bytes one replica may use (before the plan's safety fraction).
        num_replicas: replicas the global batch is split over.
        target: the `Runtime` whose precision policy `precision="auto"` takes; None for a
            budget of bytes or of this host's CPU (float32).
        heap_keeps_freed: whether this process's heap keeps freed blocks resident (glibc's
            default; `tfmem.runtime.heap`), which a "cpu" plan then counts.
    """

    device: str
    kind: str
    memory_per_replica: int
    num_replicas: int
    target: Runtime | None = None
    heap_keeps_freed: bool = dataclasses.field(
        default_factory=lambda: not heap.threshold_fixed())

    def __post_init__(self):
        check_count("memory_per_replica", self.memory_per_replica)
        check_count("num_replicas", self.num_replicas)


def budget_for(*, runtime: Runtime | None = None, memory_budget: int | None = None,
               device: str | None = None, num_replicas: int | None = None) -> Budget:
    """The budget from at most one of `runtime`, `memory_budget`, `device` (default: this host).

    Args:
        runtime: a `tfmem.Runtime` (or anything with `kind`, `device_name`,
            `memory_per_replica` and `num_replicas`); its memory must be known.
        memory_budget: bytes per replica, planned as host RAM.
        device: a name of `tfmem.runtime.devices.ACCELERATORS`, or "cpu" for this host's
            available RAM plus what this process already holds.
        num_replicas: overrides the replica count.

    Raises:
        UnknownMemoryError: (a ValueError) the runtime does not know its memory.
        ValueError: more than one source, a non-positive budget, or an unknown device name
            (listing the valid ones).

    Example:
        >>> budget_for(device="t4").memory_per_replica / 2**30  # doctest: +SKIP
        15.0
    """
    given = [name for name, value in (("runtime", runtime), ("memory_budget", memory_budget),
                                      ("device", device)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"Give one of `runtime`, `memory_budget`, `device`; got {given}.")
    if runtime is not None:
        budget = _of_runtime(runtime)
    elif memory_budget is not None:
        if memory_budget <= 0:
            raise ValueError(f"`memory_budget` must be positive bytes, got {memory_budget}.")
        budget = Budget("a memory budget", "cpu", int(memory_budget), 1)
    elif device is None or device.lower() == "cpu":
        budget = Budget("cpu (this host)", "cpu", devices.host_memory_for_process(), 1)
    else:
        try:
            runtime = Runtime.of_device(device)
        except ValueError as error:
            raise ValueError(f"`device`: {error}") from None
        budget = _of_runtime(runtime)
    if num_replicas:
        budget = dataclasses.replace(budget, num_replicas=num_replicas)
    return budget


def _of_runtime(runtime) -> Budget:
    kind = str(getattr(runtime, "kind", "cpu")).lower()
    label = getattr(runtime, "device_name", None) or kind
    if runtime.memory_per_replica is None:
        raise UnknownMemoryError(
            f"the memory of the runtime's {kind} ({label!r}) is unknown: pass `device=` (a "
            "name from tfmem.runtime.devices.ACCELERATORS) or `memory_budget=` bytes")
    # On a CPU, detect() counted this process's resident set in (as device="cpu" does).
    return Budget(label, kind, int(runtime.memory_per_replica), int(runtime.num_replicas),
                  runtime)
