"""Sizing of a training run: what it needs per replica, and the micro-batch × k that fits.

The rule of thumb this follows: training memory = model state + micro-batch × (sample data +
kept activations), planned at no more than `safety` (80%) of the device, because the OS,
the CUDA context and the runtime need the rest. Every term is a formula over the model's own
variables and graph; each comment says where it comes from. Nothing here trains or allocates;
`tfmem.probe` measures the same terms and returns a plan calibrated on them.

The arithmetic (`estimate`, `choose`, `check`) is pure: it reads the model and a frozen
`PlanSettings`. Where the plan is for comes in as a `Budget` value, made on the runtime side
(`tfmem.runtime.budget`, the only part that may read this host's free memory); `settings`
builds both from `plan`'s arguments, and a lever is a `dataclasses.replace` of the settings.

Example:
    >>> model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
    >>> p = plan(model, global_batch_size=256, optimizer="adam", device="v100-16gb",
    ...          precision="auto")
    >>> p.micro_batch_size, p.accumulation_steps  # doctest: +SKIP
    (128, 2)
    >>> print(p.table())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfmem import _keras_internals as internals
from tfmem import backend
from tfmem._sizes import format_bytes
from tfmem.memory import levers, loss_trace, remat_search, xla_rules
from tfmem.memory.memory_plan import MemoryPlan, MemoryPlanError, choose
from tfmem.memory.optimizer_state import optimizer_slot_bytes
from tfmem.memory.plan_settings import PlanSettings
from tfmem.memory.graph_walk import itemsize
from tfmem.memory.saved_tensors import model_outputs, saved_tensors
from tfmem.remat import plan as remat_plan
from tfmem.remat import runner
from tfmem.remat.spec import Ranges, RematSpec
from tfmem.runtime import precision as precision_lib
from tfmem.runtime.budget import Budget, budget_for
from tfmem.runtime.cluster import check_count, largest_divisor, split_batch
from tfmem.runtime.precision import accumulator_nbytes

__all__ = ["Budget", "MemoryPlan", "MemoryPlanError", "PlanSettings", "check", "estimate",
           "plan", "settings"]

# -- The CPU runtime term (host RAM only; zero in accelerator memory) --------------------------
# What the framework holds besides tensors: the import of TensorFlow and Keras, then per model
# variable its traced step's ops, Python objects and allocator pools (not a tensor count, so
# it dominates small models). Fitted on one CPU build (docs/planning.md, docs/benchmarks.md);
# `tfmem.probe` measures the whole term instead.
CPU_IMPORT_BYTES = 750 * 2**20
_CPU_GRAPH_BASE_BYTES = 15 * 2**20
_CPU_BYTES_PER_VARIABLE = int(1.63 * 2**20)
# Keras's TensorFlow backend runs each grouped convolution as an XLA call of its own
# (`keras/src/backend/tensorflow/nn.py`, `conv`): the first one starts XLA's CPU runtime
# (compiler, executables, thread pools), and XLA:CPU runs each one on its dense kernel,
# kh·kw × C_in × C_out (block-diagonal), made at every call whatever the batch. On JAX the
# compiled step holds the same buffers, and its memory analysis counts them.
_CPU_XLA_RUNTIME_BYTES = 100 * 2**20
# A recomputed segment's forward is traced again inside its gradient function: its ops once
# more, counted per variable the segment uses, as the traced step is.
_CPU_BYTES_PER_RECOMPUTED_VARIABLE = int(0.7 * 2**20)
_GROUPED_ON_XLA_CALLS = backend.choose(tensorflow=True, jax=False)

_MIXED = ("mixed_float16", "mixed_bfloat16")
_PRECISIONS = ("auto", "float32") + _MIXED


def settings(
    *,
    global_batch_size: int,
    optimizer: Any = "adam",
    precision: str = "float32",
    runtime: Any = None,
    memory_budget: int | None = None,
    device: str | None = None,
    budget: Budget | None = None,
    num_replicas: int | None = None,
    safety: float = 0.8,
    input_batches_in_flight: int = 2,
    input_shape: Sequence | None = None,
    rematerialize: Any = None,
    micro_batch_target: int | None = None,
    loss: Any = None,
    metrics: Sequence | None = None,
) -> PlanSettings:
    """The settings of a plan, checked: the arguments `tfmem.plan` and `tfmem.probe` take.

    Args:
        global_batch_size: samples per optimizer update, over all replicas.
        optimizer: Keras optimizer instance or name; decides the slot count.
        precision: "float32", "mixed_float16", "mixed_bfloat16", or "auto": the policy
            tfmem uses on the planned device (bf16 on TPU, fp16 on GPUs of compute
            capability ≥ 7, float32 on CPU). A float32-built model planned mixed has its
            activations counted in the 2-byte compute dtype.
        runtime: anything with `memory_per_replica` and `num_replicas` (a
            `tfmem.Runtime`); `kind` "cpu" adds the framework's host RAM.
        memory_budget: bytes per replica instead of a runtime (planned as host RAM).
        device: a name from `tfmem.runtime.devices.ACCELERATORS` or "cpu" (this host's
            available RAM). With none of `runtime`, `memory_budget`, `device`, `budget`: "cpu".
        budget: a `tfmem.runtime.budget.Budget` made beforehand, instead of the three above.
        num_replicas: overrides the replica count of the runtime/device.
        safety: fraction of `memory_per_replica` to plan for (0.8: the classic 80% rule).
        input_batches_in_flight: global batches of input resident at once (the step's own and
            one prefetched by `tf.data`).
        input_shape: one sample's shape (or a list of them), for a subclassed model that
            was never built; default: the shapes it was built with.
        rematerialize: what is recomputed in the backward pass, as `tfmem.AccumModel`
            takes it (None, "full", "auto", layer names, `(first, last)` pairs); default:
            the model's own setting (an `AccumModel`'s), else nothing.
        micro_batch_target: with "auto", the micro-batch to make fit (a run whose k is
            set); default: the largest divisor of the per-replica batch up to 16.
        loss: the run's loss, traced on one sample of the model's output (a Keras loss
            instance, name or function; a list or dict for several outputs); default: the
            model's compiled loss, else a bound of 10 tensors of the output's size.
        metrics: the run's metrics, traced the same way; default: the compiled ones.

    Raises:
        ValueError: the global batch does not split over the replicas, or bad arguments.
    """
    if budget is None:
        budget = budget_for(runtime=runtime, memory_budget=memory_budget, device=device,
                            num_replicas=num_replicas)
    elif runtime is not None or memory_budget is not None or device is not None:
        raise ValueError("Give `budget` or one of `runtime`, `memory_budget`, `device`, "
                         "not both.")
    elif num_replicas:
        budget = dataclasses.replace(budget, num_replicas=num_replicas)
    check_count("global_batch_size", global_batch_size)
    split_batch(global_batch_size, budget.num_replicas, 1)
    _check_optimizer(optimizer)
    if not 0 < safety <= 1:
        raise ValueError(f"`safety` must be in (0, 1], got {safety}.")
    chosen, note = _resolve_precision(precision, budget)
    return PlanSettings(global_batch_size=global_batch_size, budget=budget, optimizer=optimizer,
                        precision=chosen, safety=safety,
                        input_batches_in_flight=input_batches_in_flight,
                        input_shape=input_shape,
                        rematerialize=(None if rematerialize is None  # the model's own
                                       else RematSpec.parse(rematerialize)),
                        micro_batch_target=micro_batch_target, loss=loss,
                        metrics=None if metrics is None else tuple(metrics),
                        notes=(note,) if note else ())


def _resolve_precision(precision: str, budget: Budget) -> tuple[str, str | None]:
    """The policy a run on `budget` uses, and a note saying so when it was "auto"."""
    if precision not in _PRECISIONS:
        raise ValueError(f"`precision` must be one of {', '.join(map(repr, _PRECISIONS))}, "
                         f"got {precision!r}.")
    if precision != "auto":
        return precision, None
    if budget.target is None:
        return "float32", "precision='auto' on a CPU budget: float32"
    chosen = precision_lib.policy_for(budget.target)
    return chosen, (f"precision='auto': {chosen}, the policy tfmem.policy_for picks on "
                    f"{budget.device} (bf16 on TPU, fp16 on GPUs of compute capability ≥ 7)")


def _device_notes(model: keras.Model, budget, saved, precision: str) -> tuple[str, ...]:
    """What a plan for an XLA device says about how it counted for that device."""
    lanes = _tpu_lanes(model) if budget.kind == "tpu" and not saved.lane_tensors else ()
    centred = tuple(f"activations: up to micro-batch {largest}, {_per_sample(nbytes)}/sample "
                    "more, BatchNormalizations' inputs less their mean, which XLA:GPU keeps "
                    "in float32 where one kernel sums their statistics"
                    for largest, nbytes in saved.bounded_bytes)
    return lanes + centred + xla_rules.held_gradients_note(
        backend.choose(tensorflow=None, jax=budget.kind), precision)


def _held_gradients(model: keras.Model, trainable: list, precision: str, kind) -> int:
    """Bytes of gradients the step holds at its peak (`MemoryPlan.gradient_bytes`)."""
    held = xla_rules.held_gradient_bytes(
        backend.choose(tensorflow=None, jax=kind), internals.flatten_layers(model), trainable,
        precision)
    return _nbytes(trainable) if held is None else held


def _nbytes(variables) -> int:
    return sum(math.prod(v.shape) * itemsize(v.dtype) for v in variables)


def _check_optimizer(optimizer: Any) -> None:
    """Raises unless Keras makes an optimizer of `optimizer`, listing the names it knows."""
    try:
        keras.optimizers.get(optimizer)
    except ValueError:
        names = sorted(name.lower() for name, value in vars(keras.optimizers).items()
                       if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)
                       and value is not keras.optimizers.Optimizer
                       and "Optimizer" not in name)  # the wrappers take another optimizer
        raise ValueError(
            f"`optimizer` (`--optimizer`) {optimizer!r} is not an optimizer Keras knows; use "
            f"one of {', '.join(names)}, or pass a keras.optimizers.Optimizer") from None


def estimate(model: keras.Model, settings: PlanSettings,
             analyses: dict | None = None) -> MemoryPlan:
    """The plan's terms for one setting, micro-batch × k not chosen yet (`choose` picks them).

    `analyses` caches the activation analysis across settings that share the model, its
    compute dtype and the frozen set (the levers plan the same model several times).
    """
    precision, frozen, budget = settings.precision, settings.frozen, settings.budget
    optimizer = keras.optimizers.get(settings.optimizer)
    # Built in float32, planned mixed: its float32 activations are counted in 2 bytes.
    override = _override(model, precision)
    analyses = {} if analyses is None else analyses
    recomputed, ranges = _rematerialized(model, settings, override, analyses)
    # Where it saves nothing, what is recomputed is planned as kept (the run still cuts it).
    saves = runner.saves_memory(budget.kind)
    counted, counted_ranges = (recomputed, ranges) if saves else ((), ())
    key = (id(model), override, frozenset(frozen), counted, counted_ranges, budget.kind)
    if key not in analyses:
        analyses[key] = saved_tensors(model, compute_dtype=override, frozen=frozen,
                                      input_shapes=settings.input_shape,
                                      recomputed=counted, ranges=counted_ranges,
                                      inner_graphs=remat_plan.inner_graphs(model,
                                                                           counted_ranges),
                                      device_kind=budget.kind)
    saved = analyses[key]
    trainable = [v for v in model.trainable_variables if id(v) not in frozen]
    num_trainable = sum(math.prod(v.shape) for v in trainable)
    mixed = _mixed_precision_bytes(model, precision, trainable, frozen)
    fraction = (remat_search.recompute_fraction(model, ranges, override, frozen, analyses)
                if ranges else 0.0)
    held = _loss_and_metrics(model, settings, saved)
    cpu = budget.kind == "cpu"
    grouped = _grouped_convolutions(model, override) if cpu else None
    retraced = (_CPU_BYTES_PER_RECOMPUTED_VARIABLE
                * remat_search.recomputed_variables(model, counted_ranges) if cpu else 0)
    heap_scratch, heap_notes = _heap_scratch(saved, grouped, budget)
    runtime_notes = ((grouped.note,) if grouped else ()) + heap_notes + (
        (f"framework runtime includes {format_bytes(retraced)} for the recomputed segments' "
         "forward, traced again in their gradient",) if retraced else ())
    notes = _notes(model, settings, saved, override, recomputed, ranges, saves, fraction,
                   held.notes + runtime_notes) + _device_notes(model, budget, saved, precision)
    return MemoryPlan(
        model_name=model.name,
        num_parameters=int(model.count_params()),
        num_trainable_parameters=int(num_trainable),
        optimizer=type(optimizer).__name__,
        precision=precision,
        device=budget.device,
        device_kind=budget.kind,
        num_replicas=budget.num_replicas,
        memory_per_replica=budget.memory_per_replica,
        safety=settings.safety,
        global_batch_size=settings.global_batch_size,
        # Every weight (trainable and BN moving statistics) in its own dtype, and the
        # metrics' state (a confusion matrix); not the few bytes of dropout seed states.
        parameter_bytes=_nbytes(model.weights) + held.state_bytes,
        # tape.gradient returns one gradient per trainable variable, in the variable's dtype,
        # all alive together until `apply_gradients`; not so in a step XLA updates weight by
        # weight (`xla_rules.held_gradient_bytes`).
        gradient_bytes=_held_gradients(model, trainable, precision, budget.kind),
        optimizer_bytes=optimizer_slot_bytes(optimizer, trainable),
        # AccumModel's running sum of gradients, one per trainable variable: float32, or the
        # variable's own dtype where that is wider (float64).
        accumulation_bytes=sum(accumulator_nbytes(v.shape, v.dtype) for v in trainable),
        mixed_precision_bytes=int(mixed),
        runtime_bytes=(CPU_IMPORT_BYTES + _CPU_GRAPH_BASE_BYTES
                       + _CPU_BYTES_PER_VARIABLE * len(model.variables)
                       + (grouped.nbytes if grouped else 0) + retraced
                       if cpu else 0),
        # The model's inputs and the targets the loss reads: both come a global batch at a time.
        input_bytes_per_sample=saved.input_bytes + held.target_bytes,
        activation_bytes_per_sample=saved.saved_bytes + saved.recomputed_bytes,
        # What the call running at the peak holds next to the kept tensors: its gradients
        # and temporaries; beside them, what the heap keeps of the grouped convolutions'.
        workspace_bytes_per_sample=saved.workspace_bytes + heap_scratch,
        workspace_fixed_bytes=saved.workspace_fixed_bytes,
        lane_tensors=saved.lane_tensors, bounded_activations=saved.bounded_bytes,
        # Held next to every kept activation when the loss runs, before the backward pass:
        # the plan's row is what it holds beyond the backward's workspace and recomputation.
        loss_bytes_per_sample=held.per_sample,
        recomputed_bytes_per_sample=saved.recomputed_bytes,
        input_batches_in_flight=settings.input_batches_in_flight,
        notes=notes,
        rematerialized=tuple(ranges),
        recompute_fraction=fraction,
    )


@dataclasses.dataclass(frozen=True)
class _GroupedConvolutions:
    """What the grouped convolutions run through XLA add to a CPU plan's runtime term."""

    nbytes: int  # XLA's runtime + the largest dense kernel
    dense_kernel_bytes: int
    layer_name: str  # the layer of the largest dense kernel

    @property
    def note(self) -> str:
        return (f"grouped convolutions run through XLA: framework runtime includes "
                f"{format_bytes(self.nbytes)} (XLA's runtime "
                f"{format_bytes(_CPU_XLA_RUNTIME_BYTES)} + the dense kernel of "
                f"{self.layer_name}, {format_bytes(self.dense_kernel_bytes)})")


