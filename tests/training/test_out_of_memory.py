"""A train step that runs out of memory: `fit_resumable` goes on with a smaller micro-batch.

Real out-of-memory errors in real processes (`out_of_memory_run.py`): on JAX under an address
space cap, on TensorFlow from an allocation the kernel refuses (TensorFlow on a CPU crashes
under a cap instead of raising). Each recovered run is compared with a run that used the
final micro-batch from its start: on JAX in the same process after it, its cap lifted; on
TensorFlow in this process (the same program's `build` and `train`).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training import out_of_memory_run
from tfmem import AccumModel
from tfmem.training import recovery

PROGRAM = os.path.join(os.path.dirname(__file__), "out_of_memory_run.py")
GLOBAL_BATCH = 64


def _run(tmp_path, name, backend, accumulation_steps, limit, epochs=1, env=None,
         reference=None):
    """The program's outcome and stderr; with `epochs` a pair, the run and then the run started
    again in the same process (`out_of_memory_run.py`): each one's outcome and stderr."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    counts = epochs if isinstance(epochs, tuple) else (epochs,)
    result = subprocess.run(
        [sys.executable, PROGRAM, str(tmp_path / name), str(tmp_path / f"{name}.json"),
         str(accumulation_steps), str(limit), ",".join(map(str, counts)),
         *([] if reference is None else [str(tmp_path / reference)])],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads((tmp_path / f"{name}.json").read_text())
    if len(counts) == 1:
        return outcome, result.stderr
    stderr, again_stderr = result.stderr.split(out_of_memory_run.AGAIN + "\n")
    return outcome, stderr, outcome.pop("again"), again_stderr


def _straight(tmp_path, limit, accumulation_steps, epochs):
    """The program's run in this process (TensorFlow), with no limit: the reference."""
    model, make_dataset = out_of_memory_run.build(limit, accumulation_steps)
    return out_of_memory_run.train(model, make_dataset, tmp_path / "straight", epochs)


def _assert_same_weights(actual, expected):
    for a, b in zip(actual["weights"], expected["weights"], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-12)


def _assert_recoveries(outcome, stderr):
    recoveries = outcome["recoveries"]
    assert recoveries and recoveries[0]["micro_batch_size"] == GLOBAL_BATCH
    for before, after in zip(recoveries, recoveries[1:]):
        assert after["micro_batch_size"] == before["to_micro_batch_size"]
    for entry in recoveries:  # halved, and always the same global batch
        assert entry["to_micro_batch_size"] * 2 == entry["micro_batch_size"]
        assert entry["to_micro_batch_size"] * entry["to_accumulation_steps"] == GLOBAL_BATCH
    assert outcome["accumulation_steps"] == recoveries[-1]["to_accumulation_steps"]
    lines = [line for line in stderr.splitlines() if "ran out of memory" in line]
    assert len(lines) == len(recoveries)
    assert lines[0].startswith("tfmem: a train step of epoch 1 ran out of memory at "
                               f"micro-batch {GLOBAL_BATCH} × 1 (")
    assert lines[-1].endswith(
        f"with micro-batch {recoveries[-1]['to_micro_batch_size']} × "
        f"{recoveries[-1]['to_accumulation_steps']}, the same global batch")


def test_jax_step_over_an_address_space_cap_goes_on_with_a_smaller_micro_batch(tmp_path):
    # Micro-batch 64 needs ~0.9 GB of activations and their gradients; 700 MB are allowed.
    # Then, in the same process without the cap, a run at the final micro-batch from its start.
    recovered, stderr = _run(tmp_path, "recovered", "jax", 1, 700_000_000,
                             reference="straight")
    straight = recovered.pop("reference")
    _assert_recoveries(recovered, stderr)
    assert "Out of memory allocating" in recovered["recoveries"][0]["error"]
    assert straight["recoveries"] == []
    assert straight["accumulation_steps"] == recovered["accumulation_steps"]
    _assert_same_weights(recovered, straight)
    assert recovered["loss"] == pytest.approx(straight["loss"], rel=1e-6)


def test_tensorflow_out_of_memory_error_goes_on_and_a_restart_keeps_the_micro_batch(tmp_path):
    # Then started again for a second epoch with the same k=1 (the model built again and
    # `fit_resumable` called again, in the same process).
    recovered, stderr, again, again_stderr = _run(tmp_path, "run", "tensorflow", 1, "machine",
                                                  epochs=(1, 2))
    _assert_recoveries(recovered, stderr)
    assert recovered["accumulation_steps"] == 2
    assert recovered["recoveries"][0]["error"].startswith("OOM when allocating tensor")
    # Started again: the run keeps micro-batch 32.
    stderr = again_stderr
    assert "tfmem: resuming with accumulation_steps=2 (instead of 1)" in stderr
    assert "ran out of memory" not in stderr
    assert again["recoveries"] == recovered["recoveries"]
    straight = _straight(tmp_path, "none", 2, epochs=2)
    _assert_same_weights(again, straight)


def test_out_of_memory_at_micro_batch_one_goes_on_rematerialized(tmp_path):
    # TensorFlow's GPU allocator on the CPU, limited to 28 MB (oneDNN off: its kernels crash
    # where that allocator refuses): one sample of the model needs about 38 MiB in a step,
    # 16 with rematerialize="full". It starts at micro-batch 1 × 4, so only recomputing helps.
    limited = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "28",
               "TF_ENABLE_ONEDNN_OPTS": "0"}
    # Then started again for a second epoch, as written (no rematerialization), in the same
    # process (the model built again, `fit_resumable` called again).
    recovered, stderr, again, again_stderr = _run(tmp_path, "run", "tensorflow", 4, "allocator",
                                                  epochs=(1, 2), env=limited)
    (entry,) = recovered["recoveries"]
    assert entry["error"].startswith("OOM when allocating tensor")
    assert (entry["micro_batch_size"], entry["to_micro_batch_size"],
            entry["accumulation_steps"], entry["to_accumulation_steps"]) == (1, 1, 4, 4)
    assert entry["to_rematerialize"] == recovered["rematerialize"] == "full"
    (path, ranges), = recovered["segments"]
    assert path == "" and len(ranges) >= 2
    (line,) = [line for line in stderr.splitlines() if "ran out of memory" in line]
    assert line.startswith("tfmem: a train step of epoch 1 ran out of memory at micro-batch "
                           "1 × 4 (OOM when allocating tensor")
    assert line.endswith('with micro-batch 1 × 4 and rematerialize="full" (activations '
                         "recomputed in the backward pass: the same training, more time), "
                         "the same global batch")
    # Started again: it keeps the rematerialization.
    stderr = again_stderr
    assert ('tfmem: resuming with rematerialize="full", which this run took after running '
            "out of memory at micro-batch 1") in stderr
    assert "ran out of memory" not in stderr and again["rematerialize"] == "full"
    # The weights of the same run without a limit and without rematerialization.
    straight = _straight(tmp_path, "allocator", 4, epochs=2)
    assert straight["recoveries"] == [] and straight["rematerialize"] is None
    assert np.all(np.isfinite(straight["loss"]))
    _assert_same_weights(again, straight)


