"""Plans for a named device (its precision and replicas), golden EfficientNetV2-XL plans,
"nothing fits" naming a change checked to fit, and every tfmem.models family planned."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import keras
import pytest

import tfmem
from tfmem import _keras_internals as internals
from tfmem import models
from tfmem.models import applications
from tfmem._sizes import format_bytes
from tfmem.memory import levers, plan_report, planner
from tfmem.memory.memory_plan import Term
from tfmem.runtime import devices

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 2**30


def _cnn():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("device, policy", [
    ("tpu-v3-8", "mixed_bfloat16"), ("v100-32gb", "mixed_float16"), ("t4", "mixed_float16"),
    ("p100", "float32"),  # compute capability 6.0: no fast float16
    ("cpu", "float32"),
])
def test_auto_precision_is_the_named_devices_policy_and_says_so(device, policy):
    p = tfmem.plan(_cnn(), global_batch_size=64, device=device, precision="auto")
    assert p.precision == policy
    assert any(note.startswith("precision='auto'") and policy in note for note in p.notes)
    explicit = tfmem.plan(_cnn(), global_batch_size=64, device=device, precision=policy)
    assert p.peak_bytes(4, 1) == explicit.peak_bytes(4, 1)


def test_auto_precision_of_a_runtime_follows_its_compute_capability():
    a100 = types.SimpleNamespace(kind="gpu", device_name="A100", compute_capability=(8, 0),
                                 memory_per_replica=40 * GIB, num_replicas=2)
    assert tfmem.plan(_cnn(), global_batch_size=8, runtime=a100,
                      precision="auto").precision == "mixed_float16"
    k80 = types.SimpleNamespace(**{**vars(a100), "compute_capability": (3, 7)})
    assert tfmem.plan(_cnn(), global_batch_size=8, runtime=k80,
                      precision="auto").precision == "float32"


@pytest.fixture(scope="module")
def xl():
    """EfficientNetV2-XL at 384 px, built once without initialising its 209M weights."""
    with tfmem.models.shapes_only():
        return models.build("efficientnetv2-xl", num_classes=1000, image_size=384)


def _hand_choice(p, model, precision):
    """The plan's choice recomputed from its terms: the largest micro-batch dividing the
    per-replica batch whose fixed + per-sample bytes stay under 80% of the device."""
    trainable = sum(math.prod(w.shape) for w in model.trainable_weights)
    params = sum(math.prod(w.shape) for w in model.weights)
    assert p.parameter_bytes == 4 * params and p.gradient_bytes == 4 * trainable
    assert p.optimizer_bytes == 2 * 4 * trainable  # Adam: m and v
    not_bn = sum(math.prod(w.shape) for layer in internals.flatten_layers(model)
                 if not isinstance(layer, keras.layers.BatchNormalization)
                 for w in internals.own_trainable_variables(layer))
    mixed = 0 if precision == "float32" else (
        2 * not_bn + (4 * trainable if precision == "mixed_float16" else 0))
    assert p.mixed_precision_bytes == mixed
    per_replica = 64 // p.num_replicas
    budget = 0.8 * devices.lookup(p.device).memory_per_replica
    for micro in (b for b in range(per_replica, 0, -1) if per_replica % b == 0):
        k = per_replica // micro
        # Parameters + gradients + Adam's 2 slots + mixed copies (+ float32 sums when k > 1).
        fixed = 4 * params + 4 * trainable + 8 * trainable + mixed + (
            4 * trainable if k > 1 else 0)
        images = 384 * 384 * 3 * 4 * micro * k * 2  # the global batch share, 2 in flight
        kept = (p.activation_bytes_per_sample + p.workspace_bytes_per_sample) * micro
        if fixed + images + kept <= budget:
            return micro, k
    return 0, 0


@pytest.mark.parametrize("device, precision, split", [
    ("tpu-v3-8", "mixed_bfloat16", (8, 1, 8)),
    ("v100-32gb", "mixed_float16", (16, 4, 1)),
    ("t4", "mixed_float16", (4, 16, 1)),
    ("v100-32gb", "float32", (8, 8, 1)),  # --precision float32 on the same V100
])
def test_efficientnetv2_xl_golden_plans(xl, device, precision, split, capsys):
    requested = "auto" if precision != "float32" else "float32"
    p = tfmem.plan(xl, global_batch_size=64, optimizer="adam", device=device,
                   precision=requested)
    assert p.num_parameters == 208_896_832 and p.precision == precision
    print(f"{device}: {p.split()}")
    micro, k, replicas = split
    steps, replicas_word = ("step" if k == 1 else "steps"), ("replica" if replicas == 1
                                                             else "replicas")
    assert capsys.readouterr().out == (f"{device}: global batch 64 = micro-batch {micro} × {k} "
                                       f"accumulation {steps} × {replicas} {replicas_word}\n")
    assert (p.micro_batch_size, p.accumulation_steps, p.num_replicas) == split
    assert _hand_choice(p, xl, precision) == (micro, k)
    # docs/planning.md's row of this plan shows its split, peak and budget.
    first = f"`{device}`" + (', `precision="float32"`' if requested == "float32" else "")
    page = (ROOT / "docs" / "planning.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith(f"| {first} |"))
    peak = p.peak_bytes(micro, k) / GIB
    assert row == (f"| {first} | {precision} | micro-batch {micro} × {k} "
                   f"{'step' if k == 1 else 'steps'} × {replicas} {replicas_word} | "
                   f"{peak:.2f} GiB | {p.budget_bytes / GIB:.2f} GiB |")
    if precision == "float32":
        # Measured on CPU (FACTS.md): batch 1 → 2 adds ≈ 1.7-1.8 GiB per sample at 384 px.
        assert 1.6 * GIB < p.peak_bytes(2, 1) - p.peak_bytes(1, 1) < 1.95 * GIB


def _over_budget_model():
    """A convolutional backbone (nested model: big activations, few weights) and a dense head
    (17M weights): each lever saves something different."""
    inputs = keras.Input((64, 64, 3))
    x = inputs
    for _ in range(4):
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    backbone = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x), name="backbone")
    outer = keras.Input((64, 64, 3))
    x = keras.layers.Dense(4096, activation="relu")(backbone(outer))
    x = keras.layers.Dense(4096, activation="relu")(x)
    return keras.Model(outer, keras.layers.Dense(10)(x))


def _plan64(model, memory=64 * GIB, **kwargs):
    return tfmem.plan(model, global_batch_size=64, memory_budget=memory, **kwargs)


def _memory_between(fits, does_not):
    """A device size whose 80% budget lies between two plans' micro-batch-1 peaks."""
    return int((fits.peak_bytes(1, 64) + does_not.peak_bytes(1, 64)) / 2 / 0.8)


