"""tfmem.metrics against scikit-image on its shipped sample photographs, both ranges."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from skimage import data as skdata
from skimage import metrics as skmetrics

from tfmem.metrics import image as metrics


def _photographs():
    """scikit-image's bundled photos (no download) as float64 RGB in [0, 255]."""
    photos = {name: getattr(skdata, name)() for name in ("astronaut", "coffee", "chelsea")}
    photos["camera"] = np.repeat(skdata.camera()[:, :, None], 3, axis=-1)  # gray → RGB
    # Keep the tests fast: a 160×160 crop of each (SSIM's window is 11×11).
    return {name: photo[:160, :160].astype("float64") for name, photo in photos.items()}


PHOTOS = _photographs()


def _noisy(image, seed, sigma=12.0):
    rng = np.random.default_rng(seed)
    return np.clip(image + rng.normal(0.0, sigma, image.shape), 0.0, 255.0)


def _skimage(clean, noisy, data_range):
    return {
        "mae": np.mean(np.abs(clean - noisy)),
        "mse": skmetrics.mean_squared_error(clean, noisy),
        "psnr": skmetrics.peak_signal_noise_ratio(clean, noisy, data_range=data_range),
        "ssim": skmetrics.structural_similarity(
            clean, noisy, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
            channel_axis=-1, data_range=data_range),
    }


FUNCTIONS = {"mae": metrics.mae, "mse": metrics.mse, "psnr": metrics.psnr,
             "ssim": metrics.ssim}


@pytest.mark.parametrize("scale", [255.0, 1.0])
@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_functions_match_scikit_image(name, scale):
    clean = PHOTOS[name] / 255.0 * scale
    noisy = _noisy(PHOTOS[name], seed=len(name)) / 255.0 * scale
    expected = _skimage(clean, noisy, data_range=scale)
    for metric, function in FUNCTIONS.items():
        actual = float(function(clean, noisy, data_range=scale))
        np.testing.assert_allclose(actual, expected[metric], rtol=1e-3, err_msg=metric)
    # Sanity on the references themselves: real noise, not a degenerate pair.
    assert 0.2 < expected["ssim"] < 0.95 and 20 < expected["psnr"] < 35


def test_batch_gives_one_value_per_image_and_tuple_range():
    clean = np.stack([PHOTOS["astronaut"], PHOTOS["coffee"]])
    noisy = np.stack([_noisy(PHOTOS["astronaut"], 1), _noisy(PHOTOS["coffee"], 2, sigma=30)])
    values = np.asarray(metrics.ssim(clean, noisy, data_range=(0, 255)))
    expected = [_skimage(c, n, 255)["ssim"] for c, n in zip(clean, noisy)]
    assert values.shape == (2,)
    np.testing.assert_allclose(values, expected, rtol=1e-3)


@pytest.mark.parametrize("scale", [255.0, 1.0])
def test_keras_metrics_in_compiled_evaluate_match_scikit_image(scale):
    names = ["astronaut", "camera", "chelsea", "coffee"]
    clean = np.stack([PHOTOS[n] for n in names]) / 255.0 * scale
    noisy = np.stack([_noisy(PHOTOS[n], i) for i, n in enumerate(names)]) / 255.0 * scale
    per_image = [_skimage(c, n, scale) for c, n in zip(clean, noisy)]
    model = keras.Sequential([keras.Input((160, 160, 3)), keras.layers.Identity()])
    model.compile(loss="mse", metrics=[metrics.MAE(scale), metrics.MSE(scale),
                                       metrics.PSNR(scale), metrics.SSIM(scale)])
    # Batches of 2 so the metrics really average over several update_state calls.
    results = model.evaluate(noisy.astype("float32"), clean.astype("float32"),
                             batch_size=2, verbose=0, return_dict=True)
    for metric in ("mae", "mse", "psnr", "ssim"):
        expected = np.mean([values[metric] for values in per_image])
        np.testing.assert_allclose(results[metric], expected, rtol=1e-3, err_msg=metric)


