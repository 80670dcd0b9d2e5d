"""One run of the training in this process: build → plan → train → evaluate → report.

`run_attempt` is what `tfmem.finetune.run` calls without a memory limit, and what each
training process of the supervisor (`tfmem.finetune.supervisor`) runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import keras
import numpy as np

from tfmem import cli, models
from tfmem.data import reader
from tfmem.data.integrity import SkippedRecords
from tfmem.finetune import messages, outputs, validation as validation_lib
from tfmem.finetune.config import FinetuneConfig, check_loss, model_spec
from tfmem.finetune.data_facts import DataFacts, check_sizes, demo_data
from tfmem.memory import guard, levers, loss_trace, plan_report
from tfmem.memory.memory_plan import MemoryPlanError
from tfmem.metrics.segmentation import MultiLabelIoU
from tfmem._sizes import format_bytes
from tfmem.remat.spec import Ranges, RematSpec
from tfmem.runtime import current, devices, precision as precision_lib
from tfmem.runtime.cluster import split_batch
from tfmem.runtime.runtime import Runtime
from tfmem.training import recovery, run_directory
from tfmem.training.accumulation import AccumModel
from tfmem.training.progress import RunProgress
from tfmem.training.resume import TrainingDivergedError, fit_resumable
from tfmem.training.segmentation_losses import DiceLoss


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What one training process is asked to do: the k to use, the recoveries before it, where
    to say which split it took (the supervisor reads it), and the data's facts already found."""

    accumulation_steps: int | str
    recoveries: tuple = ()
    split_file: str | None = None
    locked: bool = False  # the run directory is held by the supervising process
    plan_budget: int | None = None  # plan for these bytes instead of the device's memory
    data: dict | None = None  # the data's facts, as the supervising process found them
    memory_limit: int | None = None  # the limit the process runs under, checked against the plan


def run_attempt(config: FinetuneConfig, attempt: Attempt) -> dict:
    """The run itself, in this process (no memory limit enforced here)."""
    spec = model_spec(config)
    if config.deterministic:
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(config.seed)
    runtime = current.detect(prefer=config.prefer)
    precision = (precision_lib.policy_for(runtime) if config.precision == "auto"
                 else config.precision)
    precision_lib.set_policy(policy=precision)

    output = outputs.output_directory(config, spec)
    data = DataFacts(**attempt.data) if attempt.data else DataFacts.of(config, spec)
    check_loss(config, data.task)
    if not config.dry_run:  # nothing is written for a run these refuse
        check_sizes(config, spec, data)
    if config.dry_run:
        if not config.device:  # the plan is for this machine: say what it is
            messages.print_environment(config, runtime)
        build_and_plan(config, spec, runtime, precision, data, attempt)
        return {}
    held = contextlib.nullcontext() if attempt.locked else run_directory.lock(output, "--output")
    with held:  # one process per run directory
        return _train_in(config, spec, runtime, precision, output, data, attempt)


def _train_in(config: FinetuneConfig, spec, runtime: Runtime, precision: str, output: str,
              data: DataFacts, attempt: Attempt) -> dict:
    """In the locked run directory: its settings checked (or a finished run left as it is),
    the training, and the run marked complete."""
    if config.overwrite:
        outputs.discard(output)
    recorded = outputs.recorded_settings(config, spec, precision, data, output)
    finished = recorded.get("complete")
    if finished and config.epochs <= finished["epochs"]:
        print(messages.complete_line(output, finished["epochs"]))
        return {}
    outputs.check_epochs_done(config, output)
    if recorded.get("epochs") != config.epochs:  # a later start may train on further
        recorded = {**recorded, "epochs": config.epochs}
        run_directory.write_config(output, recorded)
    if not attempt.recoveries:  # once per run, not again in each training process
        messages.print_environment(config, runtime)
    if data.demo:
        data = dataclasses.replace(data, **demo_data(output, data.image_size, data.task))
        if not attempt.recoveries:
            print(messages.demo_line(spec, config, data))
    results = _train(config, spec, runtime, precision, output, data, attempt)
    run_directory.write_config(output, {**recorded, "complete": {
        "epochs": config.epochs, "metrics": os.path.join(output, "metrics.json")}})
    print(messages.summary(output))
    if results.get("skipped"):
        print(results["skipped"])
    return results


