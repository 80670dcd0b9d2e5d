"""The plan's "loss and metrics" term: what a per-pixel loss and metric hold next to the model's
output, counted in tensors of the output's size and checked against hand counts."""

import dataclasses

import keras
import numpy as np
import pytest
from keras import ops

import tfmem
from tfmem.memory import loss_trace
from tfmem.memory.memory_plan import Term
from tfmem.training.segmentation_losses import DiceLoss

C = 3  # classes


def _per_pixel(height, width):
    """A 1×1 convolution to a softmax per pixel: its output, float32 H × W × C a sample, is
    among the activations (the softmax's backward reads it)."""
    inputs = keras.Input((height, width, 2))
    return keras.Model(inputs, keras.layers.Conv2D(C, 1, activation="softmax")(inputs))


def _plan(model, **arguments):
    return tfmem.plan(model, global_batch_size=4, memory_budget=2**30, **arguments)


def _output_bytes(height, width):
    return height * width * C * 4


def _dot(y_true, y_pred):
    return ops.sum(y_true * y_pred)


def test_a_traced_loss_counts_its_tensors_beyond_the_kept_output():
    model = _per_pixel(8, 12)
    p = _plan(model, loss=_dot)
    # sum(t · p) forward and backward, one op at a time with the output p held throughout:
    # p, the targets t (shaped as p) and t · p in the forward; in the backward the sum's
    # gradient broadcast to p's shape, and t times it written over one of the two (both
    # read for the last time): 3 tensors of the output's size at the peak, of which the
    # activations count p already.
    assert p.loss_bytes_per_sample == 2 * _output_bytes(8, 12)
    # The backward's workspace, two tensors of the output's size (the largest: its gradient
    # and the convolution's), runs after the loss, never beside it: the row is the excess,
    # none here.
    assert p.workspace_bytes_per_sample == 2 * _output_bytes(8, 12)
    assert p.breakdown(2, 2)[Term.LOSS] == 0
    assert p.peak_bytes(2, 2) == sum(p.breakdown(2, 2).values())
    assert not [note for note in p.notes if "loss" in note]


def test_an_output_nothing_reads_after_the_loss_is_freed_there():
    inputs = keras.Input((8, 12, 2))
    linear = keras.Model(inputs, keras.layers.Conv2D(C, 1)(inputs))  # its backward reads x
    metric = keras.metrics.MeanSquaredError()
    alone, with_metric = (_plan(linear, loss=_dot, metrics=metrics).loss_bytes_per_sample
                          for metrics in ([], [metric]))
    # sum(t · p), one op at a time: p and t, then t · p written over p (its last use); the
    # sum's gradient broadcast to p's shape and t in the backward, their product written
    # over one of them (2 tensors of the output's size). A metric reads p after the
    # backward pass, so with one p is held throughout and t · p needs a buffer of its own (3).
    assert (alone, with_metric) == (2 * _output_bytes(8, 12), 3 * _output_bytes(8, 12))


