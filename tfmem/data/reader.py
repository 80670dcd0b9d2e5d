"""The streaming reader: `image_dataset` turns TFRecord shards into batches of images.

Nothing here holds the dataset in memory: files are listed, read in parallel by an
`interleave`, and each record is parsed, decoded and resized on the fly. Memory is bounded by
three options, whatever the size of the set: `prefetch_batches` (decoded batches waiting,
plus the one being built), `shuffle_buffer_size` (*encoded* records) and `num_parallel_reads`
(open shards, each holding a few dozen encoded records).

The data is checked, not trusted (see `integrity`): shards against their manifest before the
first batch, each shard's bytes and record count as it streams, each record's image and label
as it is decoded; whatever fails is named by shard and record.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import NamedTuple

from tfmem._tf import tf

from tfmem.data import augment, integrity
from tfmem.data import manifest as manifest_lib
from tfmem.data import pipeline
from tfmem.data import schema as schema_lib
from tfmem.data import tfrecords
from tfmem.data.options import ReaderOptions, with_reader_options
from tfmem.data.pipeline import auto_shard_policy, num_workers_from_environment  # noqa: F401


def _glob(path_or_pattern: str) -> list[str]:
    if tf.io.gfile.isdir(path_or_pattern):
        names = [n for n in tf.io.gfile.listdir(path_or_pattern)
                 if not n.startswith(".") and n != manifest_lib.MANIFEST_NAME]
        files = [os.path.join(path_or_pattern, n) for n in sorted(names)]
        files = [f for f in files if not tf.io.gfile.isdir(f)]
        what = "TFRecord files in the directory"
    else:
        files = sorted(tf.io.gfile.glob(path_or_pattern))
        what = "files matching the pattern"
    if not files:
        raise ValueError(
            f"Found no {what} {path_or_pattern!r}. Expected a directory written by "
            "`tfmem.write_image_tfrecords`, a directory of TFRecord shards, or a glob such as "
            "'/data/train/*.tfrecord'. Check the path (and that the data is attached/mounted)."
        )
    return files


def _manifest_files(path_or_pattern: str, manifest: manifest_lib.Manifest) -> list[str]:
    """The manifest's shards, or those a glob picks among them."""
    if tf.io.gfile.isdir(path_or_pattern):
        return manifest.files
    listed = {os.path.basename(f): f for f in manifest.files}
    matched = _glob(path_or_pattern)
    unlisted = [f for f in matched if os.path.basename(f) not in listed]
    if unlisted:  # e.g. the old shards of a replacement that was killed before its cleanup
        print(f"tfmem: reading the {len(matched) - len(unlisted)} shard(s) of "
              f"{path_or_pattern!r} that its {manifest_lib.MANIFEST_NAME} lists; ignoring "
              f"{len(unlisted)} other file(s) such as {os.path.basename(unlisted[0])!r}",
              file=sys.stderr)
    files = [f for f in matched if os.path.basename(f) in listed]
    if not files:
        raise ValueError(f"none of the files matching {path_or_pattern!r} is a shard its "
                         f"{manifest_lib.MANIFEST_NAME} lists; pass the set's directory instead")
    return files


def _first_features(files: list[str], skip_corrupt: bool) -> tuple[str, dict]:
    """The first record's features: of the first file, or with `skip_corrupt` the first
    readable one."""
    candidates = files if skip_corrupt else files[:1]
    for path in candidates[:-1]:
        try:
            return path, schema_lib.read_first_record(path)
        except ValueError:
            continue
    return candidates[-1], schema_lib.read_first_record(candidates[-1])


