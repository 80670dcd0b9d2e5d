"""The one path of a run: settings → budget → plan → check → k, and its one warning policy."""

import dataclasses
import warnings

import keras
import numpy as np
import pytest

import tfmem
from tfmem import cli
from tfmem.memory import guard, levers, plan_report, planner
from tfmem.runtime import devices
from tfmem.runtime.budget import Budget, budget_for

GIB = 2**30


def dense_model():
    """Dense(64) → Dense(4) on 32 features: small, and its activations grow with the batch."""
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4)(hidden))


MODEL = dense_model()


def test_settings_or_their_arguments_plan_the_same():
    arguments = dict(global_batch_size=64, optimizer="adam", precision="auto", device="t4")
    from_arguments = tfmem.plan(MODEL, **arguments)
    made = planner.settings(**arguments)
    assert tfmem.plan(MODEL, made) == from_arguments
    # The budget is a value: made beforehand on the runtime side, it plans the same.
    budget = budget_for(device="t4")
    assert tfmem.plan(MODEL, global_batch_size=64, precision="auto", budget=budget) \
        == from_arguments
    t4 = devices.lookup("t4")
    assert (budget.device, budget.kind, budget.memory_per_replica, budget.num_replicas) == (
        "t4", "gpu", t4.memory_per_replica, 1)
    assert made.precision == "mixed_float16"  # "auto" resolved once, for the T4
    with pytest.raises(TypeError, match="not both"):
        tfmem.plan(MODEL, made, global_batch_size=64)
    with pytest.raises(ValueError, match="not both"):
        planner.settings(global_batch_size=64, budget=budget, device="t4")


def test_the_budget_of_a_device_is_its_table_entry_as_a_runtime():
    runtime = tfmem.Runtime.of_device("tpu-v3-8")
    assert (runtime.kind, runtime.num_replicas, runtime.device_name) == ("tpu", 8, "tpu-v3-8")
    assert tfmem.policy_for(runtime) == "mixed_bfloat16"
    with pytest.raises(RuntimeError, match="for planning and has no strategy"):
        runtime.scope()
    with pytest.raises(ValueError, match="Give one of"):
        budget_for(device="t4", memory_budget=GIB)
    with pytest.raises(ValueError, match="at least 1"):
        Budget("x", "cpu", 0, 1)


def test_a_lever_is_a_replace_of_the_frozen_settings():
    made = planner.settings(global_batch_size=8, memory_budget=GIB)
    base = tfmem.plan(MODEL, made)
    precision = next(lever for lever in levers.levers_for(MODEL, base) if lever.group ==
                     "precision")
    changed = precision.apply(made, MODEL)
    assert changed == dataclasses.replace(made, precision="mixed_bfloat16")
    assert made.precision == "float32"  # the settings it started from are unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.precision = "mixed_float16"


