"""The planner's numbers that docs/out-of-memory.md shows, recomputed: its table of levers,
its printed plan and its refusal. The planner is arithmetic over the model's shapes, so each
number is the same on every machine; a change of the planner that moves one fails here, with
the text to put on the page."""

import pathlib
import re

import keras
import pytest

import tfmem
from tfmem import models
from tfmem.memory import plan_report, planner

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "out-of-memory.md"
GIB, MIB = 2**30, 2**20


# What finetune.py and plan.py train and plan a classifier with (`tfmem.finetune.task_loss`).
_CLASSIFIER_LOSS = dict(loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])


def _planned(precision="float32", optimizer="adam", **build_options):
    """ResNet50, 1000 classes, global batch 256 on a T4: the page's running example."""
    keras.mixed_precision.set_global_policy(precision)  # layers read it when built
    try:
        with models.shapes_only():
            model = models.build("resnet50", num_classes=1000, **build_options)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return tfmem.plan(model, global_batch_size=256, optimizer=optimizer, precision=precision,
                      device="t4", **_CLASSIFIER_LOSS)


@pytest.fixture(scope="module")
def plans():
    return {
        "float32": _planned(image_size=224),
        "mixed_float16": _planned("mixed_float16", image_size=224),
        "mixed_bfloat16": _planned("mixed_bfloat16", image_size=224),
        "frozen": _planned(image_size=224, freeze_backbone=True),
        "160": _planned(image_size=160),
        "112": _planned(image_size=112),
        "sgd": _planned(optimizer="sgd", image_size=224),
    }


@pytest.fixture(scope="module")
def page():
    return PAGE.read_text()


def _gib(num_bytes):
    return f"{num_bytes / GIB:.2f}"


def _mib(num_bytes):
    return f"{num_bytes / MIB:.0f}"


def _block(page, after):
    """The first ```text block after the line `after` starts, whitespace made single."""
    start = page.index(after)
    body = re.search(r"```text\n(.*?)```", page[start:], re.S).group(1)
    return body


def test_the_table_of_levers_is_the_planners(plans, page):
    f32, f16 = plans["float32"], plans["mixed_float16"]
    expected = {
        "none: one step of 256": (f32.peak_bytes(256, 1), f32.max_micro_batch),
        "micro-batch 128 × 2 steps": (f32.peak_bytes(128, 2), f32.max_micro_batch),
        "micro-batch 64 × 4 steps": (f32.peak_bytes(64, 4), f32.max_micro_batch),
        "mixed float16": (f16.peak_bytes(256, 1), f16.max_micro_batch),
        "mixed float16 and 128 × 2 steps": (f16.peak_bytes(128, 2), f16.max_micro_batch),
        "frozen backbone (train the head only)": (plans["frozen"].peak_bytes(256, 1),
                                                  plans["frozen"].max_micro_batch),
        "160×160 images": (plans["160"].peak_bytes(256, 1), plans["160"].max_micro_batch),
        "112×112 images": (plans["112"].peak_bytes(256, 1), plans["112"].max_micro_batch),
        "SGD instead of Adam": (plans["sgd"].peak_bytes(256, 1), plans["sgd"].max_micro_batch),
    }
    table = page[page.index("| change | command |"):]
    table = table[:table.index("\n\n")]
    shown = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip().strip("*") for cell in row.strip("|").split("|")]
        shown[cells[0]] = (cells[2], cells[3])
    assert shown == {change: (f"{_gib(peak)} GiB", str(largest))
                     for change, (peak, largest) in expected.items()}
    # The bold row is the plan's own choice for the float32 run, and it fits.
    chosen = next(change for change, (peak, _) in shown.items() if change in table and
                  f"**{peak}**" in table)
    assert chosen == (f"micro-batch {f32.micro_batch_size} × {f32.accumulation_steps} steps")
    assert f32.peak_bytes(f32.micro_batch_size, f32.accumulation_steps) <= f32.budget_bytes
    snippet = (f"print(plan.peak_bytes({f32.micro_batch_size}, {f32.accumulation_steps}) / "
               f"2**30, plan.max_micro_batch)   # "
               f"{_gib(f32.peak_bytes(f32.micro_batch_size, f32.accumulation_steps))}, "
               f"{f32.max_micro_batch}")
    assert snippet in page