def _heap_scratch(saved, grouped: _GroupedConvolutions | None,
                  budget) -> tuple[int, tuple[str, ...]]:
    """What the grouped convolutions' XLA calls leave in a heap that keeps freed blocks
    (glibc's default), bytes per sample, and the note that says so."""
    if not grouped or not budget.heap_keeps_freed or not saved.heap_scratch_bytes:
        return 0, ()
    nbytes = saved.heap_scratch_bytes
    return nbytes, (f"workspace includes {format_bytes(nbytes)}/sample that the grouped "
                    "convolutions' XLA calls leave in the process heap (glibc's default keeps "
                    "freed blocks; `tfmem.runtime.fix_mmap_threshold()` gives them back, at a "
                    "cost in time)",)


def _grouped_convolutions(model: keras.Model, override) -> _GroupedConvolutions | None:
    """The grouped convolutions' XLA term of a CPU plan (None: none, or not XLA calls)."""
    if not _GROUPED_ON_XLA_CALLS:
        return None
    dense = [(math.prod(layer.kernel_size) * layer.kernel.shape[-2] * layer.groups
              * layer.filters * itemsize(override or layer.compute_dtype), layer.name)
             for layer in internals.flatten_layers(model)
             if getattr(layer, "groups", 1) > 1 and getattr(layer, "kernel", None) is not None]
    if not dense:
        return None
    nbytes, name = max(dense, key=lambda entry: entry[0])
    return _GroupedConvolutions(_CPU_XLA_RUNTIME_BYTES + nbytes, nbytes, name)