def _budget_between(model, low, high, global_batch_size):
    """Bytes (before the 80% safety) that fit micro-batch `low` and not `high`."""
    loose = tfmem.plan(model, global_batch_size=global_batch_size, memory_budget=100 * GIB)
    k_low, k_high = global_batch_size // low, global_batch_size // high
    return int((loose.peak_bytes(low, k_low) + loose.peak_bytes(high, k_high)) // 2 / 0.8) + 1


def test_guard_splits_checks_and_picks_k():
    budget = _budget_between(MODEL, 16, 32, 64)
    auto = guard.guard(MODEL, global_batch_size=64, memory_budget=budget)
    assert (auto.micro_batch_size, auto.accumulation_steps, auto.num_replicas) == (16, 4, 1)
    assert auto.peak_bytes == auto.plan.peak_bytes(16, 4) <= auto.plan.budget_bytes
    assert auto.describe() == "global batch 64 = micro-batch 16 × 4 accumulation steps × 1 replica"
    with pytest.raises(tfmem.MemoryPlanError, match="micro-batch 16 × 4 accumulation steps fits"):
        guard.guard(MODEL, global_batch_size=64, accumulation_steps=1, memory_budget=budget)
    kept = guard.guard(MODEL, global_batch_size=64, accumulation_steps=1, memory_budget=budget,
                       allow_over_budget=True)
    assert (kept.micro_batch_size, kept.accumulation_steps) == (64, 1)
    with pytest.raises(ValueError, match=r"\(64\) must be divisible by replicas × "
                                         r"accumulation_steps \(1 × 3 = 3\)\. Try 63 or 66"):
        guard.guard(MODEL, global_batch_size=64, accumulation_steps=3, memory_budget=budget)
    with pytest.raises(ValueError, match="must be a positive integer; received 'four'"):
        guard.guard(MODEL, global_batch_size=64, accumulation_steps="four", memory_budget=budget)


def test_a_step_xla_could_not_compile_leaves_the_plans_answer_and_says_so():
    # What the check of a run's compiled step raises for data of no static batch shape.
    def compiled_peak(accumulation_steps, memory_plan):
        raise ValueError("the training data has no static batch shape\nsecond line")

    budget = _budget_between(MODEL, 16, 32, 64)
    planned = guard.guard(MODEL, global_batch_size=64, memory_budget=budget)
    with pytest.warns(guard.UncheckedSplitWarning) as caught:
        run = guard.guard(MODEL, global_batch_size=64, memory_budget=budget,
                          compiled_peak=compiled_peak)
    assert (run.micro_batch_size, run.accumulation_steps) == (planned.micro_batch_size,
                                                              planned.accumulation_steps)
    assert run.compiled_peak_bytes is None
    assert [str(w.message) for w in caught] == [
        "the split was chosen by the plan alone: XLA's figure of the compiled step could not "
        "be read (ValueError: the training data has no static batch shape)"]
    with pytest.warns(guard.UncheckedSplitWarning, match="the split was refused by the plan "
                                                         "alone"):
        with pytest.raises(tfmem.MemoryPlanError, match="micro-batch 16 × 4 accumulation"):
            guard.guard(MODEL, global_batch_size=64, accumulation_steps=1,
                        memory_budget=budget, compiled_peak=compiled_peak)


def test_when_nothing_fits_auto_over_budget_takes_micro_batch_one():
    tiny = 2**20  # less than the CPU runtime term alone: nothing fits
    with pytest.raises(tfmem.MemoryPlanError, match="not even micro-batch 1|exceeds the budget"):
        guard.guard(MODEL, global_batch_size=8, memory_budget=tiny)
    run = guard.guard(MODEL, global_batch_size=8, memory_budget=tiny, allow_over_budget=True)
    assert not run.plan.fits
    assert (run.micro_batch_size, run.accumulation_steps) == (1, 8)


def test_a_runtime_of_unknown_memory_trains_unchecked_after_one_warning():
    model = dense_model()
    runtime = tfmem.Runtime("gpu", None, 2, memory_per_replica=None, device_name="Mystery GPU")
    with pytest.warns(guard.UnplannedRunWarning,
                      match=r"memory check skipped, the memory of the runtime's gpu "
                            r"\('Mystery GPU'\) is unknown"):
        run = guard.guard(model, global_batch_size=64, accumulation_steps=2, runtime=runtime)
    assert run.plan is None and run.peak_bytes is None and "Mystery GPU" in run.skipped
    assert (run.micro_batch_size, run.accumulation_steps, run.num_replicas) == (16, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning for the same model would raise
        guard.guard(model, global_batch_size=64, accumulation_steps=2, runtime=runtime)
    # A batch that does not split is an error first, whether or not a plan can be made.
    with pytest.raises(ValueError, match=r"replicas × accumulation_steps \(2 × 3 = 6\)"):
        guard.guard(model, global_batch_size=64, accumulation_steps=3, runtime=runtime)
    with pytest.raises(ValueError, match=r"`accumulation_steps='auto'` takes k from the memory "
                                         r"plan, and there is none: .*divides the per-replica "
                                         r"batch \(32\), e\.g\. `accumulation_steps=1`"):
        guard.guard(model, global_batch_size=64, runtime=runtime)
    # From a program: its flag.
    with pytest.raises(ValueError, match=r"`--accumulation-steps auto` takes k .* e\.g\. "
                                         r"`--accumulation-steps 1`\.$"):
        guard.guard(model, global_batch_size=64, runtime=runtime,
                    switches=plan_report.COMMAND_LINE)


def test_a_warning_of_a_command_line_program_is_one_line():
    shown = warnings.formatwarning
    with cli.one_line_warnings():  # what `cli.run` prints a warning as
        assert warnings.formatwarning("memory check skipped, for a reason",
                                      guard.UnplannedRunWarning, "guard.py", 170) == (
            "warning: memory check skipped, for a reason\n")
    assert warnings.formatwarning is shown


def test_accum_fit_auto_with_the_check_off_takes_micro_batch_one_when_nothing_fits():
    # The refusal names `check_memory=False`: passed, it trains (micro-batch 1), the same
    # update as plain Keras on the whole batch.
    features = keras.random.normal((8, 32), seed=1)
    targets = keras.random.normal((8, 4), seed=2)
    plain = dense_model()
    model = tfmem.AccumModel.wrap(dense_model(), accumulation_steps="auto")
    model.set_weights(plain.get_weights())
    for each in (plain, model):
        each.compile(keras.optimizers.SGD(0.1), "mse")
    tiny = 2**20  # nothing fits
    with pytest.raises(tfmem.MemoryPlanError, match="Pass `check_memory=False` to run anyway"):
        model.fit(features, targets, batch_size=8, verbose=0, memory_budget=tiny)
    model.fit(features, targets, batch_size=8, verbose=0, memory_budget=tiny,
              check_memory=False)
    plain.fit(features, targets, batch_size=8, verbose=0)
    assert model.accumulation_steps == 8
    for ours, reference in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
