"""`ReaderOptions`: the batching, shuffling and memory options both readers share, checked once.

`image_dataset` (TFRecord shards) and `tfds_image_dataset` (tfds-prepared data) take the same
keyword arguments for everything after the records are read; they are the fields below, with
their defaults and their checks in one place.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence

from tfmem._tf import tf

DATA_RANGES = ((0, 255), (0, 1))
# The most pixels an image may have, read from its header before it is decoded: 8192 × 8192
# (192 MiB as 8-bit RGB, 768 MiB as the float32 image resized from it). A PNG of a few
# megabytes can claim gigapixels; such a record is refused, named, without being decoded.
MAX_IMAGE_PIXELS = 8192 * 8192


def _positive_int(name: str, value, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int ({example}), got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ReaderOptions:
    """How records become batches: size, range, shuffling, sharding and the memory bounds.

    Attributes:
        image_size: `(height, width)` every image is resized to (bilinear; masks
            nearest-neighbour).
        batch_size: examples per batch; with `input_context`, the *global* batch, divided
            among the replicas.
        training: shuffle, augment if asked, drop the last partial batch, non-deterministic.
        data_range: pixel range of the float32 images returned: `(0, 255)` or `(0, 1)`.
        channels: channels of the decoded images (1 = grey, 3 = RGB, 4 = RGBA).
        shuffle_buffer_size: encoded records in the shuffle buffer (memory ≈ this × the
            mean record size, e.g. 1024 × 110 KB for ImageNet JPEGs).
        augment: random left-right flips when training; for segmentation sets also a
            random scale (0.5-2×) and crop, the same for an image and its mask.
        cache: keep decoded, resized images in memory after the first epoch. Only for sets
            that fit in RAM (examples × height × width × channels × 4 bytes); it ends
            streaming, so it is off unless asked.
        drop_remainder: drop the last partial batch; default: `training` (static shapes, as
            TPUs need, and every step sees a full batch).
        num_parallel_reads: shards read at the same time. tf.data opens two more shards per
            read ahead of time, and each open shard holds ~35 encoded records and a 256 KB
            read buffer (≈ 1.7 MB with 42 KB JPEGs): ≈ 3 × this × 1.7 MB in all. 4 keeps two
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
        max_image_pixels: the most pixels (height × width, read from the image's header
            before decoding) an image may have; a larger one raises an error naming its
            shard and record (with `skip_corrupt`, it is skipped). Default `MAX_IMAGE_PIXELS`
            (8192 × 8192).

    Raises:
        ValueError: a value out of range, naming the argument and what it accepts.

    Example:
        >>> options = tfmem.ReaderOptions(image_size=(224, 224), batch_size=64, training=True)
        >>> options.drop_remainder
        True
    """

    image_size: Sequence[int]
    batch_size: int
    training: bool
    data_range: tuple[float, float] = (0, 255)
    channels: int = 3
    shuffle_buffer_size: int = 1024
    augment: bool = False
    cache: bool = False
    drop_remainder: bool | None = None
    num_parallel_reads: int = 4
    prefetch_batches: int = 2
    seed: int | None = None
    num_workers: int | None = None
    input_context: tf.distribute.InputContext | None = None
    max_image_pixels: int = MAX_IMAGE_PIXELS

    def __post_init__(self):
        size = self.image_size
        if (isinstance(size, (str, bytes)) or not isinstance(size, Sequence) or len(size) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size)):
            raise ValueError(f"`image_size` must be (height, width), two positive ints such as "
                             f"(224, 224), got {size!r}.")
        object.__setattr__(self, "image_size", tuple(size))
        _positive_int("batch_size", self.batch_size, "examples per batch, e.g. 64")
        if tuple(self.data_range) not in DATA_RANGES:
            raise ValueError(f"`data_range` must be one of {DATA_RANGES}, got "
                             f"{self.data_range!r}.")
        object.__setattr__(self, "data_range", tuple(self.data_range))
        if self.channels not in (1, 3, 4):
            raise ValueError(f"`channels` must be 1 (grey), 3 (RGB) or 4 (RGBA), got "
                             f"{self.channels!r}.")
        _positive_int("shuffle_buffer_size", self.shuffle_buffer_size, "e.g. 1024")
        _positive_int("num_parallel_reads", self.num_parallel_reads,
                      "shards read at the same time, e.g. 4")
        if (isinstance(self.prefetch_batches, bool) or not isinstance(self.prefetch_batches, int)
                or (self.prefetch_batches < 1 and self.prefetch_batches != tf.data.AUTOTUNE)):
            raise ValueError(
                f"`prefetch_batches` must be a positive int (e.g. 2) or tf.data.AUTOTUNE, got "
                f"{self.prefetch_batches!r}.")
        _positive_int("max_image_pixels", self.max_image_pixels,
                      f"pixels per image, e.g. {MAX_IMAGE_PIXELS} = 8192 × 8192")
        if self.num_workers is not None:
            _positive_int("num_workers", self.num_workers, "workers of the cluster")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ValueError(f"`seed` must be an int or None, got {self.seed!r}.")
        if self.drop_remainder is None:
            object.__setattr__(self, "drop_remainder", bool(self.training))

    @classmethod
    def from_arguments(cls, function: str, options: dict) -> ReaderOptions:
        """`cls(**options)`, with a missing or unknown keyword named for `function`'s caller."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{function}() got unexpected keyword argument(s) {unknown}; its "
                            f"reader options are {names}.")
        missing = [name for name in names[:3] if name not in options]
        if missing:
            raise TypeError(f"{function}() needs the keyword argument(s) {missing} "
                            "(e.g. image_size=(224, 224), batch_size=64, training=True).")
        return cls(**options)


def with_reader_options(function):
    """Gives `function(..., **options)` a signature listing the `ReaderOptions` fields.

    `help()`, IDEs and `inspect.signature` then show every option with its default, while
    the defaults themselves stay in `ReaderOptions` only.
    """
    own = [p for p in inspect.signature(function).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    fields = [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, annotation=field.type,
            default=(inspect.Parameter.empty if field.default is dataclasses.MISSING
                     else field.default))
        for field in dataclasses.fields(ReaderOptions)]
    required = [p for p in fields if p.default is inspect.Parameter.empty]
    optional = [p for p in fields if p.default is not inspect.Parameter.empty]
    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    function.__signature__ = inspect.signature(function).replace(
        parameters=positional + required + keyword + optional)
    return function

