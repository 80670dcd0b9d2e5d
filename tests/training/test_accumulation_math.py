"""The arithmetic both train steps share, on hand-computed numbers (no model)."""

import keras
import numpy as np

from tfmem.training.accumulation_math import AccumulationState, average_statistic, mean


def test_mean_divides_the_sum_by_the_number_of_micro_batches():
    np.testing.assert_array_equal(mean(np.array([2.0, 6.0], "float32"), 4), [0.5, 1.5])


def test_statistic_moves_by_the_mean_change():
    start = np.array([1.0, 2.0, 3.0], "float32")
    delta_sum = np.array([0.5, 0.0, -1.0], "float32")
    averaged = np.asarray(average_statistic(start, delta_sum, 4))
    np.testing.assert_array_equal(averaged, [1.125, 2.0, 2.75])  # 1 + 0.5/4, 2, 3 - 1/4
    assert averaged.dtype == np.float32


def test_statistic_no_micro_batch_moved_keeps_its_bits():
    # -0.0 + 0.0 / 4 is +0.0: only the rule's `delta_sum == 0` keeps the sign bit.
    start = np.array([-0.0, np.float32(1 / 3)], "float32")
    averaged = np.asarray(average_statistic(start, np.zeros(2, "float32"), 4))
    assert averaged.tobytes() == start.tobytes()


def test_half_precision_statistic_is_rounded_once():
    # mean = 2^-11 (1 + 2^-12): rounded to float16 first it would be 2^-11, half an ulp of
    # 1.0, and 1 + 2^-11 would round to even (1.0). Added in float32, it is above the tie.
    start = np.array([1.0], "float16")
    delta_sum = np.array([4 * 2.0**-11 * (1 + 2.0**-12)], "float32")
    averaged = np.asarray(average_statistic(start, delta_sum, 4))
    assert averaged.dtype == np.float16
    np.testing.assert_array_equal(averaged, [1 + 2.0**-10])


def test_state_is_a_nest_of_its_fields_in_order():
    state = AccumulationState(gradient_sums=[1.0, 2.0], statistic_deltas=[3.0], loss_sum=4.0)
    assert keras.tree.flatten(state) == [1.0, 2.0, 3.0, 4.0]  # empty fields hold no leaves
    assert state.carried == state.metrics_variables == ()
