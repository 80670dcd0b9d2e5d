"""Data: TFRecord shards written and streamed without ever holding a data set in RAM.

`tfrecords` writes shards (temporary name, then rename; the manifest's rename commits a set)
from the `sources` (folders, arrays, datasets; segmentation masks in `masks`, Kaggle's RLE
CSVs in `rle`) and `manifest` describes them; `schema` says which feature holds the image,
label or mask and id, for tfmem's sets and foreign ones; `reader` streams them
(`image_dataset`) through the shared `pipeline` tail and the `augment`ations, with the
`options` both readers take; `integrity` checks shards and records against what was written
and logs what `skip_corrupt` skips; `tfds_data` reads tfds-prepared data; `demo` makes the
embedded demo set (classification or segmentation).
"""

from tfmem._exports import lazy_exports

# Each module here needs TensorFlow: importing `tfmem.data` does not, using a name does.
EXPORTS = {
    "auto_shard_policy": "tfmem.data.reader",
    "count_records": "tfmem.data.reader",
    "image_dataset": "tfmem.data.reader",
    "inspect_tfrecords": "tfmem.data.reader",
    "DEMO_CLASS_NAMES": ("tfmem.data.demo", "CLASS_NAMES"),
    "demo_examples": "tfmem.data.demo",
    "make_demo_dataset": "tfmem.data.demo",
    "Manifest": "tfmem.data.manifest",
    "Shard": "tfmem.data.manifest",
    "read_manifest": "tfmem.data.manifest",
    "Schema": "tfmem.data.schema",
    "detect_schema": "tfmem.data.schema",
    "write_image_tfrecords": "tfmem.data.tfrecords",
    "tfds_image_dataset": "tfmem.data.tfds_data",
    "ReaderOptions": "tfmem.data.options",
    "SkippedRecords": "tfmem.data.integrity",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