def _train(config: FinetuneConfig, spec, runtime: Runtime, precision: str, output: str,
           data: DataFacts, attempt: Attempt) -> dict:
    """Builds, plans, trains and evaluates; returns metrics.json's dict."""
    skipped = SkippedRecords() if config.skip_corrupt else None
    options = dict(image_size=data.image_size, data_range=spec.data_range,
                   num_classes=data.num_classes, skip_corrupt=config.skip_corrupt,
                   skipped=skipped, max_image_pixels=config.max_image_pixels)

    def make_dataset(epoch):
        dataset = reader.image_dataset(data.train, batch_size=config.global_batch_size,
                                       training=True, seed=config.seed + epoch, **options)
        # Skipped records would end the epoch early: an epoch is steps_per_epoch updates.
        return dataset.repeat() if config.skip_corrupt else dataset

    accum = None  # the AccumModel the memory check compiled, which the run trains

    def trainer(model, optimizer, memory_plan):
        nonlocal accum
        if accum is None:
            accum = _trainer(config, runtime, data, model, optimizer, memory_plan)
        return accum

    model, optimizer, run_plan = build_and_plan(config, spec, runtime, precision, data,
                                                attempt, train_data=make_dataset(0),
                                                trainer=trainer)
    steps_per_epoch = data.num_examples // config.global_batch_size  # >= 1: check_sizes
    accum = trainer(model, optimizer, run_plan.plan)
    accum.accumulation_steps = run_plan.accumulation_steps
    # Evaluated a micro-batch per replica at a time, as the plan trains: a validation batch
    # of the global batch's size would run its forward pass on all of it at once.
    validation_batch = run_plan.micro_batch_size * runtime.num_replicas
    validation = (reader.image_dataset(data.validation, batch_size=validation_batch,
                                       training=False, **options)
                  if data.validation else None)
    recoveries = list(attempt.recoveries)  # this run's stops at the limit, and those in-process
    start = time.perf_counter()
    history = _fit(config, output, accum, make_dataset, steps_per_epoch, validation, recoveries)
    results = {
        "model": spec.name, "num_parameters": model.count_params(), "data": data.train,
        "num_examples": data.num_examples, "num_classes": data.num_classes,
        "epochs": config.epochs, "global_batch_size": config.global_batch_size,
        # After running out of memory in a step, the run goes on with a larger k.
        "micro_batch_size": split_batch(config.global_batch_size, run_plan.num_replicas,
                                        accum.accumulation_steps),
        "accumulation_steps": accum.accumulation_steps,
        "num_replicas": run_plan.num_replicas, "device": runtime.device_name,
        "precision": precision, "planned_peak_bytes": run_plan.peak_bytes,
        "budget_bytes": run_plan.plan.budget_bytes if run_plan.plan else None,
        "history": history, "train_seconds_this_run": time.perf_counter() - start,
        "memory_recoveries": recoveries,
    }
    if validation is not None and data.task == "segmentation":
        # At the validation images' own size (Keras's per-epoch pass read them resized).
        choice = validation_lib.choose(config, spec, data, run_plan, validation_batch)
        print(choice.line())
        loss_function, metrics = loss_and_metrics(data, config.loss)  # a fresh metric state
        loss = validation_lib.evaluate(model, choice, spec.image_size_multiple,
                                       validation_lib.batches(choice, data, options),
                                       loss_function, metrics[0])
        mean_iou = float(metrics[0].result())
        # The metric's state after the pass: its counts.
        scores = (metrics[0].scores() if data.multi_label
                  else segmentation_scores(metrics[0].total_cm))
        results["validation"] = {
            "loss": loss, "mean_iou": mean_iou, **scores, "batch_size": validation_batch,
            "image_size": list(choice.image_size),
            "tile_size": list(choice.tile_size) if choice.tile_size else None}
        print(messages.segmentation_line(mean_iou, scores["pixel_accuracy"], config.epochs))
    elif validation is not None:
        loss, accuracy = accum.evaluate(validation, verbose=0)
        results["validation"] = {"loss": loss, "accuracy": accuracy,
                                 "batch_size": validation_batch}
        print(messages.validation_line(accuracy, config.epochs, data.num_classes))
    if skipped is not None:
        results["skipped"] = skipped.summary()
    outputs.save_results(accum, results, output)
    return results