def test_a_wide_head_and_its_cross_entropy_hold_one_tensor_of_the_logits_size():
    # A next-token head: 8 positions of 4 features into 512 classes, sparse cross-entropy from
    # the logits. TensorFlow writes the loss's gradient over the logits (read for the last
    # time there) and the products after it over that gradient: at the loss's peak the logits'
    # buffer once, beside the targets as int64 (8 bytes a position) and the per-position
    # losses (4). The head's backward: its output's gradient (the logits' size) and its
    # input's (8 × 4), not two tensors of the logits' size.
    inputs = keras.Input((8, 4))
    model = keras.Model(inputs, keras.layers.Dense(512)(inputs))
    p = _plan(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logits = 8 * 512 * 4
    assert p.loss_bytes_per_sample == logits + 8 * (8 + 4)
    assert p.workspace_bytes_per_sample == logits + 8 * 4 * 4
    assert p.loss_row_bytes_per_sample == 0
    # Kept: the head's input; at the peak, beside it, the head's backward.
    assert p.peak_bytes(3, 1) - p.peak_bytes(2, 1) == 8 * 4 * 4 + logits + 8 * 4 * 4 + (
        p.input_bytes_per_sample * 2)


def test_the_loss_and_the_recomputed_segment_are_not_held_together():
    # A hand-made plan, MiB a sample: activations 10, of which a recomputed segment holds 6
    # again while it is recomputed; the backward's workspace 2. The loss runs before the
    # backward, beside the 4 kept but not the segment: the peak's per-sample part is
    # 4 + max(loss, 6 + 2).
    mib = 2**20
    base = _plan(_per_pixel(8, 12), loss=_dot)
    for loss, per_sample in ((5, 12), (8, 12), (9, 13)):
        p = dataclasses.replace(base, activation_bytes_per_sample=10 * mib,
                                recomputed_bytes_per_sample=6 * mib,
                                workspace_bytes_per_sample=2 * mib,
                                loss_bytes_per_sample=loss * mib)
        rows = p.breakdown(3, 1)
        assert sum(rows[t] for t in (Term.ACTIVATIONS, Term.WORKSPACE, Term.LOSS)) == (
            3 * per_sample * mib)


def test_without_a_loss_the_term_is_the_bound_and_says_so():
    model = _per_pixel(8, 12)
    p = _plan(model)
    # The bound, less the softmax's output that the activations count.
    assert p.loss_bytes_per_sample == (loss_trace.BOUND_TENSORS - 1) * _output_bytes(8, 12)
    assert ("no loss given: loss and metrics counted as 10 tensors of the output's size (pass "
            "the run's `loss` to trace it)") in p.notes
    # A compiled model plans its own loss.
    model.compile("adam", _dot)
    assert _plan(model).loss_bytes_per_sample == 2 * _output_bytes(8, 12)


def test_an_untraceable_loss_is_bounded_and_named():
    def broken(y_true, y_pred):
        raise RuntimeError("not traceable")

    p = _plan(_per_pixel(8, 12), loss=broken)
    assert p.loss_bytes_per_sample == (loss_trace.BOUND_TENSORS - 1) * _output_bytes(8, 12)
    assert ("loss broken could not be traced: counted as 10 tensors of the output's size"
            in p.notes)


def test_a_metric_s_state_is_counted_with_the_variables():
    model = _per_pixel(8, 12)
    metric = keras.metrics.MeanIoU(C, ignore_class=255, sparse_y_pred=False)
    without, with_metric = (_plan(model, loss=_dot, metrics=metrics)
                            for metrics in ([], [metric]))
    # Its confusion matrix, classes × classes in float64.
    assert with_metric.parameter_bytes - without.parameter_bytes == C * C * 8
    assert with_metric.parameter_bytes - without.parameter_bytes == sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in metric.variables)


@pytest.mark.parametrize("loss, tolerance", [
    (keras.losses.SparseCategoricalCrossentropy(ignore_class=255), 0),
    (DiceLoss(C, ignore_class=255, cross_entropy=True), 1e-3),  # its per-class sums do not
])
def test_the_term_grows_with_the_pixels(loss, tolerance):
    metrics = [keras.metrics.MeanIoU(C, ignore_class=255, sparse_y_pred=False)]
    small, large = (_plan(_per_pixel(h, w), loss=loss, metrics=metrics).loss_bytes_per_sample
                    for h, w in ((16, 24), (32, 48)))
    assert small >= 2 * _output_bytes(16, 24)  # more than the output's gradient and targets
    assert large == pytest.approx(4 * small, rel=tolerance)  # 4× the pixels


def test_the_input_row_counts_the_targets_the_loss_reads():
    # A global batch of targets comes with the images: per pixel, sparse targets are one
    # int32 class index, dense (one-hot or multi-label) targets one float32 per class.
    model = _per_pixel(8, 12)
    image = 8 * 12 * 2 * 4
    sparse = keras.losses.SparseCategoricalCrossentropy(ignore_class=255)
    for loss, target in ((sparse, 8 * 12 * 4), (keras.losses.BinaryCrossentropy(),
                                                 _output_bytes(8, 12))):
        p = _plan(model, loss=loss)
        assert p.input_bytes_per_sample == image + target
        # The global batch, 1 × 4 samples, twice: one batch in the step, one coming.
        assert p.breakdown(1, 4)[Term.INPUT] == 4 * 2 * (image + target)
