r"""Fine-tune an image classifier from TFRecords without running out of memory.

    python scripts/finetune.py                      # the demo: about 15 s on 2 CPU cores
    python scripts/finetune.py --model efficientnetv2-xl --dry-run --device v100-32gb
    python scripts/finetune.py --model efficientnetv2-xl --data '/data/train-*.tfrec' \
        --validation-data '/data/val-*.tfrec' --num-classes 104 --global-batch-size 64 \
        --image-size 384 --weights /kaggle/input/xl/xl.weights.h5 --output runs/xl

What it does: detects the runtime (TPU / multi-worker / GPUs / CPU) and its precision, builds
the model inside the strategy's scope, plans the memory of the run (prints the breakdown and
refuses a setting over 80% of the device, naming one that fits), streams the TFRecords,
trains an `AccumModel` (global batch = micro-batch × accumulation steps × replicas), evaluates
and writes to `--output` (default `runs/<model>`): `run.json` (the run's settings), `backup/`
(resume points), `logs/` (TensorBoard), `model.keras` and `metrics.json`. Started again with
the same `--output` after a kill, it resumes from the last saved step; with other settings it
stops and names them; a finished run is left as it is. Errors are one line on stderr (exit 2:
the command is wrong, 1: the run failed; `--debug` adds the traceback); see
docs/failure-model.md.

Expected result of the first command (2 CPU cores, 2026-11-24): the demo set is written, 2
epochs of the small CNN train in about 5 s (15 s for the whole command), and it prints a
validation accuracy near 0.99 (0.990) against a chance level of 0.25.
"""

import contextlib
import glob
import json
import math
import os
import shutil
import sys
import time

from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem  # noqa: E402  (first: it imports TensorFlow without its banner)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tfmem import cli, models  # noqa: E402
from tfmem.data import manifest as manifest_lib  # noqa: E402
from tfmem.memory import levers, planner  # noqa: E402
from tfmem.runtime import devices  # noqa: E402
from tfmem.training import run_directory  # noqa: E402

_MODEL = flags.DEFINE_string("model", "small-cnn", "A name of tfmem.models.MODELS.")
_DATA = flags.DEFINE_string(
    "data", "demo", "'demo' (the embedded demo set, written under --output), a directory of "
    "TFRecords, or a glob such as 'gs://bucket/train-*.tfrec'.")
_VALIDATION_DATA = flags.DEFINE_string(
    "validation_data", None, "TFRecords to evaluate on (with --data demo: the demo's "
    "held-out set).")
_NUM_CLASSES = flags.DEFINE_integer(
    "num_classes", None, "Classes, for data without a tfmem manifest.json.", lower_bound=1)
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", None, "Training examples to use, for data without a manifest.json "
    "(default: all the records, counted on a local disk; required for gs://).", lower_bound=1)
_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 64, "Samples per optimizer update, over all replicas.", lower_bound=1)
_ACCUMULATION_STEPS = flags.DEFINE_string(
    "accumulation_steps", "auto", "'auto' (the planner picks the largest micro-batch that "
    "fits) or a number k of micro-batches per global batch.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Training epochs.", lower_bound=1)
_IMAGE_SIZE = flags.DEFINE_integer("image_size", None, "Height and width; default: the "
                                   "model's training size (the demo set's 32 for --data demo).",
                                   lower_bound=1)
_PRECISION = flags.DEFINE_enum(
    "precision", "auto", ["auto", "float32", "mixed_float16", "mixed_bfloat16"],
    "'auto': bf16 on TPU, fp16 on GPUs with compute capability >= 7, float32 on CPU.")
_WEIGHTS = flags.DEFINE_string("weights", None, "Local weights file (nothing is downloaded).")
_FREEZE_BACKBONE = flags.DEFINE_bool(
    "freeze_backbone", False, "Train only the new head (transfer learning); default trains "
    "every layer (full fine-tuning, which needs gradients and optimizer slots for all).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", ["adam", "adamw", "sgd", "rmsprop"],
                               "Optimizer.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Learning rate (finite, > 0).")
