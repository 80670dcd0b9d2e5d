r"""Fine-tune an image classifier or a segmentation network from TFRecords without running out
of memory.

    python scripts/finetune.py                      # the demo: about 45 s on 2 CPU cores
    python scripts/finetune.py --model unet --task segmentation   # the demo's masks, per pixel
    python scripts/finetune.py --model efficientnetv2-xl --dry-run --device v100-32gb
    python scripts/finetune.py --model efficientnetv2-xl --data '/data/train-*.tfrec' \
        --validation-data '/data/val-*.tfrec' --num-classes 104 --global-batch-size 64 \
        --image-size 384 --weights /kaggle/input/xl/xl.weights.h5 --output runs/xl

What it does (`tfmem.finetune.run`, called with the flags as its `FinetuneConfig`): detects
the runtime (TPU / multi-worker / GPUs / CPU) and its precision, builds the model inside the
strategy's scope, plans the memory of the run (prints the breakdown and refuses a setting over
80% of the device, naming one that fits), streams the TFRecords, trains an `AccumModel`
(global batch = micro-batch × accumulation steps × replicas) in a child process held under
`--memory-limit` (reaching it resumes the run with half the micro-batch), evaluates
and writes to `--output` (default `runs/<model>`): `run.json` (the run's settings), `backup/`
(resume points), `logs/` (TensorBoard), `model.keras` and `metrics.json`. Started again with
the same `--output` after a kill, it resumes from the last saved step; with other settings it
stops and names them; a finished run is left as it is. Errors are one line on stderr (exit 2:
the command is wrong, 1: the run failed; `--debug` adds the traceback); see
docs/failure-model.md.

Expected result of the first command (2 CPU cores, 2026-11-26): the demo set is written, 2
epochs of the small CNN train in about 17 s (45 s for the whole command), and it prints a
validation accuracy near 0.98 (0.992) against a chance level of 0.25.
"""

import math
import os

from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem  # noqa: E402  (first: it imports TensorFlow without its banner)
from tfmem import cli, finetune  # noqa: E402

flags.DEFINE_string("model", "small-cnn", "A name of tfmem.models.MODELS.")
flags.DEFINE_enum(
    "task", None, list(finetune.TASKS), "'segmentation': a class per pixel (a segmentation "
    "--model: unet, tiramisu-*; its loss skips the masks' ignore value; validation reports "
    "mean IoU); 'classification': a label per image. Default: the task of the --data set's "
    "manifest, else classification (--data demo then writes the shapes with their masks).")
flags.DEFINE_string(
    "data", "demo", "'demo' (the embedded demo set, written under --output), a directory of "
    "TFRecords, or a glob such as 'gs://bucket/train-*.tfrec'.")
flags.DEFINE_string(
    "validation_data", None, "TFRecords to evaluate on (with --data demo: the demo's "
    "held-out set).")
flags.DEFINE_integer(
    "num_classes", None, "Classes, for data without a tfmem manifest.json.", lower_bound=1)
flags.DEFINE_integer(
    "num_examples", None, "Training examples to use, for data without a manifest.json "
    "(default: all the records, counted on a local disk; required for gs://).", lower_bound=1)
flags.DEFINE_integer(
    "global_batch_size", None, "Samples per optimizer update, over all replicas (default: 64; "
    "16 for the segmentation demo).", lower_bound=1)
flags.DEFINE_string(
    "accumulation_steps", "auto", "'auto' (the planner picks the largest micro-batch that "
    "fits) or a number k of micro-batches per global batch.")
flags.DEFINE_enum(
    "loss", "cross-entropy", list(finetune.LOSSES), "Segmentation: 'cross-entropy' (per "
    "pixel, over the pixels that have a class), 'dice' (each image's Dice loss over the "
    "classes, averaged over the images) or 'cross-entropy+dice' (each image's mean "
    "cross-entropy plus its Dice loss, averaged over the images).")
flags.DEFINE_integer("epochs", None, "Training epochs (default: 2; 1 for the segmentation "
                     "demo).", lower_bound=1)
flags.DEFINE_string(
    "image_size", None, "One number (square) or height,width, e.g. 360,480; default: the "
    "size of the --data set's images (its manifest, where they share one), else the model's "
    "training size (the demo set's 32 for --data demo).")
flags.DEFINE_enum(
    "precision", "auto", ["auto", "float32", "mixed_float16", "mixed_bfloat16"],
    "'auto': bf16 on TPU, fp16 on GPUs with compute capability >= 7, float32 on CPU.")
