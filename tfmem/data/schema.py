"""Which feature of a TFRecord `tf.train.Example` holds the image, the label (or mask) and the id.

tfmem's own shards say so in their manifest. Shards written by other tools (Kaggle competition
sets, the ImageNet/TF-slim layout) have none, so `detect_schema` reads the first record of the
first shard and recognises the common layouts:

- Kaggle: `image` + `class` / `label` / `target` (+ `id`); test sets: `image` + `id` only.
- ImageNet / TF-slim: `image/encoded` + `image/class/label`, whose labels are usually 1-based
  (0 was "background"), so the label offset must be given explicitly.
- DeepLab / TF Model Garden segmentation: `image/encoded` + `image/segmentation/class/encoded`
  (a PNG of class indices per pixel; 255 marks pixels to ignore).

When the layout is ambiguous or a key is missing, the error lists the keys found with their
types and shows the `Schema(...)` to pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tfmem._tf import tf

# Leading bytes of the encodings `tf.io.decode_image` reads.
_IMAGE_SIGNATURES = {
    b"\xff\xd8\xff": "jpeg",
    b"\x89PNG\r\n\x1a\n": "png",
    b"GIF87a": "gif",
    b"GIF89a": "gif",
    b"BM": "bmp",
}
# Label keys of the common layouts, in the order they are tried.
LABEL_KEYS = ("label", "class", "target", "image/class/label")
# Mask keys of the segmentation layouts: a PNG of class indices per pixel.
MASK_KEYS = ("image/segmentation/class/encoded", "mask")
# The value DeepLab and the Model Garden give pixels without a class (borders, "void").
DEFAULT_IGNORE_VALUE = 255
ID_KEYS = ("id", "image_id", "image_name", "image/filename", "filename", "image/source_id")
# Keys that describe an image rather than label it: ignored when deciding "unlabelled".
_METADATA_SUFFIXES = (
    "height", "width", "channels", "depth", "format", "colorspace", "filename",
    "source_id", "sha256", "synset", "text", "shape",
)  # fmt: skip
_ONE_BASED_LABEL_KEYS = ("image/class/label",)


def image_format(data: bytes) -> str | None:
    """The encoding of `data` (`"jpeg"`, `"png"`, `"gif"`, `"bmp"`) from its signature, or None."""
    for signature, name in _IMAGE_SIGNATURES.items():
        if data.startswith(signature):
            return name
    return None


@dataclasses.dataclass(frozen=True)
class FeatureInfo:
    """One feature of a record: its kind, number of values and a peek at the first value."""

    kind: str  # "bytes", "int64" or "float"
    length: int
    first: bytes | int | float | None

    def describe(self) -> str:
        text = f"{self.kind}[{self.length}]"
        if self.kind == "bytes" and isinstance(self.first, bytes):
            encoding = image_format(self.first)
            if encoding:
                return f"{text} ({encoding} image, {len(self.first)} bytes)"
            if len(self.first) <= 40:
                return f"{text} e.g. {self.first!r}"
            return f"{text} ({len(self.first)} bytes)"
        return f"{text} e.g. {self.first!r}" if self.first is not None else text


@dataclasses.dataclass(frozen=True)
class Schema:
    """Where a record keeps its encoded image, its label (or mask) and its id.

    Attributes:
        image_key: bytes feature holding the encoded image (JPEG, PNG, GIF or BMP).
        label_key: int64 feature with a class index, or bytes feature with a class name (then
            `class_names` is required); None for unlabelled sets (e.g. a competition test set).
        id_key: optional feature identifying the example (kept alongside for prediction).
        label_offset: subtracted from stored int labels, e.g. 1 for TF-slim ImageNet shards
            whose labels run 1..1000 so that they become 0..999.
        class_names: class names; maps string labels to indices and gives `num_classes`.
        mask_key: bytes feature holding a segmentation mask (a PNG of class indices per
            pixel, the DeepLab layout); set, the records give `(images, masks)`.
        ignore_value: the mask value of pixels without a class (not checked against the
            classes; a loss skips it with `ignore_class`); None when no pixel is ignored.
        multi_label: the mask's PNG packs one 0/1 channel per class into the bits of each
            pixel (bit `c` for class `c`), for classes that overlap; read as
            `(height, width, num_classes)`.

    Example:
        >>> schema = tfmem.Schema(image_key="image/encoded", label_key="image/class/label",
        ...                       label_offset=1)
        >>> ds = tfmem.image_dataset("gs://bucket/imagenet/train-*", schema=schema,
        ...                          image_size=(224, 224), batch_size=256, training=True)
        ...                                                              # doctest: +SKIP
    """

    image_key: str = "image"
    label_key: str | None = "label"
    id_key: str | None = None
    label_offset: int = 0
    class_names: tuple[str, ...] | None = None
    mask_key: str | None = None
    ignore_value: int | None = None
    multi_label: bool = False

    def __post_init__(self):
        if not isinstance(self.image_key, str) or not self.image_key:
            raise TypeError(f"`image_key` must be a non-empty str, got {self.image_key!r}.")
        for name in ("label_key", "id_key", "mask_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{name}` must be a str or None, got {value!r}.")
        if not isinstance(self.label_offset, int):
            raise TypeError(f"`label_offset` must be an int, got {self.label_offset!r}.")
        if self.class_names is not None:
            object.__setattr__(self, "class_names", tuple(str(c) for c in self.class_names))
        if self.mask_key is not None and self.label_key is not None:
            raise ValueError(f"A Schema has a label (`label_key={self.label_key!r}`) or a "
                             f"mask (`mask_key={self.mask_key!r}`), not both; pass "
                             "label_key=None for a segmentation set.")
        if self.ignore_value is not None and (isinstance(self.ignore_value, bool) or not (
                isinstance(self.ignore_value, int) and 0 <= self.ignore_value <= 255)):
            raise ValueError(f"`ignore_value` must be a mask value in [0, 255] or None, got "
                             f"{self.ignore_value!r}.")
        if (self.multi_label or self.ignore_value is not None) and self.mask_key is None:
            raise ValueError("`ignore_value` and `multi_label` describe masks: pass "
                             "`mask_key` with them.")

    @property
    def labelled(self) -> bool:
        """Whether each record has a target: a label or a mask."""
        return self.label_key is not None or self.mask_key is not None

    @property
    def task(self) -> str:
        """`"segmentation"` (a mask per record) or `"classification"`."""
        return "classification" if self.mask_key is None else "segmentation"

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self) | {
            "class_names": list(self.class_names) if self.class_names is not None else None
        }
        if self.mask_key is None:  # a classification schema keeps its text (and fingerprint)
            for name in ("mask_key", "ignore_value", "multi_label"):
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> Schema:
        return cls(**data)

    def feature_spec(self, features: Mapping[str, FeatureInfo], path: str) -> dict:
        """The `tf.io.parse_single_example` spec, checked against the first record's features."""
        wanted = {"image_key": self.image_key, "label_key": self.label_key,
                  "mask_key": self.mask_key, "id_key": self.id_key}
        spec = {}
        for role, key in wanted.items():
            if key is None:
                continue
            if key not in features:
                raise ValueError(
                    f"`{role}={key!r}` is not a feature of the records in {path!r}.\n"
                    f"{describe_features(features)}\nPass the key that holds the "
                    f"{role.removesuffix('_key')} (`scripts/make_tfrecords.py --inspect PATH` "
                    "prints them)."
                )
            info = features[key]
            if role in ("image_key", "mask_key") and info.kind != "bytes":
                raise ValueError(
                    f"`{role}={key!r}` in {path!r} is {info.kind}, expected a bytes feature "
                    f"holding an encoded image.\n{describe_features(features)}"
                )
            if role == "label_key" and info.kind == "bytes" and self.class_names is None:
                raise ValueError(
                    f"The labels in `{key}` of {path!r} are strings (e.g. {info.first!r}); pass "
                    "`class_names=[...]` in the Schema to map them to class indices."
                )
            if info.kind == "float":
                raise ValueError(f"`{role}={key!r}` in {path!r} is a float feature; expected int64 "
                                 "or bytes.")
            dtype = tf.string if info.kind == "bytes" else tf.int64
            spec[key] = tf.io.FixedLenFeature([], dtype)
        return spec