_OUTPUT = flags.DEFINE_string("output", None, "Run directory (default runs/<model>); a run "
                              "started there before resumes if its settings are the same.")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Discard the run in --output (resume point, logs, model, metrics) "
    "and start it again from the beginning.")
_SKIP_CORRUPT = flags.DEFINE_bool(
    "skip_corrupt", False, "Skip records that cannot be read (damaged shards, broken images) "
    "instead of stopping; each is named on stderr, and a summary per shard ends the run.")
_DEVICE = flags.DEFINE_string(
    "device", None, "Plan for this device instead of the detected one (e.g. v100-32gb, "
    "tpu-v3-8; see tfmem.runtime.devices.ACCELERATORS). Only with --dry-run.")
_PREFER = flags.DEFINE_enum("prefer", None, ["tpu", "gpu", "cpu"], "Force a device kind.")
_ALLOW_OVER_BUDGET = flags.DEFINE_bool(
    "allow_over_budget", False, "Train even when the plan exceeds the memory budget.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build the model, print its parameters and "
                             "the memory plan, train nothing.")
_SAVE_EVERY_STEPS = flags.DEFINE_integer(
    "save_every_steps", None, "Save a resume point every this many updates (default: 4 "
    "times per epoch).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights, shuffling and augmentation.")
_DETERMINISTIC = flags.DEFINE_bool(
    "deterministic", False, "Deterministic ops (slower): a resumed run then ends with exactly "
    "the weights of an uninterrupted one.")
flags.register_validator(
    "learning_rate", lambda value: math.isfinite(value) and value > 0,
    "the learning rate must be a finite number > 0, e.g. --learning-rate=1e-3")
flags.register_validator(
    "accumulation_steps", lambda value: value == "auto" or (value.isdigit() and int(value) > 0),
    "--accumulation-steps must be 'auto' or a positive int, e.g. --accumulation-steps=4")


# The demo set: 2048 training + 512 held-out shapes (tfmem.make_demo_dataset), 4 classes.
_DEMO_SPLITS = (("train", 2048, 0), ("validation", 512, 1))


def _demo_data(output: str, image_size: int) -> tuple[str, str]:
    """Writes the demo train/validation sets once under `output` and returns their paths."""
    paths = []
    for split, num_examples, seed in _DEMO_SPLITS:
        path = os.path.join(output, "demo-data", f"{image_size}px", split)
        try:
            tfmem.read_manifest(path)
        except ValueError:  # none yet, or damaged: (re)write it; it is the same every time
            tfmem.make_demo_dataset(path, num_examples=num_examples, image_size=image_size,
                                    seed=seed, overwrite=True)
        paths.append(path)
    return paths[0], paths[1]