@pytest.fixture(scope="module")
def tensorflow_out_of_memory_error():
    """The error TensorFlow raises for an allocation the kernel refuses (128 GiB); TensorFlow
    retries the allocation for 10 s before it raises, so it is made once."""
    try:
        tf.fill([1 << 35], 0.0)
    except tf.errors.ResourceExhaustedError as error:
        return error
    pytest.fail("an allocation of 128 GiB succeeded")


def test_micro_batch_one_out_of_memory_is_one_error_with_the_plan(
        tensorflow_out_of_memory_error):
    error = tensorflow_out_of_memory_error
    inputs = keras.Input((4,))
    model = AccumModel(inputs, keras.layers.Dense(2)(inputs), accumulation_steps=8)
    model.compile("sgd", "mse")
    split = recovery.smaller_split(model, 16, 1, error)  # micro-batch 2 → 1
    assert (split["to_micro_batch_size"], split["to_accumulation_steps"]) == (1, 16)
    model.accumulation_steps = 16
    with pytest.raises(recovery.OutOfMemoryError) as raised:
        recovery.smaller_split(model, 16, 1, error)
    message = str(raised.value)
    assert message.startswith("out of memory in a train step at micro-batch 1 × 16 "
                              "accumulation steps (OOM when allocating tensor with shape[")
    # This model fits this machine, so the plan's estimate is named as the one that is low.
    assert "and nothing smaller can be tried; the plan for this device picks micro-batch 16 × 1" \
        in message


def test_micro_batch_one_out_of_memory_turns_rematerialization_on_once(
        tensorflow_out_of_memory_error):
    from tests.training import remat_cases

    model = remat_cases.chain(accumulation_steps=16)  # "full" cuts its residual blocks
    split = recovery.smaller_split(model, 16, 1, tensorflow_out_of_memory_error)
    assert split["to_rematerialize"] == "full"
    assert (split["to_micro_batch_size"], split["to_accumulation_steps"]) == (1, 16)
    recovery.rematerialize_all(model)
    assert model.rematerialize == "full"
    with pytest.raises(recovery.OutOfMemoryError, match=r'^out of memory in a train step at '
                       r'micro-batch 1 × 16 accumulation steps with rematerialize="full" \(OOM'):
        recovery.smaller_split(model, 16, 1, tensorflow_out_of_memory_error)
    # Names are the user's choice: the error, with what the plan says.
    named = remat_cases.chain(["conv0a"], accumulation_steps=16)
    assert not recovery.rematerialization_left(named)