def test_nothing_fits_names_the_smallest_change_checked_to_fit():
    model = _over_budget_model()
    sgd = keras.optimizers.SGD(momentum=0.9)
    memory = _memory_between(_plan64(model, optimizer=sgd), _plan64(model))
    p = _plan64(model, memory)
    assert not p.fits and p.alternative.changes == ("optimizer SGD (momentum 0.9)",)
    # Rematerialization first (no numerics change); the dense head's state is what does not fit.
    assert p.alternative.tried[:3] == ("rematerialize full", "precision mixed_bfloat16",
                                       "optimizer SGD (momentum 0.9)")
    assert not _plan64(model, memory, precision="mixed_bfloat16").fits  # tried first, no fit
    checked = _plan64(model, memory, optimizer=sgd)
    assert checked.fits and (checked.micro_batch_size, checked.accumulation_steps) == (
        p.alternative.micro_batch_size, p.alternative.accumulation_steps)
    with pytest.raises(tfmem.MemoryPlanError,
                       match=r"Smallest change checked to fit: optimizer SGD \(momentum 0.9\) "
                             r"→ micro-batch \d+ × \d+ accumulation step"):
        planner.check(p)


def test_nothing_fits_tries_single_changes_before_pairs():
    model = _over_budget_model()
    sgd = keras.optimizers.SGD(momentum=0.9)
    pair = _plan64(model, optimizer=sgd, precision="float32")
    frozen_pair = tfmem.plan(_frozen(_over_budget_model()), global_batch_size=64,
                             memory_budget=64 * GIB, optimizer=sgd)
    assert frozen_pair.peak_bytes(1, 64) < pair.peak_bytes(1, 64)
    memory = _memory_between(frozen_pair, pair)
    p = _plan64(model, memory)
    assert p.alternative.changes == ("optimizer SGD (momentum 0.9)",
                                     "frozen backbone (train the head only)")
    # The same changes as settings of the run: the table's next step spells them.
    assert p.alternative.settings == (("optimizer", "sgd"), ("freeze_backbone", True))
    assert p.table().splitlines()[-1] == (
        f"next: optimizer='sgd', freeze_backbone=True, "
        f"accumulation_steps={p.alternative.accumulation_steps}")
    assert plan_report.format_choice(p, plan_report.COMMAND_LINE).splitlines()[-1] == (
        f"next: --optimizer sgd --freeze-backbone --accumulation-steps "
        f"{p.alternative.accumulation_steps}")
    singles = [t for t in p.alternative.tried if "+" not in t]
    assert p.alternative.tried[:len(singles)] == tuple(singles)  # all singles come first
    for kwargs in (dict(precision="mixed_bfloat16"), dict(optimizer=sgd),
                   dict(optimizer=keras.optimizers.Adafactor())):
        assert not _plan64(model, memory, **kwargs).fits
    assert not tfmem.plan(_frozen(_over_budget_model()), global_batch_size=64,
                          memory_budget=memory).fits