def _loss_and_metrics(model: keras.Model, settings: PlanSettings,
                      saved) -> loss_trace.LossBytes:
    """The settings' loss and metrics (default: the model's compiled ones), traced on one
    sample of its outputs."""
    outputs, names = model_outputs(model, settings.input_shape)
    if not outputs:
        return loss_trace.LossBytes(0, notes=(
            "loss and metrics not counted: the model's outputs could not be sized",))
    loss = settings.loss if settings.loss is not None else getattr(model, "loss", None)
    metrics = (settings.metrics if settings.metrics is not None
               else internals.compiled_metrics(model))
    return loss_trace.loss_bytes(outputs, names, loss, metrics, saved.kept_output_bytes)


def _mixed_precision_bytes(model: keras.Model, precision: str, trainable: list,
                           frozen) -> int:
    """The extra bytes a mixed policy keeps: 2-byte copies of the weights, and under
    float16 a second gradient set."""
    if precision not in _MIXED:
        return 0
    # Keras autocasts each float32 variable to the compute dtype at every call; conv/dense
    # backward keeps that 2-byte copy (input gradient = dy ⊛ kernel). Normalization layers
    # upcast to float32 instead, so their variables get no copy.
    mixed = 2 * sum(math.prod(w.shape) for layer in internals.flatten_layers(model)
                    if not isinstance(layer, keras.layers.BatchNormalization)
                    for w in internals.own_trainable_variables(layer)
                    if id(w) not in frozen)
    if precision == "mixed_float16":
        # LossScaleOptimizer unscales into new float32 gradients and checks them all for
        # inf/nan before applying: a second gradient set is alive at once.
        mixed += _nbytes(trainable)
    return mixed


