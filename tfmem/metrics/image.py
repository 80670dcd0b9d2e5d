"""Image-quality metrics on a declared pixel range: MAE, MSE, PSNR and SSIM.

Every function and metric takes an explicit `data_range` — `255` (or `(0, 255)`) for
8-bit pixels, `1.0` (or `(0, 1)`) for scaled ones, the same range the data pipeline
declares — and refuses data that does not fit it, because the wrong range gives
plausible-looking nonsense rather than an error:

* PSNR and SSIM depend on the range itself (PSNR = 10·log10(range² / MSE); SSIM's
  stabilising constants are (0.01·range)² and (0.03·range)²). SSIM with
  ``max_val=255`` on images scaled to [0, 1] makes the constants ~65,000× too large
  relative to the pixel statistics and returns 0.99999 for almost any pair of images.
* MSE on [0, 1] data squares numbers below 1, so it comes out far *smaller* than MAE
  (e.g. MAE 0.05 → MSE 0.0025); compared with a 0..255 baseline it looks like a
  65,025× improvement.

Hence: a value outside `data_range` is an error (set `clip_predictions=True` to clip
predictions, as restoration benchmarks do when saving 8-bit outputs), and data whose
targets and predictions all lie in [low, low + 1] under a range wider than 1 is
rejected as "[0, 1] data declared as 0..255".

Errors: eagerly, a `ValueError`; inside a compiled TensorFlow step (`fit`/`evaluate`)
an `InvalidArgumentError` naming the metric; under a jitted JAX step, where nothing can
raise, the affected images score NaN.

Conventions match scikit-image: PSNR as `peak_signal_noise_ratio`, SSIM as
`structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
channel_axis=-1)` (an 11×11 Gaussian window, valid positions only, mean over channels).
Functions take one image `(H, W, C)` or a batch `(N, H, W, C)` and return one value per
image; the Keras metrics average those values over all images seen.

Example:
    >>> import numpy as np
    >>> clean = np.full((16, 16, 3), 100.0)
    >>> round(float(psnr(clean, clean + 10.0, data_range=255)), 4)  # 10·log10(255² / 100)
    28.1308
    >>> model.compile(..., metrics=[PSNR(data_range=1.0), SSIM(data_range=1.0)])  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import keras
import numpy as np
from keras import ops

from tfmem import backend

# The checks of a metric's inputs inside a compiled function, per backend.
_CHECKS = backend.half(tensorflow="tfmem.metrics.traced_tf", jax="tfmem.metrics.traced_jax")

__all__ = ["mae", "mse", "psnr", "ssim", "MAE", "MSE", "PSNR", "SSIM"]

DataRange = Union[float, Sequence[float]]

_SSIM_WINDOW = 11  # skimage: 2 * int(truncate * sigma + 0.5) + 1 with truncate 3.5
_SSIM_SIGMA = 1.5
_SSIM_K1, _SSIM_K2 = 0.01, 0.03


def _resolve_range(data_range: DataRange) -> tuple[float, float]:
    """`255` → (0, 255); `(low, high)` → itself; anything else is an error."""
    if isinstance(data_range, (int, float)) and not isinstance(data_range, bool):
        low, high = 0.0, float(data_range)
    elif isinstance(data_range, (tuple, list)) and len(data_range) == 2:
        low, high = float(data_range[0]), float(data_range[1])
    else:
        raise TypeError(
            f"`data_range` must be the pixel range of your data, 255 or 1.0 (or a (low, "
            f"high) pair such as (0, 255)); got {data_range!r}. Pass the range your data "
            "pipeline declares.")
    if not (math.isfinite(low) and math.isfinite(high) and high > low):
        raise ValueError(f"`data_range` must satisfy low < high; got {data_range!r}.")
    return low, high


def _prepare(y_true, y_pred, data_range, clip_predictions, metric):
    """Validates shapes and range; returns float32 batches, (low, high), and the
    per-image validity (all True unless traced under JAX)."""
    low, high = _resolve_range(data_range)
    # uint8 pixels and float16 model outputs are scored in float32.
    y_true = ops.cast(ops.convert_to_tensor(y_true), "float32")
    y_pred = ops.cast(ops.convert_to_tensor(y_pred), "float32")
    if not _same_shape(y_true.shape, y_pred.shape) or len(y_true.shape) not in (3, 4):
        raise ValueError(
            f"{metric}: y_true and y_pred must both be (height, width, channels) or "
            f"(batch, height, width, channels) with the same shape; got "
            f"{tuple(y_true.shape)} and {tuple(y_pred.shape)}.")
    single = len(y_true.shape) == 3
    if single:
        y_true, y_pred = y_true[None], y_pred[None]
    if clip_predictions:
        y_pred = ops.clip(y_pred, low, high)
    valid = _check_range(y_true, y_pred, low, high, metric)
    return y_true, y_pred, (low, high), valid, single


def _same_shape(a, b) -> bool:
    # Unknown (None) dimensions of a traced batch match anything.
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def _check_range(y_true, y_pred, low, high, metric):
    span = high - low
    fix = ("declare the range your images really have (data_range=255 for 0..255 "
           "pixels, 1.0 for 0..1), the same one the data pipeline uses")
    if not _CHECKS.is_traced(y_true):
        for name, x in (("y_true", y_true), ("y_pred", y_pred)):
            x_min, x_max = float(ops.min(x)), float(ops.max(x))
            if x_min < low or x_max > high:
                hint = (" (or pass clip_predictions=True to clip model outputs)"
                        if name == "y_pred" else "")
                raise ValueError(
                    f"{metric}: {name} has values in [{x_min:.6g}, {x_max:.6g}], outside "
                    f"the declared data_range ({low:g}, {high:g}); {fix}{hint}.")
        if span > 1 and float(ops.maximum(ops.max(y_true), ops.max(y_pred))) <= low + 1:
            raise ValueError(
                f"{metric}: every value lies in [{low:g}, {low + 1:g}] but data_range is "
                f"({low:g}, {high:g}): these look like [0, 1] images declared as 0..255, "
                f"which inflates SSIM to ~1 and PSNR by {20 * math.log10(span):.0f} dB; "
                "pass data_range=1.0.")
        return None
    # Traced: the backend's half checks in the graph (TensorFlow) or marks images (JAX).
    return _CHECKS.check_range(y_true, y_pred, low, high, metric, fix)


def _finish(values, valid, single):
    if valid is not None:
        values = ops.where(valid, values, ops.full_like(values, float("nan")))
    return values[0] if single else values


def mae(y_true, y_pred, *, data_range: DataRange, clip_predictions: bool = False):
    """Mean absolute error per image, in the units of `data_range`.

    Args:
        y_true: reference image(s), `(H, W, C)` or `(N, H, W, C)`.
        y_pred: image(s) of the same shape.
        data_range: 255, 1.0, or (low, high); values outside it are an error.
        clip_predictions: clip `y_pred` into the range instead of raising.

    Returns:
        A scalar for one image, else shape `(N,)`.

    Example:
        >>> float(mae([[[0.0]]], [[[0.5]]], data_range=1.0))
        0.5
    """
    y_true, y_pred, _, valid, single = _prepare(y_true, y_pred, data_range,
                                                clip_predictions, "mae")
    return _finish(ops.mean(ops.abs(y_true - y_pred), axis=(1, 2, 3)), valid, single)


def mse(y_true, y_pred, *, data_range: DataRange, clip_predictions: bool = False):
    """Mean squared error per image, in squared units of `data_range`.

    On [0, 1] data MSE is much smaller than MAE (errors below 1 shrink when squared);
    compare MSEs only between runs with the same `data_range`.

    Example:
        >>> float(mse([[[0.0]]], [[[0.5]]], data_range=1.0))
        0.25
    """
    y_true, y_pred, _, valid, single = _prepare(y_true, y_pred, data_range,
                                                clip_predictions, "mse")
    return _finish(ops.mean(ops.square(y_true - y_pred), axis=(1, 2, 3)), valid, single)


def psnr(y_true, y_pred, *, data_range: DataRange, clip_predictions: bool = False):
    """Peak signal-to-noise ratio per image in dB: 10·log10(range² / MSE).

    Identical images give +inf, as in scikit-image.

    Example:
        >>> round(float(psnr([[[0.0]]], [[[0.1]]], data_range=1.0)), 6)
        20.0
    """
    y_true, y_pred, (low, high), valid, single = _prepare(
        y_true, y_pred, data_range, clip_predictions, "psnr")
    error = ops.mean(ops.square(y_true - y_pred), axis=(1, 2, 3))
    values = 10.0 * ops.log10((high - low) ** 2 / error)
    return _finish(values, valid, single)


def _gaussian_window(channels: int):
    offsets = np.arange(_SSIM_WINDOW, dtype="float64") - (_SSIM_WINDOW - 1) / 2
    profile = np.exp(-(offsets**2) / (2 * _SSIM_SIGMA**2))
    profile /= profile.sum()
    window = np.outer(profile, profile)[:, :, None, None]
    return ops.convert_to_tensor(np.tile(window, (1, 1, channels, 1)), dtype="float32")


def ssim(y_true, y_pred, *, data_range: DataRange, clip_predictions: bool = False):
    """Structural similarity per image (Wang et al. 2004), averaged over channels.

    Gaussian 11×11 window with σ = 1.5 over valid positions, population covariances,
    K1 = 0.01, K2 = 0.03: scikit-image's `structural_similarity(gaussian_weights=True,
    sigma=1.5, use_sample_covariance=False, channel_axis=-1, data_range=high - low)`.

    Example:
        >>> image = np.linspace(0, 1, 16 * 16 * 3).reshape(16, 16, 3)
        >>> round(float(ssim(image, image, data_range=1.0)), 6)
        1.0
    """
    y_true, y_pred, (low, high), valid, single = _prepare(
        y_true, y_pred, data_range, clip_predictions, "ssim")
    height, width, channels = y_true.shape[1:]
    if height is not None and width is not None and min(height, width) < _SSIM_WINDOW:
        raise ValueError(
            f"ssim needs images of at least {_SSIM_WINDOW}×{_SSIM_WINDOW} (its Gaussian "
            f"window); got {height}×{width}.")
    window = _gaussian_window(channels)

    def local_mean(x):
        return ops.depthwise_conv(x, window, strides=1, padding="valid")

    c1 = (_SSIM_K1 * (high - low)) ** 2
    c2 = (_SSIM_K2 * (high - low)) ** 2
    mean_true, mean_pred = local_mean(y_true), local_mean(y_pred)
    var_true = local_mean(y_true * y_true) - mean_true**2
    var_pred = local_mean(y_pred * y_pred) - mean_pred**2
    covariance = local_mean(y_true * y_pred) - mean_true * mean_pred
    similarity = ((2 * mean_true * mean_pred + c1) * (2 * covariance + c2)) / (
        (mean_true**2 + mean_pred**2 + c1) * (var_true + var_pred + c2))
    return _finish(ops.mean(similarity, axis=(1, 2, 3)), valid, single)


class _RangeMetric(keras.metrics.MeanMetricWrapper):
    """Mean over images of a per-image metric, with its `data_range` in the config."""

    _function = None
    _default_name = None

    def __init__(self, data_range: DataRange, clip_predictions: bool = False,
                 name: str | None = None, dtype=None):
        low, high = _resolve_range(data_range)  # fail at construction, not mid-fit
        self.data_range = (low, high)
        self.clip_predictions = clip_predictions
        super().__init__(type(self)._function, name=name or self._default_name,
                         dtype=dtype, data_range=self.data_range,
                         clip_predictions=clip_predictions)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype,
                "data_range": list(self.data_range),
                "clip_predictions": self.clip_predictions}


@keras.saving.register_keras_serializable(package="tfmem")
class MAE(_RangeMetric):
    """Keras metric: mean over images of `mae`. Example: `MAE(data_range=255)`."""

    _function = staticmethod(mae)
    _default_name = "mae"


@keras.saving.register_keras_serializable(package="tfmem")
class MSE(_RangeMetric):
    """Keras metric: mean over images of `mse`. Example: `MSE(data_range=1.0)`."""

    _function = staticmethod(mse)
    _default_name = "mse"


@keras.saving.register_keras_serializable(package="tfmem")
class PSNR(_RangeMetric):
    """Keras metric: mean over images of `psnr` (dB). Example: `PSNR(data_range=255)`."""

    _function = staticmethod(psnr)
    _default_name = "psnr"


@keras.saving.register_keras_serializable(package="tfmem")
class SSIM(_RangeMetric):
    """Keras metric: mean over images of `ssim`. Example: `SSIM(data_range=1.0)`."""

    _function = staticmethod(ssim)
    _default_name = "ssim"