class _Source:
    """Files to read, with their sizes, record counts (when a manifest says) and schema."""

    def __init__(self, path_or_pattern: str, schema: schema_lib.Schema | None,
                 num_classes: int | None, skip_corrupt: bool,
                 log: integrity.SkippedRecords | None):
        self.manifest = None
        if tf.io.gfile.exists(os.path.join(path_or_pattern, "dataset_info.json")):
            raise ValueError(
                f"{path_or_pattern!r} is a dataset prepared by tensorflow-datasets; read it with "
                f"`tfmem.tfds_image_dataset({path_or_pattern!r}, split='train', ...)`."
            )
        if manifest_lib.has_manifest(path_or_pattern):
            self.manifest = manifest_lib.read_manifest(path_or_pattern)
            self.files = integrity.check_shards(
                self.manifest, _manifest_files(path_or_pattern, self.manifest), skip_corrupt, log)
        else:
            self.files = _glob(path_or_pattern)
        counts = {}
        if self.manifest is not None:
            counts = {s.name: s.num_examples for s in self.manifest.shards}
        self.counts = [counts.get(os.path.basename(f), integrity.UNKNOWN) for f in self.files]
        self.sizes = [tf.io.gfile.stat(f).length for f in self.files]
        first, features = _first_features(self.files, skip_corrupt)
        if schema is None and self.manifest is not None:
            schema = self.manifest.schema
        if schema is None:
            schema = schema_lib.detect_schema(first, features)
            if tuple(features) == tfrecords.FEATURE_KEYS:
                raise ValueError(
                    f"{path_or_pattern!r} holds tfmem shards but no {manifest_lib.MANIFEST_NAME}: "
                    "the write that made them did not finish, so the set may be incomplete. "
                    "Write it again, or pass `schema=tfmem.Schema(image_key='image', "
                    "label_key='label', id_key='id')` to read these shards anyway."
                )
        self.schema = schema
        self.spec = schema.feature_spec(features, first)
        class_names = schema.class_names or (self.manifest and self.manifest.class_names)
        known = len(class_names) if class_names else None
        if num_classes is not None:
            if isinstance(num_classes, bool) or not isinstance(num_classes, int) or (
                    num_classes < 1):
                raise ValueError(f"`num_classes` must be a positive int, got {num_classes!r}.")
            if known is not None and known != num_classes:
                raise ValueError(
                    f"num_classes={num_classes}, but {path_or_pattern!r} has {known} classes "
                    f"({', '.join(class_names[:5])}{', ...' if known > 5 else ''}); pass "
                    f"num_classes={known} (`--num-classes {known}`) or leave it out")
        self.num_classes = num_classes if num_classes is not None else known


def count_records(path_or_pattern: str | os.PathLike) -> int | None:
    """Complete records in TFRecord files (a directory, a file or a glob), from their framing.

    Reads 8 bytes per record and skips the payloads, so it is quick on a local disk. Returns
    None for remote files (gs://...), where a seek per record is slow; a tfmem set's manifest
    gives the count without reading at all. A record cut by the end of its file is not
    counted (`image_dataset` names it when it reads there).

    Raises:
        ValueError: no files there, or files that are not TFRecords (bytes, but no complete
            record), each named.

    Example:
        >>> tfmem.count_records("/kaggle/input/flowers/train/*.tfrec")  # doctest: +SKIP
        12753
    """
    files = _glob(os.fspath(path_or_pattern))
    counts = [integrity.count_records(path) for path in files]
    foreign = [path for path, count in zip(files, counts)
               if count == 0 and tf.io.gfile.stat(path).length > 0]
    if foreign:
        names = ", ".join(os.path.basename(path) for path in foreign[:5])
        raise ValueError(
            f"{len(foreign)} of the {len(files)} file(s) of {os.fspath(path_or_pattern)!r} are "
            f"not TFRecord files: {names}{', ...' if len(foreign) > 5 else ''} "
            f"{'holds' if len(foreign) == 1 else 'hold'} bytes but no complete record. "
            "Expected TFRecord files of tf.train.Example: a directory written by "
            "`tfmem.write_image_tfrecords` (scripts/make_tfrecords.py), or a glob of the shards "
            "alone, such as '/data/train-*.tfrec'")
    return None if None in counts else sum(counts)


