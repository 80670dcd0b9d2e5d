"""The `keras.applications` families users fine-tune, with their input scaling as a layer.

Every tfmem classifier takes raw pixels in [0, 255]; `ImagePreprocessing` applies the
family's convention (caffe, tf or torch; table in docs/models.md) inside the model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
from keras import ops

from tfmem.models import small_cnn

_IMAGENET_RGB_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_RGB_STD = (0.229, 0.224, 0.225)
_CAFFE_BGR_MEAN = (103.939, 116.779, 123.68)
PREPROCESSING_MODES = ("caffe", "tf", "torch")


@keras.saving.register_keras_serializable(package="tfmem")
class ImagePreprocessing(keras.layers.Layer):
    """Maps RGB pixels in [0, 255] to what a `keras.applications` backbone expects.

    Args:
        mode: "caffe", "tf" or "torch" (see the module docstring).

    Example:
        >>> layer = ImagePreprocessing("tf")
        >>> [float(v) for v in layer(keras.ops.array([[[[0.0, 127.5, 255.0]]]]))[0, 0, 0]]
        [-1.0, 0.0, 1.0]
    """

    def __init__(self, mode: str, **kwargs):
        super().__init__(**kwargs)
        if mode not in PREPROCESSING_MODES:
            raise ValueError(
                f"Unknown preprocessing mode {mode!r}; expected one of {PREPROCESSING_MODES}.")
        self.mode = mode

    def call(self, inputs):
        x = ops.cast(inputs, self.compute_dtype)
        if self.mode == "tf":
            return x / 127.5 - 1.0
        if self.mode == "torch":
            mean = ops.array(_IMAGENET_RGB_MEAN, dtype=self.compute_dtype)
            std = ops.array(_IMAGENET_RGB_STD, dtype=self.compute_dtype)
            return (x / 255.0 - mean) / std
        bgr = ops.flip(x, axis=-1)
        return bgr - ops.array(_CAFFE_BGR_MEAN, dtype=self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "mode": self.mode}


@dataclasses.dataclass(frozen=True)
class ApplicationFamily:
    """How to build one `keras.applications` backbone."""

    constructor: Callable[..., keras.Model]
    default_image_size: int
    preprocessing: str | None  # a mode of ImagePreprocessing, or None if built in
    default_dropout: float
    extra_kwargs: dict = dataclasses.field(default_factory=dict)

    def backbone(self, input_shape: tuple[int, int, int], weights: str | None) -> keras.Model:
        """The Keras model without its classifier, optionally loading a local `.h5`."""
        kwargs = dict(self.extra_kwargs)
        if "include_preprocessing" in kwargs:
            # Keep the family's own scaling: its pretrained weights expect it.
            kwargs["include_preprocessing"] = True
        return self.constructor(include_top=False, weights=weights,
                                input_shape=input_shape, **kwargs)


def _families() -> dict[str, ApplicationFamily]:
    apps = keras.applications
    # Image sizes: Keras's defaults (the resolution each ImageNet checkpoint was made
    # at). Dropout before the classifier: the Keras/paper value where the family has
    # one, 0 for ResNet/DenseNet, whose reference heads have none. (ConvNeXt's Keras
    # backbone already ends in its head's LayerNorm, so pooling + Dense matches it.)
    built_in = {"include_preprocessing": True}
    effnet = [("b0", apps.EfficientNetV2B0, 224), ("b1", apps.EfficientNetV2B1, 240),
              ("b2", apps.EfficientNetV2B2, 260), ("b3", apps.EfficientNetV2B3, 300),
              ("s", apps.EfficientNetV2S, 384), ("m", apps.EfficientNetV2M, 480),
              ("l", apps.EfficientNetV2L, 480)]
    table = {f"efficientnetv2-{suffix}": ApplicationFamily(fn, size, None, 0.2, built_in)
             for suffix, fn, size in effnet}
    for depth in (50, 101, 152):
        table[f"resnet{depth}"] = ApplicationFamily(
            getattr(apps, f"ResNet{depth}"), 224, "caffe", 0.0)
        table[f"resnet{depth}v2"] = ApplicationFamily(
            getattr(apps, f"ResNet{depth}V2"), 224, "tf", 0.0)
    for depth in (121, 169, 201):
        table[f"densenet{depth}"] = ApplicationFamily(
            getattr(apps, f"DenseNet{depth}"), 224, "torch", 0.0)
    for size in ("tiny", "small", "base", "large"):
        table[f"convnext-{size}"] = ApplicationFamily(
            getattr(apps, f"ConvNeXt{size.capitalize()}"), 224, None, 0.0, built_in)
    # MobileNetV3 is left out: its Keras head has an extra 1x1 conv after pooling that
    # a plain pooled-Dense head would silently drop.
    table["mobilenetv2"] = ApplicationFamily(apps.MobileNetV2, 224, "tf", 0.0)
    # Not from keras.applications: the demo's tiny CNN, built with the same signature.
    table["small-cnn"] = ApplicationFamily(small_cnn.small_cnn, 32, "tf", 0.0)
    return table


FAMILIES = _families()
