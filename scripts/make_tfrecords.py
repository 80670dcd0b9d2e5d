r"""Writes an image set to sharded TFRecords, or inspects existing ones.

    python scripts/make_tfrecords.py --source photos/ --output /data/photos-tfrecords
    python scripts/make_tfrecords.py --source demo --output /tmp/demo --num_examples 2048
    python scripts/make_tfrecords.py --source tfds:tf_flowers --split train --output /data/flowers
    python scripts/make_tfrecords.py --source voc/images --masks voc/masks --output /data/voc
    python scripts/make_tfrecords.py --source clouds/train_images --rle-csv clouds/train.csv \
        --output /data/clouds
    python scripts/make_tfrecords.py --inspect '/kaggle/input/flowers/*.tfrec'

`--source` is an image folder laid out `root/<class_name>/<image>.{jpg,jpeg,png}`, `demo`
(the embedded shapes set; `--task segmentation` draws the shapes as masks) or `tfds:NAME` (a
tfds dataset already prepared in `--data_dir`; nothing is downloaded). With `--masks DIR`
(PNG masks of class indices, grey or palette, named as the images) or `--rle-csv FILE`
(Kaggle's run-length-encoded masks) `--source` is a folder of images and the set is a
segmentation set (DeepLab's record keys; `--ignore-value`, default 255, marks pixels without
a class). Prints a progress bar and a summary line, e.g. on 2 CPU cores:
`wrote 2048 examples in 6 shards, 5.9 MB, in 4.1 s to /tmp/demo`.
`--inspect PATH` prints the feature keys, types and the first record's image shape of any
TFRecord files, and the schema tfmem detects for them. `--overwrite` replaces a set by writing
the new one beside it and switching at the end: a kill at any moment leaves one complete set.
Errors are one line on stderr (exit 2: the command is wrong, 1: the write failed; `--debug`
adds the traceback).
"""

import os
import sys
import time

from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem  # noqa: E402
from tfmem import cli  # noqa: E402

_SOURCE = flags.DEFINE_string("source", None, "Image folder, 'demo' or 'tfds:NAME'.")
_OUTPUT = flags.DEFINE_string("output", None, "Directory for the shards and manifest.json.")
_INSPECT = flags.DEFINE_string("inspect", None, "TFRecord file, directory or glob to describe.")
_SHARD_SIZE_MB = flags.DEFINE_float("shard_size_mb", 128, "Shard size in MB (10**6 bytes).")
flags.register_validator("shard_size_mb", lambda value: value > 0,
                         "--shard-size-mb must be a number > 0, e.g. --shard-size-mb=128")
_ENCODING = flags.DEFINE_enum("encoding", "png", ["png", "jpeg"], "How arrays are stored.")
_SKIP_UNREADABLE = flags.DEFINE_bool(
    "skip_unreadable", False, "Skip and count bad images (and files that are not regular "
    "files: FIFOs, devices, broken links).")
_ALLOW_EMPTY_CLASSES = flags.DEFINE_bool(
    "allow_empty_classes", False, "Keep a class folder without images as a class (warned) "
    "instead of stopping.")
_MAX_IMAGE_PIXELS = flags.DEFINE_integer(
    "max_image_pixels", tfmem.ReaderOptions.max_image_pixels, "The most pixels (height × "
    "width, from the header) an image may have; a larger one is unreadable, not decoded.",
    lower_bound=1)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a set already in --output.")
_MASKS = flags.DEFINE_string("masks", None, "Segmentation: folder of PNG masks (class indices, "
                             "grey or palette), one per image of --source, same file names.")
_RLE_CSV = flags.DEFINE_string("rle_csv", None, "Segmentation: Kaggle CSV of run-length-encoded "
                               "masks of the images of --source (an image without a row has an "
                               "empty mask unless the CSV has rows of empty EncodedPixels).")
_IGNORE_VALUE = flags.DEFINE_string("ignore_value", "255", "Segmentation: the mask value of "
                                    "pixels without a class, or 'none'.")
_CLASS_NAMES = flags.DEFINE_list("class_names", None, "Segmentation: class names in the order of "
                                 "the mask values; default: '0' .. the largest value.")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 2048, "Demo set: number of images.",
                                     lower_bound=1)
_IMAGE_SIZE = flags.DEFINE_string("image_size", "32", "Demo set: image size, one number "
                                  "(square) or height,width.")
_TASK = flags.DEFINE_enum("task", "classification", ["classification", "segmentation"],
                          "Demo set: a label per image, or a mask (the shapes drawn as classes).")
