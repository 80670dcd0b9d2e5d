"""Foreign TFRecords (Kaggle, ImageNet/TF-slim, tfds): written here with tf.train.Example
directly, read back through tfmem, pixels/labels/ids and error messages checked."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfmem

SIZE = 8
NUM = 12


def _feature(value):
    if isinstance(value, bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def _images(seed=0, num=NUM):
    return np.random.default_rng(seed).integers(0, 256, size=(num, SIZE, SIZE, 3), dtype=np.uint8)


def _write(path, rows):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row in rows:
            feature = {key: _feature(value) for key, value in row.items()}
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


def _png(image):
    return tf.io.encode_png(image).numpy()


def _read_all(path, **kwargs):
    dataset = tfmem.image_dataset(path, image_size=(SIZE, SIZE), batch_size=NUM,
                                  training=False, num_parallel_reads=1, **kwargs)
    return [tuple(t.numpy() for t in batch) for batch in dataset]


@pytest.mark.parametrize("label_key", ["class", "label", "target"])
def test_kaggle_layout_png_is_detected_and_read_exactly(tmp_path, label_key):
    images, labels = _images(), np.arange(NUM) % 5
    path = _write(tmp_path / "00-8x8-12.tfrec", [
        {"image": _png(x), label_key: int(y), "id": f"id{i:03d}".encode()}
        for i, (x, y) in enumerate(zip(images, labels))])
    assert tfmem.detect_schema(path) == tfmem.Schema(image_key="image", label_key=label_key,
                                                     id_key="id")
    (read_images, read_labels), = _read_all(str(tmp_path))  # a directory of .tfrec files
    np.testing.assert_array_equal(read_images, images.astype(np.float32))
    np.testing.assert_array_equal(read_labels, labels)


def test_kaggle_jpeg_test_set_keeps_ids_alongside(tmp_path):
    images = _images(1)
    jpegs = [tf.io.encode_jpeg(x, quality=90).numpy() for x in images]
    for part in range(2):  # two shards, as competition test sets come
        _write(tmp_path / f"test{part}.tfrec", [
            {"image": jpegs[i], "id": f"img{i}".encode()} for i in range(part * 6, part * 6 + 6)])
    assert tfmem.detect_schema(str(tmp_path / "test0.tfrec")) == tfmem.Schema(
        image_key="image", label_key=None, id_key="id")
    (read_images, ids), = _read_all(str(tmp_path / "test*.tfrec"))
    assert [i.decode() for i in ids] == [f"img{i}" for i in range(NUM)]
    # JPEG is lossy: the reference is TensorFlow's decoder on the same bytes.
    expected = np.stack([tf.io.decode_jpeg(j, channels=3).numpy() for j in jpegs])
    np.testing.assert_array_equal(read_images, expected.astype(np.float32))
    with pytest.raises(ValueError, match=r"has no labels.*prediction \(training=False\)"):
        tfmem.image_dataset(str(tmp_path), image_size=(8, 8), batch_size=4, training=True)


def _slim_rows(images, labels):
    return [{"image/encoded": tf.io.encode_jpeg(x, quality=95).numpy(),
             "image/format": b"JPEG", "image/class/label": int(y),
             "image/class/synset": b"n01440764", "image/height": SIZE, "image/width": SIZE,
             "image/filename": f"n01440764_{i}.JPEG".encode()}
            for i, (x, y) in enumerate(zip(images, labels))]


def test_imagenet_slim_layout_needs_an_explicit_label_offset(tmp_path):
    images, labels = _images(2), np.arange(NUM) % 4 + 1  # 1-based, as TF-slim wrote them
    path = _write(tmp_path / "train-00000-of-00001", _slim_rows(images, labels))
    with pytest.raises(ValueError) as error:
        tfmem.image_dataset(path, image_size=(8, 8), batch_size=4, training=True)
    message = str(error.value)
    assert "ImageNet/TF-slim layout ('image/encoded' + 'image/class/label')" in message
    assert "'image/class/label': int64[1] e.g. 1" in message  # keys listed with their types
    assert "'image/encoded': bytes[1] (jpeg image" in message
    assert ("schema=tfmem.Schema(image_key='image/encoded', label_key='image/class/label', "
            "id_key='image/filename', label_offset=1)") in message
    schema = tfmem.Schema(image_key="image/encoded", label_key="image/class/label",
                          label_offset=1)
    (_, read_labels), = _read_all(path, schema=schema)
    np.testing.assert_array_equal(read_labels, labels - 1)


def test_ambiguous_and_missing_keys_list_what_was_found(tmp_path):
    image = _png(_images(3)[0])
    both = _write(tmp_path / "both.tfrec", [{"image": image, "label": 1, "class": 2}])
    with pytest.raises(ValueError, match=r"(?s)\['label', 'class'\] are all present.*"
                                         r"'class': int64\[1\] e.g. 2.*"
                                         r"'label': int64\[1\] e.g. 1.*label_key='label'"):
        tfmem.detect_schema(both)
    two_images = _write(tmp_path / "two.tfrec", [{"image": image, "mask": image, "label": 0}])
    with pytest.raises(ValueError, match=r"several features hold \(\['image', 'mask'\]\)"):
        tfmem.detect_schema(two_images)
    unknown = _write(tmp_path / "species.tfrec", [{"picture": image, "species": 3}])
    with pytest.raises(ValueError, match=r"(?s)Found no label.*\['species'\] may be one.*"
                                         r"'species': int64\[1\] e.g. 3.*"
                                         r"image_key='picture', label_key='species'"):
        tfmem.image_dataset(unknown, image_size=(8, 8), batch_size=1, training=False)
    with pytest.raises(ValueError, match=r"(?s)`label_key='class'` is not a feature.*"
                                         r"'species': int64\[1\]"):
        tfmem.image_dataset(unknown, image_size=(8, 8), batch_size=1, training=False,
                            schema=tfmem.Schema(image_key="picture", label_key="class"))


def test_string_labels_map_through_the_class_list(tmp_path):
    images, names = _images(4, 4), [b"tulip", b"rose", b"tulip", b"daisy"]
    path = _write(tmp_path / "s.tfrec", [{"image": _png(x), "label": n}
                                         for x, n in zip(images, names)])
    with pytest.raises(ValueError,
                       match=r"(?s)are strings \(e.g. b'tulip'\).*class_names=\[\.\.\.\]"):
        tfmem.detect_schema(path)
    schema = tfmem.Schema(image_key="image", label_key="label",
                          class_names=["daisy", "rose", "tulip"])
    dataset = tfmem.image_dataset(path, image_size=(8, 8), batch_size=4, training=False,
                                  schema=schema)
    (_, labels), = [tuple(t.numpy() for t in b) for b in dataset]
    assert labels.tolist() == [2, 1, 2, 0]
    short = tfmem.Schema(image_key="image", label_key="label", class_names=["rose", "tulip"])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"its label \(`label`\) is daisy, not one of the 2 class_names"):
        list(tfmem.image_dataset(path, image_size=(8, 8), batch_size=4, training=False,
                                 schema=short))


def test_inspect_describes_keys_types_and_shape(tmp_path):
    path = _write(tmp_path / "k.tfrec", [{"image": _png(_images(5)[0]), "class": 7,
                                          "id": b"abc"}])
    text = tfmem.inspect_tfrecords(path)
    assert "1 file(s), e.g." in text
    assert "'class': int64[1] e.g. 7" in text and "'id': bytes[1] e.g. b'abc'" in text
    assert "'image' decodes to an image of shape (8, 8, 3)" in text
    assert "Schema(image_key='image', label_key='class', id_key='id'" in text


# ---- tfds: a tiny builder prepared into tmp_path (nothing downloaded) -------------------

TFDS_IMAGES, TFDS_LABELS = _images(6, 20), np.arange(20) % 3


class TinyPatches(tfds.core.GeneratorBasedBuilder):
    """20 random 8x8 PNG images in 3 classes."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        # DatasetInfo directly: `dataset_info_from_configs` looks for metadata files in a
        # package, and this test module is not one.
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(SIZE, SIZE, 3)),
            "label": tfds.features.ClassLabel(names=["a", "b", "c"]),
        }))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 16), "test": self._generate_examples(16, 20)}

    def _generate_examples(self, start, stop):
        for i in range(start, stop):
            yield i, {"image": TFDS_IMAGES[i], "label": int(TFDS_LABELS[i])}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    TinyPatches(data_dir=data_dir).download_and_prepare()
    return data_dir


