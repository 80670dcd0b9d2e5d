"""A plan's table says why it chose its micro-batch and what to run next; --plot's lines hold
the chosen point. Plans made by hand, numbers worked out by hand."""

import dataclasses

from tfmem.memory import plan_report
from tfmem.memory.memory_plan import Alternative, MemoryPlan, Term, choose

MIB = 2**20


def _plan(**changes) -> MemoryPlan:
    # Budget 80 MiB (80% of 100 MiB). Peak of micro-batch b: 40 MiB + 5 MiB × b in one plain
    # step, 10 MiB more with k > 1 (the accumulation buffers).
    plan = MemoryPlan(
        model_name="m", num_parameters=1, num_trainable_parameters=1, optimizer="Adam",
        precision="float32", device="d", device_kind="gpu", num_replicas=1,
        memory_per_replica=100 * MIB, safety=0.8, global_batch_size=12,
        parameter_bytes=10 * MIB, gradient_bytes=10 * MIB, optimizer_bytes=20 * MIB,
        accumulation_bytes=10 * MIB, mixed_precision_bytes=0, runtime_bytes=0,
        input_bytes_per_sample=0, activation_bytes_per_sample=5 * MIB,
        workspace_bytes_per_sample=0)
    return choose(dataclasses.replace(plan, **changes))


def test_the_choice_is_told_apart_from_the_largest_plain_step():
    plan = _plan()
    # One step of 12: 40 + 60 = 100 MiB > 80. 6 × 2: 50 + 30 = 80 MiB, fits. A plain step
    # (no buffers) fits up to 8: 40 + 40 = 80 MiB; 8 does not divide 12.
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.max_micro_batch) == (6, 2, 8)
    lines = plan.table().splitlines()
    assert lines[-2:] == [
        "chosen: micro-batch 6 × 2 accumulation steps, 80.0 MiB of the 80.0 MiB budget: the "
        "largest micro-batch that divides the 12 samples per replica and fits (the next, "
        "12 × 1, needs 100.0 MiB); a plain step without accumulation fits up to micro-batch 8",
        "next: accumulation_steps=2"]
    # The command line's spelling, given by the caller.
    assert plan_report.format_table(plan, switches=plan_report.COMMAND_LINE).endswith(
        "\nnext: --accumulation-steps 2")
    # An explicit setting (the guard's error, a run's own k) shows its breakdown only.
    assert "next:" not in plan.table(accumulation_steps=4)


def test_one_plain_step_that_fits_says_so():
    plan = _plan(global_batch_size=8)  # 40 + 40 = 80 MiB
    assert plan.table().splitlines()[-2:] == [
        "chosen: one step of micro-batch 8 (no accumulation), 80.0 MiB of the 80.0 MiB budget",
        "next: accumulation_steps=1"]


def test_nothing_fits_is_said_once_with_the_change_to_make():
    plan = _plan(parameter_bytes=100 * MIB)  # the state alone: 130 MiB > 80 MiB
    assert not plan.fits
    text = plan.table()
    assert text.count("nothing fits") == 0 and text.splitlines()[-1] == (
        "the model state alone (parameters 100.0 MiB + gradients 10.0 MiB + Adam slots "
        "20.0 MiB = 130.0 MiB) exceeds the budget of 80.0 MiB per replica. Use a smaller "
        "model or images, or a device with more memory.")
    changed = dataclasses.replace(plan, alternative=Alternative(
        ("precision mixed_float16", "image size 160"), 4, 3, 70 * MIB,
        settings=(("precision", "mixed_float16"), ("image_size", 160))))
    assert changed.table().splitlines()[-1] == (
        "next: precision='mixed_float16', image_size=160, accumulation_steps=3")
    program = plan_report.Switches(
        "--allow-over-budget", flags=True, program="python scripts/finetune.py",
        settings=(("model", "m"), ("image_size", 224), ("precision", "auto")))
    assert plan_report.format_choice(changed, program).splitlines()[-1] == (
        "next: python scripts/finetune.py --model m --image-size 160 --precision "
        "mixed_float16 --accumulation-steps 3")
    # A change named in words only (a caller's own variant) is said in words.
    worded = dataclasses.replace(plan, alternative=Alternative(("a smaller head",), 4, 3,
                                                               70 * MIB))
    assert worded.table().splitlines()[-1] == (
        "next: a smaller head, with accumulation_steps=3")
    tight = _plan(activation_bytes_per_sample=50 * MIB)  # micro-batch 1: 90 MiB
    assert tight.table().count("nothing fits") == 1


def test_the_plot_draws_the_chosen_point_on_its_own_line():
    plan = _plan()
    lines = plan_report.plot_lines(plan)
    plain = lines["one step of micro-batch b"]
    accumulated = lines["micro-batch b × 2 accumulation steps"]
    assert plain[0] == accumulated[0] == list(range(1, 13))  # up to max(12, 1.25 × 8)
    gib = 2**30
    assert accumulated[1][6 - 1] * gib == 80 * MIB  # the chosen 6 × 2, on its line
    assert plain[1][6 - 1] * gib == 70 * MIB  # 10 MiB below: no accumulation buffers
    assert list(plan_report.plot_lines(_plan(global_batch_size=8))) == [
        "one step of micro-batch b"]


def test_activations_held_only_at_small_micro_batches_are_planned_where_they_are():
    # 6 MiB a sample more up to micro-batch 4 (XLA:GPU's centred inputs of BatchNormalization,
    # `SavedTensors.bounded_bytes`): plain peaks 51, 62, 73, 84 MiB for 1-4, then the line,
    # 65 MiB at 5 up to 80 at 8. The peak is not monotone in the micro-batch, so the choice
    # checks each divisor of 12: 6 × 2 (80 MiB with the buffers) fits, 4 × 3 (94) and 3 × 4
    # (83) do not, and 2 × 6 (72) does.
    plan = _plan(bounded_activations=((4, 6 * MIB),))
    assert [plan.peak_bytes(b, 1) // MIB for b in (1, 4, 5, 8, 9)] == [51, 84, 65, 80, 85]
    assert (plan.micro_batch_size, plan.accumulation_steps) == (6, 2)
    assert plan.max_micro_batch == 8
    # Where the line alone would allow 4 (60 MiB), 2 is the largest that fits 62 MiB.
    assert plan.largest_micro_batch(62 * MIB) == 2
    assert plan.largest_micro_batch(66 * MIB) == 5  # 65 MiB: beyond the bound, the line's
    assert plan.breakdown(4, 1)[Term.ACTIVATIONS] == 4 * (5 + 6) * MIB