def read_first_record(path: str) -> dict[str, FeatureInfo]:
    """The features of the first `tf.train.Example` in the TFRecord file `path`."""
    try:
        record = next(iter(tf.data.TFRecordDataset(path).take(1)), None)
    except tf.errors.OpError as error:
        raise ValueError(f"Cannot read a TFRecord from {path!r}: {error.message}") from None
    if record is None:
        raise ValueError(
            f"{path!r} holds no records: expected a TFRecord file of tf.train.Example.")
    example = tf.train.Example()
    try:
        example.ParseFromString(record.numpy())
    except Exception as error:  # protobuf raises its own DecodeError type
        raise ValueError(
            f"The first record of {path!r} is not a tf.train.Example ({error}); tfmem reads "
            "image-classification TFRecords of tf.train.Example."
        ) from None
    features = {}
    for key, feature in sorted(example.features.feature.items()):
        kind = feature.WhichOneof("kind")
        values = {"bytes_list": feature.bytes_list, "int64_list": feature.int64_list,
                  "float_list": feature.float_list}.get(kind)
        values = list(values.value) if values is not None else []
        features[key] = FeatureInfo(
            kind=(kind or "bytes_list").removesuffix("_list"),
            length=len(values),
            first=values[0] if values else None,
        )
    return features


