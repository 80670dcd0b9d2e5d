"""Data: TFRecord shards written and streamed without ever holding a data set in RAM.

`tfrecords` writes shards (temporary name, then rename; the manifest's rename commits a set)
and `manifest` describes them; `schema` says which feature holds the image, label and id, for
tfmem's sets and foreign ones; `reader` streams them (`image_dataset`) through the shared
`pipeline` tail, with the `options` both readers take; `integrity` checks shards and records
against what was written and logs what `skip_corrupt` skips; `tfds_data` reads tfds-prepared
data; `demo` makes the embedded demo set.
"""