def test_tfds_prepared_split_streams_with_the_same_batching(tfds_dir, constant_inputs):
    test = tfmem.tfds_image_dataset("tiny_patches", split="test", data_dir=tfds_dir,
                                    image_size=(SIZE, SIZE), batch_size=3, training=False,
                                    data_range=(0, 1))
    batches = [tuple(t.numpy() for t in b) for b in test]
    assert [len(y) for _, y in batches] == [3, 1]  # evaluation keeps the partial batch
    images = np.concatenate([x for x, _ in batches])
    labels = np.concatenate([y for _, y in batches])
    np.testing.assert_allclose(images * 255, np.round(images * 255), atol=1e-4)  # x / 255
    order = [int(np.flatnonzero((TFDS_IMAGES[16:] == np.round(x * 255)).all(axis=(1, 2, 3)))[0])
             for x in images]  # tfds orders records by key hash; match each image exactly
    assert sorted(order) == [0, 1, 2, 3]
    np.testing.assert_array_equal(labels, TFDS_LABELS[16:][order])

    train = tfmem.tfds_image_dataset("tiny_patches", split="train", data_dir=tfds_dir,
                                     image_size=(4, 4), batch_size=6, training=True, seed=0)
    assert [tuple(x.shape) for x, _ in train] == [(6, 4, 4, 3)] * 2  # 16 // 6, remainder dropped
    assert constant_inputs(train, "PrefetchDataset") == [2]  # the same tail as image_dataset
    bounded = tfmem.tfds_image_dataset("tiny_patches", split="train", data_dir=tfds_dir,
                                       image_size=(4, 4), batch_size=6, training=True,
                                       prefetch_batches=1, num_parallel_reads=1)
    assert constant_inputs(bounded, "PrefetchDataset") == [1]
    assert [len(y) for _, y in bounded] == [6, 6]
    context = tf.distribute.InputContext(1, 0, num_replicas_in_sync=2)
    split = tfmem.tfds_image_dataset("tiny_patches", split="train", data_dir=tfds_dir,
                                     image_size=(4, 4), batch_size=8, training=True,
                                     input_context=context)
    assert [len(y) for _, y in split] == [4] * 4  # global 8 over 2 replicas
    # The same pixel limit, read from each image's header: a tfds record is named by its file.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"record \d+ of .*tiny_patches-test\.tfrecord.*: its image is "
                             rf"{SIZE}×{SIZE} = {SIZE * SIZE} pixels, above the limit of "
                             rf"{SIZE * SIZE - 1} "):
        list(tfmem.tfds_image_dataset("tiny_patches", split="test", data_dir=tfds_dir,
                                      image_size=(4, 4), batch_size=4, training=False,
                                      max_image_pixels=SIZE * SIZE - 1))


