"""Reading datasets that tensorflow-datasets (tfds) has already prepared on disk.

tfds writes its own TFRecord shards plus `dataset_info.json` into `data_dir`. Its builder
already streams them, splits them across input pipelines and knows the class count, so this
reads through `tfds.builder(name, data_dir=...)` and only adds tfmem's decode → resize →
shuffle → batch tail, with the same options as `image_dataset`. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import os

from tfmem._tf import tf

from tfmem.data import augment, pipeline
from tfmem.data.options import ReaderOptions, with_reader_options
from tfmem.data.schema import Schema


def tfds_builder(name_or_dir: str, data_dir: str | None = None):
    """The tfds builder of a prepared dataset: by name (in `data_dir`) or by its directory."""
    import tensorflow_datasets as tfds

    if tf.io.gfile.exists(os.path.join(os.fspath(name_or_dir), "dataset_info.json")):
        return tfds.builder_from_directory(os.fspath(name_or_dir))
    builder = tfds.builder(name_or_dir, data_dir=data_dir)
    if not tf.io.gfile.exists(os.path.join(builder.data_dir, "dataset_info.json")):
        raise ValueError(
            f"The tfds dataset {name_or_dir!r} is not prepared in {builder.data_dir!r}: tfmem "
            "reads prepared data only (it never downloads). Prepare it once with "
            f"`tfds.builder({name_or_dir!r}, data_dir=...).download_and_prepare()`, or pass the "
            "`data_dir` where it is (e.g. an attached Kaggle dataset)."
        )
    return builder


@with_reader_options
def tfds_image_dataset(
    name_or_dir: str,
    *,
    split: str,
    data_dir: str | None = None,
    image_key: str = "image",
    label_key: str = "label",
    **options,
) -> tf.data.Dataset:
    """Streams a tfds-prepared image-classification split as `(images, labels)` batches.

    Same batching, `data_range`, shuffling and distribution options as `tfmem.image_dataset`
    (the `tfmem.ReaderOptions` fields). Images are read still encoded
    (`tfds.decode.SkipDecoding`) and decoded in tfmem's parallel map, after the shuffle
    buffer, so the buffer holds small encoded images. A record that cannot be decoded, or
    whose label is outside the dataset's classes, raises an error naming its tfds file and
    index.

    Args:
        name_or_dir: a tfds name (e.g. `"tf_flowers"`) prepared in `data_dir`, or the
            prepared version directory (holding `dataset_info.json`).
        split: a tfds split, e.g. `"train"`, `"train[:90%]"`.
        data_dir: where tfds prepared the dataset (default: tfds's own, ~/tensorflow_datasets).
        image_key: the `tfds.features.Image` feature.
        label_key: the `tfds.features.ClassLabel` feature.
        **options: the `tfmem.ReaderOptions` fields, as in `tfmem.image_dataset`
            (`num_parallel_reads` is tfds's `interleave_cycle_length`).

    Returns:
        `(images float32 in data_range, labels int32)` batches.

    Raises:
        ValueError: the dataset is not prepared there, lacks the image/label features, or
            an option is out of range.

    Example:
        >>> train = tfmem.tfds_image_dataset("tf_flowers", split="train[:90%]",
        ...                                  data_dir="/kaggle/input/tfds", image_size=(224, 224),
        ...                                  batch_size=64, training=True)  # doctest: +SKIP
    """
    import tensorflow_datasets as tfds

    options = ReaderOptions.from_arguments("tfds_image_dataset", options)
    builder = tfds_builder(name_or_dir, data_dir)
    features = builder.info.features
    for role, key in (("image_key", image_key), ("label_key", label_key)):
        if key not in features:
            raise ValueError(
                f"`{role}={key!r}` is not a feature of tfds dataset {builder.name!r}; it has "
                f"{dict((k, type(v).__name__) for k, v in features.items())}."
            )
    if split not in builder.info.splits:
        raise ValueError(f"tfds dataset {builder.name!r} has no split {split!r}; it has "
                         f"{list(builder.info.splits)}.")
    batch_size = options.batch_size
    if options.input_context is not None:
        batch_size = options.input_context.get_per_replica_batch_size(batch_size)
    read_config = tfds.ReadConfig(
        input_context=options.input_context,  # tfds splits files (or records) per pipeline
        shuffle_seed=options.seed, interleave_cycle_length=options.num_parallel_reads,
        try_autocache=False, add_tfds_id=True)  # the id names a record that fails
    elements = builder.as_dataset(split=split, shuffle_files=options.training,
                                  read_config=read_config,
                                  decoders={image_key: tfds.decode.SkipDecoding()})
    elements = elements.map(lambda example: (
        {image_key: example[image_key], label_key: example[label_key]}, example["tfds_id"]))

    def describe(tfds_ids):  # "mnist-train.tfrecord-00000-of-00001__17" → (file, 17)
        return (tf.strings.regex_replace(tfds_ids, "__[0-9]+$", ""),
                tf.strings.to_number(tf.strings.regex_replace(tfds_ids, "^.*__", ""), tf.int64))

    schema = Schema(image_key=image_key, label_key=label_key)
    decode_batch = pipeline.decode_fn(
        schema, parse=None, label_is_string=False,
        num_classes=getattr(features[label_key], "num_classes", None), options=options,
        describe=describe, skip_corrupt=False, log=None)
    transform = augment.batch_transform(schema, options, None)
    dataset = pipeline.batched(elements, decode_batch,
                               dataclasses.replace(options, batch_size=batch_size), False,
                               transform=transform)
    return dataset.with_options(
        pipeline.dataset_options(options, builder.info.splits[split].num_shards))