def describe_features(features: Mapping[str, FeatureInfo]) -> str:
    """One line per feature: key, kind, length and a peek at the value."""
    lines = ["Features of the first record:"]
    lines += [f"  {key!r}: {info.describe()}" for key, info in features.items()]
    return "\n".join(lines)


def _suggested_call(path: str, schema_text: str) -> str:
    return (
        f"tfmem.image_dataset({path!r}, image_size=..., batch_size=..., training=...,\n"
        f"                    schema=tfmem.Schema({schema_text}))"
    )


def _is_metadata(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return name in _METADATA_SUFFIXES or key.startswith("image/object/")


def detect_schema(path: str, features: Mapping[str, FeatureInfo] | None = None) -> Schema:
    """Recognises the layout of foreign image TFRecords from their first record.

    A record with a DeepLab mask (`image/segmentation/class/encoded`, or `mask`) is a
    segmentation layout, read with DeepLab's ignore value 255.

    Args:
        path: a TFRecord file; its first record is read unless `features` is given.
        features: the first record's features, if already read.

    Returns:
        The `Schema` of a recognised layout.

    Raises:
        ValueError: the layout is ambiguous, lacks an image or a label, or needs an explicit
            choice (TF-slim labels, string labels); the message lists the keys and their types
            and shows the call to make.

    Example:
        >>> tfmem.detect_schema("/kaggle/input/flowers/00-224x224-798.tfrec")  # doctest: +SKIP
        Schema(image_key='image', label_key='class', id_key='id', label_offset=0, ...)
    """
    if features is None:
        features = read_first_record(path)
    listing = describe_features(features)
    images = [k for k, f in features.items()
              if f.kind == "bytes" and isinstance(f.first, bytes) and image_format(f.first)]
    # A segmentation layout (a mask, no label): the other encoded image is the picture.
    has_label = any(k in features for k in LABEL_KEYS)
    masks = [k for k in MASK_KEYS if k in images and not has_label]
    if masks:
        images = [k for k in images if k != masks[0]]
    if len(images) != 1:
        what = "no feature holds" if not images else f"several features hold ({images})"
        raise ValueError(
            f"Cannot tell which feature of {path!r} is the image: {what} an encoded image "
            f"(JPEG/PNG/GIF/BMP).\n{listing}\nPass a schema naming it, e.g.\n"
            + _suggested_call(path, f"image_key={(images or ['...'])[0]!r}, label_key=...")
        )
    image_key = images[0]
    ids = [k for k in ID_KEYS if k in features and features[k].kind in ("bytes", "int64")]
    id_key = ids[0] if ids else None
    if masks:
        return Schema(image_key=image_key, label_key=None, id_key=id_key, mask_key=masks[0],
                      ignore_value=DEFAULT_IGNORE_VALUE)
    labels = [k for k in LABEL_KEYS if k in features and features[k].kind in ("bytes", "int64")]
    if len(labels) > 1:
        raise ValueError(
            f"Cannot tell which feature of {path!r} is the label: {labels} are all present.\n"
            f"{listing}\nPass a schema naming it, e.g.\n"
            + _suggested_call(path, f"image_key={image_key!r}, label_key={labels[0]!r}, "
                                    f"id_key={id_key!r}")
        )
    if not labels:
        unexplained = [k for k in features if k not in (image_key, id_key) and not _is_metadata(k)]
        if unexplained:
            raise ValueError(
                f"Found no label in {path!r}: none of {list(LABEL_KEYS)} is a feature, and "
                f"{unexplained} may be one.\n{listing}\nName the label (or label_key=None for "
                "an unlabelled set), e.g.\n"
                + _suggested_call(path, f"image_key={image_key!r}, label_key={unexplained[0]!r}, "
                                        f"id_key={id_key!r}")
            )
        return Schema(image_key=image_key, label_key=None, id_key=id_key)
    label_key = labels[0]
    if label_key in _ONE_BASED_LABEL_KEYS:
        raise ValueError(
            f"{path!r} has the ImageNet/TF-slim layout ({image_key!r} + {label_key!r}), whose "
            "labels are usually 1-based (1..1000, with 0 once meaning 'background'). tfmem will "
            "not guess: pass the offset explicitly, label_offset=1 to map 1..N to 0..N-1 or "
            f"label_offset=0 to keep the stored values.\n{listing}\n"
            + _suggested_call(path, f"image_key={image_key!r}, label_key={label_key!r}, "
                                    f"id_key={id_key!r}, label_offset=1")
        )
    if features[label_key].kind == "bytes":
        raise ValueError(
            f"The labels in {label_key!r} of {path!r} are strings (e.g. "
            f"{features[label_key].first!r}); pass the class list so they map to indices:\n"
            + _suggested_call(path, f"image_key={image_key!r}, label_key={label_key!r}, "
                                    f"id_key={id_key!r}, class_names=[...]")
        )
    return Schema(image_key=image_key, label_key=label_key, id_key=id_key)

