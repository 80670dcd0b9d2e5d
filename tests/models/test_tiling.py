"""tfmem.predict_tiled against the whole-image prediction of the same model."""

import keras
import numpy as np
import pytest

import tfmem
from tfmem import models

RNG = np.random.default_rng(0)


def _images(height, width, count=2):
    return RNG.uniform(0, 255, size=(count, height, width, 3)).astype("float32")


def _model(*blocks):
    """A model of any input size made of `blocks` (layers called in order)."""
    inputs = x = keras.Input((None, None, 3))
    for layer in blocks:
        x = layer(x)
    return keras.Model(inputs, x)


@pytest.fixture(scope="module")
def three_convs():
    """Three 'same' 3×3 convolutions: each output pixel sees 3 pixels to each side."""
    keras.utils.set_random_seed(1)
    return _model(keras.layers.Rescaling(1 / 255),
                  *(keras.layers.Conv2D(4, 3, padding="same", activation="tanh")
                    for _ in range(3)))


@pytest.fixture(scope="module")
def pooled():
    """Convolutions around a 2× pooling and upsampling (stride 2), without concatenation."""
    keras.utils.set_random_seed(2)
    return _model(keras.layers.Rescaling(1 / 255),
                  keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
                  keras.layers.MaxPooling2D(2),
                  keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
                  keras.layers.UpSampling2D(2),
                  keras.layers.Conv2D(3, 1, activation="softmax"))


def test_tiles_equal_the_whole_image_where_the_receptive_field_is_within_half_the_overlap(
        three_convs):
    images = _images(37, 53)  # no multiple of the tile's step
    whole = three_convs.predict(images, verbose=0)
    tiled = tfmem.predict_tiled(three_convs, images, 16, overlap=6, batch_size=5)
    assert tiled.shape == whole.shape == (2, 37, 53, 4)
    np.testing.assert_allclose(tiled, whole, atol=1e-5)
    # Seams closer to a tile's edge than the receptive field's radius (3) show.
    near_edges = tfmem.predict_tiled(three_convs, images, 16, overlap=2, batch_size=5)
    assert np.abs(near_edges - whole).max() > 1e-3


def test_a_pointwise_model_is_exact_without_overlap_and_on_images_smaller_than_a_tile():
    keras.utils.set_random_seed(3)
    pointwise = _model(keras.layers.Conv2D(2, 1))
    for size in ((21, 30), (5, 7)):  # several tiles; one tile, padded and cropped back
        images = _images(*size, count=3)
        np.testing.assert_allclose(
            tfmem.predict_tiled(pointwise, images, (8, 12), overlap=0, batch_size=4),
            pointwise.predict(images, verbose=0), atol=1e-5)


def test_tile_offsets_follow_the_pooling_grid(pooled):
    images = _images(38, 50)  # sizes the model takes (multiples of its stride, 2)
    whole = pooled.predict(images, verbose=0)
    # 16-pixel tiles, overlap 11: steps of 5 would put odd offsets off the pooling grid; the
    # stride found from the model (2) makes them 4.
    tiled = tfmem.predict_tiled(pooled, images, 16, overlap=11, batch_size=8)
    np.testing.assert_allclose(tiled, whole, atol=1e-5)
    off_grid = tfmem.predict_tiled(pooled, images, 16, overlap=11, batch_size=8, stride=1)
    assert np.abs(off_grid - whole).max() > 1e-3


def test_a_unet_built_for_its_tile_predicts_any_size():
    unet = models.build("unet", num_classes=3, image_size=32)
    images = _images(40, 56)  # not multiples of its stride (16): the last tiles are flush
    predicted = tfmem.predict_tiled(unet, images, overlap=8, batch_size=4)
    assert predicted.shape == (2, 40, 56, 3)
    np.testing.assert_allclose(predicted.sum(axis=-1), 1.0, atol=1e-5)  # its softmax
    # The stride found from the model is its 4 poolings' 16.
    np.testing.assert_allclose(
        tfmem.predict_tiled(unet, images, overlap=8, batch_size=4, stride=16), predicted,
        atol=1e-6)
    # One tile covers an image of the tile's size: the model's own prediction.
    np.testing.assert_allclose(
        tfmem.predict_tiled(unet, images[:, :32, :32], overlap=8),
        unet.predict(images[:, :32, :32], verbose=0), atol=1e-5)
    with pytest.raises(ValueError, match=r"^`tile_size` \(48, 48\): the model takes only "
                                         r"32×32 inputs"):
        tfmem.predict_tiled(unet, images, 48, overlap=8)


@pytest.mark.parametrize("arguments, message", [
    (dict(tile_size=16, overlap=16), r"^`overlap` \(16, 16\) must be ≥ 0 and below the tile"),
    (dict(tile_size=15, overlap=4), r"^`tile_size` \(15, 15\): the model does not map 15×15 "
                                    r"inputs to outputs of that size"),
    (dict(tile_size=None), r"^`tile_size` is needed"),
    (dict(tile_size=16, overlap=15), r"^`overlap` 15 leaves a step of 1 pixels .* stride 2"),
    (dict(tile_size=16, batch_size=0), r"^`batch_size` must be an int ≥ 1"),
])
def test_arguments_it_cannot_use_are_one_error_naming_the_argument(pooled, arguments, message):
    with pytest.raises(ValueError, match=message):
        tfmem.predict_tiled(pooled, _images(20, 20), **arguments)
