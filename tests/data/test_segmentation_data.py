"""Segmentation sets: masks written (arrays, folder pairs, Kaggle RLE CSVs) and streamed back,
compared with the NumPy masks they came from; real TFRecord files in tmp_path."""

import re

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import tfmem

NUM_EXAMPLES, HEIGHT, WIDTH = 6, 20, 28
CLASSES = ("sky", "road", "car")


def _masks(num_examples, height, width, seed=0):
    """Blocks of classes 0..2 and a band of ignored pixels (255): random, not symmetric."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((num_examples, height, width), np.uint8)
    for mask in masks:
        top, left = rng.integers(1, height // 2), rng.integers(1, width // 2)
        mask[top:, :left] = 1
        mask[:top, left + 3:] = 2
        mask[-2:, left:] = 255
    return masks


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Random images with block masks, written in order (2 records per shard)."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(NUM_EXAMPLES, HEIGHT, WIDTH, 3), dtype=np.uint8)
    masks = _masks(NUM_EXAMPLES, HEIGHT, WIDTH)
    manifest = tfmem.write_image_tfrecords(
        (images, masks), tmp_path_factory.mktemp("set"), class_names=CLASSES, shuffle=False,
        shard_size_mb=0.004)
    return images, masks, manifest


def _read(path, image_size=(HEIGHT, WIDTH), **options):
    dataset = tfmem.image_dataset(path, image_size=image_size, num_parallel_reads=1,
                                  **({"training": False, "batch_size": 64} | options))
    images, masks = zip(*dataset.as_numpy_iterator())
    return np.concatenate(images), np.concatenate(masks)


def _stored(manifest):
    """The records' masks, decoded from their PNGs in written order (no reader)."""
    masks = []
    for path in manifest.files:
        for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
            feature = tf.train.Example.FromString(record).features.feature
            data = feature["image/segmentation/class/encoded"].bytes_list.value[0]
            masks.append(tf.io.decode_png(data)[..., 0].numpy())
    return masks


def _nearest(masks, height, width):
    """NumPy's nearest-neighbour resize with half-pixel centres (TensorFlow's)."""
    rows = np.minimum(np.floor((np.arange(height) + 0.5) * masks.shape[1] / height),
                      masks.shape[1] - 1).astype(int)
    columns = np.minimum(np.floor((np.arange(width) + 0.5) * masks.shape[2] / width),
                         masks.shape[2] - 1).astype(int)
    return masks[:, rows][:, :, columns]


def test_arrays_round_trip_to_masks_with_deeplab_keys(written, tmp_path):
    images, masks, manifest = written
    assert (manifest.task, manifest.class_names, manifest.ignore_value) == (
        "segmentation", CLASSES, 255)
    assert len(manifest.shards) > 1 and tfmem.read_manifest(manifest.directory) == manifest
    read_images, read_masks = _read(manifest.directory)
    assert read_masks.dtype == np.int32 and read_masks.shape == masks.shape
    np.testing.assert_array_equal(read_masks, masks)
    np.testing.assert_array_equal(read_images, images.astype(np.float32))
    record = tf.train.Example.FromString(next(iter(tf.data.TFRecordDataset(
        manifest.files[0]))).numpy()).features.feature
    assert sorted(record) == [
        "image/channels", "image/encoded", "image/filename", "image/format", "image/height",
        "image/segmentation/class/encoded", "image/segmentation/class/format", "image/width"]
    np.testing.assert_array_equal(  # the mask is a plain PNG of the class indices
        tf.io.decode_png(record["image/segmentation/class/encoded"].bytes_list.value[0])[..., 0],
        masks[0])

    # Multi-label masks: one 0/1 channel per class, overlapping, stored as bits.
    channels = np.stack([masks == 1, masks >= 1, masks == 2, masks == 255], axis=-1)
    multi = tfmem.write_image_tfrecords((images, channels.astype(np.int64)), tmp_path / "multi",
                                        shuffle=False)
    assert multi.class_names == ("0", "1", "2", "3") and multi.schema.multi_label
    np.testing.assert_array_equal(np.stack(_stored(multi)), (channels * [1, 2, 4, 8]).sum(-1))

    # Two classes stored as 0 and 255 would leave the foreground ignored: refused.
    with pytest.raises(ValueError, match=r"The 6 masks hold no class but 0 \(background\), "
                                         r"besides the ignore value 255"):
        tfmem.write_image_tfrecords((images, (masks > 0) * 255), tmp_path / "binary")
    assert not list((tmp_path / "binary").iterdir())