def _notes(model: keras.Model, settings: PlanSettings, saved, override, recomputed, ranges,
           saves: bool, fraction: float, loss_notes: tuple[str, ...]) -> tuple[str, ...]:
    """What a plan says about how it counted: the settings' notes, the loss's, then the
    analysis's."""
    notes = list(settings.notes) + list(loss_notes)
    if override:
        notes.append(f"built in float32, planned {settings.precision}: float32 activations "
                     f"counted as {override}")
    if saved.traced_calls:
        notes.append("measured by tracing their backward pass: "
                     + ", ".join(saved.traced_calls))
    if saved.fallback_calls:
        notes.append("could not be traced, counted as keeping inputs and outputs (an upper "
                     "bound): " + "; ".join(saved.fallback_calls))
    if saved.loop_calls:
        notes.append("loop intermediates not counted in: " + ", ".join(saved.loop_calls))
    if (recomputed or ranges) and not saves:
        notes.append("rematerialized layers planned as kept: on JAX on a CPU, XLA runs the "
                     "recomputation where it saves no memory (only time)")
    elif (recomputed and not saved.segments
            and not internals.is_graph_network(internals.functional_of(model))):
        notes.append("rematerialized layers planned as kept (an upper bound): the call of "
                     f"{type(model).__name__} does not trace as a graph of its layers")
    if remat_setting(model, settings).mode == "full" and not ranges:
        notes.append("rematerialize full: no cut lowers the planned peak, so none is made"
                     + (f" (not counted: the loop intermediates of "
                        f"{', '.join(saved.loop_calls)}; name those layers to recompute them)"
                        if saved.loop_calls else ""))
    if saved.segments:
        notes.append("rematerialized, recomputed in the backward pass one at a time (the "
                     "largest counted in activations): " + ", ".join(
                         f"{name} {_per_sample(nbytes)}/sample" for name, nbytes in
                         saved.segments)
                     + (f"; ≈ +{100 * fraction:.0f}% compute" if ranges else ""))
    return tuple(notes)


