"""The tail both readers share: decode each record (naming the ones that fail), check its
label, then shuffle → batch → prefetch, and the tf.data options for distribution.

A record is decoded inside a one-element dataset with `ignore_errors`, so a record that is not
an Example or holds a broken image comes out as "failed" instead of stopping the pipeline with
TensorFlow's bare decoder message; the caller's `describe(locator)` then names it (shard and
index for TFRecords, the tfds id for tfds) in an error, or, with `skip_corrupt`, in a skip.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tensorflow as tf

from tfmem.data import integrity
from tfmem.data import schema as schema_lib
from tfmem.data.options import ReaderOptions
from tfmem.runtime.cluster import workers_in_tf_config

_SKIP_HINT = ("; pass skip_corrupt=True (`--skip-corrupt`) to skip such records, or write the "
              "set again")


def example_fn(schema: schema_lib.Schema, *, parse: Callable | None, label_is_string: bool,
               num_classes: int | None, options: ReaderOptions,
               describe: Callable[..., tuple[tf.Tensor, tf.Tensor]], skip_corrupt: bool,
               log: integrity.SkippedRecords | None):
    """`(payload, *locator) -> (parts, ok)`; `parts` is `(image, label)`, `(image, id)` or
    `(image,)`, and `ok` is False for a record that cannot be parsed or decoded (skip mode
    only: otherwise such a record raises an error naming it). `describe(*locator)` gives the
    record's `(shard name, index)` for the messages.
    """
    table = None
    if label_is_string:
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                list(schema.class_names), tf.range(len(schema.class_names), dtype=tf.int64)),
            default_value=-1)
    height, width = options.image_size

    def decode(payload):
        features = payload if parse is None else parse(payload)
        image = tf.io.decode_image(features[schema.image_key], channels=options.channels,
                                   expand_animations=False)
        image = tf.image.resize(image, (height, width))  # float32, values still in 0..255
        if options.data_range == (0, 1):
            image = image / 255.0
        if schema.labelled:
            return image, features[schema.label_key]
        return (image, features[schema.id_key]) if schema.id_key else (image,)

    def fail(shard, where, reason, skippable):
        if skippable and skip_corrupt:
            integrity.report_skip(log, shard, where, 1, reason)
        else:
            tf.debugging.Assert(False, [tf.strings.join([
                "tfmem: record ", tf.strings.as_string(where), " of ", shard, ": ", reason,
                _SKIP_HINT if skippable else ""])])

    def to_example(payload, *locator):
        decoded = tf.data.Dataset.from_tensors(payload).map(decode).ignore_errors()
        spec = decoded.element_spec
        failed = tuple(tf.zeros(s.shape, s.dtype) for s in spec)
        ok_and_parts = decoded.map(lambda *parts: (True, *parts)).concatenate(
            tf.data.Dataset.from_tensors((False, *failed))).take(1).get_single_element()
        ok, parts = ok_and_parts[0], ok_and_parts[1:]
        if not ok:  # autograph: a tf.cond, its message built only on failure
            shard, where = describe(*locator)
            fail(shard, where, "it cannot be decoded (a damaged or truncated image, or not a "
                 "tf.train.Example)", skippable=True)
        if not schema.labelled:
            return parts, ok
        stored = parts[1]
        label = tf.cast(stored, tf.int64) if table is None else table.lookup(stored)
        if table is None:
            label = label - schema.label_offset
        bad = tf.logical_and(ok, label < 0)
        if num_classes is not None:
            bad = tf.logical_or(bad, tf.logical_and(ok, label >= num_classes))
        if bad:
            shard, where = describe(*locator)
            value = stored if table is not None else tf.strings.as_string(stored)
            classes = (f"one of the {len(schema.class_names)} class_names" if table is not None
                       else f"a class index in [0, {num_classes})" if num_classes is not None
                       else "a class index >= 0")
            offset = (f" after subtracting label_offset={schema.label_offset}"
                      if schema.label_offset else "")
            fail(shard, where, tf.strings.join([
                f"its label (`{schema.label_key}`) is ", value, f", not {classes}{offset}; "
                "check num_classes (`--num-classes`) and the Schema (label_key, "
                "label_offset)"]), skippable=False)
        return (parts[0], tf.cast(label, tf.int32)), ok

    return to_example


def batched(elements: tf.data.Dataset, to_example, options: ReaderOptions,
            skip_corrupt: bool) -> tf.data.Dataset:
    """Shuffle (training) → decode (`to_example`) → augment → batch → prefetch.

    `elements` are `(payload, *locator)`, still encoded; `to_example` is from `example_fn`.
    """
    def decode(*element):
        parts, ok = to_example(*element)
        if skip_corrupt:
            return (*parts, ok)
        return parts if len(parts) > 1 else parts[0]

    def drop_failed(dataset):
        if not skip_corrupt:
            return dataset
        return dataset.filter(lambda *element: element[-1]).map(
            lambda *element: element[:-1] if len(element) > 2 else element[0])

    training, seed = options.training, options.seed
    if options.cache:
        dataset = drop_failed(elements.map(decode, num_parallel_calls=tf.data.AUTOTUNE)).cache()
        if training:  # shuffle after the cache, so that each epoch has a new order
            dataset = dataset.shuffle(options.shuffle_buffer_size, seed=seed)
    else:
        if training:  # shuffle encoded records: ~10x smaller than decoded images
            elements = elements.shuffle(options.shuffle_buffer_size, seed=seed)
        dataset = drop_failed(elements.map(decode, num_parallel_calls=tf.data.AUTOTUNE,
                                           deterministic=not training))
    if training and options.augment:
        dataset = dataset.map(lambda image, *rest: (tf.image.random_flip_left_right(image, seed),
                                                    *rest), num_parallel_calls=tf.data.AUTOTUNE)
    # drop_remainder=True keeps the batch dimension static (TPUs need it) and every step full.
    dataset = dataset.batch(options.batch_size, drop_remainder=options.drop_remainder)
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


def dataset_options(options: ReaderOptions, num_files: int) -> tf.data.Options:
    """Determinism and auto-shard policy, shared by `image_dataset` and `tfds_image_dataset`."""
    result = tf.data.Options()
    # Evaluation keeps the order (ids line up with predictions); training takes whichever
    # element is ready first, which is faster.
    result.deterministic = not options.training
    distribute = result.experimental_distribute
    if options.input_context is not None:  # already split by the input pipeline
        distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    else:
        workers = options.num_workers or num_workers_from_environment()
        distribute.auto_shard_policy = auto_shard_policy(num_files, workers)
    return result
