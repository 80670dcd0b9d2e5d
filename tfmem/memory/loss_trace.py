"""What the loss and the metrics hold per sample next to the model's output, traced.

The loss runs once the forward pass is done, with every kept activation alive: its forward
and backward (log-probabilities, one-hot or gathered targets, an ignore mask, Dice's
products, and the gradient of the output it hands to the model) are held on top of them. A
metric updates after the backward pass, from the same output: the output is held through
the loss when a metric or the model's backward reads it, else freed at its last use there.
Both are traced like a layer (`gradient_trace`): the loss forward and backward with respect
to one sample of the output, a metric's `stateless_update_state` forward, each counted at
its peak. A loss or metric that
cannot be traced, or no loss at all (an uncompiled model planned without `loss`), counts as
`BOUND_TENSORS` tensors of the output's size, named in the plan's notes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import keras

from tfmem import backend
from tfmem._sizes import itemsize
from tfmem.memory import gradient_trace

# The bound for a loss or metric that is not traced, in tensors of the output's size. With
# the output and the targets, the losses and metrics of Keras and tfmem that segmentation
# uses hold 3-9 such tensors traced, and up to 10 on TensorFlow's CPU allocator
# (docs/benchmarks.md).
BOUND_TENSORS = 10

# Traces by (loss or metric, output and target specs), for the process: the guard and the
# levers plan the same run several times.
_TRACES: dict = {}


@dataclasses.dataclass(frozen=True)
class LossBytes:
    """What the loss and metrics of a run hold.

    Attributes:
        per_sample: bytes per sample at the loss's peak (its forward and backward) or a
            metric update's, whichever is larger, with the micro-batch's targets, less the
            model's outputs the activations count already.
        state_bytes: the metrics' variables (a confusion matrix: classes × classes).
        notes: what was bounded instead of traced, for the plan's notes.
        target_bytes: bytes per sample of the targets the losses read, in the form each
            was traced with (shaped as the output, or its class indices in int32); an
            untraced loss's as the output. They come with the inputs, a global batch of
            them at a time.
    """

    per_sample: int
    state_bytes: int = 0
    notes: tuple[str, ...] = ()
    target_bytes: int = 0


def loss_bytes(outputs, output_names, loss, metrics, kept_output_bytes: int) -> LossBytes:
    """Traces `loss` and `metrics` on one sample of `outputs`.

    Args:
        outputs: the model's symbolic outputs (`KerasTensor`s with a batch axis).
        output_names: their names, as a dict of losses is keyed.
        loss: a Keras loss (instance, name or function), one per output as a list or dict
            keyed by output name, or None (bounded).
        metrics: Keras metrics (instances, names or functions) of the first output.
        kept_output_bytes: bytes per sample of the outputs the activations count already.
    """
    outputs = list(outputs)
    output_bytes = sum(_bytes(t.shape[1:], t.dtype) for t in outputs)
    bound = BOUND_TENSORS * output_bytes
    notes, peaks = [], []
    targets = output_bytes  # untraced: a target shaped as each output
    losses = _per_output(loss, len(outputs), output_names)
    if losses is None:
        notes.append((f"no loss given: loss and metrics counted as {BOUND_TENSORS} tensors of "
                      "the output's size (pass the run's `loss` to trace it)") if loss is None
                     else (f"the loss does not pair with the model's {len(outputs)} outputs: "
                           f"counted as {BOUND_TENSORS} tensors of their size"))
        peaks.append(bound)
    else:
        # Each output's loss in turn, the gradients of the earlier ones still held: their sum.
        total = targets = 0
        for item, output in zip(losses, outputs):
            peak, target = _traced(item, output, _loss_call,
                                   hold_output=bool(metrics) or kept_output_bytes > 0)
            if peak is None:
                notes.append(f"loss {_name(item)} could not be traced: counted as "
                             f"{BOUND_TENSORS} tensors of the output's size")
                peak = BOUND_TENSORS * _bytes(output.shape[1:], output.dtype)
            total += peak
            targets += target
        peaks.append(total)
    state = 0
    for given in metrics or ():
        metric = _metric(given)
        if isinstance(metric, keras.metrics.Metric):
            state += sum(_bytes(v.shape, v.dtype) for v in metric.variables)
        peak, _ = _traced(given, outputs[0], _metric_call, hold_output=True)
        if peak is None:
            notes.append(f"metric {_name(given)} could not be traced: counted as "
                         f"{BOUND_TENSORS} tensors of the output's size")
            peak = BOUND_TENSORS * _bytes(outputs[0].shape[1:], outputs[0].dtype)
        peaks.append(peak)
    # The loss's tensors and a metric's are never alive together (the metric updates after
    # the backward pass): the larger of them, less the outputs counted as activations.
    return LossBytes(max(max(peaks, default=0) - kept_output_bytes, 0), state, tuple(notes),
                     targets)


def _per_output(loss, num_outputs: int, names) -> list | None:
    """One loss per output, or None without one (or when they do not pair with the outputs)."""
    if loss is None:
        return None
    if isinstance(loss, dict):
        names = list(names or ())
        return ([loss[name] for name in names]
                if len(names) == num_outputs and all(name in loss for name in names) else None)
    if isinstance(loss, (list, tuple)):
        return list(loss) if len(loss) == num_outputs else None
    return [loss] * num_outputs


def _loss_call(item):
    function = keras.losses.get(item) if isinstance(item, (str, dict)) else item
    return (lambda xs: function(xs[1], xs[0])), [True, False], []


def _metric(given):
    """The metric a name stands for (None: none Keras knows by it, as "acc", which `compile`
    resolves by the targets' shape), else `given` itself."""
    if not isinstance(given, str):
        return given
    try:
        return keras.metrics.get(given)
    except ValueError:
        return None


def _metric_call(metric):
    metric = _metric(metric)
    if metric is None:
        raise ValueError("not a metric Keras knows by this name")
    if not isinstance(metric, keras.metrics.Metric):
        return (lambda xs: metric(xs[1], xs[0])), [False, False], []

    def call(xs):  # the metric's variables are mapped to symbolic values by the trace
        with int64_as_run():
            return metric.stateless_update_state([v.value for v in metric.variables],
                                                 xs[1], xs[0])

    return call, [False, False], list(metric.variables)


@contextlib.contextmanager
def int64_as_run():
    """Keras's confusion matrix (MeanIoU's update) asks for int64, which JAX without x64 makes
    int32 and warns of, as the run's own step does: a trace made to measure the step does not
    warn again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Explicitly requested dtype int64",
                                category=UserWarning)
        yield


def _traced(item, output, make_call, hold_output: bool) -> tuple[int | None, int]:
    """Peak bytes per sample of `item` traced on `output` (inputs included), or None, and the
    bytes of one sample's targets: shaped as the output, else as its class indices (the
    output's shape without the class axis, int32), whichever traces first (the first for
    None)."""
    shape = tuple(output.shape[1:])
    dtype = keras.backend.standardize_dtype(output.dtype)
    # A name by its value; an object by identity, kept alive with its trace.
    key = (item if isinstance(item, str) else id(item), shape, dtype, make_call.__name__,
           hold_output)
    if key in _TRACES and (isinstance(item, str) or _TRACES[key][0] is item):
        return _TRACES[key][1]
    trace = backend.choose(tensorflow=gradient_trace.trace_call_tensorflow,
                           jax=gradient_trace.trace_call_jax)
    peak, target_bytes = None, _bytes(shape, dtype)
    for target in ((shape, dtype), (shape[:-1], "int32")):
        specs = [(shape, dtype), target]
        try:
            call, differentiable, variables = make_call(item)
            traced = trace(call, specs, differentiable=differentiable, trainable=[],
                           non_trainable=variables, held=[0] if hold_output else [],
                           owned=[] if hold_output else [0])
        except Exception:  # noqa: BLE001 - targets of the other form, or not traceable
            continue
        inputs = [_bytes(*spec) for spec in specs]
        internal = sum(nbytes for nbytes, _ in traced.internal)
        if traced.transient_bytes:  # TensorFlow: its ops one at a time
            peak = (traced.transient_bytes + internal
                    + sum(inputs[i] for i in traced.kept_inputs)
                    + sum(traced.output_bytes[i] for i in traced.kept_outputs))
        else:  # no transient sized (JAX): as the backward workspace counts one
            # Its inputs, what its backward keeps, and two tensors of the largest size (the
            # output's gradient and one temporary).
            peak = sum(inputs) + internal + 2 * traced.largest_bytes
        target_bytes = inputs[1]
        break
    _TRACES[key] = (item, (peak, target_bytes))
    return peak, target_bytes


def _bytes(shape, dtype) -> int:
    return math.prod(shape) * itemsize(dtype)


def _name(item) -> str:
    return getattr(item, "name", None) or getattr(item, "__name__", None) or repr(item)