def test_augmentation_moves_image_and_mask_together(written, tmp_path):
    _, masks, _ = written
    # Each pixel's brightness tells its class: 100 + 50 × class (ignored pixels: 250).
    images = np.repeat((100 + 50 * np.minimum(masks, 3))[..., None], 3, axis=-1).astype(np.uint8)
    manifest = tfmem.write_image_tfrecords((images, masks), tmp_path, shuffle=False)
    dataset = tfmem.image_dataset(manifest.directory, image_size=(16, 24), training=True,
                                  augment=True, seed=3, batch_size=NUM_EXAMPLES)
    # Static shapes (drop_remainder), as TPUs need, after the augmentation too.
    assert [tuple(spec.shape) for spec in dataset.element_spec] == [
        (NUM_EXAMPLES, 16, 24, 3), (NUM_EXAMPLES, 16, 24)]
    (images, read), = dataset.as_numpy_iterator()
    value = images[..., 0]
    # Away from edges (where bilinear mixes two classes) the image says the mask's class; a
    # pixel outside the zoomed-out image is 0 in the image and ignored in the mask.
    expected = {100: 0, 150: 1, 200: 2, 250: 255, 0: 255}
    for brightness, label in expected.items():
        at = np.isclose(value, brightness, atol=1e-3)
        np.testing.assert_array_equal(read[at], label)
    assert np.isin(read, [0, 1, 2, 255]).all()  # nearest-neighbour: no new value
    assert np.isclose(value[..., None], list(expected), atol=1e-3).any(-1).mean() > 0.5
    # Scaled, cropped or flipped: most examples are not as stored (resized), in any order (a
    # scale near 1 without a flip may leave one so).
    plain = _nearest(masks, 16, 24)
    unchanged = sum(any(np.array_equal(mask, other) for other in plain) for mask in read)
    assert unchanged < NUM_EXAMPLES / 2


def _png(array, palette=None):
    image = Image.fromarray(array)
    if palette is not None:  # a grey image with a palette becomes a palette ("P") image
        image.putpalette(palette)
    return image


def test_folder_pair_reads_palette_masks_as_indices(tmp_path, written):
    images, masks, _ = written
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    voc = [0, 0, 0, 128, 0, 0, 0, 128, 0] + [224, 224, 192] * 253  # VOC's first colours
    for index in range(3):
        _png(images[index]).save(tmp_path / "images" / f"{index:03d}.png")
        mask = _png(masks[index], voc) if index < 2 else _png(masks[index])
        mask.save(tmp_path / "masks" / f"{index:03d}.png")  # palette, palette, grey
    assert Image.open(tmp_path / "masks" / "000.png").mode == "P"
    manifest = tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "masks"),
                                           tmp_path / "set", class_names=CLASSES, shuffle=False)
    assert manifest.num_examples == 3 and manifest.task == "segmentation"
    np.testing.assert_array_equal(np.stack(_stored(manifest)), masks[:3])

    def refused(match):
        with pytest.raises(ValueError, match=match):
            tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "masks"),
                                        tmp_path / "out", class_names=CLASSES)
        assert not (tmp_path / "out" / "manifest.json").exists()

    _png(images[3]).save(tmp_path / "images" / "003.png")
    refused(r"image '.*images/003.png' has no mask in '.*masks'")
    _png(masks[3][:, :10]).save(tmp_path / "masks" / "003.png")
    refused(r"mask '.*masks/003.png' is 10×20 pixels but its image '.*003.png' is 28×20")
    bad = masks[3].copy()
    bad[4, 5] = 7
    _png(bad).save(tmp_path / "masks" / "003.png")
    refused(r"mask '.*masks/003.png' holds the value 7 \(1 such pixel\(s\)\); expected a class "
            r"index in \[0, 3\) of the class_names or the ignore value 255")
    (tmp_path / "images" / "003.png").unlink()
    refused(r"mask '.*masks/003.png' has no image in '.*images'")


