"""FC-DenseNet ("The One Hundred Layers Tiramisu", Jégou et al., CVPRW 2017): 56, 67 and 103.

Each dense block is one Keras layer (`DenseBlock`), so the functional graph stays shallow;
the paper's blocks and parameter counts are in docs/models.md.

Example:
    >>> model = fc_densenet(103, input_shape=(32, 32, 3), num_classes=11)
"""

from __future__ import annotations

import keras
from keras import layers, ops

# Variant → (layers per block, down path then bottleneck then up path; growth rate).
VARIANTS = {
    56: ((4,) * 11, 12),
    67: ((5,) * 11, 16),
    103: ((4, 5, 7, 10, 12, 15, 12, 10, 7, 5, 4), 16),
}
FIRST_CONV_FILTERS = 48
DROPOUT = 0.2  # paper, Section 4.1


def _he_uniform():
    # The paper initialises with HeUniform.
    return keras.initializers.HeUniform()


@keras.saving.register_keras_serializable(package="tfmem")
class DenseBlock(layers.Layer):
    """`num_layers` × (BN → ReLU → 3×3 conv → dropout), each fed all previous maps.

    Args:
        num_layers: layers in the block.
        growth_rate: feature maps each layer adds (k).
        dropout: dropout rate after each conv.
        return_input: if True, return the input concatenated with the new maps
            (down path); if False, only the `num_layers * growth_rate` new maps
            (what the up path upsamples).

    Example:
        >>> DenseBlock(4, 12)(keras.ops.ones((1, 8, 8, 48))).shape[-1]
        96
    """

    def __init__(self, num_layers: int, growth_rate: int, dropout: float = DROPOUT,
                 return_input: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.num_layers = num_layers
        self.growth_rate = growth_rate
        self.dropout = dropout
        self.return_input = return_input
        self.units = []
        for i in range(num_layers):
            self.units.append((
                layers.BatchNormalization(name=f"bn{i}"),
                layers.Conv2D(growth_rate, 3, padding="same",
                              kernel_initializer=_he_uniform(), name=f"conv{i}"),
                layers.Dropout(dropout, name=f"dropout{i}"),
            ))

    def build(self, input_shape):
        # Explicit so that a `.keras` file restores every sub-layer's variables.
        channels = input_shape[-1]
        for bn, conv, _ in self.units:
            shape = (*input_shape[:-1], channels)
            bn.build(shape)
            conv.build(shape)
            channels += self.growth_rate

    def call(self, inputs, training=None):
        stack, new_maps = inputs, []
        for bn, conv, dropout in self.units:
            x = conv(ops.relu(bn(stack, training=training)))
            x = dropout(x, training=training)
            new_maps.append(x)
            stack = ops.concatenate([stack, x], axis=-1)
        return stack if self.return_input else ops.concatenate(new_maps, axis=-1)

    def compute_output_shape(self, input_shape):
        new = self.num_layers * self.growth_rate
        channels = input_shape[-1] + new if self.return_input else new
        return (*input_shape[:-1], channels)

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers,
                "growth_rate": self.growth_rate, "dropout": self.dropout,
                "return_input": self.return_input}


def fc_densenet(
    depth: int,
    *,
    input_shape: tuple[int, int, int],
    num_classes: int | None,
    dropout: float = DROPOUT,
    include_top: bool = True,
    classifier_activation: str | None = "softmax",
    name: str | None = None,
) -> keras.Model:
    """Builds FC-DenseNet56, 67 or 103.

    Args:
        depth: 56, 67 or 103.
        input_shape: `(height, width, channels)` of pixels in [0, 255] (scaled to
            [0, 1] inside); height and width must be multiples
            of 32 (five 2× poolings, then five 2× upsamplings back to the input size).
        num_classes: output maps of the 1×1 classifier (ignored if not `include_top`).
        dropout: rate after every conv (paper: 0.2).
        include_top: add the 1×1 conv classifier; otherwise return the last features.
        classifier_activation: activation of the classifier; `None` for logits.
        name: model name (default `fc_densenet{depth}`).

    Returns:
        A `keras.Model` mapping images to per-pixel class scores.

    Example:
        >>> fc_densenet(56, input_shape=(32, 32, 3), num_classes=11).count_params()
        1397963
    """
    if depth not in VARIANTS:
        raise ValueError(f"FC-DenseNet depth must be one of {sorted(VARIANTS)}; got {depth}.")
    block_sizes, growth = VARIANTS[depth]
    num_pool = len(block_sizes) // 2

    inputs = keras.Input(input_shape, name="image")
    x = layers.Rescaling(1.0 / 255, name="scale")(inputs)
    x = layers.Conv2D(FIRST_CONV_FILTERS, 3, padding="same",
                      kernel_initializer=_he_uniform(), name="first_conv")(x)
    skips = []
    for i in range(num_pool):
        x = DenseBlock(block_sizes[i], growth, dropout, name=f"down{i}_dense")(x)
        skips.append(x)
        channels = x.shape[-1]
        x = layers.BatchNormalization(name=f"down{i}_bn")(x)
        x = layers.Activation("relu", name=f"down{i}_relu")(x)
        x = layers.Conv2D(channels, 1, kernel_initializer=_he_uniform(),
                          name=f"down{i}_conv")(x)
        x = layers.Dropout(dropout, name=f"down{i}_dropout")(x)
        x = layers.MaxPooling2D(2, name=f"down{i}_pool")(x)

    # Bottleneck and the up path keep only their new maps for the next upsampling.
    x = DenseBlock(block_sizes[num_pool], growth, dropout, return_input=False,
                   name="bottleneck_dense")(x)
    for i in range(num_pool):
        is_last = i == num_pool - 1
        x = layers.Conv2DTranspose(
            block_sizes[num_pool + i] * growth, 3, strides=2, padding="same",
            kernel_initializer=_he_uniform(), name=f"up{i}_transpose")(x)
        x = layers.Concatenate(name=f"up{i}_concat")([x, skips[-1 - i]])
        # The last block's output feeds the classifier, so it keeps its input too.
        x = DenseBlock(block_sizes[num_pool + 1 + i], growth, dropout,
                       return_input=is_last, name=f"up{i}_dense")(x)

    if include_top:
        if num_classes is None or num_classes < 1:
            raise ValueError(f"`num_classes` must be a positive int; got {num_classes!r}.")
        # float32 output so the softmax stays accurate under a mixed-precision policy.
        x = layers.Conv2D(num_classes, 1, activation=classifier_activation,
                          kernel_initializer=_he_uniform(), dtype="float32",
                          name="predictions")(x)
    return keras.Model(inputs, x, name=name or f"fc_densenet{depth}")
