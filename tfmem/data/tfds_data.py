"""Reading datasets that tensorflow-datasets (tfds) has already prepared on disk.

tfds writes its own TFRecord shards plus `dataset_info.json` into `data_dir`. Its builder
already streams them, splits them across input pipelines and knows the class count, so this
reads through `tfds.builder(name, data_dir=...)` and only adds tfmem's decode → resize →
shuffle → batch tail, with the same options as `image_dataset`. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tfmem._tf import tf

from tfmem.data import reader as data
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


def tfds_image_dataset(
    name_or_dir: str,
    *,
    split: str,
    image_size: Sequence[int],
    batch_size: int,
    training: bool,
    data_dir: str | None = None,
    data_range: tuple[float, float] = (0, 255),
    image_key: str = "image",
    label_key: str = "label",
    channels: int = 3,
    shuffle_buffer_size: int = 1024,
    augment: bool = False,
    cache: bool = False,
    drop_remainder: bool | None = None,
    num_parallel_reads: int = 4,
    prefetch_batches: int = 2,
    seed: int | None = None,
    num_workers: int | None = None,
    input_context: tf.distribute.InputContext | None = None,
) -> tf.data.Dataset:
    """Streams a tfds-prepared image-classification split as `(images, labels)` batches.

    Same batching, `data_range`, shuffling and distribution options as `tfmem.image_dataset`.
    Images are read still encoded (`tfds.decode.SkipDecoding`) and decoded in tfmem's
    parallel map, after the shuffle buffer, so the buffer holds small encoded images.

    Args:
        name_or_dir: a tfds name (e.g. `"tf_flowers"`) prepared in `data_dir`, or the
            prepared version directory (holding `dataset_info.json`).
        split: a tfds split, e.g. `"train"`, `"train[:90%]"`.
        image_size, batch_size, training, data_range, channels, shuffle_buffer_size,
        augment, cache, drop_remainder, num_parallel_reads, prefetch_batches, seed,
        num_workers, input_context: as in `tfmem.image_dataset` (`num_parallel_reads` is tfds's
        `interleave_cycle_length`).
        data_dir: where tfds prepared the dataset (default: tfds's own, ~/tensorflow_datasets).
        image_key: the `tfds.features.Image` feature.
        label_key: the `tfds.features.ClassLabel` feature.

    Returns:
        `(images float32 in data_range, labels int32)` batches.

    Raises:
        ValueError: the dataset is not prepared there, lacks the image/label features, or
            `num_parallel_reads` / `prefetch_batches` is out of range.

    Example:
        >>> train = tfmem.tfds_image_dataset("tf_flowers", split="train[:90%]",
        ...                                  data_dir="/kaggle/input/tfds", image_size=(224, 224),
        ...                                  batch_size=64, training=True)  # doctest: +SKIP
    """
    import tensorflow_datasets as tfds

    if tuple(data_range) not in data.DATA_RANGES:
        raise ValueError(f"`data_range` must be one of {data.DATA_RANGES}, got {data_range!r}.")
    data.check_reader_arguments(num_parallel_reads, prefetch_batches)
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
    drop_remainder = training if drop_remainder is None else drop_remainder
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    read_config = tfds.ReadConfig(
        input_context=input_context,  # tfds splits files (or records) per input pipeline
        shuffle_seed=seed, interleave_cycle_length=num_parallel_reads, try_autocache=False)
    elements = builder.as_dataset(split=split, shuffle_files=training, read_config=read_config,
                                  decoders={image_key: tfds.decode.SkipDecoding()})
    to_example = data.example_fn(
        Schema(image_key=image_key, label_key=label_key), label_is_string=False,
        num_classes=getattr(features[label_key], "num_classes", None),
        image_size=tuple(image_size), channels=channels, data_range=tuple(data_range))
    dataset = data.batched(
        elements, to_example, training=training, batch_size=batch_size,
        drop_remainder=drop_remainder, cache=cache, shuffle_buffer_size=shuffle_buffer_size,
        seed=seed, augment=augment, prefetch_batches=prefetch_batches)
    workers = num_workers if num_workers is not None else data.num_workers_from_environment()
    return dataset.with_options(data.dataset_options(
        training, input_context, builder.info.splits[split].num_shards, workers))
