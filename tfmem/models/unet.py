"""A small U-Net (Ronneberger et al., MICCAI 2015) for segmentation and benchmarks.

Each level is two 3×3 conv → BN → ReLU; the encoder halves the resolution with a 2×2
max-pool and doubles the width, the decoder upsamples with a 2×2 stride-2 transposed
conv, concatenates the encoder features of the same resolution and applies two convs.
Unlike the paper's "valid" convolutions, padding is "same" so the output has the
input's size (the common modern variant) and BN follows every conv.

Example:
    >>> unet(input_shape=(32, 32, 3), num_classes=2).output_shape
    (None, 32, 32, 2)
"""

from __future__ import annotations

import keras
from keras import layers


def _conv_block(x, filters, name):
    for i in range(2):
        # No conv bias: the following BN's beta plays that role.
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                          kernel_initializer="he_normal", name=f"{name}_conv{i}")(x)
        # Momentum 0.9, not Keras's 0.99: the moving statistics evaluation uses follow the
        # training within tens of updates, as a short fine-tuning has.
        x = layers.BatchNormalization(momentum=0.9, name=f"{name}_bn{i}")(x)
        x = layers.Activation("relu", name=f"{name}_relu{i}")(x)
    return x


def unet(
    *,
    input_shape: tuple[int, int, int],
    num_classes: int | None,
    base_filters: int = 16,
    depth: int = 4,
    dropout: float = 0.0,
    include_top: bool = True,
    classifier_activation: str | None = "softmax",
    name: str = "unet",
) -> keras.Model:
    """Builds a U-Net.

    Args:
        input_shape: `(height, width, channels)` of pixels in [0, 255] (scaled to
            [0, 1] inside); height and width must be multiples
            of `2 ** depth`.
        num_classes: output maps of the 1×1 classifier (ignored if not `include_top`).
        base_filters: width of the first level; level i has `base_filters * 2**i`.
        depth: number of 2× poolings.
        dropout: dropout rate before the bottleneck's convs (0 disables it).
        include_top: add the 1×1 classifier; otherwise return the last features.
        classifier_activation: activation of the classifier; `None` for logits.
        name: model name.

    Returns:
        A `keras.Model` mapping images to per-pixel class scores.

    Example:
        >>> unet(input_shape=(64, 64, 3), num_classes=2).count_params()
        1945538
    """
    inputs = keras.Input(input_shape, name="image")
    x, skips = layers.Rescaling(1.0 / 255, name="scale")(inputs), []
    for level in range(depth):
        x = _conv_block(x, base_filters * 2**level, name=f"down{level}")
        skips.append(x)
        x = layers.MaxPooling2D(2, name=f"down{level}_pool")(x)
    if dropout > 0:
        x = layers.Dropout(dropout, name="bottleneck_dropout")(x)
    x = _conv_block(x, base_filters * 2**depth, name="bottleneck")
    for level in reversed(range(depth)):
        filters = base_filters * 2**level
        x = layers.Conv2DTranspose(filters, 2, strides=2, name=f"up{level}_transpose")(x)
        x = layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = _conv_block(x, filters, name=f"up{level}")
    if include_top:
        if num_classes is None or num_classes < 1:
            raise ValueError(f"`num_classes` must be a positive int; got {num_classes!r}.")
        # float32 output so the softmax stays accurate under a mixed-precision policy.
        x = layers.Conv2D(num_classes, 1, activation=classifier_activation,
                          dtype="float32", name="predictions")(x)
    return keras.Model(inputs, x, name=name)