def first_image_sizes(path_or_pattern: str | os.PathLike,
                      num_files: int = 4) -> list[tuple[int, int]]:
    """`(height, width)` of the first record's image in each of the first `num_files` files,
    read from the image headers (an image without a readable size is left out).

    Raises:
        ValueError: no files, a file without a readable record, or a layout whose image
            `detect_schema` cannot tell.
    """
    sizes = []
    for path in _glob(os.fspath(path_or_pattern))[:num_files]:
        features = schema_lib.read_first_record(path)
        image = features[schema_lib.detect_schema(path, features).image_key].first
        try:
            height, width = pipeline.encoded_size(image).numpy().tolist()
        except tf.errors.OpError:  # a damaged JPEG header: reading the record names it
            continue
        if height > 0:
            sizes.append((height, width))
    return sizes


def inspect_tfrecords(path_or_pattern: str | os.PathLike) -> str:
    """Describes TFRecord files: their feature keys and types, the first record's image shape,
    and the schema `image_dataset` would use (or why it cannot tell).

    Example:
        >>> print(tfmem.inspect_tfrecords("/kaggle/input/flowers/train/*.tfrec"))  # doctest: +SKIP
        16 file(s), e.g. /kaggle/input/flowers/train/00-224x224-798.tfrec
        Features of the first record:
          'class': int64[1] e.g. 57
          'id': bytes[1] e.g. b'338ab7bac'
          'image': bytes[1] (jpeg image, 24781 bytes)
          'image' decodes to an image of shape (224, 224, 3)
        Schema: Schema(image_key='image', label_key='class', id_key='id', ...)
    """
    path_or_pattern = os.fspath(path_or_pattern)
    files = _glob(path_or_pattern)
    features = schema_lib.read_first_record(files[0])
    lines = [f"{len(files)} file(s), e.g. {files[0]}", schema_lib.describe_features(features)]
    for key, info in features.items():
        if info.kind == "bytes" and schema_lib.image_format(info.first or b""):
            height, width = pipeline.encoded_size(info.first).numpy().tolist()
            if height * width > ReaderOptions.max_image_pixels:  # not decoded: named by size
                lines.append(f"  {key!r} is an image of {width}×{height} pixels (its header), "
                             "over the default max_image_pixels: not decoded")
                continue
            shape = tf.io.decode_image(info.first, expand_animations=False).shape
            lines.append(f"  {key!r} decodes to an image of shape {tuple(shape)}")
    if manifest_lib.has_manifest(path_or_pattern):
        manifest = manifest_lib.read_manifest(path_or_pattern)
        schema = manifest.schema
        task = ("" if schema.mask_key is None else ", segmentation (multi-label masks)"
                if schema.multi_label else f", segmentation (ignore value {schema.ignore_value})")
        lines.append(f"Manifest: {manifest.num_examples} examples, {manifest.num_classes} "
                     f"classes{task}")
        lines.append(f"Schema: {manifest.schema}")
        return "\n".join(lines)
    try:
        lines.append(f"Schema: {schema_lib.detect_schema(files[0], features)}")
    except ValueError as error:
        lines.append(f"Schema: not detected automatically.\n{error}")
    return "\n".join(lines)