@pytest.fixture(scope="module")
def auto():
    """`scripts/plan.py` and `finetune.py --dry-run --device t4` build the model in float32 and
    plan precision "auto": mixed_float16 on a T4."""
    with models.shapes_only():
        model = models.build("resnet50", num_classes=1000, image_size=224)
    return tfmem.plan(model, global_batch_size=256, optimizer="adam", precision="auto",
                      device="t4", **_CLASSIFIER_LOSS)


def test_the_printed_plan_is_the_planners(auto, page):
    shown = _block(page, "## See where the memory goes").rstrip("\n").splitlines()
    expected = plan_report.format_table(auto).splitlines()
    assert shown[:-1] == expected[:-1]
    assert shown[-1] == (
        "next: python scripts/finetune.py --model resnet50 --data PATH --image-size 224 "
        f"--global-batch-size 256 --accumulation-steps {auto.accumulation_steps}")


def test_the_refusal_is_the_planners(auto, page):
    # The symptom table quotes its start.
    assert (f"`MemoryPlanError: global batch 256 (…) needs {_gib(auto.peak_bytes(256, 1))} GiB "
            "per replica on t4, over the budget of 12.00 GiB …`") in page
    with pytest.raises(tfmem.MemoryPlanError) as refused:
        planner.check(auto, accumulation_steps=1, switches=plan_report.COMMAND_LINE)
    shown = " ".join(_block(page, "## The planner refused the run").split())
    assert shown == "error: " + str(refused.value).splitlines()[0]


def test_the_numbers_in_the_words_are_the_planners(plans, page):
    f32, f16, bf16 = plans["float32"], plans["mixed_float16"], plans["mixed_bfloat16"]
    activations = f32.activation_bytes_per_sample
    phrases = [
        f"({_gib(256 * activations)} → {_gib(128 * activations)} GiB of activations at k = 2)",
        f"float32 copy of the trainable weights for the summed gradients "
        f"({_mib(f32.accumulation_bytes)} MiB",
        f"for ResNet50 the activations go from {_gib(256 * activations)} to "
        f"{_gib(256 * f16.activation_bytes_per_sample)} GiB "
        f"({f16.activation_bytes_per_sample / activations:.2f}×",
        f"({_mib(f16.mixed_precision_bytes)} MiB with float16",
        f"{_mib(bf16.mixed_precision_bytes)} MiB with bfloat16",
        f"({_gib(f32.peak_bytes(256, 1))} → {_gib(plans['frozen'].peak_bytes(256, 1))} GiB for "
        "ResNet50",
        f"SGD none (with momentum 1): {_mib(f32.optimizer_bytes)} MiB for ResNet50",
    ]
    text = " ".join(page.split())
    missing = [phrase for phrase in phrases if phrase not in text]
    assert not missing, f"docs/out-of-memory.md should say: {missing}"


def _this_machine_masked(text):
    """A CPU plan's text without what depends on the machine: its name and free memory."""
    text = re.sub(r" on [^,\n]+, global batch", " on CPU, global batch", text)
    text = re.sub(r"budget [\d.]+ GiB = 80% of [\d.]+ GiB", "budget B", text)
    text = re.sub(r"of the [\d.]+ GiB budget", "of the B budget", text)
    return re.sub(r"fits up to micro-batch \d+", "fits up to micro-batch M", text)


def test_getting_started_shows_the_example_plan():
    # The README's example, step 2 and 3: small-cnn, 4 classes, 32 px, global batch 64.
    runtime = tfmem.detect()
    with runtime.scope():
        base = models.build("small-cnn", num_classes=4, image_size=32)
    plan = tfmem.plan(base, global_batch_size=64, optimizer="adam", runtime=runtime)
    page = (PAGE.parent / "getting-started.md").read_text()
    shown = _block(page, "`print(plan.table())` shows where the memory goes")
    assert _this_machine_masked(shown.rstrip("\n")) == _this_machine_masked(plan.table())