def _example(image, mask, name):
    def feature(value):
        if isinstance(value, int):
            return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": feature(tf.io.encode_png(image).numpy()),
        "image/format": feature(b"png"),
        "image/height": feature(image.shape[0]),
        "image/width": feature(image.shape[1]),
        "image/segmentation/class/encoded": feature(tf.io.encode_png(mask[..., None]).numpy()),
        "image/segmentation/class/format": feature(b"png"),
        "image/filename": feature(name.encode()),
    })).SerializeToString()


def test_foreign_deeplab_records_are_read_and_a_bad_mask_value_is_named(written, tmp_path):
    images, masks, _ = written
    for shard in range(2):
        with tf.io.TFRecordWriter(str(tmp_path / f"train-{shard}.tfrecord")) as writer:
            for index in range(3 * shard, 3 * shard + 3):
                writer.write(_example(images[index], masks[index], f"{index}.png"))
    schema = tfmem.detect_schema(str(tmp_path / "train-0.tfrecord"))
    assert (schema.image_key, schema.mask_key, schema.id_key, schema.ignore_value) == (
        "image/encoded", "image/segmentation/class/encoded", "image/filename", 255)
    # Read at another size, not square: masks nearest-neighbour, images bilinear.
    read_images, read_masks = _read(str(tmp_path / "train-*.tfrecord"), image_size=(13, 37))
    np.testing.assert_array_equal(read_masks, _nearest(masks, 13, 37))
    np.testing.assert_allclose(read_images, tf.image.resize(images, (13, 37)), atol=1e-3)

    bad = masks[4].copy()
    bad[0, 0] = 3  # not one of 3 classes, not the ignore value
    with tf.io.TFRecordWriter(str(tmp_path / "train-1.tfrecord")) as writer:
        for index, mask in ((3, masks[3]), (4, bad), (5, masks[5])):
            writer.write(_example(images[index], mask, f"{index}.png"))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"record 1 of .*train-1\.tfrecord: its mask "
                             r"\(`image/segmentation/class/encoded`\) holds the value 3, not a "
                             r"class index in \[0, 3\) or the ignore value 255"):
        _read(str(tmp_path / "train-*.tfrecord"), num_classes=3)


def _decoded_by_hand(text, height, width):
    """Kaggle's runs, pixel by pixel: 1-based starts counted down each column."""
    mask = np.zeros((height, width), np.uint8)
    numbers = [int(n) for n in text.split()]
    for start, length in zip(numbers[::2], numbers[1::2]):
        for pixel in range(start - 1, start - 1 + length):
            mask[pixel % height, pixel // height] = 1
    return mask


def test_kaggle_rle_csv_becomes_masks_with_overlapping_classes_as_channels(tmp_path):
    rng = np.random.default_rng(2)
    (tmp_path / "images").mkdir()
    shapes = {"a.jpg": (12, 16), "b.jpg": (16, 12)}
    for name, shape in shapes.items():
        image = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
        (tmp_path / "images" / name).write_bytes(tf.io.encode_jpeg(image).numpy())
    runs = {("a.jpg", "Fish"): "1 5 30 8", ("a.jpg", "Sugar"): "3 4 100 20",  # overlap at 3-5
            ("a.jpg", "Gravel"): "", ("b.jpg", "Fish"): "",
            ("b.jpg", "Gravel"): "13 3 150 40", ("b.jpg", "Sugar"): "190 2"}
    lines = ["Image_Label,EncodedPixels"] + [f"{image}_{label},{text}"
                                              for (image, label), text in runs.items()]
    (tmp_path / "clouds.csv").write_text("\n".join(lines) + "\n")
    manifest = tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "clouds.csv"),
                                           tmp_path / "clouds", shuffle=False)
    assert manifest.class_names == ("Fish", "Gravel", "Sugar") and manifest.schema.multi_label
    dataset = tfmem.image_dataset(manifest.directory, image_size=(12, 16), batch_size=1,
                                  training=False)
    first = next(iter(dataset))[1].numpy()[0]  # a.jpg, at its own size
    expected = np.stack([_decoded_by_hand(runs.get(("a.jpg", name), ""), 12, 16)
                         for name in manifest.class_names], axis=-1)
    np.testing.assert_array_equal(first, expected)
    assert (expected.sum(-1) == 2).any()  # the classes do overlap

    # No overlap: class indices, 0 the background (ImageId_ClassId, several rows per class).
    (tmp_path / "steel.csv").write_text(
        "ImageId_ClassId,EncodedPixels\na.jpg_1,1 5\na.jpg_3,40 10\na.jpg_1,100 3\nb.jpg_1,\n")
    steel = tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "steel.csv"),
                                        tmp_path / "steel", shuffle=False)
    assert steel.class_names == ("background", "1", "3") and not steel.schema.multi_label
    np.testing.assert_array_equal(_stored(steel)[0], _decoded_by_hand("1 5 100 3", 12, 16)
                                  + 2 * _decoded_by_hand("40 10", 12, 16))

    (tmp_path / "long.csv").write_text("ImageId,EncodedPixels\na.jpg,190 8\nb.jpg,\n")
    with pytest.raises(ValueError, match=re.escape(
            f"'{tmp_path / 'long.csv'}', image 'a.jpg', class '1': its runs leave the "
            "image's 192 pixels (16×12)")):
        tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "long.csv"),
                                    tmp_path / "long")