def test_value_outside_declared_range_is_a_value_error():
    clean, noisy = PHOTOS["astronaut"], _noisy(PHOTOS["astronaut"], 0)
    with pytest.raises(ValueError, match=r"psnr: y_true has values in \[0, 237\], outside "
                                         r"the declared data_range \(0, 1\)"):
        metrics.psnr(clean, noisy, data_range=1.0)
    with pytest.raises(ValueError, match="clip_predictions=True"):
        metrics.mae(clean / 255, noisy / 255 + 0.2, data_range=1.0)


def test_clip_predictions_clips_into_range():
    clean = PHOTOS["coffee"] / 255
    overshoot = clean + 0.3
    expected = skmetrics.peak_signal_noise_ratio(clean, np.clip(overshoot, 0, 1),
                                                 data_range=1.0)
    actual = float(metrics.psnr(clean, overshoot, data_range=1.0, clip_predictions=True))
    np.testing.assert_allclose(actual, expected, rtol=1e-3)


def test_unit_range_images_declared_as_255_are_refused():
    """The classic bug: [0, 1] images scored as 0..255 look almost perfect."""
    clean = PHOTOS["astronaut"] / 255
    noisy = _noisy(PHOTOS["astronaut"], 0) / 255
    fooled = float(tf.reduce_mean(tf.image.ssim(clean, noisy, max_val=255.0)))
    honest = _skimage(clean, noisy, data_range=1.0)["ssim"]
    assert fooled > 0.9999 and honest < 0.9
    # And on [0, 1] data MSE is far below MAE, unlike on 0..255 data.
    assert float(metrics.mse(clean, noisy, data_range=1.0)) < 0.2 * float(
        metrics.mae(clean, noisy, data_range=1.0))
    with pytest.raises(ValueError, match=r"look like \[0, 1\] images .* data_range=1.0"):
        metrics.ssim(clean, noisy, data_range=255)


def test_keras_metric_out_of_range_fails_inside_compiled_step():
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Identity()])
    model.compile(loss="mse", metrics=[metrics.PSNR(data_range=1.0)])
    images = np.full((2, 16, 16, 3), 200.0, "float32")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"psnr: values outside the declared data_range \(0, 1\)"):
        model.evaluate(images, images, verbose=0)
    model.compile(loss="mse", metrics=[metrics.SSIM(data_range=255)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, 1\] images"):
        model.evaluate(images / 255, images / 255, verbose=0)


@pytest.mark.parametrize("data_range, error", [
    (None, TypeError), ("255", TypeError), ((1, 0), ValueError), (0, ValueError)])
def test_bad_data_range(data_range, error):
    with pytest.raises(error, match="data_range"):
        metrics.SSIM(data_range=data_range)


def test_metric_config_round_trip():
    metric = metrics.SSIM(data_range=(0, 255), name="val_ssim")
    clone = keras.metrics.deserialize(keras.metrics.serialize(metric))
    assert type(clone) is metrics.SSIM
    assert clone.get_config() == metric.get_config()
    assert clone.data_range == (0.0, 255.0) and clone.name == "val_ssim"


def test_hand_computed_values():
    zeros, tenths = np.zeros((12, 12, 1)), np.full((12, 12, 1), 0.1)
    assert float(metrics.mae(zeros, tenths, data_range=1.0)) == pytest.approx(0.1)
    assert float(metrics.mse(zeros, tenths, data_range=1.0)) == pytest.approx(0.01)
    assert float(metrics.psnr(zeros, tenths, data_range=1.0)) == pytest.approx(20.0)
    assert float(metrics.psnr(zeros, zeros, data_range=1.0)) == np.inf
    with pytest.raises(ValueError, match="same shape"):
        metrics.mae(zeros, zeros[:, :6], data_range=1.0)
    with pytest.raises(ValueError, match="at least 11×11"):
        metrics.ssim(zeros[:8, :8], zeros[:8, :8], data_range=1.0)


def test_inside_tf_function_the_range_is_checked_by_the_graph():
    clean = np.full((2, 16, 16, 3), 100.0, "float32")
    traced = tf.function(lambda a, b: metrics.psnr(a, b, data_range=255))
    # 10·log10(255² / 10²) per image, as eagerly.
    np.testing.assert_allclose(traced(clean, clean + 10.0), [28.1308] * 2, atol=1e-4)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"psnr: values outside the declared data_range \(0, 255\)"):
        traced(clean, clean + 300.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, 1\] images declared as"):
        traced(clean / 255, clean / 255)
