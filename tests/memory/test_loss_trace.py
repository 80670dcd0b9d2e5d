"""The plan's "loss and metrics" term: what a per-pixel loss and metric hold next to the model's
output, counted in tensors of the output's size and checked against hand counts."""

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
    # p, the targets t (shaped as p), the sum's gradient broadcast to p's shape, and the
    # gradient t · that broadcast: 4 tensors of the output's size at the peak, of which the
    # activations count p already.
    assert p.loss_bytes_per_sample == 3 * _output_bytes(8, 12)
    assert p.breakdown(2, 2)[Term.LOSS] == 2 * 3 * _output_bytes(8, 12)
    assert p.peak_bytes(2, 2) == sum(p.breakdown(2, 2).values())
    assert not [note for note in p.notes if "loss" in note]


def test_without_a_loss_the_term_is_the_bound_and_says_so():
    model = _per_pixel(8, 12)
    p = _plan(model)
    # The bound, less the softmax's output that the activations count.
    assert p.loss_bytes_per_sample == (loss_trace.BOUND_TENSORS - 1) * _output_bytes(8, 12)
    assert ("no loss given: loss and metrics counted as 10 tensors of the output's size (pass "
            "the run's `loss` to trace it)") in p.notes
    # A compiled model plans its own loss.
    model.compile("adam", _dot)
    assert _plan(model).loss_bytes_per_sample == 3 * _output_bytes(8, 12)


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