def _frozen(model):
    model.get_layer("backbone").trainable = False
    return model


def test_model_state_alone_over_the_device_is_said_with_numbers():
    model = _over_budget_model()
    p = tfmem.plan(model, global_batch_size=8, memory_budget=200_000)
    assert p.state_bytes > p.budget_bytes and not p.fits
    with pytest.raises(tfmem.MemoryPlanError) as error:
        planner.check(p)
    text = str(error.value)
    state = (f"parameters {format_bytes(p.parameter_bytes)} + "
             f"gradients {format_bytes(p.gradient_bytes)} + Adam slots")
    assert f"the model state alone ({state}" in text and "exceeds the budget of" in text
    assert "None of the changes checked fits" in text


def test_breakdown_terms_are_named():
    p = tfmem.plan(_cnn(), global_batch_size=8, memory_budget=GIB)
    assert list(p.breakdown(2, 4)) == [Term.PARAMETERS, Term.GRADIENTS, Term.OPTIMIZER_SLOTS,
                                      Term.ACCUMULATION, Term.MIXED_PRECISION, Term.RUNTIME,
                                      Term.INPUT, Term.ACTIVATIONS, Term.WORKSPACE, Term.LOSS]
    assert p.fixed_bytes(4) == sum(v for t, v in p.breakdown(1, 4).items()
                                   if t not in (Term.ACTIVATIONS, Term.WORKSPACE, Term.LOSS))


_DRIVER = r"""
import contextlib, importlib.util, io, json, sys
from absl import flags
import tfmem.cli
spec = importlib.util.spec_from_file_location("finetune_script", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for name in sys.argv[3:]:
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["finetune.py", *tfmem.cli.underscore_flags(
        ["--model", name, "--image-size", "32", "--dry-run", "--device", sys.argv[2],
         "--global-batch-size", "64"])])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main([])
    print(json.dumps({"name": name, "out": out.getvalue()}), flush=True)
"""


def _family(name):
    """The code that builds `name`: its Keras module (and input scaling) for a
    `keras.applications` backbone, else its name's stem ("tiramisu-67" → "tiramisu")."""
    family = applications.FAMILIES.get(name)
    return ((family.constructor.__module__, family.preprocessing) if family
            else name.split("-")[0])


def _one_per_family(task):
    """The first registered model of each family (its smallest): the others are the same code
    with other depths and widths, the same layer kinds in other numbers, planned the same way.
    """
    first = {}
    for name, spec in models.MODELS.items():
        if spec.task == task:
            first.setdefault(_family(name), name)
    return list(first.values())


def test_one_model_of_each_family_is_planned():
    assert _one_per_family("classification") == [
        "efficientnetv2-b0", "resnet50", "resnet50v2", "densenet121", "convnext-tiny",
        "mobilenetv2", "small-cnn", "efficientnetv2-xl"]
    assert _one_per_family("segmentation") == ["tiramisu-56", "unet"]
    # Every other name takes the image size its family was planned at (spec checked, no build).
    for name, spec in models.MODELS.items():
        size = 32 if spec.task == "classification" else 64
        assert models.input_shape(name, size) == (size, size, 3), name