_SEED = flags.DEFINE_integer("seed", 0, "Demo set pixels / folder writing order.")
_SPLIT = flags.DEFINE_string("split", "train", "tfds: split to write.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "tfds: where the dataset is prepared.")


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int, num_bytes: int, total: int | None, force=False) -> None:
        now = time.perf_counter()
        if now - self.last < 0.2 and done != total and not force:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        if total:
            filled = int(30 * done / total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}"
        else:
            bar = f"{done} examples"
        sys.stderr.write(f"\r{bar} {num_bytes / 1e6:.1f} MB {rate:.0f} ex/s")
        sys.stderr.flush()


def _ignore_value() -> int | None:
    text = _IGNORE_VALUE.value.strip().lower()
    if text == "none":
        return None
    if not text.isdigit() or int(text) > 255:
        raise cli.UsageError(f"--ignore-value {_IGNORE_VALUE.value!r} is not a mask value: pass "
                             "a number in 0..255 (e.g. --ignore-value 255) or 'none'")
    return int(text)


def write(source: str, output: str, progress: ProgressBar) -> tfmem.Manifest:
    if _MASKS.value and _RLE_CSV.value:
        raise cli.UsageError("give --masks (a folder of PNG masks) or --rle-csv (a CSV of "
                             "run-length-encoded masks), not both")
    targets = _MASKS.value or _RLE_CSV.value
    if source == "demo":
        if targets:
            raise cli.UsageError("the demo set draws its own masks: pass --task segmentation "
                                 "instead of --masks/--rle-csv")
        # The demo's own small shards unless --shard_size_mb is given.
        size = {"shard_size_mb": _SHARD_SIZE_MB.value} if _SHARD_SIZE_MB.present else {}
        return tfmem.make_demo_dataset(output, num_examples=_NUM_EXAMPLES.value,
                                       image_size=cli.image_size(_IMAGE_SIZE.value),
                                       seed=_SEED.value, overwrite=_OVERWRITE.value,
                                       progress=progress, task=_TASK.value, **size)
    if targets:
        return tfmem.write_image_tfrecords(
            (source, targets), output, shard_size_mb=_SHARD_SIZE_MB.value,
            class_names=_CLASS_NAMES.value, seed=_SEED.value,
            skip_unreadable=_SKIP_UNREADABLE.value, overwrite=_OVERWRITE.value,
            progress=progress, max_image_pixels=_MAX_IMAGE_PIXELS.value,
            ignore_value=_ignore_value())
    if source.startswith("tfds:"):
        import tensorflow_datasets as tfds

        from tfmem.data.tfds_data import tfds_builder

        builder = tfds_builder(source.removeprefix("tfds:"), data_dir=_DATA_DIR.value)
        dataset = builder.as_dataset(split=_SPLIT.value,
                                     decoders={"image": tfds.decode.SkipDecoding()})
        return tfmem.write_image_tfrecords(
            dataset, output, shard_size_mb=_SHARD_SIZE_MB.value,
            class_names=builder.info.features["label"].names, overwrite=_OVERWRITE.value,
            progress=progress, max_image_pixels=_MAX_IMAGE_PIXELS.value)
    return tfmem.write_image_tfrecords(
        source, output, shard_size_mb=_SHARD_SIZE_MB.value, encoding=_ENCODING.value,
        seed=_SEED.value, skip_unreadable=_SKIP_UNREADABLE.value, overwrite=_OVERWRITE.value,
        progress=progress, allow_empty_classes=_ALLOW_EMPTY_CLASSES.value,
        max_image_pixels=_MAX_IMAGE_PIXELS.value)


def main(argv):
    del argv
    if _INSPECT.value:
        with cli.usage_errors():  # nothing there: the path is wrong
            print(tfmem.inspect_tfrecords(_INSPECT.value))
        return
    if not _SOURCE.value or not _OUTPUT.value:
        raise cli.UsageError("give --source and --output (or --inspect PATH)")
    start = time.perf_counter()
    progress = ProgressBar()
    with cli.usage_errors():  # a missing folder, a set already there, bad labels
        manifest = write(_SOURCE.value, _OUTPUT.value, progress)
    num_read = manifest.num_examples + len(manifest.skipped)
    progress(manifest.num_examples, manifest.num_bytes, num_read, force=True)
    sys.stderr.write("\n")
    skipped = f", skipped {len(manifest.skipped)} unreadable file(s)" if manifest.skipped else ""
    print(f"wrote {manifest.num_examples} examples in {len(manifest.shards)} shards, "
          f"{manifest.num_bytes / 1e6:.1f} MB, in {time.perf_counter() - start:.1f} s to "
          f"{manifest.directory}{skipped}")


if __name__ == "__main__":
    cli.run(main)