@with_reader_options
def image_dataset(
    path_or_pattern: str | os.PathLike,
    *,
    schema: schema_lib.Schema | None = None,
    num_classes: int | None = None,
    skip_corrupt: bool = False,
    skipped: integrity.SkippedRecords | None = None,
    **options,
) -> tf.data.Dataset:
    """A streaming `tf.data.Dataset` of `(images, labels)` batches from TFRecord shards.

    The pipeline: shard files (shuffled when training) → parallel `interleave` of
    `TFRecordDataset`s, each shard checked → shuffle buffer of encoded records (training) →
    parse, decode, resize, label check (parallel) → optional flip → batch → prefetch. Order is
    deterministic for evaluation and not when training (faster: whichever file is ready first
    is read), except with several JAX processes: then, when training under `tfmem.detect()`,
    each process reads only its part of every global batch (`batch_size ÷ processes` rows),
    by shard when each process's shards hold an epoch, by record otherwise (all read one
    order from one `seed`, and each decodes its rows); docs/multi-host.md. Memory does not grow with the set: it is set by `prefetch_batches`,
    `shuffle_buffer_size` and `num_parallel_reads`.

    Args:
        path_or_pattern: a directory written by `write_image_tfrecords` (its manifest gives
            the shards and schema), a directory of foreign TFRecords, or a glob of shards.
        schema: feature keys of foreign records; default: from the manifest, else detected
            from the first record (see `tfmem.detect_schema`).
        num_classes: labels (mask values other than the ignore value) must lie in
            `[0, num_classes)`; default: the manifest's or the schema's class count (then
            giving another one is an error).
        skip_corrupt: skip what cannot be read (a truncated or corrupted shard's rest, a
            missing shard, a record that cannot be decoded) instead of raising an error that
            names it; each skip is printed on stderr, naming the shard and record.
        skipped: with `skip_corrupt`, a `tfmem.SkippedRecords` that also collects the skips,
            per shard (e.g. to print `skipped.summary()` after training).
        **options: the `tfmem.ReaderOptions` fields: `image_size`, `batch_size` and
            `training` (required), `data_range`, `channels`, `shuffle_buffer_size`,
            `augment`, `cache`, `drop_remainder`, `num_parallel_reads`, `prefetch_batches`,
            `seed`, `num_workers`, `input_context`.

    Returns:
        `(images, labels)`: float32 `(batch, height, width, channels)` in `data_range` and
        int32 `(batch,)`. Segmentation sets (a mask per record: tfmem's, or DeepLab's layout)
        give `(images, masks)`: masks int32 `(batch, height, width)` of class indices and
        the ignore value (resized nearest-neighbour), or `(batch, height, width, classes)`
        of 0/1 for multi-label masks. Unlabelled sets give `(images, ids)`, or images alone
        without ids.

    Raises:
        ValueError: no files, unknown keys, an option out of range, a manifest set whose
            shards are missing or of another size. While reading,
            `tf.errors.InvalidArgumentError` names the shard (and record) of damaged data or
            of a label or mask value outside the classes (unless `skip_corrupt`, for damage).

    Example:
        >>> train = tfmem.image_dataset("/data/flowers/train", image_size=(224, 224),
        ...                             batch_size=64, training=True, data_range=(0, 1))
        ...                                                             # doctest: +SKIP
        >>> model.fit(train, epochs=3)                                  # doctest: +SKIP
    """
    options = ReaderOptions.from_arguments("image_dataset", options)
    if skipped is not None and not skip_corrupt:
        raise ValueError("`skipped` collects what skip_corrupt=True skips; pass "
                         "skip_corrupt=True with it, or leave it out.")
    source = _Source(os.fspath(path_or_pattern), schema, num_classes, bool(skip_corrupt),
                     skipped)
    schema = source.schema
    if options.training and not schema.labelled:
        raise ValueError(
            f"{path_or_pattern!r} has no labels ({schema}); it can be read for prediction "
            "(training=False), not for training."
        )
    num_files = len(source.files)
    files = tf.data.Dataset.from_tensor_slices(
        (source.files, tf.constant(source.sizes, tf.int64), tf.constant(source.counts, tf.int64),
         tf.range(num_files, dtype=tf.int32)))
    share = _share(files, source.counts, options)
    files = share.files
    if options.training:
        # Seeded even when `seed` is None: every worker must see the same file order for FILE
        # sharding to split it; the per-epoch reshuffle still changes it every epoch.
        files = files.shuffle(num_files, seed=0 if options.seed is None else options.seed)
    # tf.data opens 2 × cycle_length more shards ahead of the cycle (the parallel interleave's
    # default `prefetch_input_elements`), each holding its block of records: a set with fewer
    # shards than 3 × num_parallel_reads never fills that window (less memory), a bigger one
    # does, and no set goes beyond it.
    records = files.interleave(
        lambda f, size, count, shard: integrity.checked_records(
            f, shard, size, count, bool(skip_corrupt), skipped),
        cycle_length=min(options.num_parallel_reads, num_files),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=pipeline.in_order(options),
    )
    workers = options.num_workers or num_workers_from_environment()
    if (integrity.UNKNOWN not in share.counts and not skip_corrupt
            and (options.input_context or workers == 1)):
        # A known length lets Keras show steps per epoch and, under MirroredStrategy, end the
        # epoch without the extra empty step it may run on a dataset of unknown length.
        # (Not under multi-worker auto-sharding: that splits the files after this point.)
        records = records.apply(tf.data.experimental.assert_cardinality(sum(share.counts)))
    if share.record_shard is not None:
        records = records.shard(*share.record_shard)
    transform = augment.batch_transform(schema, options, source.num_classes)
    spec, names = source.spec, tf.constant(source.files)
    decode_batch = pipeline.decode_fn(
        schema, parse=lambda record: tf.io.parse_single_example(record, spec),
        label_is_string=schema.label_key is not None and spec[schema.label_key].dtype == tf.string,
        num_classes=source.num_classes, options=options,
        describe=lambda shards, indices: (tf.gather(names, shards), indices),
        skip_corrupt=bool(skip_corrupt), log=skipped)
    dataset = pipeline.batched(records, decode_batch,
                               dataclasses.replace(options, batch_size=share.batch_size),
                               bool(skip_corrupt), rows=share.rows, transform=transform)
    if share.split is not None and integrity.UNKNOWN not in source.counts:
        # Every process takes the same number of steps (one more alone would wait forever).
        dataset = dataset.take(sum(source.counts) // options.batch_size)
    return dataset.with_options(pipeline.dataset_options(options, num_files,
                                                         split=share.split is not None))


class _Share(NamedTuple):
    """What one input pipeline reads of a set: its shards (`files`, their record `counts`),
    its `batch_size`, and how it splits further. `record_shard` is `(pipelines, index)` when
    the pipelines split by record; `split` is `(processes, index)` for several JAX processes
    (`rows` the same when each decodes only its rows of every record)."""

    files: tf.data.Dataset
    counts: list
    batch_size: int
    record_shard: tuple[int, int] | None
    split: tuple[int, int] | None
    rows: tuple[int, int] | None


def _share(files: tf.data.Dataset, counts: list, options: ReaderOptions) -> _Share:
    """This pipeline's share of the shards and of the global batch: per replica under a
    `tf.distribute.InputContext`, per JAX process when training under several."""
    num_files, record_shard, batch_size = len(counts), None, options.batch_size
    context = options.input_context
    if context is not None:
        # Each replica gets its share of the global batch (raises if it does not divide).
        batch_size = context.get_per_replica_batch_size(batch_size)
        pipelines, index = context.num_input_pipelines, context.input_pipeline_id
        if pipelines == 1:
            pass  # one pipeline (one worker) feeds all its replicas: nothing to split
        elif num_files >= pipelines:
            files = files.shard(pipelines, index)
            counts = counts[index::pipelines]
        else:
            record_shard = (pipelines, index)
    # Training only: evaluation reads every global batch in each process, and Keras splits it.
    split = None if context is not None or not options.training else pipeline.process_split()
    rows = None
    if split is not None:  # several JAX processes: each reads its part of every global batch
        processes, index = split
        if batch_size % processes:
            raise ValueError(
                f"batch_size={batch_size} does not split over {processes} processes; use a "
                f"multiple of {processes}")
        batch_size //= processes
        if _enough_in_each(counts, processes, batch_size):
            files = files.shard(processes, index)  # by shard: each reads only its files
            counts = counts[index::processes]
        else:  # by record: each reads every record and decodes only its rows
            rows = split
    return _Share(files, counts, batch_size, record_shard, split, rows)


def _enough_in_each(counts: list[int], processes: int, per_process_batch: int) -> bool:
    """Whether sharding the files by process leaves each process the batches of a full epoch
    (`total // global batch`): a process that ran out first would leave the others waiting.
    Unknown counts, or fewer files than processes, split by record instead."""
    if len(counts) < processes or integrity.UNKNOWN in counts:
        return False
    steps = sum(counts) // (per_process_batch * processes)
    return all(sum(counts[index::processes]) >= steps * per_process_batch
               for index in range(processes))
