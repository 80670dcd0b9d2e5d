"""The streaming reader: `image_dataset` turns TFRecord shards into batches of images.

Nothing here holds the dataset in memory: files are listed, read in parallel by an
`interleave`, and each record is parsed, decoded and resized on the fly. Memory is bounded by
three arguments, whatever the size of the set: `prefetch_batches` (decoded batches waiting,
plus the one being built), `shuffle_buffer_size` (*encoded* records) and `num_parallel_reads`
(open shards, each holding a few dozen encoded records).

Each shard is checked while it streams: the bytes of the records read must add up to the
file's size, so a truncated or corrupted shard (bad CRC) is caught and named instead of
silently ending an epoch early.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from tfmem._tf import tf

from tfmem.data import manifest as manifest_lib
from tfmem.data import schema as schema_lib
from tfmem.data import tfrecords
from tfmem.runtime.cluster import workers_in_tf_config

DATA_RANGES = ((0, 255), (0, 1))
_RECORD_FRAMING_BYTES = 16  # uint64 length + CRC of the length + CRC of the data
_UNKNOWN = -1  # expected record count of a foreign shard (no manifest)
_CHECK_BLOCK = 32  # records counted per step of the shard check


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


class _Source:
    """Files to read, with their sizes and (when a manifest says) record counts, and schema."""

    def __init__(self, path_or_pattern: str, schema: schema_lib.Schema | None):
        self.manifest = None
        if tf.io.gfile.exists(os.path.join(path_or_pattern, "dataset_info.json")):
            raise ValueError(
                f"{path_or_pattern!r} is a dataset prepared by tensorflow-datasets; read it with "
                f"`tfmem.tfds_image_dataset({path_or_pattern!r}, split='train', ...)`."
            )
        if manifest_lib.has_manifest(path_or_pattern):
            self.manifest = manifest_lib.read_manifest(path_or_pattern)
        if self.manifest is not None and tf.io.gfile.isdir(path_or_pattern):
            self.files = self.manifest.files
        else:
            self.files = _glob(path_or_pattern)
        counts = {}
        if self.manifest is not None:
            counts = {s.name: s.num_examples for s in self.manifest.shards}
        self.counts = [counts.get(os.path.basename(f), _UNKNOWN) for f in self.files]
        self.sizes = [tf.io.gfile.stat(f).length for f in self.files]
        features = schema_lib.read_first_record(self.files[0])
        if schema is None and self.manifest is not None:
            schema = self.manifest.schema
        if schema is None:
            schema = schema_lib.detect_schema(self.files[0], features)
            if tuple(features) == tfrecords.FEATURE_KEYS:
                raise ValueError(
                    f"{path_or_pattern!r} holds tfmem shards but no {manifest_lib.MANIFEST_NAME}: "
                    "the write that made them did not finish, so the set may be incomplete. "
                    "Write it again, or pass `schema=tfmem.Schema(image_key='image', "
                    "label_key='label', id_key='id')` to read these shards anyway."
                )
        self.schema = schema
        self.spec = schema.feature_spec(features, self.files[0])
        class_names = schema.class_names or (self.manifest and self.manifest.class_names)
        self.num_classes = len(class_names) if class_names else None


def _checked_records(filename, size, expected, skip_corrupt: bool) -> tf.data.Dataset:
    """The records of one shard, then a check that they covered the whole file."""
    # Counted in blocks of records: one scan step per block instead of per record cut the
    # check's cost from ~170 to ~20-40 µs a record (2 loaded cores), far below decoding
    # (~1 ms an image). Blocks stay small: each shard reader holds one.
    blocks = tf.data.TFRecordDataset(filename).ignore_errors().batch(_CHECK_BLOCK)
    # An end marker after the last block lets a `scan` compare bytes read with the file size:
    # a reader that stopped early (bad CRC, truncated record) read fewer bytes than the file.
    marked = blocks.map(lambda b: (b, False)).concatenate(
        tf.data.Dataset.from_tensors((tf.constant([], tf.string), True)))

    def step(state, element):
        num_bytes, num_records = state
        block, is_end = element
        num_bytes += tf.reduce_sum(tf.cast(tf.strings.length(block), tf.int64)
                                   + _RECORD_FRAMING_BYTES)
        num_records += tf.size(block, out_type=tf.int64)
        if is_end:  # autograph: a tf.cond, evaluated once per block
            damaged = num_bytes != size
            lost = tf.where(expected >= 0, tf.strings.as_string(expected - num_records),
                            "an unknown number of")
            message = tf.strings.join([
                "tfmem: shard ", filename, " is truncated or corrupted: its records stop at "
                "byte ", tf.strings.as_string(num_bytes), " of ", tf.strings.as_string(size),
                "; read ", tf.strings.as_string(num_records), " records, skipped ", lost,
                " record(s)."])
            if damaged and skip_corrupt:
                tf.print(message, output_stream=sys.stderr)
            elif damaged:
                tf.debugging.Assert(False, [message, "Write the shard again, or pass "
                                            "skip_corrupt=True to skip what cannot be read."])
        return (num_bytes, num_records), (block, is_end)

    initial = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
    return marked.scan(initial, step).filter(lambda b, is_end: not is_end).map(
        lambda b, is_end: b).unbatch()


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
            shape = tf.io.decode_image(info.first, expand_animations=False).shape
            lines.append(f"  {key!r} decodes to an image of shape {tuple(shape)}")
    if manifest_lib.has_manifest(path_or_pattern):
        manifest = manifest_lib.read_manifest(path_or_pattern)
        lines.append(f"Manifest: {manifest.num_examples} examples, {manifest.num_classes} classes")
        lines.append(f"Schema: {manifest.schema}")
        return "\n".join(lines)
    try:
        lines.append(f"Schema: {schema_lib.detect_schema(files[0], features)}")
    except ValueError as error:
        lines.append(f"Schema: not detected automatically.\n{error}")
    return "\n".join(lines)


def num_workers_from_environment() -> int:
    """Workers of a multi-worker cluster described by TF_CONFIG; 1 when there is none."""
    return workers_in_tf_config(os.environ.get("TF_CONFIG"))


def auto_shard_policy(num_files: int, num_workers: int) -> tf.data.experimental.AutoShardPolicy:
    """FILE when every worker gets at least one file, else DATA (each reads all, keeps 1/n).

    Example:
        >>> tfmem.auto_shard_policy(num_files=16, num_workers=4)
        <AutoShardPolicy.FILE: 1>
    """
    policy = tf.data.experimental.AutoShardPolicy
    return policy.FILE if num_files >= num_workers else policy.DATA


def image_dataset(
    path_or_pattern: str | os.PathLike,
    *,
    image_size: Sequence[int],
    batch_size: int,
    training: bool,
    data_range: tuple[float, float] = (0, 255),
    schema: schema_lib.Schema | None = None,
    channels: int = 3,
    shuffle_buffer_size: int = 1024,
    augment: bool = False,
    cache: bool = False,
    skip_corrupt: bool = False,
    drop_remainder: bool | None = None,
    num_parallel_reads: int = 4,
    prefetch_batches: int = 2,
    seed: int | None = None,
    num_workers: int | None = None,
    input_context: tf.distribute.InputContext | None = None,
) -> tf.data.Dataset:
    """A streaming `tf.data.Dataset` of `(images, labels)` batches from TFRecord shards.

    The pipeline: shard files (shuffled when training) → parallel `interleave` of
    `TFRecordDataset`s → shuffle buffer of encoded records (training) → parse, decode, resize
    (parallel) → optional flip → batch → prefetch. Order is deterministic for evaluation and
    not when training (faster: whichever file is ready first is read). Memory does not grow
    with the set: it is set by `prefetch_batches`, `shuffle_buffer_size` and
    `num_parallel_reads` (see each).

    Args:
        path_or_pattern: a directory written by `write_image_tfrecords` (its manifest gives
            the shards and schema), a directory of foreign TFRecords, or a glob of shards.
        image_size: `(height, width)` every image is resized to (bilinear).
        batch_size: examples per batch; with `input_context`, the *global* batch, divided
            among the replicas.
        training: shuffle, augment if asked, drop the last partial batch, non-deterministic.
        data_range: pixel range of the float32 images returned: `(0, 255)` or `(0, 1)`.
        schema: feature keys of foreign records; default: from the manifest, else detected
            from the first record (see `tfmem.detect_schema`).
        channels: channels of the decoded images (3 = RGB, 1 = grey).
        shuffle_buffer_size: encoded records in the shuffle buffer (memory ≈ this × the
            mean record size, e.g. 1024 × 110 KB for ImageNet JPEGs).
        augment: random left-right flips when training.
        cache: keep decoded, resized images in memory after the first epoch. Only for sets
            that fit in RAM (examples × height × width × channels × 4 bytes); it ends
            streaming, so it is off unless asked.
        skip_corrupt: on a truncated or corrupted shard, print what was skipped to stderr and
            go on, instead of raising an error that names the shard.
        drop_remainder: drop the last partial batch; default: `training` (static shapes, as
            TPUs need, and every step sees a full batch).
        num_parallel_reads: shards read at the same time. tf.data opens two more shards per
            read ahead of time, and each open shard holds ~35 encoded records and a 256 KB
            read buffer (≈ 1.7 MB with 42 KB JPEGs): ≈ 3 × this × 1.7 MB in all. 4 kept two
            cores decoding at full speed from a local disk; raise it for remote storage
            (GCS), where each read waits on the network.
        prefetch_batches: decoded batches prepared while the model trains on the current one
            (memory: this × batch × height × width × channels × 4 bytes, plus the batch being
            built). A fixed number bounds memory; `tf.data.AUTOTUNE` lets tf.data grow the
            buffer, which it does every time a full buffer drains (e.g. after each
            validation run) and never undoes.
        seed: seed of the shuffles (the file order always has one, so that all workers of
            a cluster shard the same file list).
        num_workers: workers of a multi-worker cluster, for the auto-shard policy (FILE when
            there are at least as many files as workers, else DATA); default: from TF_CONFIG.
        input_context: from `strategy.distribute_datasets_from_function`; the dataset then
            reads only its pipeline's part of the data and batches `batch_size / replicas`.

    Returns:
        `(images, labels)`: float32 `(batch, height, width, channels)` in `data_range` and
        int32 `(batch,)`. Unlabelled sets give `(images, ids)`, or images alone without ids.

    Raises:
        ValueError: no files, unknown keys, bad `data_range`, `num_parallel_reads` or
            `prefetch_batches`; reading a damaged shard raises
            `tf.errors.InvalidArgumentError` naming it (unless `skip_corrupt`).

    Example:
        >>> train = tfmem.image_dataset("/data/flowers/train", image_size=(224, 224),
        ...                             batch_size=64, training=True, data_range=(0, 1))
        ...                                                             # doctest: +SKIP
        >>> model.fit(train, epochs=3)                                  # doctest: +SKIP
    """
    if tuple(data_range) not in DATA_RANGES:
        raise ValueError(f"`data_range` must be one of {DATA_RANGES}, got {data_range!r}.")
    if len(image_size) != 2:
        raise ValueError(f"`image_size` must be (height, width), got {image_size!r}.")
    check_reader_arguments(num_parallel_reads, prefetch_batches)
    source = _Source(os.fspath(path_or_pattern), schema)
    schema = source.schema
    if training and not schema.labelled:
        raise ValueError(
            f"{path_or_pattern!r} has no labels ({schema}); it can be read for prediction "
            "(training=False), not for training."
        )
    drop_remainder = training if drop_remainder is None else drop_remainder
    files = tf.data.Dataset.from_tensor_slices(
        (source.files, tf.constant(source.sizes, tf.int64), tf.constant(source.counts, tf.int64)))
    shard_records, counts = False, source.counts
    workers = num_workers if num_workers is not None else num_workers_from_environment()
    if input_context is not None:
        # Each replica gets its share of the global batch (raises if it does not divide).
        batch_size = input_context.get_per_replica_batch_size(batch_size)
        pipelines, index = input_context.num_input_pipelines, input_context.input_pipeline_id
        if pipelines == 1:
            pass  # one pipeline (one worker) feeds all its replicas: nothing to split
        elif len(source.files) >= pipelines:
            files = files.shard(pipelines, index)
            counts = counts[index::pipelines]
        else:
            shard_records = True
    if training:
        # Seeded even when `seed` is None: every worker must see the same file order for FILE
        # sharding to split it; the per-epoch reshuffle still changes it every epoch.
        files = files.shuffle(len(source.files), seed=0 if seed is None else seed)
    # tf.data opens 2 × cycle_length more shards ahead of the cycle (the parallel interleave's
    # default `prefetch_input_elements`), each holding its block of _CHECK_BLOCK records: a set
    # with fewer shards than 3 × num_parallel_reads never fills that window (less memory), a
    # bigger one does, and no set goes beyond it.
    records = files.interleave(
        lambda f, size, count: _checked_records(f, size, count, skip_corrupt),
        cycle_length=min(num_parallel_reads, len(source.files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training,
    )
    if _UNKNOWN not in counts and not skip_corrupt and (input_context or workers == 1):
        # A known length lets Keras show steps per epoch and, under MirroredStrategy, end the
        # epoch without the extra empty step it may run on a dataset of unknown length.
        # (Not under multi-worker auto-sharding: that splits the files after this point.)
        records = records.apply(tf.data.experimental.assert_cardinality(sum(counts)))
    if shard_records:
        records = records.shard(pipelines, index)
    spec = source.spec
    to_example = example_fn(
        schema, label_is_string=schema.labelled and spec[schema.label_key].dtype == tf.string,
        num_classes=source.num_classes, image_size=tuple(image_size), channels=channels,
        data_range=tuple(data_range))
    dataset = batched(
        records, lambda record: to_example(tf.io.parse_single_example(record, spec)),
        training=training, batch_size=batch_size, drop_remainder=drop_remainder, cache=cache,
        shuffle_buffer_size=shuffle_buffer_size, seed=seed, augment=augment,
        prefetch_batches=prefetch_batches)
    return dataset.with_options(
        dataset_options(training, input_context, len(source.files), workers))


def check_reader_arguments(num_parallel_reads: int, prefetch_batches: int) -> None:
    """Raises ValueError for arguments that would leave memory unbounded or the reader idle."""
    if not isinstance(num_parallel_reads, int) or num_parallel_reads < 1:
        raise ValueError(f"`num_parallel_reads` must be a positive int (shards read at the "
                         f"same time, e.g. 4), got {num_parallel_reads!r}.")
    if (not isinstance(prefetch_batches, int)
            or (prefetch_batches < 1 and prefetch_batches != tf.data.AUTOTUNE)):
        raise ValueError(
            f"`prefetch_batches` must be a positive int (e.g. 2) or tf.data.AUTOTUNE, got "
            f"{prefetch_batches!r}.")


def batched(elements: tf.data.Dataset, to_example, *, training: bool, batch_size: int,
            drop_remainder: bool, cache: bool, shuffle_buffer_size: int, seed: int | None,
            augment: bool, prefetch_batches: int) -> tf.data.Dataset:
    """Shuffle (training) → decode (`to_example`) → augment → batch → prefetch.

    Shared by `image_dataset` and `tfds_image_dataset`; `elements` are still encoded.
    """
    if cache:
        dataset = elements.map(to_example, num_parallel_calls=tf.data.AUTOTUNE).cache()
        if training:  # shuffle after the cache, so that each epoch has a new order
            dataset = dataset.shuffle(shuffle_buffer_size, seed=seed)
    else:
        if training:  # shuffle encoded records: ~10x smaller than decoded images
            elements = elements.shuffle(shuffle_buffer_size, seed=seed)
        dataset = elements.map(to_example, num_parallel_calls=tf.data.AUTOTUNE,
                               deterministic=not training)
    if training and augment:
        dataset = dataset.map(lambda image, *rest: (tf.image.random_flip_left_right(image, seed),
                                                    *rest), num_parallel_calls=tf.data.AUTOTUNE)
    # drop_remainder=True keeps the batch dimension static (TPUs need it) and every step full.
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    # Decode the next batches while this one trains. A fixed depth, not AUTOTUNE: tf.data's
    # prefetch autotuner doubles its buffer each time a full buffer drains to empty and never
    # shrinks it, so a run with pauses (validation, checkpoints) keeps growing: one epoch of
    # 0.5 GB with a 2 s pause every 20 batches peaked at 2.1 GB, vs 1.0 GB with a depth of 2
    # (benchmarks/data_pipeline.py, 2026-11-21).
    return dataset.prefetch(prefetch_batches)


def dataset_options(training: bool, input_context, num_files: int,
                    workers: int) -> tf.data.Options:
    """Determinism and auto-shard policy, shared by `image_dataset` and `tfds_image_dataset`."""
    result = tf.data.Options()
    # Evaluation keeps the order (ids line up with predictions); training takes whichever
    # element is ready first, which is faster.
    result.deterministic = not training
    distribute = result.experimental_distribute
    if input_context is not None:  # already split by the input pipeline
        distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    else:
        distribute.auto_shard_policy = auto_shard_policy(num_files, workers)
    return result


def example_fn(schema: schema_lib.Schema, *, label_is_string: bool, num_classes: int | None,
               image_size: tuple[int, int], channels: int, data_range):
    """Maps a dict of parsed features to `(image, label)`, `(image, id)` or `image`."""
    table = None
    if label_is_string:
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                list(schema.class_names), tf.range(len(schema.class_names), dtype=tf.int64)),
            default_value=-1)

    def to_example(features):
        image = tf.io.decode_image(features[schema.image_key], channels=channels,
                                   expand_animations=False)
        image = tf.image.resize(image, image_size)  # float32, values still in 0..255
        if data_range == (0, 1):
            image = image / 255.0
        if not schema.labelled:
            return (image, features[schema.id_key]) if schema.id_key else image
        label = tf.cast(features[schema.label_key], tf.int64) if table is None else (
            table.lookup(features[schema.label_key]))
        if table is not None:
            tf.debugging.assert_non_negative(
                label, message=f"a label in {schema.label_key!r} is not one of the class_names")
        else:
            label = label - schema.label_offset
        if num_classes is not None:
            tf.debugging.assert_less(
                label, tf.constant(num_classes, tf.int64),
                message=f"a label is >= the number of classes ({num_classes})")
        tf.debugging.assert_non_negative(
            label, message=f"a label in {schema.label_key!r} is negative after subtracting "
                           f"label_offset={schema.label_offset}")
        return image, tf.cast(label, tf.int32)

    return to_example