flags.DEFINE_string("weights", None, "Local weights file (nothing is downloaded).")
flags.DEFINE_bool(
    "freeze_backbone", False, "Train only the new head (transfer learning); default trains "
    "every layer (full fine-tuning, which needs gradients and optimizer slots for all).")
flags.DEFINE_enum("optimizer", "adam", list(finetune.OPTIMIZERS), "Optimizer.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate (finite, > 0).")
flags.DEFINE_string("output", None, "Run directory (default runs/<model>); a run "
                              "started there before resumes if its settings are the same.")
flags.DEFINE_bool(
    "overwrite", False, "Discard the run in --output (resume point, logs, model, metrics) "
    "and start it again from the beginning.")
flags.DEFINE_bool(
    "skip_corrupt", False, "Skip records that cannot be read (damaged shards, broken images) "
    "instead of stopping; each is named on stderr, and a summary per shard ends the run.")
flags.DEFINE_string(
    "device", None, "Plan for this device instead of the detected one (e.g. v100-32gb, "
    "tpu-v3-8; see tfmem.runtime.devices.ACCELERATORS). Only with --dry-run.")
flags.DEFINE_enum("prefer", None, ["tpu", "gpu", "cpu"], "Force a device kind.")
flags.DEFINE_bool(
    "allow_over_budget", False, "Train even when the plan exceeds the memory budget.")
flags.DEFINE_bool("dry_run", False, "Build the model, print its parameters and "
                             "the memory plan, train nothing.")
flags.DEFINE_bool(
    "compile", True, "A dry run on JAX (KERAS_BACKEND=jax) for a TPU or GPU --device, where "
    "its compiler is installed (libtpu; JAX's CUDA plugin, no GPU needed): check the split "
    "with XLA's own figure of the step one replica runs, compiled here ahead of time (for a "
    "large model, minutes and gigabytes of RAM); --nocompile: the plan alone.")
flags.DEFINE_integer(
    "save_every_steps", None, "Save a resume point every this many updates (default: 4 "
    "times per epoch).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of weights, shuffling and augmentation.",
                     lower_bound=0, upper_bound=2**32 - 1)
flags.DEFINE_bool(
    "deterministic", False, "Deterministic ops (slower): a resumed run then ends with exactly "
    "the weights of an uninterrupted one.")
flags.DEFINE_string(
    "memory_limit", "auto", "The most RAM (and swap) the training process may hold: 'auto' "
    "(80% of the RAM available at the start), 'none', or a size such as 3GB. Reaching it stops "
    "that process; training resumes from its last resume point with half the micro-batch and "
    "twice the accumulation steps (the same global batch), at micro-batch 1 with "
    "--rematerialize full.")
flags.DEFINE_string(
    "rematerialize", None, "Recompute activations in the backward pass instead of keeping "
    "them: less memory per sample for about one more forward pass; exact. 'full': the whole "
    "model in segments; 'auto': only as much as the micro-batch needs to fit; 'none' (the "
    "default); or comma-separated layer names and first:last layer ranges "
    "(docs/rematerialization.md).")
flags.DEFINE_integer(
    "max_image_pixels", tfmem.ReaderOptions.max_image_pixels, "The most pixels (height × "
    "width) an image may have: larger ones in the data are refused by their header before "
    "decoding (named by shard and record), and so is a larger --image-size.", lower_bound=1)
flags.DEFINE_bool(
    "verbose", False, "Print the whole environment table (default: one line of it).")
flags.DEFINE_bool(
    "validation_tiles", False, "Segmentation: validate at the validation images' own size "
    "by tiles of the training size even where whole images fit (default: whole images where "
    "a forward pass of a micro-batch of them fits the plan, else tiles).")
flags.register_validator(
    "learning_rate", lambda value: math.isfinite(value) and value > 0,
    "the learning rate must be a finite number > 0, e.g. --learning-rate=1e-3")
flags.register_validator(
    "accumulation_steps", lambda value: value == "auto" or (value.isdigit() and int(value) > 0),
    "--accumulation-steps must be 'auto' or a positive int, e.g. --accumulation-steps=4")




def config_from_flags() -> finetune.FinetuneConfig:
    """The flags' values as the run's settings (each flag is the field of the same name)."""
    values = {field: flags.FLAGS[field].value
              for field in finetune.FinetuneConfig.__dataclass_fields__}
    steps = values["accumulation_steps"]
    values["accumulation_steps"] = steps if steps == "auto" else int(steps)  # validated above
    return finetune.FinetuneConfig(**values)


def main(argv):
    del argv
    finetune.run(config_from_flags())


if __name__ == "__main__":
    cli.run(main, when_stopped="start the same command again to resume from its last resume "
                               "point")
