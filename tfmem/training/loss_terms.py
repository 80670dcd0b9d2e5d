"""A window's loss as the whole batch's: each compiled loss's sum and count, divided once.

Keras divides each compiled loss by a count of the batch it sees: its elements, the valid ones
under a mask (`ignore_class`, an output's `_keras_mask`), the sum of the sample weights
("mean_with_sample_weight"), or nothing ("sum"). Where that count differs between micro-batches,
the mean of the micro-batch losses is not the whole batch's loss (docs/accumulation.md, "Loss
normalisation"). While a micro-step computes its loss, `recording` notes each compiled loss's
value and count, evaluated as Keras evaluates it, and `split` sorts them into gradient *groups*:
the fixed group (losses whose count is the same in every micro-batch, and the `add_loss` terms),
whose window gradient is the mean over the micro-batches, and one group per counted loss, whose
summed gradient is divided by its summed count. Without a counted loss there is one group, the
loss Keras computes. One definition (`keras.ops`) serves both backends.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, NamedTuple

import keras
from keras import ops

from tfmem import _keras_internals as internals

MEAN = "mean"  # divided by the same count in every micro-batch: the window takes the mean
SUM = "sum"  # not divided ("sum"): the window adds the micro-batch values
ELEMENTWISE = "elementwise"  # not reduced ("none"): trained on its sum, logged as its mean
COUNTED = "counted"  # divided by a count that differs between micro-batches
UNKNOWN = "unknown"  # a value whose count is not known: taken as a mean, with a warning


class Layout(NamedTuple):
    """What a window sums, fixed when the micro-step is traced.

    Attributes:
        fixed: whether the fixed group has a loss (it is then the first gradient group).
        tracked: `(index, kind, weight)` of each compiled loss whose window value is not the
            mean of its micro-batch values (COUNTED, SUM): its numerator and count are
            carried; `weight` is its `loss_weights` entry (None for 1).
    """

    fixed: bool = True
    tracked: tuple = ()
    seen: bool = True  # False: traced before the compiled loss existed (traced again)

    @property
    def counted(self) -> tuple:
        """The indices of the counted losses, one gradient group each, in `tracked` order."""
        return tuple(index for index, kind, _ in self.tracked if kind == COUNTED)

    @property
    def num_groups(self) -> int:
        return int(self.fixed) + len(self.counted)


SINGLE = Layout()  # one gradient group: the micro-batch loss Keras computes, as a mean
UNSEEN = Layout(seen=False)  # as SINGLE, from a trace that could not see the compiled loss


class Term(NamedTuple):
    """One compiled loss on one micro-batch."""

    index: int
    name: str  # for messages: "'loss_name' of the output 'output_name'"
    kind: str
    weight: Any  # its `loss_weights` entry, None for 1
    value: Any  # Keras's value of the loss (before its weight)
    count: Any  # COUNTED: what Keras divided it by; else None


class Split(NamedTuple):
    """A micro-batch's loss, taken apart by `split`."""

    layout: Layout
    losses: list  # per gradient group, the loss whose gradient that group sums
    report: Any  # what the window's logged loss averages (the fixed group's part of it)
    term_sums: list  # per tracked loss, `[numerator, count]` to add into the window's sums


class Recording:
    """The compiled losses one call of `compute_loss` evaluated (`recording`)."""

    def __init__(self, model: keras.Model, built: bool = True):
        self.model, self.built = model, built
        self.terms: list[Term] = []
        self.num_added = 0  # `add_loss` terms (regularisers) compute_loss added


_LOCAL = threading.local()  # replicas trace in threads of their own
_LOCK = threading.Lock()


@contextlib.contextmanager
def recording(model: keras.Model):
    """Notes each compiled loss `compute_loss` evaluates in this thread while inside.

    Yields a `Recording`, or None where the losses cannot be told apart: no compiled loss, or
    a `compute_loss` the model overrides (warned about once). Before Keras builds the compiled
    loss (on its first call) nothing is noted, and the recording says so (`built`).
    """
    record = None
    if _overrides_compute_loss(model):
        _warn_once(model, f"{type(model).__name__}.compute_loss",
                   f"{type(model).__name__} overrides `compute_loss`",
                   "compile the loss (`compile(loss=...)`) and leave `compute_loss` to Keras")
    else:
        entries = _install(model)
        if entries is None:
            record = Recording(model, built=False)
        elif entries:
            record = Recording(model)
    previous = getattr(_LOCAL, "record", None)
    _LOCAL.record = record if record is not None and record.built else None
    try:
        yield record
    finally:
        _LOCAL.record = previous