def loss_and_metrics(data: DataFacts, loss: str = "cross-entropy"
                     ) -> tuple[keras.losses.Loss, list]:
    """The task's loss (`--loss`) and metrics on the model's probabilities: per image,
    accuracy; per pixel, mean IoU over the pixels that have a class (the ignore value counts
    in neither), or for multi-label masks each class's IoU at the threshold 0.5."""
    if data.task != "segmentation":
        return keras.losses.SparseCategoricalCrossentropy(), ["accuracy"]
    if loss != "cross-entropy":  # each image's Dice (and cross-entropy), as a mean over images
        function = DiceLoss(data.num_classes, ignore_class=data.ignore_value,
                            multi_label=data.multi_label, cross_entropy=loss != "dice")
    elif data.multi_label:  # a sigmoid per class and pixel
        function = keras.losses.BinaryCrossentropy()
    else:
        function = keras.losses.SparseCategoricalCrossentropy(ignore_class=data.ignore_value)
    if data.multi_label:
        return function, [MultiLabelIoU(data.num_classes, name="mean_iou")]
    return function, [keras.metrics.MeanIoU(data.num_classes, name="mean_iou",
                                            ignore_class=data.ignore_value,
                                            sparse_y_pred=False)]


def segmentation_scores(confusion) -> dict:
    """Pixel accuracy and each class's IoU (true ∩ predicted / true ∪ predicted) from a
    confusion matrix (rows: true class, columns: predicted); None for a class in neither."""
    confusion = np.asarray(confusion, dtype=np.float64)
    true, predicted, hits = confusion.sum(axis=1), confusion.sum(axis=0), np.diag(confusion)
    union = true + predicted - hits
    return {"pixel_accuracy": float(hits.sum() / max(confusion.sum(), 1.0)),
            "per_class_iou": [float(h / u) if u else None for h, u in zip(hits, union)]}