def test_rle_csv_without_empty_rows_lists_only_images_with_masks(tmp_path):
    rng = np.random.default_rng(3)
    (tmp_path / "images").mkdir()
    for name, shape in {"a.jpg": (12, 16), "b.jpg": (16, 12), "c.jpg": (10, 10)}.items():
        image = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
        (tmp_path / "images" / name).write_bytes(tf.io.encode_jpeg(image).numpy())
    # Severstal's newer layout: a row per image and class with pixels; b and c have none.
    (tmp_path / "steel.csv").write_text(
        "ImageId,ClassId,EncodedPixels\na.jpg,3,1 5 100 3\na.jpg,1,40 10\nc.jpg,3,7 2\n")
    steel = tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "steel.csv"),
                                        tmp_path / "steel", shuffle=False)
    assert steel.class_names == ("background", "1", "3") and steel.num_examples == 3
    expected = [_decoded_by_hand("40 10", 12, 16) + 2 * _decoded_by_hand("1 5 100 3", 12, 16),
                np.zeros((16, 12), np.uint8), 2 * _decoded_by_hand("7 2", 10, 10)]
    for stored, mask in zip(_stored(steel), expected, strict=True):
        np.testing.assert_array_equal(stored, mask)

    # A CSV with rows of empty runs lists every image: one missing is the wrong folder.
    (tmp_path / "ships.csv").write_text("ImageId,EncodedPixels\na.jpg,1 5\nb.jpg,\n")
    with pytest.raises(ValueError, match=re.escape(
            f"image '{tmp_path / 'images' / 'c.jpg'}' has no row in '{tmp_path / 'ships.csv'}' "
            "(1 such image(s)), which lists every image (it has rows of empty EncodedPixels)")):
        tfmem.write_image_tfrecords((tmp_path / "images", tmp_path / "ships.csv"),
                                    tmp_path / "ships")


def test_demo_segmentation_set_draws_the_shapes_as_masks(tmp_path):
    manifest = tfmem.make_demo_dataset(tmp_path, num_examples=8, image_size=(12, 16), seed=5,
                                       task="segmentation")
    assert manifest.class_names == ("background", "disk", "square", "triangle", "plus")
    assert manifest.origin.endswith("image_size=(12, 16), seed=5, task='segmentation')")
    drawn = list(tfmem.demo_examples(8, (12, 16), seed=5, task="segmentation"))
    labelled = list(tfmem.demo_examples(8, (12, 16), seed=5))
    for (image, mask), (same_image, label) in zip(drawn, labelled):
        np.testing.assert_array_equal(image, same_image)  # the classification set's pictures
        assert set(np.unique(mask)) == {0, label + 1}
        bright = image.mean(-1) > 125  # the shape is the brighter part
        assert (bright == (mask > 0)).mean() > 0.9
    # Written in the order drawn.
    np.testing.assert_array_equal(np.stack(_stored(manifest)),
                                  np.stack([mask for _, mask in drawn]))