def evaluate(loss, y_true, y_pred, sample_weight) -> tuple:
    """`(value, kind, count)` of a Keras `Loss` on one micro-batch; the value is Keras's.

    As `keras.losses.Loss.__call__`: the loss's `call`, its masks (of `y_pred`, and the one
    `call` sets, e.g. for `ignore_class`) and Keras's reduction; the count is what that
    reduction divided by.
    """
    if type(loss).__call__ is not keras.losses.Loss.__call__:
        return loss(y_true, y_pred, sample_weight), UNKNOWN, None
    in_mask = internals.keras_mask(y_pred)
    with keras.name_scope(loss.name):
        y_pred = keras.tree.map_structure(
            lambda v: ops.convert_to_tensor(v, dtype=loss.dtype), y_pred)
        y_true = keras.tree.map_structure(
            lambda v: ops.convert_to_tensor(v, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
        out_mask = internals.keras_mask(values)
        if in_mask is not None and out_mask is not None:
            mask = in_mask & out_mask
        else:
            mask = in_mask if in_mask is not None else out_mask
        value = internals.reduce_weighted_values(values, sample_weight, mask, loss.reduction,
                                                 loss.dtype)
        kind, count = _count(values, sample_weight, mask, loss.reduction, loss.dtype)
    return value, kind, count


def _count(values, sample_weight, mask, reduction, dtype) -> tuple:
    """The kind of a reduction on these values and, where it varies, its count."""
    if reduction in (None, "none"):
        return ELEMENTWISE, None
    if tuple(values.shape) in ((), (0,)):  # Keras returns such values unreduced
        return UNKNOWN, None
    if reduction == "sum":
        return SUM, None
    if reduction in ("sum_over_batch_size", "mean"):
        # Divided by the elements (the same in every micro-batch), or by the valid ones.
        return (MEAN, None) if mask is None else (COUNTED, ops.sum(ops.cast(mask, dtype)))
    # "mean_with_sample_weight": divided by the sum of the weights the mask is merged into.
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    weight = internals.masked_sample_weight(sample_weight, mask, dtype, reduction)
    return (MEAN, None) if weight is None else (COUNTED, ops.sum(ops.cast(weight, dtype)))


def split(total, record: Recording | None, num_steps: int) -> Split:
    """A micro-batch's loss `total` (as `compute_loss` returned it) taken apart by group.

    The fixed group's loss is `total` without the counted losses and with each summed loss
    counted `num_steps` times, so that the window's mean of it is the whole batch's; a counted
    loss's group loss is its weighted value times its count (the sum Keras divided).
    """
    if record is not None and not record.built:
        return Split(UNSEEN, [total], total, [])
    terms = record.terms if record is not None else []
    for term in terms:
        if term.kind == UNKNOWN:
            _warn_once(record.model, term.name, f"the loss {term.name} returns a value "
                       "whose count Keras does not know (a scalar)",
                       "return the per-sample values from the loss (Keras then reduces them)")
    if not any(term.kind in (COUNTED, SUM, ELEMENTWISE) for term in terms):
        return Split(SINGLE, [total], total, [])
    fixed = bool(record.num_added) or any(term.kind != COUNTED for term in terms)
    dtype = total.dtype
    if len(total.shape):  # a "none" loss: Keras trains on its sum, logs its mean
        fixed_loss, report = ops.sum(total), ops.mean(total)
    else:
        fixed_loss = report = total
    group_losses, tracked, term_sums = [], [], []
    for term in terms:
        weighted = ops.cast(term.value, dtype)
        if term.weight is not None:
            weighted = ops.multiply(weighted, term.weight)
        if term.kind == COUNTED:
            count = ops.stop_gradient(ops.cast(term.count, dtype))
            fixed_loss = fixed_loss - weighted
            report = report - weighted
            group_losses.append(weighted * count)
            term_sums.append([ops.cast(term.value, dtype) * count, count])
        elif term.kind == SUM:
            fixed_loss = fixed_loss + (num_steps - 1) * weighted
            report = report + (num_steps - 1) * weighted
            term_sums.append([ops.cast(term.value, dtype), ops.zeros((), dtype)])
        elif term.kind == ELEMENTWISE:
            fixed_loss = fixed_loss + (num_steps - 1) * ops.sum(weighted)
            continue
        else:
            continue
        tracked.append((term.index, term.kind, term.weight))
    layout = Layout(fixed=fixed, tracked=tuple(tracked))
    return Split(layout, ([fixed_loss] if fixed else []) + group_losses, report, term_sums)


def window_gradient(layout: Layout, group_sums: list, term_sums: list, num_steps: int,
                    mean, scaled=None, added=None) -> list:
    """Per trainable variable, the window's gradient from each group's summed gradients.

    Args:
        layout: the window's `Layout`.
        group_sums: per gradient group, per variable, the summed gradient (None: none).
        term_sums: per tracked loss, its summed `[numerator, count]`.
        num_steps: `k`.
        mean: `accumulation_math.mean`, the fixed group's division.
        scaled: `scaled(total, divide)`: `divide` applied to a summed gradient (default: called
            on it); a backend whose gradients may be rows passes its own.
        added: `added(a, b)`: two groups' parts of one gradient together (default: `a + b`).
    """
    scaled = scaled or (lambda total, divide: divide(total))
    added = added or (lambda a, b: a + b)
    divisors = [None] * layout.fixed + [count for (_, kind, _), (_, count)
                                        in zip(layout.tracked, term_sums) if kind == COUNTED]
    grads = []
    for sums in zip(*group_sums):
        grad = None
        for total, count in zip(sums, divisors):
            if total is None:
                continue
            if count is None:
                part = scaled(total, lambda t: mean(t, num_steps))
            else:
                part = scaled(total, lambda t, c=count: ops.divide_no_nan(t, ops.cast(c, t.dtype)))
            grad = part if grad is None else added(grad, part)
        grads.append(grad)
    return grads


def window_values(layout: Layout, loss_sum, term_sums: list, num_steps: int, mean) -> tuple:
    """The window's loss and, per tracked loss, its value: what the logs report."""
    loss = mean(loss_sum, num_steps)
    values = []
    for (_, kind, weight), (numerator, count) in zip(layout.tracked, term_sums):
        value = numerator if kind == SUM else ops.divide_no_nan(numerator, count)
        values.append(value)
        if kind == COUNTED:
            loss = loss + (value if weight is None else ops.multiply(value, weight))
    return loss, values


class _Recorded:
    """A compiled loss that notes its value and count in the thread's `Recording`, if any;
    otherwise the loss itself."""

    def __init__(self, loss, index: int, output: str, weight):
        self.loss, self.index, self.output, self.weight = loss, index, output, weight

    def __getattr__(self, name):  # `reduction`, `dtype`, ... of the loss
        if name == "loss" or name.startswith("__"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.loss, name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        record = getattr(_LOCAL, "record", None)
        if record is None:
            return self.loss(y_true, y_pred, sample_weight)
        value, kind, count = evaluate(self.loss, y_true, y_pred, sample_weight)
        record.num_added = len(record.model.losses)
        name = repr(getattr(self.loss, "name", type(self.loss).__name__))
        if self.output:
            name += f" of the output {self.output!r}"
        record.terms.append(Term(self.index, name, kind, self.weight, value, count))
        return value


def _install(model: keras.Model) -> list | None:
    """Puts a `_Recorded` around each compiled loss; returns the entries (None: not built)."""
    entries = internals.compiled_loss_entries(model)
    if not entries:
        return entries
    with _LOCK:
        for i, entry in enumerate(entries):
            if not isinstance(entry[1], _Recorded):
                path, loss, weight, name = entry
                entries[i] = entry._replace(loss=_Recorded(loss, i, name, weight))
    return entries


def _overrides_compute_loss(model: keras.Model) -> bool:
    return type(model).compute_loss is not keras.Model.compute_loss


def _warn_once(model: keras.Model, key: str, what: str, fix: str) -> None:
    with _LOCK:
        warned = model.__dict__.setdefault("_tfmem_loss_warnings", set())
        if key in warned:
            return
        warned.add(key)
    warnings.warn(
        f"AccumModel: {what}, so each micro-batch's loss is taken as a mean over the same "
        f"number of elements and the window averages the {model.accumulation_steps} values. "
        "That is the whole batch's loss only when every micro-batch divides by the same count "
        f"(docs/accumulation.md, 'Loss normalisation'). For the whole batch's loss always, {fix}.",
        UserWarning, stacklevel=4)


def stored_layout(model: keras.Model) -> Layout:
    """The layout the model's last traced micro-step found (`SINGLE` before any)."""
    return model.__dict__.get("_tfmem_loss_layout", SINGLE)


def store_layout(model: keras.Model, layout: Layout) -> None:
    """Keeps `layout` for the next window's carry (outside Keras's attribute tracking)."""
    model.__dict__["_tfmem_loss_layout"] = layout


class LayoutChanged(Exception):
    """Raised while a JAX micro-step is traced for a carry laid out for another `Layout` (the
    new one is stored): the caller lays the carry out again and traces once more."""
