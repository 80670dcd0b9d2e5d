"""The probe runs real training steps in real child processes under a real memory limit."""

import importlib
import signal
import subprocess
import sys

import keras
import pytest

import tfmem
from tfmem.memory.probe import measure
from tfmem.runtime.memory_cap import MemoryWatch

# `tfmem.probe` is the function; the module (for its watchdog) is reached by name.
probe_module = importlib.import_module("tfmem.memory.probe")

GIB, MIB = 2**30, 2**20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the probe reads /proc for resident memory")


def conv_model():
    """Three 64-channel convs at 64×64: ~5 MiB of kept activations per sample, so that
    the growth over the batch sizes below (~0.6 GiB) dwarfs the allocator's ~20 MiB jitter."""
    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_probe_line_predicts_a_separate_run():
    # One training step per run (the first, which traces the graph), in the probe's runs and
    # in the separate run alike.
    model = conv_model()
    calibrated = tfmem.probe(model, global_batch_size=128, optimizer="adam",
                             memory_budget=6 * GIB, micro_batch_sizes=(16, 64), num_steps=1)
    line = calibrated.measured
    assert line.micro_batch_sizes == (16, 64)
    # The per-sample slope is real and of the size the graph predicts: measured 17% under it
    # on a quiet machine, 25% under on a loaded one, 33-35% under on a 2-core machine alone
    # and under CI (the resident set's slope, not the plan: the plan is unchanged); within 40%.
    estimate = tfmem.plan(model, global_batch_size=128, memory_budget=6 * GIB)
    estimated_slope = estimate.peak_bytes(2, 1) - estimate.peak_bytes(1, 1)
    assert line.per_sample_bytes > 0
    assert abs(line.per_sample_bytes / estimated_slope - 1) < 0.40
    # A separate fresh run at 128 (outside the probed range): the calibrated prediction of the
    # growth above TensorFlow's import baseline is within 30% of the measured growth (within
    # 10% on a quiet machine; the shared 2-core machine's load moves it further). It trains on
    # a loss instance and class indices, whose tensors are as small as mse's on 10 outputs:
    # either one lost on the way to the child fails its step (the shapes do not match).
    separate = measure(model, micro_batch_size=128, input_shape=(64, 64, 3),
                       memory_limit=6 * GIB, optimizer="adam", num_steps=1,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       targets="class_indices")
    assert not separate.stopped, separate.reason
    predicted = line.fixed_bytes + line.per_sample_bytes * 128
    growth, predicted_growth = (separate.peak_bytes - separate.baseline_bytes,
                                predicted - separate.baseline_bytes)
    assert abs(predicted_growth / growth - 1) < 0.30, (predicted_growth / MIB, growth / MIB)
    # The calibrated plan chooses on the measured line: 128 × 1 fits a 6 GiB budget.
    assert (calibrated.micro_batch_size, calibrated.accumulation_steps) == (128, 1)
    assert "measured fixed (probe)" in calibrated.table()


def test_measure_refuses_unknown_targets():
    with pytest.raises(ValueError, match="must be 'zeros' or 'class_indices', got 'ones'"):
        measure(conv_model, micro_batch_size=1, input_shape=(64, 64, 3), memory_limit=GIB,
                targets="ones")


def test_child_over_the_limit_is_stopped_near_it():
    limit = 1 * GIB  # TensorFlow alone takes ~0.75 GiB; batch 256 needs ~1.3 GiB more
    result = measure(conv_model(), micro_batch_size=256, input_shape=(64, 64, 3),
                                  memory_limit=limit, optimizer="adam", num_steps=1)
    assert result.stopped
    # Two protections race here: the parent's watchdog (resident set polled every 20 ms) and
    # the child's RLIMIT_DATA (an allocation refused). Either may stop it first; both keep it
    # within a step's growth of the limit, far below the ~2 GiB the step needs.
    assert ("stopped by the memory limit" in result.reason
            or "under the child's RLIMIT_DATA" in result.reason
            or "OOM when allocating" in result.reason), result.reason
    assert result.peak_bytes < limit + 256 * MIB


def test_watchdog_kills_a_child_whose_resident_set_reaches_the_limit():
    # A plain Python child (no RLIMIT_DATA) that touches 16 MiB more every 10 ms.
    grow = ("import time\nheld = []\nwhile True:\n"
            "    held.append(bytearray(16 * 2**20))\n    time.sleep(0.01)\n")
    child = subprocess.Popen([sys.executable, "-c", grow])
    limit = 256 * MIB
    watchdog = MemoryWatch(child.pid, limit)
    watchdog.start()
    assert child.wait(timeout=60) == -signal.SIGKILL
    watchdog.join(timeout=5)
    assert watchdog.reason.startswith("stopped by the memory limit: resident set reached")
    # Killed at the first poll past the limit: within a few 16 MiB steps of it.
    assert limit <= watchdog.highest < limit + 128 * MIB


def wide_model():
    """Tiny input, one huge activation: 16 × 16 × 1024 float32 = 1 MiB per sample."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(1024, 3, padding="same")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))


def test_rlimit_refuses_a_huge_allocation_before_it_is_touched():
    limit = 1 * GIB
    # At batch 2048 the conv output is one 2 GiB tensor: more than twice what is left under
    # the limit, so the child's RLIMIT_DATA makes the allocation fail before a page is touched.
    result = measure(wide_model(), micro_batch_size=2048, input_shape=(16, 16, 3),
                     memory_limit=limit, optimizer="sgd", num_steps=1)
    assert result.stopped
    assert "stopped by the memory limit" not in result.reason  # the kernel said no, not us
    # TensorFlow reports the refused 2 GiB allocation as an OOM, then often crashes.
    assert "OOM when allocating" in result.reason or "killed by SIG" in result.reason
    assert result.peak_bytes < limit


def test_probe_refuses_sizes_whose_estimate_is_near_the_budget():
    with pytest.raises(ValueError, match="under half the budget"):
        tfmem.probe(conv_model(), global_batch_size=64, memory_budget=2 * GIB,
                    micro_batch_sizes=(8, 4096))


def test_default_sizes_span_up_to_half_the_budget():
    estimate = tfmem.plan(conv_model(), global_batch_size=4096, optimizer="adam",
                          memory_budget=6 * GIB)
    sizes = probe_module.default_sizes(estimate)
    upper = sizes[-1]
    half = estimate.budget_bytes / 2
    # The largest size is the last one whose estimated peak is under half the budget...
    assert estimate.peak_bytes(upper, 1) <= half < estimate.peak_bytes(upper + 1, 1)
    assert sizes == [upper // 4, upper // 2, upper]
    # ...and the span is wide: the estimate grows by more than 1 GiB across it.
    assert estimate.peak_bytes(upper, 1) - estimate.peak_bytes(sizes[0], 1) > GIB
    # Capped by the per-replica batch: no point measuring beyond what the run will use.
    small = estimate.replace(global_batch_size=64)
    assert probe_module.default_sizes(small) == [16, 32, 64]
    # No room under half the budget: nothing to run (probe() then raises ValueError).
    tight = estimate.replace(memory_per_replica=GIB)  # half of 80%: 410 MiB < TF's import
    assert tight.peak_bytes(1, 1) > tight.budget_bytes / 2
    assert probe_module.default_sizes(tight) == []