def _fit(config: FinetuneConfig, output: str, accum: AccumModel, make_dataset,
         steps_per_epoch: int, validation, recoveries: list) -> dict:
    """`fit_resumable` with the run's resume points, logs and progress; its history."""
    progress = RunProgress(epochs=config.epochs, steps_per_epoch=steps_per_epoch,
                           global_batch_size=config.global_batch_size)
    try:
        return fit_resumable(
            accum, make_dataset, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
            backup_dir=os.path.join(output, "backup"),
            save_every_steps=config.save_every_steps or max(steps_per_epoch // 4, 1),
            validation_data=validation,
            callbacks=[progress, keras.callbacks.TensorBoard(os.path.join(output, "logs"))],
            verbose=0, memory_recoveries=recoveries,
            check_memory=False)  # the guard checked it
    except TrainingDivergedError as error:
        raise messages.diverged_run(config, output, error) from error


def _trainer(config: FinetuneConfig, runtime: Runtime, data: DataFacts, model: keras.Model,
             optimizer, memory_plan) -> AccumModel:
    """The compiled AccumModel the run trains, cutting the segments the plan chose."""
    setting = RematSpec.from_flag(config.rematerialize).value
    if setting in ("full", "auto") and memory_plan is not None:
        # The segments the plan chose: the run cuts the same ones.
        chosen = memory_plan.rematerialized
        setting = Ranges(chosen) if chosen else None
    with runtime.scope():
        accum = AccumModel.wrap(model, rematerialize=setting)
        loss_function, metrics = loss_and_metrics(data, config.loss)
        accum.compile(optimizer, loss_function, metrics=metrics)
    return accum


def build_and_plan(config: FinetuneConfig, spec, runtime: Runtime, precision: str,
                   data: DataFacts, attempt: Attempt, train_data=None, trainer=None
                   ) -> tuple[keras.Model, keras.optimizers.Optimizer, guard.RunPlan]:
    """The model and optimizer (in the strategy's scope), and the run's checked split.

    With `train_data` (the run's dataset) and `trainer` (`(model, optimizer, plan) →` the
    AccumModel that trains), the split is checked on the runtime's XLA backend with the
    compiled step the run then runs (`AccumModel.compiled_peaks`)."""
    model, optimizer = _build(config, spec, runtime, data)
    planned = model
    if config.rematerialize:  # the plan counts what is recomputed
        with runtime.scope(), cli.usage_errors():  # a name that is no layer of the model
            planned = AccumModel.wrap(model,
                                      rematerialize=RematSpec.from_flag(config.rematerialize))
    # --device plans for that device (its replicas and, with precision "auto", its policy).
    where = (dict(device=config.device, precision=config.precision) if config.device
             else dict(runtime=runtime, precision=precision))
    compiled_peak = None
    # On a backend whose step compiles ahead (JAX), for the runtime the run trains on.
    if trainer is not None and not config.device and hasattr(AccumModel,
                                                             "compiled_step_memory"):

        def compiled_peak_of_the_run(accumulation_steps: int, memory_plan) -> int:
            peaks = trainer(model, optimizer, memory_plan).compiled_peaks(train_data)
            if peaks is None:  # data without a static batch shape
                raise ValueError("the training data has no static batch shape")
            return peaks(accumulation_steps, memory_plan)

        compiled_peak = compiled_peak_of_the_run
    elif config.dry_run and config.device and config.compile:
        # A TPU's or GPU's own figure, compiled ahead of time here where its compiler is
        # installed.
        compiled_peak = compiled_ahead(config, spec, runtime, data)
    if attempt.plan_budget is not None:  # what fits under a memory limit
        where = dict(memory_budget=attempt.plan_budget, num_replicas=runtime.num_replicas,
                     precision=precision)
    loss, metrics = loss_and_metrics(data, config.loss)  # the plan counts what they hold
    with cli.usage_errors():  # a batch that does not split, a plan over the budget, "auto"
        try:
            run_plan = guard.guard(
                planned, global_batch_size=config.global_batch_size, loss=loss, metrics=metrics,
                accumulation_steps=attempt.accumulation_steps,
                allow_over_budget=config.allow_over_budget, optimizer=optimizer,
                smaller_variants=levers.registry_variants(
                    spec.name, image_size=data.image_size, num_classes=data.num_classes),
                switches=plan_report.COMMAND_LINE, compiled_peak=compiled_peak, **where)
        except MemoryPlanError as error:  # the plan it refused, then the one-line refusal
            print(error.plan.table(error.accumulation_steps))
            raise
    if attempt.memory_limit is not None and run_plan.plan is not None:
        _check_memory_limit(run_plan.plan, attempt.memory_limit)
    if attempt.split_file:  # the supervising process halves this split if memory runs out
        _write_split(attempt.split_file, config, model, run_plan, runtime)
    if run_plan.plan is not None:  # its first line: parameters and the split
        print(run_plan.table())
    else:
        print(f"{spec.name}: {model.count_params():,} parameters, {run_plan.describe()}")
    return model, optimizer, run_plan


def compiled_ahead(config: FinetuneConfig, spec, runtime: Runtime, data: DataFacts,
                   program: str = "finetune"):
    """For a plan on JAX for a TPU or GPU (`--device tpu-v5e-8`, `--device t4`): `(k, plan)
    →` XLA's peak of the step one replica runs, compiled here ahead of time for a model
    built for its shapes in the plan's precision, as the device would run it; None (after a
    line, begun with `program`, that says what it needs) without that device's compiler (the
    TPU compiler, JAX's CUDA plugin); None on another backend."""
    accelerator = devices.by_name(config.device)
    if not hasattr(AccumModel, "compiled_step_memory"):
        return None
    from tfmem.memory import probe_jax  # JAX's own module: this backend only
    try:
        chip = (probe_jax.tpu_device(config.device) if accelerator.kind == "tpu" else
                probe_jax.gpu_device(config.device))
    except ImportError:  # no compiler for the device here
        print(f"{program}: the plan alone: XLA's own figure of this step needs "
              f"{probe_jax.compiler_needed(accelerator.kind)}")
        return None
    except ValueError:  # a GPU JAX's CUDA plugin does not compile for (a K80)
        print(f"{program}: the plan alone: XLA's own figure of this step cannot be compiled "
              f"for a {accelerator.description} (JAX does not support it)")
        return None
    replicas = accelerator.num_replicas
    shapes_only = dataclasses.replace(config, weights=None)  # weights change no memory
    built = {}

    def compiled_peak(accumulation_steps: int, memory_plan) -> int:
        precision = memory_plan.precision
        if precision not in built:
            previous = keras.mixed_precision.dtype_policy()
            keras.mixed_precision.set_dtype_policy(precision)
            try:
                model, optimizer = _build(shapes_only, spec, runtime, data)
            finally:
                keras.mixed_precision.set_dtype_policy(previous)
            built[precision] = _trainer(config, runtime, data, model, optimizer, memory_plan)
        accum = built[precision]
        per_replica = config.global_batch_size // replicas
        x, y = _batch_of_shapes(accum, data, per_replica)
        print(f"{program}: compiling the train step of one {chip.device_kind} replica at "
              f"micro-batch {per_replica // accumulation_steps} × {accumulation_steps} ahead "
              "of time (for a large model, minutes and gigabytes of RAM)", flush=True)
        # The optimizer's slots and the sums: shapes alone. A step that does not compile
        # for the device leaves the plan's answer, which the guard says.
        with models.shapes_only(), loss_trace.int64_as_run():
            peaks = accum.compiled_peaks(x, y, batch_size=per_replica, device=chip)
            return peaks(accumulation_steps, memory_plan)

    return compiled_peak


def _batch_of_shapes(model: keras.Model, data: DataFacts, rows: int) -> tuple:
    """`(images, labels)` of `rows` samples as the run's data gives them, shapes alone:
    float32 images, int32 class indices (per pixel for masks), multi-label masks of 0/1."""
    from jax import ShapeDtypeStruct  # noqa: N813 - JAX itself: this backend only

    images = ShapeDtypeStruct((rows,) + tuple(model.inputs[0].shape[1:]), "float32")
    if data.task != "segmentation":
        return images, ShapeDtypeStruct((rows,), "int32")
    if data.multi_label:
        return images, ShapeDtypeStruct((rows, *data.image_size, data.num_classes), "float32")
    return images, ShapeDtypeStruct((rows, *data.image_size), "int32")


def _build(config: FinetuneConfig, spec, runtime: Runtime,
           data: DataFacts) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """The model and its optimizer, in the strategy's scope."""
    # A dry run reads only shapes: its model's weights are never initialised (no RAM for them).
    deferred = config.dry_run and not config.weights
    with runtime.scope(), cli.usage_errors():  # e.g. an image size the model cannot take
        with models.shapes_only() if deferred else contextlib.nullcontext():
            if spec.task == "classification" or data.task == "segmentation":
                # A segmentation network on masks: its own per-pixel head, no pooling.
                # Multi-label masks: a sigmoid per class and pixel, else a softmax per pixel.
                model = models.build(spec.name, num_classes=data.num_classes,
                                     image_size=data.image_size, weights=config.weights,
                                     freeze_backbone=config.freeze_backbone,
                                     classifier_activation=("sigmoid" if data.multi_label
                                                            else "softmax"))
            else:
                model = _pooled_classifier(spec, data, config.freeze_backbone)
        optimizer = keras.optimizers.get({"class_name": config.optimizer,
                                          "config": {"learning_rate": config.learning_rate}})
    return model, optimizer


def _write_split(path: str, config: FinetuneConfig, model: keras.Model,
                 run_plan: guard.RunPlan, runtime: Runtime) -> None:
    """The split this process trains with, for the supervisor: micro-batch, k, whether nothing
    fits, and whether rematerializing more is left to try."""
    memory_plan = run_plan.plan
    with open(path, "w") as file:
        json.dump({"micro_batch_size": run_plan.micro_batch_size,
                   "accumulation_steps": run_plan.accumulation_steps,
                   "nothing_fits": (plan_report.format_nothing_fits(memory_plan)
                                    if memory_plan is not None and not memory_plan.fits
                                    else None),
                   "recompute_more": _recomputes_more(config, model, run_plan, runtime)}, file)


def _check_memory_limit(memory_plan, limit: int) -> None:
    """Before training: a `--memory-limit` below what the framework and the model's state need
    (the plan's terms that no smaller micro-batch changes) stops here, naming the smallest limit
    the plan sees working (micro-batch 1)."""
    fixed = memory_plan.fixed_bytes()
    if fixed <= limit:
        return
    smallest = memory_plan.peak_bytes(1)
    raise cli.UsageError(
        f"--memory-limit {format_bytes(limit)} is below what the framework and the model's "
        f"state need before any batch ({format_bytes(fixed)} as planned), so no micro-batch "
        f"can fit; the smallest limit that could work is about {format_bytes(smallest)} (the "
        "plan at micro-batch 1): raise --memory-limit, or pass --memory-limit none")


def _recomputes_more(config: FinetuneConfig, model: keras.Model, run_plan: guard.RunPlan,
                     runtime: Runtime) -> bool:
    """At micro-batch 1: whether `--rematerialize full` would recompute more than this run
    (what the supervising process tries when micro-batch 1 reaches the memory limit)."""
    if run_plan.micro_batch_size != 1:
        return False
    setting = RematSpec.from_flag(config.rematerialize).value
    chosen = run_plan.plan.rematerialized if run_plan.plan is not None else ()
    return recovery.rematerialization_left(model, setting, chosen if setting else (),
                                           runtime.kind)


def _pooled_classifier(spec, data: DataFacts, freeze_backbone: bool) -> keras.Model:
    """A segmentation network (FC-DenseNet, U-Net) as an image classifier: its last feature
    maps (per pixel), averaged over the image, then a softmax layer."""
    features = models.build(spec.name, num_classes=None, image_size=data.image_size,
                            include_top=False, freeze_backbone=freeze_backbone)
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(features.output)
    predictions = keras.layers.Dense(data.num_classes, activation="softmax", dtype="float32",
                                     name="predictions")(pooled)
    print(f"{spec.name} is a {spec.task} network: its last feature maps are averaged into a "
          f"{data.num_classes}-class classifier")
    return keras.Model(features.input, predictions, name=spec.name)