def test_every_tfmem_model_family_plans_through_finetune_dry_run():
    names = _one_per_family("classification")
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(ROOT / "scripts" / "finetune.py"), "tpu-v3-8",
         *names], capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {run["name"]: run["out"] for run in map(json.loads, result.stdout.splitlines())}
    assert sorted(runs) == sorted(names)
    for name, out in runs.items():
        assert "mixed_bfloat16" in out and "total (peak per replica)" in out, (name, out)
        assert "upper bound" not in out, (name, out)
        # The split is the TPU's: 8 replicas × 8 per replica, whatever this host has.
        split = re.search(r"global batch 64 = micro-batch (\d+) × (\d+) accumulation steps? × "
                          r"8 replicas$", out, flags=re.M)
        assert split and int(split[1]) * int(split[2]) == 8, (name, out)


@pytest.mark.parametrize("name", _one_per_family("segmentation"))
def test_every_segmentation_model_family_plans(name):
    with tfmem.models.shapes_only():
        model = models.build(name, num_classes=3, image_size=64)
    p = tfmem.plan(model, global_batch_size=4, device="t4", precision="auto")
    assert p.fits and p.num_parameters == model.count_params()
    assert not [note for note in p.notes if "upper bound" in note]


def _wide_cnn(size, filters=64):
    inputs = keras.Input((size, size, 3))
    x = inputs
    for _ in range(6):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x)))


def test_smaller_variants_are_built_and_checked_after_the_changes_to_the_model_itself():
    model = _wide_cnn(128)
    variants = [("image size 64", lambda: _wide_cnn(64)),
                ("model with 16 filters", lambda: _wide_cnn(128, filters=16))]
    smaller = _plan64(_wide_cnn(64))
    mixed = _plan64(model, precision="mixed_bfloat16")
    assert smaller.peak_bytes(1, 64) < mixed.peak_bytes(1, 64)
    memory = _memory_between(smaller, mixed)
    p = tfmem.plan(model, global_batch_size=64, memory_budget=memory, smaller_variants=variants)
    assert p.alternative.changes == ("image size 64",)
    assert p.alternative.tried == ("rematerialize full", "precision mixed_bfloat16",
                                   "optimizer SGD (momentum 0.9)", "optimizer Adafactor",
                                   "image size 64")
    assert tfmem.plan(_wide_cnn(64), global_batch_size=64, memory_budget=memory).fits


def test_registry_variants_name_smaller_images_and_the_next_smaller_model():
    variants = levers.registry_variants("efficientnetv2-xl", image_size=384, num_classes=10)
    assert [d for d, _ in variants] == ["image size 288", "image size 192",
                                        "model efficientnetv2-l"]
    assert variants[1][1]().input_shape == (None, 192, 192, 3)
    assert [build.setting for _, build in variants] == [  # each as a setting of the run
        ("image_size", 288), ("image_size", 192), ("model", "efficientnetv2-l")]
    assert [d for d, _ in levers.registry_variants("resnet101", image_size=224,
                                                   num_classes=10)] == [
        "image size 160", "image size 96", "model resnet50"]
    assert levers.registry_variants("small-cnn", image_size=32, num_classes=4) == []
    wide = levers.registry_variants("unet", image_size=(352, 480), num_classes=3)
    assert [(d, build.setting) for d, build in wide] == [
        ("image size 256×352", ("image_size", "256,352")),
        ("image size 160×224", ("image_size", "160,224"))]
    assert wide[0][1]().input_shape == (None, 256, 352, 3)


def test_the_planner_imports_no_tensorflow():
    program = (
        "import sys\n"
        "class NoTensorFlow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow' or name.startswith('tensorflow.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoTensorFlow())\n"
        "import types\n"
        "sys.modules['tfmem'] = types.ModuleType('tfmem')  # skip tfmem/__init__ (imports TF)\n"
        "sys.modules['tfmem'].__path__ = [sys.argv[1] + '/tfmem']\n"
        "from tfmem.memory import planner, plan_report\n"
        "print(sorted(m for m in sys.modules if m.startswith('tfmem.memory')))\n")
    result = subprocess.run([sys.executable, "-c", program, str(ROOT)], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, KERAS_BACKEND="jax"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tfmem.memory.planner" in result.stdout


def test_planner_and_report_do_not_import_each_other():
    import ast

    def imports(module):
        tree = ast.parse((ROOT / "tfmem" / "memory" / f"{module}.py").read_text())
        return {alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}

    assert not [name for name in imports("planner") if "plan_report" in name]
    # Of tfmem, only the one wording of a size (a module that imports nothing of tfmem).
    assert not [name for name in imports("plan_report")
                if name.startswith("tfmem") and name != "tfmem._sizes.format_bytes"]
