"""make_demo_dataset reuses a demo set with the same content and refuses to replace another."""

import numpy as np
import pytest

import tfmem


def _images(manifest):
    dataset = tfmem.image_dataset(manifest.directory, image_size=(8, 8), batch_size=64,
                                  training=False)
    return np.concatenate([images for images, _ in dataset.as_numpy_iterator()])


def test_the_same_demo_set_is_reused_and_another_is_refused(tmp_path):
    first = tfmem.make_demo_dataset(tmp_path, num_examples=12, image_size=8, seed=3)
    assert first.origin == "tfmem.make_demo_dataset(num_examples=12, image_size=8, seed=3)"
    written = (tmp_path / "manifest.json").stat().st_mtime_ns
    again = tfmem.make_demo_dataset(tmp_path, num_examples=12, image_size=8, seed=3)
    assert again == tfmem.read_manifest(tmp_path) and again.fingerprint == first.fingerprint
    assert (tmp_path / "manifest.json").stat().st_mtime_ns == written
    for other in ({"seed": 4}, {"num_examples": 16}, {"image_size": 16}):
        with pytest.raises(ValueError, match="already holds a TFRecord set"):
            tfmem.make_demo_dataset(tmp_path, **{"num_examples": 12, "image_size": 8,
                                                 "seed": 3} | other)
    replaced = tfmem.make_demo_dataset(tmp_path, num_examples=12, image_size=8, seed=4,
                                       overwrite=True)
    assert replaced.origin.endswith("seed=4)")
    expected = np.stack([image for image, _ in tfmem.demo_examples(12, 8, seed=4)])
    # The records hold seed 4's pixels, in the order drawn.
    np.testing.assert_array_equal(_images(replaced), expected.astype(np.float32))


def test_a_set_without_an_origin_keeps_its_manifest_text(tmp_path):
    images = np.zeros((4, 8, 8, 3), np.uint8)
    manifest = tfmem.write_image_tfrecords((images, np.arange(4) % 2), tmp_path)
    assert manifest.origin == "" and '"origin"' not in manifest.to_json()
    assert tfmem.read_manifest(tmp_path) == manifest
