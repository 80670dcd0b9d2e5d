"""The reader checks what it reads against what was written: real files, damaged for real."""

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem import cli
from tfrecord_framing import record_lengths

NUM_EXAMPLES = 12


def _images(seed=0, num_examples=NUM_EXAMPLES):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(num_examples, 6, 5, 3), dtype=np.uint8),
            rng.integers(0, 3, size=num_examples))


@pytest.fixture()
def written(tmp_path):
    """12 random 6x5 images, unshuffled, in shards of 3 records; the source arrays."""
    images, labels = _images()
    manifest = tfmem.write_image_tfrecords((images, labels), tmp_path / "set",
                                           shard_size_mb=0.0008, class_names=["a", "b", "c"],
                                           shuffle=False)
    assert [s.num_examples for s in manifest.shards] == [3, 3, 3, 3]
    return manifest, images, labels


def _read(directory, **kwargs):
    options = dict(image_size=(6, 5), batch_size=4, training=False, num_parallel_reads=1)
    dataset = tfmem.image_dataset(str(directory), **options | kwargs)
    return [tuple(t.numpy() for t in batch) for batch in dataset]


def _edit_manifest(manifest, edit):
    path = os.path.join(manifest.directory, "manifest.json")
    data = json.loads(open(path).read())
    edit(data)
    open(path, "w").write(json.dumps(data))


def test_shards_are_compared_with_the_manifest_before_the_first_batch(written, tmp_path, capfd):
    manifest, images, labels = written
    flat = np.full_like(images[:3], 7)  # compresses better: same count, another size
    other = tfmem.write_image_tfrecords((flat, labels[:3]), tmp_path / "other", shuffle=False)
    files = manifest.files
    open(files[1], "wb").close()                 # a zero-byte shard
    os.remove(files[3])                          # a missing one
    shutil.copy(other.files[0], files[2])        # one swapped for another set's (same count)
    assert other.shards[0].num_examples == manifest.shards[2].num_examples
    assert other.shards[0].num_bytes != manifest.shards[2].num_bytes
    with pytest.raises(ValueError) as error:  # raised building the dataset: nothing trained yet
        tfmem.image_dataset(manifest.directory, image_size=(6, 5), batch_size=4,
                            training=True)
    text = str(error.value)
    assert f"{files[1]} has 0 bytes, the manifest says {manifest.shards[1].num_bytes}" in text
    assert f"{files[2]} has {other.shards[0].num_bytes} bytes, the manifest says " \
           f"{manifest.shards[2].num_bytes}" in text
    assert f"{files[3]} is missing" in text and "skip_corrupt=True" in text

    skipped = tfmem.SkippedRecords()
    batches = _read(manifest.directory, skip_corrupt=True, skipped=skipped)
    read = np.concatenate([x for x, _ in batches])
    # Shard 0 as written, shard 2 as the other set wrote it, shards 1 and 3 skipped.
    np.testing.assert_array_equal(read, np.concatenate([images[:3], flat]))
    assert skipped.by_shard() == {
        files[1]: [(0, 3, "it holds 0 records, its manifest says 3")],
        files[3]: [(0, 3, "the shard is missing")],
    }
    assert skipped.num_records == 6
    err = capfd.readouterr().err
    assert f"tfmem: {files[2]} has {other.shards[0].num_bytes} bytes" in err  # said, not hidden
    assert f"tfmem: skipped records from 0 of {files[1]}: it holds 0 records" in err
    assert skipped.summary().splitlines() == [
        "skipped 6 record(s) in 2 shard(s):",
        f"  {files[1]}: records 0-2 (3): it holds 0 records, its manifest says 3",
        f"  {files[3]}: records 0-2 (3): the shard is missing"]


def test_a_short_shard_is_named_with_its_missing_records(written):
    manifest, images, labels = written
    lengths = record_lengths(manifest.files[1])
    cut = lengths[0] + 16  # at a record boundary: what is left reads without a CRC error
    with open(manifest.files[1], "r+b") as file:
        file.truncate(cut)
    with pytest.raises(ValueError, match=rf"{manifest.files[1]} has {cut} bytes, the manifest "
                                         rf"says {manifest.shards[1].num_bytes}"):
        _read(manifest.directory)
    skipped = tfmem.SkippedRecords()
    batches = _read(manifest.directory, skip_corrupt=True, skipped=skipped)
    np.testing.assert_array_equal(np.concatenate([y for _, y in batches]),
                                  np.concatenate([labels[:4], labels[6:]]))
    assert skipped.by_shard() == {
        manifest.files[1]: [(1, 2, "it holds 1 records, its manifest says 3")]}

    # A manifest whose per-shard counts are wrong (bytes right) is caught while streaming.
    shutil.copy(manifest.files[0], manifest.files[1])  # shard 1 back to 3 records, shard 0's

    def wrong_counts(data):  # sizes as on disk, counts off by one in shards 2 and 3
        for shard, path, count in zip(data["shards"], manifest.files, [3, 3, 4, 2]):
            shard.update(num_bytes=os.path.getsize(path), num_examples=count)

    _edit_manifest(manifest, wrong_counts)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfmem: shard {manifest.files[2]}: it holds 3 records, its "
                             r"manifest says 4; read 3 of 4 records\. .*skip_corrupt=True"):
        _read(manifest.directory)