def test_tfds_errors_point_to_the_right_call(tfds_dir, tmp_path):
    version_dir = f"{tfds_dir}/tiny_patches/1.0.0"
    with pytest.raises(ValueError, match=r"prepared by tensorflow-datasets.*tfds_image_dataset"):
        tfmem.image_dataset(version_dir, image_size=(8, 8), batch_size=2, training=False)
    with pytest.raises(ValueError, match=r"not prepared in .*download_and_prepare\(\)"):
        tfmem.tfds_image_dataset("tiny_patches", split="train", data_dir=str(tmp_path),
                                 image_size=(8, 8), batch_size=2, training=False)
    with pytest.raises(ValueError, match=r"has no split 'validation'; it has \['train', 'test'\]"):
        tfmem.tfds_image_dataset(version_dir, split="validation", image_size=(8, 8),
                                 batch_size=2, training=False)
    # tfds shards are tf.train.Examples with `image` + `label`: the glob is detected too.
    (images, labels), = _read_all(f"{version_dir}/tiny_patches-test.tfrecord*")
    assert sorted(labels.tolist()) == sorted(TFDS_LABELS[16:].tolist())


def test_make_tfrecords_script_writes_a_prepared_tfds_split(tfds_dir, tmp_path):
    # As a user runs it: a subprocess that knows the dataset only from its prepared files.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "scripts/make_tfrecords.py", "--source=tfds:tiny_patches",
         f"--data_dir={tfds_dir}", "--split=train", f"--output={tmp_path / 'out'}"],
        cwd=root, env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("wrote 16 examples in 1 shards")
    manifest = tfmem.read_manifest(tmp_path / "out")
    assert manifest.num_examples == 16 and manifest.class_names == ("a", "b", "c")
    # The stored PNGs are tfds's own bytes: every training image and its label, exactly.
    read = tfmem.image_dataset(tmp_path / "out", image_size=(SIZE, SIZE), batch_size=16,
                               training=False)
    (images, labels), = [(x.numpy(), y.numpy()) for x, y in read]
    found = [int(np.flatnonzero((TFDS_IMAGES[:16] == image).all(axis=(1, 2, 3)))[0])
             for image in images]
    assert sorted(found) == list(range(16))
    np.testing.assert_array_equal(labels, TFDS_LABELS[:16][found])