def test_what_is_out_of_memory(tensorflow_out_of_memory_error):
    error = tensorflow_out_of_memory_error
    assert recovery.out_of_memory(error) is error
    try:  # raised while handling it, as JAX's trainer does when its donated state is gone
        try:
            raise error
        except tf.errors.ResourceExhaustedError:
            raise RuntimeError("Array has been deleted")
    except RuntimeError as second:
        assert recovery.out_of_memory(second) is error
    assert recovery.out_of_memory(ValueError("Out of memory")) is None  # not a framework's
    assert recovery.out_of_memory(tf.errors.InternalError(None, None, "failed")) is None
    assert [recovery.halved(n) for n in (64, 6, 9, 7, 2, 1)] == [32, 3, 3, 1, 1, None]


class _OutOfMemoryWhenEvaluating(AccumModel):
    """An AccumModel whose evaluation step raises TensorFlow's out-of-memory error (a
    validation batch too large for the device, where the train steps' micro-batches fit)."""

    error = None

    def test_step(self, data):
        raise _OutOfMemoryWhenEvaluating.error


def test_out_of_memory_in_the_validation_pass_says_to_batch_it_smaller(
        tensorflow_out_of_memory_error, tmp_path):
    # Halving the training's micro-batch would not help: one error, the micro-batch unchanged.
    from tfmem.training.resume import fit_resumable

    _OutOfMemoryWhenEvaluating.error = tensorflow_out_of_memory_error
    inputs = keras.Input((4,))
    model = _OutOfMemoryWhenEvaluating(inputs, keras.layers.Dense(2)(inputs),
                                       accumulation_steps=4)
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    batches = rows.batch(16, drop_remainder=True)
    with pytest.raises(recovery.OutOfMemoryError) as raised:
        fit_resumable(model, lambda epoch: batches, epochs=1, steps_per_epoch=4,
                      backup_dir=tmp_path / "backup",
                      validation_data=rows.batch(32, drop_remainder=True), verbose=0,
                      check_memory=False)
    assert str(raised.value).startswith(
        "out of memory in the validation pass of epoch 1 at its batch of 32 rows (OOM when "
        "allocating tensor")
    assert str(raised.value).endswith(
        "the train steps fit; batch the validation data smaller, e.g. at 4 rows: the "
        "training's micro-batch over its replicas, which the train steps ran, and start again "
        "(the run resumes from its last resume point)")
    assert model.accumulation_steps == 4 and int(model.optimizer.iterations) == 4


def _policy_sequence(micro_batch_size, accumulation_steps, recomputes_more, full=None):
    """The splits the out-of-memory policy goes through from one, and its stop message."""
    split, splits, asked = recovery.Split(micro_batch_size, accumulation_steps), [], []

    def recomputes():
        asked.append(split.micro_batch_size)
        return recomputes_more

    spelled = {} if full is None else {"full": full}
    while True:
        after = recovery.next_split(split, recomputes_more=recomputes,
                                    ran_out=lambda tried: f"ran out at {tried}",
                                    advice=lambda: "the advice", **spelled)
        if isinstance(after, recovery.Stop):
            return splits, after.message, asked
        splits.append((after.micro_batch_size, after.accumulation_steps,
                       after.rematerialize_full))
        split = after


def test_the_one_out_of_memory_policy_halves_then_recomputes_then_stops():
    # 64 × 1: halved six times (k doubling, the same 64 samples), then "full" once, then stop;
    # whether recomputing helps is asked only at micro-batch 1.
    splits, message, asked = _policy_sequence(64, 1, recomputes_more=True)
    assert splits == [(32, 2, False), (16, 4, False), (8, 8, False), (4, 16, False),
                      (2, 32, False), (1, 64, False), (1, 64, True)]
    assert message == ('ran out at micro-batch 1 × 64 accumulation steps with '
                       'rematerialize="full", and nothing smaller can be tried; the advice')
    assert asked == [1]
    # 12 × 2: the largest divisor up to the half (6, 3, then 1 of 3); nothing to recompute.
    splits, message, _ = _policy_sequence(12, 2, recomputes_more=False)
    assert splits == [(6, 4, False), (3, 8, False), (1, 24, False)]
    assert message == ("ran out at micro-batch 1 × 24 accumulation steps, and nothing smaller "
                       "can be tried; the advice")
    # A program spells the setting as its flag.
    splits, message, _ = _policy_sequence(1, 4, recomputes_more=True,
                                          full="--rematerialize full")
    assert splits == [(1, 4, True)] and message.startswith(
        "ran out at micro-batch 1 × 4 accumulation steps with --rematerialize full, and")
    # What a run records of a step.
    assert recovery.record(recovery.Split(9, 1), recovery.Split(3, 3)) == {
        "micro_batch_size": 9, "accumulation_steps": 1, "to_micro_batch_size": 3,
        "to_accumulation_steps": 3}
    assert recovery.record(recovery.Split(1, 4), recovery.Split(1, 4, True)) == {
        "micro_batch_size": 1, "accumulation_steps": 4, "to_micro_batch_size": 1,
        "to_accumulation_steps": 4, "to_rematerialize": "full"}
