"""`MemoryPlan`: the frozen result of planning, its named terms, and the guard's error.

Shared by the planner (which computes a plan), the probe (which calibrates one) and the
report (which prints one); it imports neither of the first two.
"""

from __future__ import annotations

import dataclasses
import enum

from tfmem.memory import plan_report, tpu_layout
from tfmem.runtime.cluster import divisors


class Term(enum.Enum):
    """One line of a plan's breakdown: its label, where the number comes from, and whether
    it grows with the micro-batch."""

    PARAMETERS = ("parameters", "all variables × their dtype size", False)
    GRADIENTS = ("gradients", "trainable variables, float32, held until applied", False)
    OPTIMIZER_SLOTS = ("optimizer slots", "Keras optimizer build(): slots × trainable bytes",
                       False)
    ACCUMULATION = ("accumulation buffers", "AccumModel gradient sums (≥ float32), k > 1",
                    False)
    MIXED_PRECISION = ("mixed-precision copies",
                       "compute-dtype kernel casts (+ unscaled grads, fp16)", False)
    RUNTIME = ("framework runtime", "CPU: TF import + traced step per variable (measured)",
               False)
    INPUT = ("input data", "global batch per replica × in-flight batches", False)
    ACTIVATIONS = ("activations", "tensors the backward reads, from the model graph", True)
    WORKSPACE = ("backward workspace",
                 "the largest call's transient, beside what is alive then", True)
    LANE_PADDING = ("lane padding (XLA:TPU)", "kept tensors and gradients to 8 × 128 tiles, "
                    "by channels or batch", True)
    LOSS = ("loss and metrics", "the loss's forward + backward (or a metric update), traced, "
            "beyond the workspace", True)
    MEASURED_FIXED = ("measured fixed (probe)", "tfmem.probe: intercept of the measured line",
                      False)
    MEASURED_PER_SAMPLE = ("measured per-sample × micro-batch",
                           "tfmem.probe: slope of the measured line", True)
    INPUT_BEYOND_PROBE = ("input data beyond the probe",
                          "extra input of the k-times larger batch", False)

    def __init__(self, label: str, source: str, per_micro_batch: bool):
        self.label = label
        self.source = source
        self.per_micro_batch = per_micro_batch