def _dataset_facts(data: str) -> tuple[int, int, str]:
    """(num_classes, num_examples, identity) from the manifest, or from the records and flags.

    The identity goes into the run's settings: the manifest's fingerprint (the set wherever
    it lies), or for foreign records their path and count.
    """
    # A dry run given both counts plans for another machine, whose data may live there (a TPU
    # VM, a bucket): a remote path is not looked at, a local manifest is still used.
    counted = _DRY_RUN.value and _NUM_CLASSES.value and _NUM_EXAMPLES.value
    has_manifest = not (counted and "://" in data) and manifest_lib.has_manifest(data)
    if counted and not has_manifest:
        print(f"finetune: data not checked: a dry run plans from --num-classes "
              f"{_NUM_CLASSES.value} and --num-examples {_NUM_EXAMPLES.value} without reading "
              f"{data}; training checks it before it starts")
        return _NUM_CLASSES.value, _NUM_EXAMPLES.value, None
    if has_manifest:
        manifest = tfmem.read_manifest(data)  # a damaged one stops here, naming the damage
        for flag, value in ((_NUM_CLASSES, manifest.num_classes),
                            (_NUM_EXAMPLES, manifest.num_examples)):
            if flag.value is not None and flag.value != value:
                raise cli.UsageError(
                    f"--{flag.name.replace('_', '-')} {flag.value}, but the manifest of {data} "
                    f"says {value}; leave --{flag.name.replace('_', '-')} out (the manifest "
                    "gives it)")
        return manifest.num_classes, manifest.num_examples, f"manifest {manifest.fingerprint}"
    if _NUM_CLASSES.value is None:
        raise cli.UsageError(
            f"{data!r} has no tfmem manifest.json, so its classes are unknown; pass "
            "--num-classes (e.g. from the dataset's description)")
    with cli.usage_errors():  # no files there: the path is wrong
        count = tfmem.count_records(data)
    if count is None and _NUM_EXAMPLES.value is None:
        raise cli.UsageError(f"{data!r} is remote and has no manifest.json, so its size is "
                             "unknown; pass --num-examples")
    if count is not None and _NUM_EXAMPLES.value is not None and _NUM_EXAMPLES.value > count:
        raise cli.UsageError(f"--num-examples {_NUM_EXAMPLES.value} is more than the {count} "
                             f"records of {data}; pass --num-examples {count} or fewer")
    num_examples = _NUM_EXAMPLES.value or count
    return _NUM_CLASSES.value, num_examples, f"{os.path.abspath(data)}, {num_examples} examples"


def _validation_identity(data: str) -> str:
    """The validation set's identity in the run's settings (as `_dataset_facts` gives it)."""
    if manifest_lib.has_manifest(data):
        return f"manifest {tfmem.read_manifest(data).fingerprint}"
    with cli.usage_errors():  # no files there: the path is wrong
        return f"{os.path.abspath(data)}, {tfmem.count_records(data)} records"


def _check_flags() -> None:
    """Combinations of flags that cannot work together."""
    if _DEVICE.value and not _DRY_RUN.value:
        raise cli.UsageError(f"--device {_DEVICE.value} plans for another machine; it only goes "
                             "with --dry-run (training always runs on the detected runtime)")
    if _DATA.value == "demo":
        # A dry run may name the classes of data it does not have (planning for another machine).
        for flag in (_VALIDATION_DATA,) if _DRY_RUN.value else (_VALIDATION_DATA, _NUM_CLASSES,
                                                                 _NUM_EXAMPLES):
            if flag.value is not None:
                raise cli.UsageError(
                    f"--{flag.name.replace('_', '-')} goes with your own --data; the demo "
                    "brings its own classes, examples and held-out set")
        if _DRY_RUN.value and _NUM_EXAMPLES.value is not None and _NUM_CLASSES.value is None:
            raise cli.UsageError("--num-examples without --data plans for data that is "
                                 "elsewhere; pass its --num-classes too")


def _run_settings(spec, image_size, num_classes, precision, data_identity,
                  validation_identity) -> dict:
    """What defines the run: a restart with any of these changed is another run."""
    return {
        "model": spec.name, "image_size": image_size, "num_classes": num_classes,
        "optimizer": _OPTIMIZER.value, "learning_rate": _LEARNING_RATE.value,
        "global_batch_size": _GLOBAL_BATCH_SIZE.value,
        "accumulation_steps": _ACCUMULATION_STEPS.value, "precision": precision,
        "seed": _SEED.value, "freeze_backbone": _FREEZE_BACKBONE.value,
        "weights": os.path.abspath(_WEIGHTS.value) if _WEIGHTS.value else None,
        "data": data_identity, "validation_data": validation_identity,
    }


