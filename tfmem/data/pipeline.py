"""The tail both readers share: decode records (naming the ones that fail), check labels,
then shuffle → batch → prefetch, and the tf.data options for distribution.

Records are decoded a batch at a time: each batch of encoded records becomes a small dataset
whose parallel decode map has `ignore_errors`, so a record that is not an Example or holds a
broken image comes out missing instead of stopping the pipeline with TensorFlow's bare decoder
message, and the caller's `describe(locator)` names it (shard and index for TFRecords, the
tfds file and index for tfds) in an error, or, with `skip_corrupt`, in a skip. Per batch, the
guard costs nothing measurable; per record (one small dataset each), or in blocks that are
then re-batched (two more copies of every image), it cost 15-20% of decoding 42 KB JPEGs.
Before decoding, each image's size is read from its header (`encoded_size`) and one over
`max_image_pixels` fails without being decoded; on a JPEG the frame-header search costs about
a tenth of decoding a 500 × 375 image (CPU time, 2 shared cores, rough), a PNG's next to nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tfmem._tf import tf

from tfmem.data import integrity
from tfmem.data import schema as schema_lib
from tfmem.data.options import ReaderOptions
from tfmem.runtime.cluster import workers_in_tf_config

BATCHES_IN_FLIGHT = 2  # batches decoded at the same time, each by all cores
_SKIP_HINT = ("; pass skip_corrupt=True (`--skip-corrupt`) to skip such records, or write the "
              "set again")
_PIXELS_HINT = ("; raise max_image_pixels (`--max-image-pixels`) if such images are meant, "
                "or pass skip_corrupt=True (`--skip-corrupt`) to skip them")
_UNDECODABLE = ("it cannot be decoded (a damaged or truncated image, or not a "
                "tf.train.Example)")


def decode_fn(schema: schema_lib.Schema, *, parse: Callable | None, label_is_string: bool,
              num_classes: int | None, options: ReaderOptions,
              describe: Callable[..., tuple[tf.Tensor, tf.Tensor]], skip_corrupt: bool,
              log: integrity.SkippedRecords | None):
    """`(payloads, *locators) -> parts` for a batch of records; `parts` is `(images, labels)`,
    `(images, masks)` (uint8, resized nearest-neighbour), `(images, ids)` or `(images,)` of
    the records that decoded. A record that does not decode raises an error naming it, or with
    `skip_corrupt` is reported and left out; a label or mask value outside the classes (and
    the ignore value) always raises. `describe(*locators)` gives `(shard names, indices)`.
    """
    table = None
    if label_is_string:
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                list(schema.class_names), tf.range(len(schema.class_names), dtype=tf.int64)),
            default_value=-1)
    limit = options.max_image_pixels
    decode = _record_decoder(schema, parse, options, num_classes)

    def name(locators, position):
        shard, index = describe(*(tf.gather(part, position) for part in locators))
        return tf.strings.join(["record ", tf.strings.as_string(index), " of ", shard])

    def reasons(payloads):
        """Why each of these records failed: its size over the limit, or it did not decode."""
        sizes = tf.map_fn(
            lambda payload: encoded_size((payload if parse is None else parse(payload))[
                schema.image_key]), payloads, fn_output_signature=tf.int64)
        pixels = sizes[:, 0] * sizes[:, 1]
        return tf.where(pixels > limit, tf.strings.join([
            "its image is ", tf.strings.as_string(sizes[:, 1]), "×",
            tf.strings.as_string(sizes[:, 0]), " = ", tf.strings.as_string(pixels),
            f" pixels, above the limit of {limit} (max_image_pixels, `--max-image-pixels`), "
            "read from its header"]), _UNDECODABLE), pixels > limit

    def decode_batch(payloads, *locators):
        static_size = locators[0].shape[0]  # known when the batch drops its remainder
        size = tf.shape(locators[0])[0]
        positions = tf.range(size)
        decoded = tf.data.Dataset.from_tensor_slices((payloads, positions)).map(
            lambda payload, position: (*decode(payload), position),
            num_parallel_calls=tf.data.AUTOTUNE).ignore_errors().batch(
                tf.cast(size, tf.int64))
        empty = tuple(tf.zeros([0, *spec.shape[1:]], spec.dtype)
                      for spec in decoded.element_spec)
        *parts, kept = decoded.concatenate(tf.data.Dataset.from_tensors(empty)).take(
            1).get_single_element()
        ok = tf.reduce_any(tf.equal(positions[:, None], kept[None, :]), axis=1)
        all_ok = tf.reduce_all(ok)

        def failed():  # built only inside the branches that run when records failed
            return tf.boolean_mask(positions, tf.logical_not(ok))

        if skip_corrupt:
            if not all_ok:  # autograph: a tf.cond, the report built only when records failed
                shards, indices = describe(*(tf.gather(part, failed()) for part in locators))
                integrity.report_skips(log, shards, indices, tf.ones_like(indices),
                                       reasons(gather(payloads, failed()))[0])
        else:
            def message():
                first = failed()[:1]
                reason, over = reasons(gather(payloads, first))
                return tf.strings.join([
                    "tfmem: ", name(locators, first[0]), ": ", reason[0],
                    tf.where(over[0], _PIXELS_HINT, _SKIP_HINT)])

            message = tf.cond(all_ok, lambda: tf.constant(""), message)
            # The check runs before the shape is asserted: a batch short of a record fails with
            # the record's name, not with the shape it no longer has.
            with tf.control_dependencies([tf.debugging.Assert(all_ok, [message])]):
                parts = [tf.ensure_shape(part, [static_size, *part.shape[1:]])
                         for part in parts]
        if not schema.labelled:
            return tuple(parts)
        if schema.mask_key is not None:
            images, masks, bad = parts
            _check_masks(bad, schema, num_classes, lambda position: name(locators, kept[position]))
            return images, masks
        images, stored = parts
        labels = _checked_labels(stored, schema, table, num_classes,
                                 lambda position: name(locators, kept[position]))
        return images, labels

    return decode_batch


def _record_decoder(schema: schema_lib.Schema, parse: Callable | None,
                    options: ReaderOptions, num_classes: int | None) -> Callable:
    """`payload -> parts` of one record: its image decoded, resized and scaled, with its label,
    its mask (resized nearest-neighbour) and the mask's largest value outside the classes and
    the ignore value (or -1), or its id; an image over `max_image_pixels` fails before it is
    decoded."""
    height, width = options.image_size
    limit = options.max_image_pixels

    def outside(values):
        """Which mask values are neither a class (a class's bit) nor the ignore value."""
        if schema.multi_label:
            return values >= 2**num_classes
        if num_classes is None:  # any 8-bit value may be a class
            return tf.zeros_like(values, tf.bool)
        return tf.logical_and(values >= num_classes, values != (
            -1 if schema.ignore_value is None else schema.ignore_value))

    def decode(payload):
        features = payload if parse is None else parse(payload)
        data = features[schema.image_key]
        # Not decoded over the limit: the error drops the record, named by `decode_fn`.
        size = encoded_size(data)
        within = tf.debugging.assert_less_equal(size[0] * size[1], tf.constant(limit, tf.int64))
        with tf.control_dependencies([within]):
            image = tf.io.decode_image(data, channels=options.channels, expand_animations=False)
        image = tf.image.resize(image, (height, width))  # float32, values still in 0..255
        if options.data_range == (0, 1):
            image = image / 255.0
        if schema.mask_key is not None:
            mask = tf.io.decode_png(features[schema.mask_key], channels=1)
            # Checked at its own size (before resizing can drop a pixel).
            values = tf.cast(mask, tf.int32)
            bad = tf.reduce_max(tf.where(outside(values), values, -1))
            # Nearest-neighbour: a mask value is a class, never a mean of two.
            mask = tf.image.resize(mask, (height, width), method="nearest")
            return image, mask[..., 0], bad
        if schema.labelled:
            return image, features[schema.label_key]
        return (image, features[schema.id_key]) if schema.id_key else (image,)

    return decode


def _check_masks(bad: tf.Tensor, schema: schema_lib.Schema, num_classes: int | None,
                 name: Callable[[tf.Tensor], tf.Tensor]) -> None:
    """Raises for the first record of a batch whose mask holds a value outside the classes
    and the ignore value (`bad`: each record's largest such value, or -1), naming it."""
    if tf.reduce_any(bad >= 0):
        first = tf.argmax(tf.cast(bad >= 0, tf.int32))
        expected = (f"{num_classes} multi-label bits (a value below {2**num_classes})"
                    if schema.multi_label else
                    f"a class index in [0, {num_classes})" + (
                        f" or the ignore value {schema.ignore_value}"
                        if schema.ignore_value is not None else ""))
        tf.debugging.Assert(False, [tf.strings.join([
            "tfmem: ", name(first), f": its mask (`{schema.mask_key}`) holds the value ",
            tf.strings.as_string(bad[first]), f", not {expected}; check num_classes "
            "(`--num-classes`) and the Schema's ignore_value"])])


def _checked_labels(stored: tf.Tensor, schema: schema_lib.Schema, table, num_classes,
                    name: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """A batch's stored labels as int32 class indices; the first outside the classes raises,
    naming its record (`name(position)`)."""
    labels = tf.cast(stored, tf.int64) if table is None else table.lookup(stored)
    if table is None:
        labels = labels - schema.label_offset
    bad = labels < 0
    if num_classes is not None:
        bad = tf.logical_or(bad, labels >= num_classes)
    if tf.reduce_any(bad):
        first = tf.argmax(tf.cast(bad, tf.int32))
        value = stored[first] if table is not None else tf.strings.as_string(stored[first])
        classes = (f"one of the {len(schema.class_names)} class_names" if table is not None
                   else f"a class index in [0, {num_classes})" if num_classes is not None
                   else "a class index >= 0")
        offset = (f" after subtracting label_offset={schema.label_offset}"
                  if schema.label_offset else "")
        tf.debugging.Assert(False, [tf.strings.join([
            "tfmem: ", name(first), f": its label (`{schema.label_key}`) "
            "is ", value, f", not {classes}{offset}; check num_classes (`--num-classes`) "
            "and the Schema (label_key, label_offset)"])])
    return tf.cast(labels, tf.int32)


def gather(structure, positions):
    """`tf.gather` of every tensor in a structure (a batch of records, or of features)."""
    return tf.nest.map_structure(lambda part: tf.gather(part, positions), structure)


def encoded_size(data: tf.Tensor) -> tf.Tensor:
    """`[height, width]` (int64) of an encoded image, read from its header without decoding
    it: PNG (IHDR), JPEG (its frame header), GIF, BMP; `[-1, -1]` for anything else (which
    the decoder then judges)."""
    head = tf.strings.substr(tf.strings.join([tf.strings.substr(data, 0, 32), "\0" * 32]),
                             0, 32)

    def raw(first, length, dtype, little_endian):  # two numbers, as (height, width)
        return tf.cast(tf.io.decode_raw(tf.strings.substr(head, first, length), dtype,
                                        little_endian=little_endian), tf.int64)[::-1]

    def starts(signature):
        return tf.equal(tf.strings.substr(head, 0, len(signature)), signature)

    # The JPEG frame-header search reads a 1 × 1 JPEG in place of anything else, so that
    # every image is sized without a branch (a branch per record costs more than the search).
    is_jpeg = starts(b"\xff\xd8\xff")
    stand_in = tf.io.encode_jpeg(tf.zeros([1, 1, 1], tf.uint8))
    jpeg = tf.cast(tf.image.extract_jpeg_shape(tf.where(is_jpeg, data, stand_in))[:2],
                   tf.int64)
    size = tf.where(is_jpeg, jpeg,
                    tf.where(starts(b"\x89PNG\r\n\x1a\n"), raw(16, 8, tf.int32, False),
                             tf.where(starts(b"GIF8"), raw(6, 4, tf.uint16, True),
                                      tf.where(starts(b"BM"), tf.abs(raw(18, 8, tf.int32, True)),
                                               tf.constant([-1, -1], tf.int64)))))
    return tf.ensure_shape(size, [2])


def num_processes() -> int:
    """Processes of JAX's distributed runtime when it is on (several hosts), else 1."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return 1
    return jax.process_count()


def in_order(options: ReaderOptions) -> bool:
    """Whether the pipeline keeps its order: always for evaluation; when training, with several
    processes, each of which reads the same global batches and keeps its rows of them."""
    return not options.training or num_processes() > 1


def check_processes(options: ReaderOptions) -> None:
    """With several processes, every one must shuffle alike: a seed is needed."""
    processes = num_processes()
    if options.training and options.seed is None and processes > 1:
        raise ValueError(
            f"with {processes} processes, each keeps its rows of the same global batches, so "
            "every process must shuffle alike: pass the same `seed` in every process (e.g. "
            "seed=epoch)")


def process_split() -> tuple[int, int] | None:
    """`(processes, this process's index)` when each process should read only its part of
    the data: several JAX processes under `tfmem.detect()`'s distribution, which takes such a
    dataset as it is; None otherwise (Keras then gives each process its rows)."""
    if num_processes() == 1:
        return None
    from tfmem.runtime import distribute_jax  # several processes: JAX is running

    return distribute_jax.process_split()


def own_rows(elements: tf.data.Dataset, processes: int, index: int,
             global_batch_size: int) -> tf.data.Dataset:
    """This process's rows of each global batch of a stream every process reads alike: the
    j-th element is row `j % global_batch_size` of its batch, and process `index` keeps rows
    `[index, index + 1) × global_batch_size / processes`, as Keras splits a global batch."""
    part = global_batch_size // processes
    return elements.enumerate().filter(
        lambda j, element: (j % global_batch_size) // part == index).map(
        lambda j, element: element)


def batched(elements: tf.data.Dataset, decode_batch, options: ReaderOptions,
            skip_corrupt: bool, rows: tuple[int, int] | None = None,
            transform: Callable | None = None) -> tf.data.Dataset:
    """Shuffle (training) → batch → decode (`decode_batch`) → `transform` → prefetch.

    `elements` are `(payload, *locator)`, still encoded; `decode_batch` is from `decode_fn`;
    `transform` (from `augment.batch_transform`) augments a decoded batch.
    Memory: `prefetch_batches` decoded batches, plus `BATCHES_IN_FLIGHT` being decoded.
    `rows` = `(processes, index)`: the elements are every process's, and this process keeps
    its rows of each global batch (`options.batch_size` is then the per-process batch).
    """
    training, seed, batch_size = options.training, options.seed, options.batch_size
    check_processes(options)

    def mine(stream):
        return stream if rows is None else own_rows(stream, *rows, batch_size * rows[0])

    def decode(batches):
        return batches.map(decode_batch, num_parallel_calls=BATCHES_IN_FLIGHT,
                           deterministic=in_order(options))

    if options.cache:  # examples cached one by one, so that each epoch can reshuffle them
        dataset = decode(elements.batch(batch_size)).unbatch().cache()
        if training:
            dataset = dataset.shuffle(options.shuffle_buffer_size, seed=seed)
        dataset = mine(dataset).batch(batch_size, drop_remainder=options.drop_remainder)
    else:
        if training:  # shuffle encoded records: ~10x smaller than decoded images
            elements = elements.shuffle(options.shuffle_buffer_size, seed=seed)
        elements = mine(elements)
        # drop_remainder=True keeps the batch dimension static (TPUs need it) and every step
        # full; a batch that lost skipped records is topped up from the next one.
        dataset = decode(elements.batch(
            batch_size, drop_remainder=options.drop_remainder and not skip_corrupt))
        if skip_corrupt:
            dataset = dataset.rebatch(batch_size, drop_remainder=options.drop_remainder)
    if len(dataset.element_spec) == 1:  # images alone
        dataset = dataset.map(lambda images: images)
    if transform is not None:
        dataset = dataset.map(transform)
    # Decode the next batches while this one trains. A fixed depth, not AUTOTUNE: tf.data's
    # prefetch autotuner doubles its buffer each time a full buffer drains to empty and never
    # shrinks it, so a run with pauses (validation, checkpoints) keeps growing
    # (benchmarks/data_pipeline.py measures both).
    return dataset.prefetch(options.prefetch_batches)


def auto_shard_policy(num_files: int, num_workers: int) -> tf.data.experimental.AutoShardPolicy:
    """FILE when every worker gets at least one file, else DATA (each reads all, keeps 1/n).

    Example:
        >>> tfmem.auto_shard_policy(num_files=16, num_workers=4)
        <AutoShardPolicy.FILE: 1>
    """
    policy = tf.data.experimental.AutoShardPolicy
    return policy.FILE if num_files >= num_workers else policy.DATA


def num_workers_from_environment() -> int:
    """Workers of a multi-worker cluster described by TF_CONFIG; 1 when there is none."""
    return workers_in_tf_config(os.environ.get("TF_CONFIG"))


def dataset_options(options: ReaderOptions, num_files: int,
                    split: bool = False) -> tf.data.Options:
    """Determinism and auto-shard policy, shared by `image_dataset` and `tfds_image_dataset`."""
    result = tf.data.Options()
    # Evaluation keeps the order (ids line up with predictions); training takes whichever
    # element is ready first, which is faster.
    result.deterministic = in_order(options)
    # No autotuning: the parallel reads and decodes run at min(16, the CPU cores), and the
    # prefetch depth is fixed anyway. With it on, tf.data runs a model thread beside each
    # iterator, whose deletion (at the end of each epoch and of each validation) can wait for
    # that thread's current period to end (10 ms doubling, up to 60 s); on 2 cores it decoded
    # between 0.6× and 1.0× the images per second of the fixed setting
    # (benchmarks/data_autotune.py).
    result.autotune.enabled = False
    distribute = result.experimental_distribute
    if options.input_context is not None or split:  # already split by pipeline or process
        distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    else:
        workers = options.num_workers or num_workers_from_environment()
        distribute.auto_shard_policy = auto_shard_policy(num_files, workers)
    return result
