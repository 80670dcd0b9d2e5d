"""Pure sizing of a training run: what it needs per replica, and the micro-batch × k that fits.

The rule of thumb this follows: training memory = model state + micro-batch × (sample data +
kept activations), planned at no more than `safety` (80%) of the device, because the OS,
the CUDA context and the runtime need the rest. Every term is a formula over the model's own
variables and graph; each comment says where it comes from. Nothing here trains or allocates;
`tfmem.probe` measures the same terms and returns a plan calibrated on them.

Example:
    >>> model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
    >>> p = plan(model, global_batch_size=256, optimizer="adam", device="v100-16gb",
    ...          precision="mixed_float16")
    >>> p.micro_batch_size, p.accumulation_steps  # doctest: +SKIP
    (128, 2)
    >>> print(p.table())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from tfmem.memory import saved_tensors as _saved_tensors
from tfmem.runtime import devices
from tfmem.runtime.cluster import nearest_multiples
from tfmem.memory.optimizer_state import optimizer_slot_bytes
from tfmem.memory.plan_report import MemoryPlanError, format_bytes, format_table

# -- The CPU runtime term (host RAM only; zero in accelerator memory) --------------------------
# Measured on this project's reference machine (TF 2.21 / Keras 3.15.1 CPU with oneDNN,
# 2026-11-21): `import tensorflow, keras` holds ~750 MiB of resident set before any model
# exists. On top of the tensors, a traced training step costs about 1.6 MiB per model
# variable (its gradient, optimizer-update and assign ops, the optimizer's Python objects, the
# traced function graphs, oneDNN primitives and allocator pools): fitted as
# 15 MiB + 1.63 MiB × variables on MobileNetV2 (262 variables), ResNet50 (320) and
# DenseNet121 (606) at 64 px with Adam; held out, it predicts EfficientNetV2B0 within 7%
# (benchmarks/planner_accuracy.py) and EfficientNetV2-XL at 384 px (1806 variables; FACTS.md:
# 7.5 / 9.3 GiB at batch 1 / 2) within 3%. It is not a tensor count, which is why
# tensor-only planners miss ~0.5 GB on small models. Other TF builds and optimizers differ:
# `tfmem.probe` replaces the whole term with a measurement.
_CPU_IMPORT_BYTES = 750 * 2**20
_CPU_GRAPH_BASE_BYTES = 15 * 2**20
_CPU_BYTES_PER_VARIABLE = int(1.63 * 2**20)

_MIXED = ("mixed_float16", "mixed_bfloat16")


@dataclasses.dataclass(frozen=True)
class MeasuredLine:
    """Peak memory measured by `tfmem.probe`: `fixed_bytes + per_sample_bytes × micro_batch`."""

    fixed_bytes: int
    per_sample_bytes: int
    micro_batch_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The memory a training run needs per replica, and the micro-batch × k it will use.

    Fixed terms (bytes per replica): `parameter_bytes`, `gradient_bytes`, `optimizer_bytes`,
    `accumulation_bytes` (float32 buffers, only when `accumulation_steps > 1`),
    `mixed_precision_bytes`, `runtime_bytes`. Per-sample terms: `input_bytes_per_sample`
    (× the global batch per replica × `input_batches_in_flight`: AccumModel receives the whole
    global batch and splits it inside the step), `activation_bytes_per_sample` and
    `workspace_bytes_per_sample` (× the micro-batch). `measured`, when set by `tfmem.probe`,
    replaces the estimated runtime, state and per-sample terms with a measured line.

    `micro_batch_size` and `accumulation_steps` are the chosen setting: the largest micro-batch
    that divides the per-replica batch and fits `budget_bytes`; both are 0 when nothing fits.
    """

    model_name: str
    num_parameters: int
    num_trainable_parameters: int
    optimizer: str
    precision: str
    device: str
    device_kind: str
    num_replicas: int
    memory_per_replica: int
    safety: float
    global_batch_size: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    accumulation_bytes: int
    mixed_precision_bytes: int
    runtime_bytes: int
    input_bytes_per_sample: int
    activation_bytes_per_sample: int
    workspace_bytes_per_sample: int
    input_batches_in_flight: int = 2
    micro_batch_size: int = 0
    accumulation_steps: int = 0
    measured: MeasuredLine | None = None
    notes: tuple[str, ...] = ()

    @property
    def budget_bytes(self) -> int:
        """Bytes one replica may plan for: `safety × memory_per_replica`."""
        return int(self.safety * self.memory_per_replica)

    @property
    def per_replica_batch_size(self) -> int:
        """Samples each replica contributes to one update: global batch ÷ replicas."""
        return self.global_batch_size // self.num_replicas

    @property
    def fits(self) -> bool:
        """Whether some micro-batch × k reaches the global batch within the budget."""
        return self.micro_batch_size > 0

    def breakdown(self, micro_batch_size: int | None = None,
                  accumulation_steps: int | None = None) -> dict[str, int]:
        """Named bytes per replica for a setting (default: the chosen one, or micro-batch 1)."""
        b = micro_batch_size or self.micro_batch_size or 1
        k = accumulation_steps or max(self.per_replica_batch_size // b, 1)
        inputs = self.input_bytes_per_sample * b * k * self.input_batches_in_flight
        accumulation = self.accumulation_bytes if k > 1 else 0
        if self.measured is not None:
            # The probe ran plain steps (k = 1) with one batch in flight: it measured everything
            # but the accumulation buffers and the extra input of a k-times larger batch.
            extra_inputs = inputs - self.input_bytes_per_sample * b
            return {
                "measured fixed (probe)": self.measured.fixed_bytes,
                "accumulation buffers": accumulation,
                "measured per-sample × micro-batch": self.measured.per_sample_bytes * b,
                "input data beyond the probe": extra_inputs,
            }
        return {
            "parameters": self.parameter_bytes,
            "gradients": self.gradient_bytes,
            "optimizer slots": self.optimizer_bytes,
            "accumulation buffers": accumulation,
            "mixed-precision copies": self.mixed_precision_bytes,
            "framework runtime": self.runtime_bytes,
            "input data": inputs,
            "activations": self.activation_bytes_per_sample * b,
            "backward workspace": self.workspace_bytes_per_sample * b,
        }

    def peak_bytes(self, micro_batch_size: int, accumulation_steps: int | None = None) -> int:
        """Predicted peak bytes per replica for one micro-batch size (k defaults to the
        per-replica batch ÷ micro-batch).

        Example:
            >>> p.peak_bytes(8) <= p.budget_bytes
        """
        if micro_batch_size < 1:
            raise ValueError(f"`micro_batch_size` must be ≥ 1, got {micro_batch_size}.")
        return sum(self.breakdown(micro_batch_size, accumulation_steps).values())

    def fixed_bytes(self, accumulation_steps: int = 1) -> int:
        """Bytes that do not grow with the micro-batch (at micro-batch 1 with k steps)."""
        rows = self.breakdown(1, accumulation_steps)
        return sum(v for name, v in rows.items() if name not in _PER_MICRO_BATCH)

    @property
    def max_micro_batch(self) -> int:
        """The largest batch one plain step (k = 1) can run within the budget; 0 if none."""
        return self.largest_micro_batch(self.budget_bytes)

    def largest_micro_batch(self, limit_bytes: float) -> int:
        """The largest batch one plain step (k = 1) can run within `limit_bytes`; 0 if none."""
        fixed, slope = self.peak_bytes(1, 1), self.peak_bytes(2, 1) - self.peak_bytes(1, 1)
        if fixed > limit_bytes:
            return 0
        return 1 + int((limit_bytes - fixed) // slope)

    def table(self) -> str:
        """The breakdown of the chosen setting (or micro-batch 1) as a text table."""
        return format_table(self)

    def replace(self, **changes) -> MemoryPlan:
        """A copy with `changes`, the micro-batch × k chosen again."""
        return _choose(dataclasses.replace(self, **changes))


def _choose(p: MemoryPlan) -> MemoryPlan:
    """Largest micro-batch dividing the per-replica batch whose peak (with its k) fits."""
    per_replica = p.per_replica_batch_size
    for micro in sorted((d for d in range(1, per_replica + 1) if per_replica % d == 0), reverse=True):
        if p.peak_bytes(micro, per_replica // micro) <= p.budget_bytes:
            return dataclasses.replace(p, micro_batch_size=micro,
                                       accumulation_steps=per_replica // micro)
    return dataclasses.replace(p, micro_batch_size=0, accumulation_steps=0)


def _budget(runtime, memory_budget, device) -> tuple[str, str, int, int]:
    """(device label, kind, memory per replica, replicas) from exactly one source."""
    given = [name for name, v in (("runtime", runtime), ("memory_budget", memory_budget),
                                  ("device", device)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"Give one of `runtime`, `memory_budget`, `device`; got {given}.")
    if runtime is not None:
        kind = str(getattr(runtime, "kind", "cpu")).lower()
        label = getattr(runtime, "device_name", None) or kind
        if runtime.memory_per_replica is None:
            raise ValueError(
                f"The runtime does not know the memory of its {kind} ({label!r}): pass "
                "`device=` (a name from tfmem.runtime.devices.ACCELERATORS) or `memory_budget=` bytes."
            )
        memory, replicas = int(runtime.memory_per_replica), int(runtime.num_replicas)
        if kind == "cpu":
            # Host RAM that was free at detection: this process's own share comes on top,
            # as for device="cpu" below (the plan counts the whole process).
            memory += (devices.resident_bytes() or 0) // replicas
        return label, kind, memory, replicas
    if memory_budget is not None:
        if memory_budget <= 0:
            raise ValueError(f"`memory_budget` must be positive bytes, got {memory_budget}.")
        return f"{format_bytes(memory_budget)} budget", "cpu", int(memory_budget), 1
    if device is None or device.lower() == "cpu":
        # The plan counts the whole process (TF import included), and this process already
        # holds part of that: what it may grow to is its own resident set plus what is free.
        own = devices.resident_bytes() or 0  # not Linux: count nothing already held
        return "cpu (this host)", "cpu", devices.host_available_memory() + own, 1
    accelerator = devices.lookup(device)
    return (accelerator.name, accelerator.kind, accelerator.memory_per_replica,
            accelerator.num_replicas)


def plan(
    model: keras.Model,
    *,
    global_batch_size: int,
    optimizer: Any = "adam",
    precision: str = "float32",
    runtime: Any = None,
    memory_budget: int | None = None,
    device: str | None = None,
    num_replicas: int | None = None,
    safety: float = 0.8,
    input_batches_in_flight: int = 2,
) -> MemoryPlan:
    """Sizes one training run of `model` and picks micro-batch × accumulation steps.

    Args:
        model: a built functional or Sequential Keras model with concrete input shapes.
        global_batch_size: samples per optimizer update, over all replicas.
        optimizer: Keras optimizer instance or name; decides the slot count.
        precision: "float32", "mixed_float16" or "mixed_bfloat16" (activations in the
            compute dtype; float32 master weights stay).
        runtime: anything with `memory_per_replica` and `num_replicas` (a
            `tfmem.Runtime`); `kind` "cpu" adds the framework's host RAM.
        memory_budget: bytes per replica instead of a runtime (planned as host RAM).
        device: a name from `tfmem.runtime.devices.ACCELERATORS` or "cpu" (this host's available RAM).
            With none of the three, "cpu".
        num_replicas: overrides the replica count of the runtime/device.
        safety: fraction of `memory_per_replica` to plan for (0.8: the classic 80% rule).
        input_batches_in_flight: global batches of input resident at once (the step's own and
            one prefetched by `tf.data`).

    Returns:
        A frozen `MemoryPlan`.

    Raises:
        ValueError: the global batch does not split over the replicas, or bad arguments.
    """
    label, kind, memory, replicas = _budget(runtime, memory_budget, device)
    replicas = num_replicas or replicas
    if global_batch_size < 1 or global_batch_size % replicas:
        raise ValueError(
            f"`global_batch_size` ({global_batch_size}) must be a positive multiple of the "
            f"{replicas} replicas. Try {nearest_multiples(max(global_batch_size, 0), replicas)}."
        )
    if not 0 < safety <= 1:
        raise ValueError(f"`safety` must be in (0, 1], got {safety}.")
    if precision not in ("float32",) + _MIXED:
        raise ValueError(f"`precision` must be 'float32', 'mixed_float16' or 'mixed_bfloat16', "
                         f"got {precision!r}.")
    optimizer = keras.optimizers.get(optimizer)
    saved = _saved_tensors.saved_tensors(model)
    trainable = model.trainable_variables

    def nbytes(variables) -> int:
        return sum(math.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
                   for v in variables)

    num_trainable = sum(math.prod(v.shape) for v in trainable)
    mixed = 0
    if precision in _MIXED:
        # Keras autocasts each float32 variable to the compute dtype at every call; conv/dense
        # backward keeps that 2-byte copy (input gradient = dy ⊛ kernel). Normalization layers
        # upcast to float32 instead, so their variables get no copy.
        mixed = 2 * sum(math.prod(w.shape) for layer in model._flatten_layers(include_self=False)
                        if not isinstance(layer, keras.layers.BatchNormalization)
                        for w in layer._trainable_variables)
        if precision == "mixed_float16":
            # LossScaleOptimizer unscales into new float32 gradients and checks them all for
            # inf/nan before applying: a second gradient set is alive at once.
            mixed += nbytes(trainable)
    notes = []
    if saved.traced_layers:
        notes.append("measured by tracing their backward pass: "
                     + ", ".join(saved.traced_layers))
    if saved.unknown_layers:
        notes.append("counted as keeping inputs and outputs (unknown to the planner): "
                     + ", ".join(saved.unknown_layers))
    estimate = MemoryPlan(
        model_name=model.name,
        num_parameters=int(model.count_params()),
        num_trainable_parameters=int(num_trainable),
        optimizer=type(optimizer).__name__,
        precision=precision,
        device=label,
        device_kind=kind,
        num_replicas=replicas,
        memory_per_replica=memory,
        safety=safety,
        global_batch_size=global_batch_size,
        # Every weight (trainable and BN moving statistics) in its own dtype; not the few
        # bytes of dropout seed states.
        parameter_bytes=nbytes(model.weights),
        # tape.gradient returns one gradient per trainable variable, in the variable's dtype,
        # all alive together until `apply_gradients`.
        gradient_bytes=nbytes(trainable),
        optimizer_bytes=optimizer_slot_bytes(optimizer, trainable),
        # AccumModel's float32 running sum of gradients (one per trainable variable).
        accumulation_bytes=4 * int(num_trainable),
        mixed_precision_bytes=int(mixed),
        runtime_bytes=(_CPU_IMPORT_BYTES + _CPU_GRAPH_BASE_BYTES
                       + _CPU_BYTES_PER_VARIABLE * len(model.variables) if kind == "cpu" else 0),
        input_bytes_per_sample=saved.input_bytes,
        activation_bytes_per_sample=saved.saved_bytes,
        # The backward pass of the largest op holds its output gradient and input gradient
        # next to the kept tensors.
        workspace_bytes_per_sample=2 * saved.largest_tensor_bytes,
        input_batches_in_flight=input_batches_in_flight,
        notes=tuple(notes),
    )
    return _choose(estimate)


def check(plan: MemoryPlan, *, accumulation_steps: int | None = None,
          allow_over_budget: bool = False) -> None:
    """The guard: raises `MemoryPlanError` when the run would not fit its budget.

    Args:
        plan: the plan of the run.
        accumulation_steps: the k the run will use (None: the plan's own choice).
        allow_over_budget: True skips the check (the explicit override).

    Raises:
        MemoryPlanError: (a ValueError) with the breakdown and the setting that would fit.

    Example:
        >>> check(plan(model, global_batch_size=64, device="t4"), accumulation_steps=1)
        Traceback (most recent call last):
        MemoryPlanError: global batch 64 needs 41.2 GiB per replica on t4 (...)
    """
    if allow_over_budget:
        return
    per_replica = plan.per_replica_batch_size
    if accumulation_steps is None:
        if plan.fits:
            return
        accumulation_steps = per_replica  # micro-batch 1: the smallest it could be
    if accumulation_steps < 1 or per_replica % accumulation_steps:
        raise ValueError(f"`accumulation_steps` ({accumulation_steps}) must divide the "
                         f"per-replica batch ({per_replica}). Use a per-replica batch of "
                         f"{nearest_multiples(per_replica, max(accumulation_steps, 1))}.")
    micro = per_replica // accumulation_steps
    needed = plan.peak_bytes(micro, accumulation_steps)
    if needed <= plan.budget_bytes:
        return
    raise MemoryPlanError(plan, micro, accumulation_steps, needed)


# Breakdown terms that scale with the micro-batch (the rest is fixed for a given k).
_PER_MICRO_BATCH = ("activations", "backward workspace", "measured per-sample × micro-batch")

def guard(
    model: keras.Model,
    *,
    global_batch_size: int,
    accumulation_steps: int | str | None = "auto",
    allow_over_budget: bool = False,
    **plan_kwargs: Any,
) -> MemoryPlan:
    """Plans a run and stops it before the first step if it cannot fit (AccumModel's check).

    Args:
        model: the model about to train.
        global_batch_size: samples per update over all replicas.
        accumulation_steps: the k the run will use, or "auto"/None for the plan's choice.
        allow_over_budget: True returns the plan without raising (the explicit override).
        **plan_kwargs: passed to `plan` (optimizer, precision, runtime/memory_budget/device…).

    Returns:
        The `MemoryPlan`; with "auto", its `accumulation_steps` is the k to use.

    Raises:
        MemoryPlanError: the setting (or, with "auto", every setting) exceeds the budget.

    Example:
        >>> k = guard(model, global_batch_size=64, device="t4").accumulation_steps
    """
    memory_plan = plan(model, global_batch_size=global_batch_size, **plan_kwargs)
    steps = None if accumulation_steps in (None, "auto") else accumulation_steps
    if isinstance(steps, str):
        raise ValueError(f"`accumulation_steps` must be a positive int or 'auto', got {steps!r}.")
    check(memory_plan, accumulation_steps=steps, allow_over_budget=allow_over_budget)
    return memory_plan