def _discard(output: str) -> None:
    """--overwrite: the run's resume points, logs and results go; the demo data stays."""
    for name in ("backup", "logs", "model.keras", "metrics.json", run_directory.CONFIG_FILE):
        path = os.path.join(output, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _save_results(accum, results: dict, output: str) -> None:
    """model.keras and metrics.json, each under a temporary name, then renamed."""
    temporary = os.path.join(output, ".tmp-model.keras")
    accum.save(temporary)
    os.replace(temporary, os.path.join(output, "model.keras"))
    temporary = os.path.join(output, ".tmp-metrics.json")
    with open(temporary, "w") as file:
        json.dump(results, file, indent=2)
    os.replace(temporary, os.path.join(output, "metrics.json"))


def _accumulation_steps(memory_plan: tfmem.MemoryPlan | None, target: tfmem.Runtime) -> int:
    """k from the flag ('auto': the plan's choice), checked against the batch and the budget."""
    if _ACCUMULATION_STEPS.value == "auto":
        if memory_plan is None:
            raise cli.UsageError("--accumulation-steps auto takes k from the memory plan, "
                                 "which could not be made (see the warning above); pass "
                                 "--accumulation-steps k")
        planner.check(memory_plan, allow_over_budget=_ALLOW_OVER_BUDGET.value)
        return memory_plan.accumulation_steps or 1
    steps = int(_ACCUMULATION_STEPS.value)  # a positive int: checked by its flag validator
    with cli.usage_errors():  # divisible? suggests sizes
        target.split_global_batch(_GLOBAL_BATCH_SIZE.value, steps)
    if memory_plan is not None:
        planner.check(memory_plan, accumulation_steps=steps,
                      allow_over_budget=_ALLOW_OVER_BUDGET.value)
    return steps


def _plan(model, optimizer, runtime, precision, image_size, num_classes):
    """The memory plan for the detected runtime or --device (None, with a warning, when the
    planner cannot size the model: training goes on without the check)."""
    try:
        return tfmem.plan(
            model, global_batch_size=_GLOBAL_BATCH_SIZE.value, optimizer=optimizer,
            # --device with --precision auto: the named device's policy, not this host's.
            precision=_PRECISION.value if _DEVICE.value else precision,
            runtime=None if _DEVICE.value else runtime, device=_DEVICE.value,
            smaller_variants=levers.registry_variants(
                _MODEL.value, image_size=image_size, num_classes=num_classes))
    except Exception as error:  # noqa: BLE001 - the planner must never stop a run
        print(f"warning: no memory plan, the planner could not size {model.name} "
              f"({type(error).__name__}: {error}); training without the memory check.",
              file=sys.stderr)
        return None


def main(argv):
    del argv
    _check_flags()
    with cli.usage_errors():  # unknown name → the list of valid ones
        spec = models.spec(_MODEL.value)
    if spec.task != "classification":
        raise cli.UsageError(
            f"{spec.name} is a {spec.task} model; finetune.py trains image classifiers. "
            f"Size it with: python scripts/plan.py --model {spec.name} ...")
    if _DETERMINISTIC.value:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(_SEED.value)
    runtime = tfmem.detect(prefer=_PREFER.value)
    precision = (tfmem.policy_for(runtime) if _PRECISION.value == "auto"
                 else _PRECISION.value)
    tfmem.set_policy(policy=precision)

    # Each model has its own default directory: a demo and an XL run never share one.
    output = _OUTPUT.value or os.path.join("runs", spec.name)
    demo = _DATA.value == "demo"
    if demo and _NUM_CLASSES.value:  # a dry run for data that is elsewhere (_check_flags)
        image_size = _IMAGE_SIZE.value or spec.default_image_size
        num_classes, num_examples = _NUM_CLASSES.value, _NUM_EXAMPLES.value
        print(f"finetune: no data given: a dry run plans for --num-classes {num_classes}; "
              "training needs --data")
    elif demo:  # written only when training starts: a dry run needs its size, not its pixels
        image_size = _IMAGE_SIZE.value or 32
        num_classes, num_examples = len(tfmem.DEMO_CLASS_NAMES), _DEMO_SPLITS[0][1]
        data_identity = validation_identity = "demo"
    else:
        image_size = _IMAGE_SIZE.value or spec.default_image_size
        train_data, validation_data = _DATA.value, _VALIDATION_DATA.value
        num_classes, num_examples, data_identity = _dataset_facts(train_data)
        # Not read either when the training data was not (a dry run for another machine).
        validation_identity = (validation_data and data_identity
                               and _validation_identity(validation_data))
    if _DRY_RUN.value:
        if not _DEVICE.value:  # the plan is for this machine: say what it is
            print(tfmem.describe(runtime))
        _train(spec, runtime, precision, output, image_size, num_classes, num_examples)
        return
    with run_directory.lock(output, "--output"):  # one process per run directory
        if _OVERWRITE.value:
            _discard(output)
        holds_run = bool(glob.glob(os.path.join(output, "backup", "backup-*.json"))) or any(
            os.path.exists(os.path.join(output, name)) for name in ("model.keras",
                                                                    "metrics.json"))
        recorded = run_directory.check_config(
            output, _run_settings(spec, image_size, num_classes, precision, data_identity,
                                  validation_identity),
            holds_run=holds_run, how_to_fix=(
                "start it with its own settings to resume it, use a new --output for a new "
                "run, or pass --overwrite to discard it and start again"))
        finished = recorded.get("complete")
        if finished and _EPOCHS.value <= finished["epochs"]:
            print(f"finetune: the run in {output} is complete ({finished['epochs']} epochs); "
                  f"its results are {os.path.join(output, 'metrics.json')} and "
                  f"{os.path.join(output, 'model.keras')}. Nothing was changed: use a new "
                  "--output for another run, or more --epochs to train this one further.")
            return
        if recorded.get("epochs") != _EPOCHS.value:  # a later start may train on further
            recorded = {**recorded, "epochs": _EPOCHS.value}
            run_directory.write_config(output, recorded)
        print(tfmem.describe(runtime))
        if demo:
            train_data, validation_data = _demo_data(output, image_size)
        results = _train(spec, runtime, precision, output, image_size, num_classes,
                         num_examples, train_data, validation_data)
        run_directory.write_config(output, {**recorded, "complete": {
            "epochs": _EPOCHS.value, "metrics": os.path.join(output, "metrics.json")}})
        print(f"finetune: wrote {os.path.join(output, 'metrics.json')}")
        if results.get("skipped"):
            print(results["skipped"])


def _train(spec, runtime, precision, output, image_size, num_classes, num_examples,
           train_data=None, validation_data=None) -> dict:
    """Builds, plans and (unless --dry-run) trains and evaluates; returns metrics.json's dict."""
    # A dry run reads only shapes: its model's weights are never initialised (no RAM for them).
    deferred = _DRY_RUN.value and not _WEIGHTS.value
    with runtime.scope(), cli.usage_errors():  # e.g. an image size the model cannot take
        with (models.shapes_only() if deferred
              else contextlib.nullcontext()):
            model = models.build(spec.name, num_classes=num_classes, image_size=image_size,
                                 weights=_WEIGHTS.value, freeze_backbone=_FREEZE_BACKBONE.value)
        optimizer = keras.optimizers.get({"class_name": _OPTIMIZER.value,
                                          "config": {"learning_rate": _LEARNING_RATE.value}})
    # The split is the planned device's: --device tpu-v3-8 splits over its 8 replicas.
    target = runtime
    if _DEVICE.value and _DEVICE.value.lower() != "cpu":
        accelerator = devices.lookup(_DEVICE.value)
        target = tfmem.Runtime(accelerator.kind, None, accelerator.num_replicas)
    with cli.usage_errors():  # splits over the replicas? else the nearest sizes
        target.split_global_batch(_GLOBAL_BATCH_SIZE.value)
    memory_plan = _plan(model, optimizer, runtime, precision, image_size, num_classes)
    accumulation_steps = _accumulation_steps(memory_plan, target)
    micro_batch = target.split_global_batch(_GLOBAL_BATCH_SIZE.value, accumulation_steps)
    if memory_plan is not None:  # its first line: parameters and the split
        print(memory_plan.table(accumulation_steps))
    else:
        print(f"{spec.name}: {model.count_params():,} parameters, " + tfmem.describe_split(
            _GLOBAL_BATCH_SIZE.value, micro_batch, accumulation_steps, target.num_replicas))
    if _DRY_RUN.value:
        return {}

    steps_per_epoch = num_examples // _GLOBAL_BATCH_SIZE.value
    if steps_per_epoch < 1:
        raise cli.UsageError(
            f"--global-batch-size {_GLOBAL_BATCH_SIZE.value} is larger than the "
            f"{num_examples} training examples; use at most {num_examples}")
    with runtime.scope():
        accum = tfmem.AccumModel.wrap(model, accumulation_steps=accumulation_steps)
        accum.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(),
                      metrics=["accuracy"])
    skipped = tfmem.SkippedRecords() if _SKIP_CORRUPT.value else None
    options = dict(image_size=(image_size, image_size), data_range=spec.data_range,
                   num_classes=num_classes, skip_corrupt=_SKIP_CORRUPT.value, skipped=skipped)

    def make_dataset(epoch):
        dataset = tfmem.image_dataset(train_data, batch_size=_GLOBAL_BATCH_SIZE.value,
                                      training=True, seed=_SEED.value + epoch, **options)
        # Skipped records would end the epoch early: an epoch is steps_per_epoch updates.
        return dataset.repeat() if _SKIP_CORRUPT.value else dataset

    validation = (tfmem.image_dataset(validation_data, batch_size=_GLOBAL_BATCH_SIZE.value,
                                      training=False, **options)
                  if validation_data else None)
    progress = tfmem.RunProgress(epochs=_EPOCHS.value, steps_per_epoch=steps_per_epoch,
                                 global_batch_size=_GLOBAL_BATCH_SIZE.value)
    start = time.perf_counter()
    history = tfmem.fit_resumable(
        accum, make_dataset, epochs=_EPOCHS.value, steps_per_epoch=steps_per_epoch,
        backup_dir=os.path.join(output, "backup"),
        save_every_steps=_SAVE_EVERY_STEPS.value or max(steps_per_epoch // 4, 1),
        validation_data=validation,
        callbacks=[progress, keras.callbacks.TensorBoard(os.path.join(output, "logs"))],
        verbose=0, check_memory=False)  # checked above against the detected runtime
    seconds = time.perf_counter() - start
    results = {
        "model": spec.name, "num_parameters": model.count_params(), "data": train_data,
        "num_examples": num_examples, "num_classes": num_classes, "epochs": _EPOCHS.value,
        "global_batch_size": _GLOBAL_BATCH_SIZE.value, "micro_batch_size": micro_batch,
        "accumulation_steps": accumulation_steps, "num_replicas": target.num_replicas,
        "device": runtime.device_name, "precision": precision,
        "planned_peak_bytes": (memory_plan.peak_bytes(micro_batch, accumulation_steps)
                               if memory_plan else None),
        "budget_bytes": memory_plan.budget_bytes if memory_plan else None, "history": history,
        "train_seconds_this_run": seconds,
    }
    if validation is not None:
        loss, accuracy = accum.evaluate(validation, verbose=0)
        results["validation"] = {"loss": loss, "accuracy": accuracy}
        print(f"finetune: validation accuracy {accuracy:.3f} after {_EPOCHS.value} epochs "
              f"(chance {1 / num_classes:.3f})")
    if skipped is not None:
        results["skipped"] = skipped.summary()
    _save_results(accum, results, output)
    return results


if __name__ == "__main__":
    cli.run(main)