@dataclasses.dataclass(frozen=True)
class MeasuredLine:
    """Peak memory measured by `tfmem.probe`: `fixed_bytes + per_sample_bytes × micro_batch`."""

    fixed_bytes: int
    per_sample_bytes: int
    micro_batch_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A change of the run that the planner checked to fit when the asked one does not.

    Attributes:
        changes: what to change, in words (e.g. `("precision mixed_float16",
            "optimizer SGD (momentum 0.9)")`); empty when nothing that was tried fits.
        micro_batch_size, accumulation_steps: the split the changed run would use.
        peak_bytes: its predicted peak per replica.
        tried: every change (or combination) checked, in the order tried.
        settings: the changes as `(argument, value)` pairs of the run (e.g.
            `("precision", "mixed_float16")`), one per change that has one.
    """

    changes: tuple[str, ...]
    micro_batch_size: int
    accumulation_steps: int
    peak_bytes: int
    tried: tuple[str, ...] = ()
    settings: tuple[tuple[str, object], ...] = ()


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The memory a training run needs per replica, and the micro-batch × k it will use.

    Fixed terms (bytes per replica): `parameter_bytes`, `gradient_bytes`, `optimizer_bytes`,
    `accumulation_bytes` (float32 buffers, float64 for float64 weights, only when
    `accumulation_steps > 1`),
    `mixed_precision_bytes`, `runtime_bytes`. Per-sample terms: `input_bytes_per_sample`
    (a sample's inputs and targets, × the global batch per replica × `input_batches_in_flight`: AccumModel receives the whole
    global batch and splits it inside the step), `activation_bytes_per_sample` and
    `workspace_bytes_per_sample` and `loss_bytes_per_sample` (× the micro-batch; the loss's
    temporaries and the output's gradient it makes, or a metric update's, beyond the output
    the activations count). Of the activations, `recomputed_bytes_per_sample` are a
    rematerialized segment's, held again only while it is recomputed. The loss runs before the
    backward pass, with no segment recomputed: the peak holds the larger of the loss and the
    workspace with the recomputed segment, so the breakdown's loss row is only the loss's
    excess over those two (`loss_row_bytes_per_sample`). The workspace adds
    `workspace_fixed_bytes`, the part of a call's transient that is the size of a weight (on
    XLA:CPU, a grouped convolution's kernel gradient made as a dense kernel), which does not
    grow with the micro-batch. `lane_tensors`, on a TPU: the kept tensors by shape
    (`SavedTensors.lane_tensors`), whose tiles' padding (`tpu_layout`) is a step function of
    the micro-batch, its own row of the breakdown. `bounded_activations`: `(micro-batch,
    bytes per sample)` of activations XLA holds only up to that micro-batch
    (`SavedTensors.bounded_bytes`), in the activations row where it applies. `measured`, when
    set by `tfmem.probe`,
    replaces the estimated runtime, state and per-sample terms with a measured line.
    `rematerialized`: the segments recomputed in the backward pass ("full", "auto",
    `(first, last)` pairs) as `(path, ranges)` pairs (`tfmem.remat.plan`), and
    `recompute_fraction` their forward FLOPs as a fraction of a training step's.

    `micro_batch_size` and `accumulation_steps` are the chosen setting: the largest micro-batch
    that divides the per-replica batch and fits `budget_bytes`; both are 0 when nothing fits,
    and `alternative` then names the smallest change the planner checked to fit.
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
    loss_bytes_per_sample: int = 0
    recomputed_bytes_per_sample: int = 0
    workspace_fixed_bytes: int = 0
    bounded_activations: tuple = ()
    lane_tensors: tuple = ()
    micro_batch_size: int = 0
    accumulation_steps: int = 0
    measured: MeasuredLine | None = None
    alternative: Alternative | None = None
    notes: tuple[str, ...] = ()
    rematerialized: tuple = ()
    recompute_fraction: float = 0.0

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

    @property
    def loss_row_bytes_per_sample(self) -> int:
        """What the loss holds beyond the backward pass's peak call, per sample.

        The two are never held together: the loss runs when the forward pass is done, every
        kept activation alive and no segment recomputed; the backward's largest call runs
        after it, beside the same activations and the segment it recomputes."""
        return max(self.loss_bytes_per_sample - self.workspace_bytes_per_sample
                   - self.recomputed_bytes_per_sample, 0)

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer slots: what the model alone holds."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def breakdown(self, micro_batch_size: int | None = None,
                  accumulation_steps: int | None = None) -> dict[Term, int]:
        """Bytes per replica of each `Term` for a setting (default: the chosen one, or 1).

        Example:
            >>> p.breakdown(8, 4)[Term.ACCUMULATION]  # float32 sums, since k > 1
        """
        b = micro_batch_size or self.micro_batch_size or 1
        k = accumulation_steps or max(self.per_replica_batch_size // b, 1)
        inputs = self.input_bytes_per_sample * b * k * self.input_batches_in_flight
        accumulation = self.accumulation_bytes if k > 1 else 0
        if self.measured is not None:
            # The probe ran plain steps (k = 1) with one batch in flight: it measured everything
            # but the accumulation buffers and the extra input of a k-times larger batch.
            return {
                Term.MEASURED_FIXED: self.measured.fixed_bytes,
                Term.ACCUMULATION: accumulation,
                Term.MEASURED_PER_SAMPLE: self.measured.per_sample_bytes * b,
                Term.INPUT_BEYOND_PROBE: inputs - self.input_bytes_per_sample * b,
            }
        rows = {
            Term.PARAMETERS: self.parameter_bytes,
            Term.GRADIENTS: self.gradient_bytes,
            Term.OPTIMIZER_SLOTS: self.optimizer_bytes,
            Term.ACCUMULATION: accumulation,
            Term.MIXED_PRECISION: self.mixed_precision_bytes,
            Term.RUNTIME: self.runtime_bytes,
            Term.INPUT: inputs,
            Term.ACTIVATIONS: (self.activation_bytes_per_sample
                               + self.bounded_bytes_per_sample(b)) * b,
            Term.WORKSPACE: self.workspace_bytes_per_sample * b + self.workspace_fixed_bytes,
            Term.LOSS: self.loss_row_bytes_per_sample * b,
        }
        if self.lane_tensors:
            rows[Term.LANE_PADDING] = self.lane_padding_bytes(b)
        return rows

    def bounded_bytes_per_sample(self, micro_batch_size: int) -> int:
        """Of `bounded_activations`, the bytes per sample held at `micro_batch_size`."""
        return sum(nbytes for largest, nbytes in self.bounded_activations
                   if micro_batch_size <= largest)

    def lane_padding_bytes(self, micro_batch_size: int) -> int:
        """What XLA:TPU's tiles add at `micro_batch_size` to the kept tensors whose shapes
        are known, and to the workspace in the same proportion (its gradient maps have
        those tensors' shapes)."""
        extra = tpu_layout.padding_bytes(self.lane_tensors, micro_batch_size)
        known = sum(nbytes for _, nbytes in self.lane_tensors)
        return extra + (extra * self.workspace_bytes_per_sample // known if known else 0)

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
        return self.workspace_fixed_bytes + sum(value for term, value in rows.items()
                                                if not term.per_micro_batch)

    @property
    def max_micro_batch(self) -> int:
        """The largest batch one plain step (k = 1) can run within the budget; 0 if none."""
        return self.largest_micro_batch(self.budget_bytes)

    def largest_micro_batch(self, limit_bytes: float) -> int:
        """The largest batch one plain step (k = 1) can run within `limit_bytes`; 0 if none."""
        if self.peak_bytes(1, 1) > limit_bytes:
            return 0

        def line(b: int) -> int:  # without the padding and the bounded activations
            rows = self.breakdown(b, 1)
            return (sum(v for t, v in rows.items() if t is not Term.LANE_PADDING)
                    - self.bounded_bytes_per_sample(b) * b)

        fixed, slope = line(1), line(2) - line(1)
        largest = 1 + int((limit_bytes - fixed) // slope)
        if self.bounded_activations:
            # They add only up to their micro-batches: the line's answer bounds the largest
            # that fits, and below it the peak is not monotone, so each is checked down.
            while self.peak_bytes(largest, 1) > limit_bytes:
                largest -= 1
            return largest
        if not self.lane_tensors:
            return largest
        # The padding only adds, and never shrinks as the micro-batch grows: the line's
        # answer bounds a bisection.
        low, high = 1, largest  # low fits
        while low < high:
            middle = (low + high + 1) // 2
            if self.peak_bytes(middle, 1) <= limit_bytes:
                low = middle
            else:
                high = middle - 1
        return low

    def split(self, accumulation_steps: int | None = None) -> str:
        """The run's split in words: "global batch 64 = micro-batch 8 × 1 accumulation
        step × 8 replicas" (default k: the plan's choice, or micro-batch 1)."""
        return plan_report.format_split(self, accumulation_steps)

    def table(self, accumulation_steps: int | None = None) -> str:
        """The breakdown as a text table, for `accumulation_steps` (default: the plan's
        choice, or micro-batch 1)."""
        micro = self.per_replica_batch_size // accumulation_steps if accumulation_steps else None
        return plan_report.format_table(self, micro, accumulation_steps)

    def replace(self, **changes) -> MemoryPlan:
        """A copy with `changes`, the micro-batch × k chosen again."""
        return choose(dataclasses.replace(self, **changes))


def choose(p: MemoryPlan) -> MemoryPlan:
    """Largest micro-batch dividing the per-replica batch whose peak (with its k) fits.

    Without accumulation (micro-batch = the per-replica batch) the buffers are not needed, so
    that one is checked alone; among the others the peak grows with the micro-batch (the
    input of a global batch is the same for each), so the largest that fits is searched by
    bisection over the divisors.
    """
    per_replica = p.per_replica_batch_size
    candidates = divisors(per_replica)
    if p.peak_bytes(per_replica, 1) <= p.budget_bytes:
        return dataclasses.replace(p, micro_batch_size=per_replica, accumulation_steps=1)
    if p.bounded_activations:  # a peak that may shrink where the micro-batch grows: each one
        fitting = [micro for micro in candidates
                   if p.peak_bytes(micro, per_replica // micro) <= p.budget_bytes]
        micro = max(fitting, default=0)
        return dataclasses.replace(p, micro_batch_size=micro,
                                   accumulation_steps=per_replica // micro if micro else 0)
    low, high = 0, len(candidates) - 1  # candidates[:low] fit (with k > 1); [high:] do not
    while low < high:
        middle = (low + high) // 2
        micro = candidates[middle]
        if p.peak_bytes(micro, per_replica // micro) <= p.budget_bytes:
            low = middle + 1
        else:
            high = middle
    if low == 0:
        return dataclasses.replace(p, micro_batch_size=0, accumulation_steps=0)
    micro = candidates[low - 1]
    return dataclasses.replace(p, micro_batch_size=micro,
                               accumulation_steps=per_replica // micro)


class MemoryPlanError(ValueError):
    """A training setting does not fit its memory budget (raised by the guard).

    Attributes:
        plan: the `MemoryPlan` that was checked.
        micro_batch_size, accumulation_steps: the setting that does not fit.
        needed_bytes: its predicted peak per replica.
        switches: how the interface that raised it spells its switches (named in the
            message; default: Python's arguments).
        compiled_fit: where XLA's compiled step decided, `(micro-batch, k, peak bytes)` of
            the split it fits (None: none does); `needed_bytes` is then XLA's figure too.
    """

    def __init__(self, plan: MemoryPlan, micro_batch_size: int, accumulation_steps: int,
                 needed_bytes: int, switches: plan_report.Switches | None = None,
                 compiled_fit: tuple[int, int, int] | None = None):
        self.plan, self.needed_bytes = plan, needed_bytes
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.switches = switches = switches or plan_report.PYTHON
        super().__init__(plan_report.format_error(plan, micro_batch_size, accumulation_steps,
                                                  needed_bytes, switches, compiled_fit))