def test_a_manifest_whose_total_disagrees_with_its_shards_is_refused(written):
    manifest, _, _ = written
    _edit_manifest(manifest, lambda data: data.update(num_examples=4 * NUM_EXAMPLES))
    with pytest.raises(ValueError, match=r"manifest.json' is damaged: it says 48 examples, but "
                                         r"its shards add up to 12; write the set again"):
        tfmem.image_dataset(manifest.directory, image_size=(6, 5), batch_size=4, training=True)


def test_a_corrupted_shard_is_named_or_skipped(written, capfd):
    manifest, images, labels = written
    victim = manifest.files[2]
    lengths = record_lengths(victim)
    data = bytearray(open(victim, "rb").read())
    data[lengths[0] + 16 + 12 + 40] ^= 0xFF  # record 1's payload: its data CRC no longer matches
    open(victim, "wb").write(bytes(data))  # same size: only the stream check can see it
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfmem: shard {victim}: truncated or corrupted: its records stop "
                             rf"at byte {lengths[0] + 16} of {len(data)}; read 1 of 3 records"):
        _read(manifest.directory)
    skipped = tfmem.SkippedRecords()
    batches = _read(manifest.directory, skip_corrupt=True, skipped=skipped, training=True,
                    drop_remainder=False)
    assert sorted(np.concatenate([y for _, y in batches])) == sorted(
        np.delete(labels, [7, 8]))  # the reader cannot resynchronise after a bad record
    assert skipped.by_shard() == {victim: [(1, 2, "truncated or corrupted: its records stop at "
                                                  f"byte {lengths[0] + 16} of {len(data)}")]}
    assert f"tfmem: skipped records from 1 of {victim}" in capfd.readouterr().err


def test_a_truncated_shard_of_foreign_data_is_named(written, tmp_path):
    manifest, _, _ = written
    data = open(manifest.files[0], "rb").read()
    (tmp_path / "part.tfrecord").write_bytes(data[:-5])  # cut inside the last record
    last_record_start = len(data) - record_lengths(manifest.files[0])[-1] - 16
    schema = tfmem.Schema(image_key="image", label_key="label", id_key="id")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"stop at byte {last_record_start} of {len(data) - 5}; read 2 "
                             r"records, the rest is lost"):
        _read(tmp_path / "part.tfrecord", schema=schema)
    assert tfmem.count_records(manifest.files[0]) == 3
    assert tfmem.count_records(manifest.directory) == NUM_EXAMPLES
    assert tfmem.count_records(tmp_path / "part.tfrecord") == 2  # complete records only


def test_a_record_that_cannot_be_decoded_is_named_and_skippable(tmp_path, capfd):
    images, labels = _images()
    encoded = [tf.io.encode_png(image).numpy() for image in images]
    encoded[7] = encoded[7][:60]  # a truncated PNG: its header still says 6x5
    # Encoded bytes are stored as given (as tfds data with SkipDecoding would be).
    manifest = tfmem.write_image_tfrecords(
        tf.data.Dataset.from_tensor_slices((encoded, labels)), tmp_path, shard_size_mb=0.0008,
        class_names=["a", "b", "c"])
    shard, index = manifest.files[2], 1  # record 7 is the 2nd of the 3rd shard of 3 records
    assert record_lengths(shard)[index] < 200
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfmem: record {index} of {shard}: it cannot be decoded .*"
                             r"skip_corrupt=True"):
        _read(tmp_path)
    # Full batches of a static size (training's default): the record is named all the same,
    # not the batch's missing row.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"tfmem: record {index} of {shard}: it cannot be decoded"):
        _read(tmp_path, training=True, drop_remainder=True)
    skipped = tfmem.SkippedRecords()
    batches = _read(tmp_path, skip_corrupt=True, skipped=skipped)
    keep = np.arange(NUM_EXAMPLES) != 7
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), images[keep])
    np.testing.assert_array_equal(np.concatenate([y for _, y in batches]), labels[keep])
    assert list(skipped.by_shard()) == [shard] and skipped.num_records == 1
    assert f"tfmem: skipped record {index} of {shard}: it cannot be decoded" in (
        capfd.readouterr().err)


def _foreign(path, labels):
    """Kaggle-layout records (image, class, id) with these labels."""
    images, _ = _images(num_examples=len(labels))
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index, (image, label) in enumerate(zip(images, labels)):
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.encode_png(image).numpy()])),
                "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"%d" % index])),
            }
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())