def _tpu_lanes(model: keras.Model) -> tuple[str, ...]:
    """What a plan for a TPU made without XLA:TPU's rules (TensorFlow's) does not count, where
    the model has feature maps or sequences whose channels are not a multiple of XLA:TPU's
    128 lanes: below a micro-batch of 128 such a tensor is laid out with its batch or its
    channels along the lanes, whichever pads less, padded to a multiple of 128
    (`tpu_layout`; a JAX plan counts it in its own row)."""
    widths = set()
    for layer in internals.flatten_layers(model):
        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):  # not called once in a graph: no one output
            continue
        widths.update(shape[-1] for shape in (tuple(getattr(o, "shape", ())) for o in outputs)
                      if len(shape) >= 3 and shape[-1] is not None and shape[-1] % 128)
    if not widths:
        return ()
    return (f"on a TPU, below a micro-batch of 128, XLA:TPU lays a tensor whose channels are "
            f"not a multiple of 128 (here from {min(widths)}) out along 128 lanes, by its "
            "batch or its channels, whichever pads less, so that it holds more than its bytes "
            "(at micro-batch 8: 24 channels 5.3×, 192 channels 1.33×); this plan does not "
            "count that, and counts more tensors than XLA:TPU keeps (a plan made on "
            "KERAS_BACKEND=jax counts what XLA:TPU keeps, and the padding). XLA:TPU's own "
            "figure of the step: scripts/plan.py or a dry run of scripts/finetune.py on JAX "
            "with the TPU compiler installed, or tfmem.memory.probe_jax.compiled_step_memory("
            "…, device=probe_jax.tpu_device(…)) (on the TPU, JAX's memory check compiles the "
            "step)",)


