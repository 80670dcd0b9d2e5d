"""Data: TFRecord shards written and streamed without ever holding a data set in RAM.

`tfrecords` writes shards (temporary name, then rename) and `manifest` describes them;
`schema` says which feature holds the image, label and id, for tfmem's sets and foreign ones;
`reader` streams them (`image_dataset`); `tfds_data` reads tfds-prepared data; `demo` makes
the embedded demo set.
"""