def test_a_label_outside_the_classes_stops_naming_its_record(written, tmp_path):
    _foreign(tmp_path / "train-00.tfrec", [0, 2, 1, 0])
    _foreign(tmp_path / "train-01.tfrec", [1, 0, 4, 2])
    pattern = str(tmp_path / "train-*.tfrec")
    assert len(_read(pattern, num_classes=5)) == 2
    for skip in (False, True):  # a wrong class count is not damage: never skipped
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=rf"tfmem: record 2 of {tmp_path / 'train-01.tfrec'}: its label "
                                 r"\(`class`\) is 4, not a class index in \[0, 3\); check "
                                 r"num_classes \(`--num-classes`\)"):
            _read(pattern, num_classes=3, skip_corrupt=skip)
    manifest, _, _ = written
    with pytest.raises(ValueError, match=r"num_classes=2, but .* has 3 classes \(a, b, c\); "
                                         r"pass num_classes=3"):
        _read(manifest.directory, num_classes=2)


def _png(width, height, rows=None):
    """A real 8-bit greyscale PNG of zeros, compressed row by row (65 KB for 8200 × 8200);
    `rows`: only that many rows of pixel data (the header still says `height`)."""
    compressor = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte + pixels
    body = b"".join(compressor.compress(row) for _ in range(
        height if rows is None else rows)) + compressor.flush()

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body)
            + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def image_bomb():
    """8200 × 8200 pixels (just above the default limit of 8192 × 8192) in 65 KB."""
    return _png(8200, 8200)


def _encoded_set(path, encoded):
    """Foreign records (image, class) of these encoded images, labels 0, 1, 2, 0, ..."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index, data in enumerate(encoded):
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[index % 3])),
            }
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


def test_an_image_over_the_pixel_limit_is_named_from_its_header(tmp_path, image_bomb, capfd):
    images, _ = _images(num_examples=4)
    small = [tf.io.encode_png(image).numpy() for image in images]
    shard = _encoded_set(tmp_path / "bomb.tfrec", [small[0], image_bomb, small[1], small[2]])
    options = dict(image_size=(6, 5), batch_size=4, training=False, num_classes=3)
    assert tfmem.ReaderOptions(image_size=(6, 5), batch_size=4,
                               training=False).max_image_pixels == 8192 * 8192
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        list(tfmem.image_dataset(shard, **options))
    assert cli.one_line(caught.value) == (
        f"record 1 of {shard}: its image is 8200×8200 = 67240000 pixels, above the limit of "
        "67108864 (max_image_pixels, `--max-image-pixels`), read from its header; raise "
        "max_image_pixels (`--max-image-pixels`) if such images are meant, or pass "
        "skip_corrupt=True (`--skip-corrupt`) to skip them")
    skipped = tfmem.SkippedRecords()
    (read, labels), = tfmem.image_dataset(shard, skip_corrupt=True, skipped=skipped, **options)
    np.testing.assert_array_equal(read.numpy(), images[:3])
    np.testing.assert_array_equal(labels.numpy(), [0, 2, 0])
    assert skipped.by_shard() == {shard: [(1, 1, (
        "its image is 8200×8200 = 67240000 pixels, above the limit of 67108864 "
        "(max_image_pixels, `--max-image-pixels`), read from its header"))]}
    bomb_first = _encoded_set(tmp_path / "first.tfrec", [image_bomb])
    assert ("'image' is an image of 8200×8200 pixels (its header), over the default "
            "max_image_pixels: not decoded") in tfmem.inspect_tfrecords(bomb_first)
    # Raised: the image decodes (zeros), resized like the others.
    (read, _), = tfmem.image_dataset(shard, max_image_pixels=8200 * 8200, **options)
    np.testing.assert_array_equal(read.numpy()[1], np.zeros((6, 5, 3)))
    np.testing.assert_array_equal(read.numpy()[[0, 2, 3]], images[:3])


def test_the_header_is_read_before_decoding_for_png_and_jpeg(tmp_path):
    # 23000 × 23000 claimed with one row of data: decoding would fail, the header refuses first.
    claimed = _png(23000, 23000, rows=1)
    jpeg = tf.io.encode_jpeg(np.zeros((16, 12, 3), np.uint8)).numpy()
    shard = _encoded_set(tmp_path / "claims.tfrec", [jpeg, claimed])
    options = dict(image_size=(6, 5), batch_size=2, training=False, num_classes=3)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"record 1 of .*: its image is 23000×23000 = 529000000 pixels"):
        list(tfmem.image_dataset(shard, **options))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"record 0 of .*: its image is 12×16 = 192 pixels, above the "
                             r"limit of 191 "):
        list(tfmem.image_dataset(shard, max_image_pixels=191, **options))
    with pytest.raises(ValueError, match=r"`max_image_pixels` must be a positive int"):
        tfmem.image_dataset(shard, max_image_pixels=0, **options)


def test_a_glob_reads_only_the_shards_its_manifest_lists(written, capfd):
    manifest, images, _ = written
    stray = os.path.join(manifest.directory, "shard-ffffff-00000.tfrecord")
    shutil.copy(manifest.files[0], stray)  # e.g. left by a replacement killed before cleanup
    batches = _read(os.path.join(manifest.directory, "shard-*.tfrecord"))
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), images)
    assert "ignoring 1 other file(s) such as 'shard-ffffff-00000.tfrecord'" in (
        capfd.readouterr().err)