def _per_sample(nbytes: int) -> str:
    """Bytes per sample in a plan's note (the report's own formatting is not imported here)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def remat_setting(model: keras.Model, settings: PlanSettings) -> RematSpec:
    """The rematerialization a plan is for: the settings', else the model's own."""
    if settings.rematerialize is not None:
        return settings.rematerialize
    return RematSpec.parse(getattr(model, "rematerialize", None))


def _rematerialized(model: keras.Model, settings: PlanSettings, override,
                    analyses: dict) -> tuple[tuple[int, ...], tuple]:
    """(ids of the layers rematerialized by name, the spec of the segments cut:
    `tfmem.remat.plan`)."""
    setting = remat_setting(model, settings)
    if setting.mode == "chosen":
        remat_plan.check_spec(model, setting.chosen)
        return (), setting.chosen
    if setting.mode in (None, "auto"):  # "auto" is resolved by `plan` into chosen segments
        return (), ()
    names = set(setting.names)
    ids = tuple(sorted(id(layer) for layer in internals.flatten_layers(model)
                       if layer is not model and layer.name in names))
    if not setting.cuts_segments:
        return ids, ()
    runner.check_graph(model, setting)
    return ids, remat_search.segments_for(model, setting, override, settings.frozen, analyses)


def _auto(model: keras.Model, plan_settings: PlanSettings, analyses: dict) -> MemoryPlan:
    """`rematerialize="auto"`: as many segments of "full" as the target micro-batch needs.

    The rule: rematerialize only when the largest micro-batch that fits without it is
    below the target (`micro_batch_target`, or the largest divisor of the per-replica batch
    up to 16: smaller micro-batches make BatchNormalization's statistics noisy and leave
    accelerators idle); then the segments of "full" (at any depth, each on its own) that
    save the most bytes per recomputed FLOP first, as few as let the target fit (all of them
    when none is enough).
    """
    plain_settings = dataclasses.replace(plan_settings, rematerialize=RematSpec.parse(Ranges(())))
    plain = choose(estimate(model, plain_settings, analyses))
    per_replica = plain.per_replica_batch_size
    target = plan_settings.micro_batch_target or largest_divisor(per_replica, 16)
    if plain.fits and plain.micro_batch_size >= target:
        return plain.replace(notes=plain.notes + (
            f"rematerialize auto: not needed, micro-batch {plain.micro_batch_size} fits",))
    if not runner.saves_memory(plan_settings.budget.kind):
        return plain.replace(notes=plain.notes + (
            "rematerialize auto: not used, on JAX on a CPU it saves no memory",))
    graph = internals.functional_of(model)
    if not internals.is_graph_network(graph):
        return plain.replace(notes=plain.notes + (
            "rematerialize auto: planned without it (a subclassed model: name its blocks "
            "to rematerialize them)",))
    override = _override(model, plan_settings.precision)
    full = remat_search.full(model, override, plan_settings.frozen, analyses)
    units = remat_search.units(model, full, override, plan_settings.frozen, analyses)
    steps = per_replica // target

    def planned(count: int) -> MemoryPlan:
        spec = remat_plan.spec_of(units[:count])
        return choose(estimate(model, dataclasses.replace(
            plan_settings, rematerialize=RematSpec.parse(Ranges(spec))), analyses))

    def fits(candidate: MemoryPlan) -> bool:
        return candidate.peak_bytes(target, steps) <= candidate.budget_bytes

    low, high = 1, len(units)  # the fewest units whose plan fits the target
    while low < high:
        middle = (low + high) // 2
        if fits(planned(middle)):
            high = middle
        else:
            low = middle + 1
    chosen = planned(low) if units else plain
    before = (f"micro-batch {plain.micro_batch_size} × {plain.accumulation_steps}"
              if plain.fits else "nothing fits")
    after = (f"micro-batch {chosen.micro_batch_size} × {chosen.accumulation_steps}"
             if chosen.fits else "still nothing fits")
    return chosen.replace(notes=chosen.notes + (
        f"rematerialize auto: {before} without it; with {low if units else 0} of "
        f"{len(units)} segments recomputed, {after} at ≈ "
        f"+{100 * chosen.recompute_fraction:.0f}% compute",))


def _override(model: keras.Model, precision: str) -> str | None:
    own_compute = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
    if precision in _MIXED and own_compute == "float32":
        return "float16" if precision == "mixed_float16" else "bfloat16"
    return None


def plan(
    model: keras.Model,
    plan_settings: PlanSettings | None = None,
    *,
    smaller_variants: Sequence[tuple[str, Callable[[], keras.Model]]] = (),
    **arguments: Any,
) -> MemoryPlan:
    """Sizes one training run of `model` and picks micro-batch × accumulation steps.

    Args:
        model: a built Keras model: functional, Sequential or subclassed, with concrete
            input shapes. Only shapes are read: a model built inside
            `tfmem.models.shapes_only()` (no weights in memory) plans the same.
        plan_settings: a `PlanSettings` from `settings(...)`; or, instead, its arguments:
            `global_batch_size` (required), `optimizer`, `precision`, one of `runtime`,
            `memory_budget`, `device`, `budget`, and `num_replicas`, `safety`,
            `input_batches_in_flight`, `input_shape`, `loss`, `metrics` (each described at
            `tfmem.memory.planner.settings`).
        smaller_variants: `(description, builder)` pairs the planner builds and checks, when
            nothing fits, after the changes it can check on `model` itself (precision,
            optimizer, frozen backbone), e.g. `("image size 288", lambda: build(...))`.

    Returns:
        A frozen `MemoryPlan`; when nothing fits, its `alternative` names the smallest
        change checked to fit.

    Raises:
        ValueError: the global batch does not split over the replicas, bad arguments, or a
            model whose shapes are unknown.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a built keras.Model (functional, Sequential or subclassed), got "
            f"{type(model).__name__}: {model!r:.80}. Build it first, e.g. "
            "`tfmem.models.build(name)` or `keras.Model(inputs, outputs)`.")
    if plan_settings is None:
        plan_settings = settings(**arguments)
    elif arguments:
        raise TypeError(f"Give `plan_settings` or its arguments, not both: {sorted(arguments)}.")
    analyses: dict = {}
    if remat_setting(model, plan_settings).mode == "auto":
        result = _auto(model, plan_settings, analyses)
    else:
        result = choose(estimate(model, plan_settings, analyses))
    if result.fits:
        return result
    alternative = levers.search(
        model, result, plan_settings,
        lambda candidate, changed: choose(estimate(candidate, changed, analyses)),
        smaller_variants)
    return result.replace(alternative=alternative)


def check(plan: MemoryPlan, *, accumulation_steps: int | None = None,
          allow_over_budget: bool = False, switches=None) -> None:
    """The guard: raises `MemoryPlanError` when the run would not fit its budget.

    Args:
        plan: the plan of the run.
        accumulation_steps: the k the run will use (None: the plan's own choice).
        allow_over_budget: True skips the check (the explicit override).
        switches: how the caller's interface spells k and the override, for the message
            (a `tfmem.memory.plan_report.Switches`; default: Python's arguments).

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
    check_count("accumulation_steps", accumulation_steps)
    micro = split_batch(plan.global_batch_size, plan.num_replicas, accumulation_steps)
    needed = plan.peak_bytes(micro, accumulation_steps)
    if needed <= plan.budget_bytes:
        return
    raise MemoryPlanError(plan, micro, accumulation_steps, needed, switches)
