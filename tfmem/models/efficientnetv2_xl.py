"""EfficientNetV2 backbones from automl block strings, including XL (which Keras cannot build).

Every block is one Keras layer named `stage{i}_block{j}`, so XL's 32-repeat stage needs no
letter past "z" and its graph has ~100 nodes; docs/models.md says why Keras's builder fails.

Example:
    >>> backbone = efficientnetv2_backbone(XL_BLOCKS, input_shape=(64, 64, 3))
"""

from __future__ import annotations

import dataclasses
import math
import re

import keras
from keras import layers, ops

# automl `effnetv2_configs.py`, "efficientnetv2-xl": width 1.0, depth 1.0,
# train 384 px, eval 512 px, dropout 0.4.
XL_BLOCKS = (
    "r4_k3_s1_e1_i32_o32_c1",
    "r8_k3_s2_e4_i32_o64_c1",
    "r8_k3_s2_e4_i64_o96_c1",
    "r16_k3_s2_e4_i96_o192_se0.25",
    "r24_k3_s1_e6_i192_o256_se0.25",
    "r32_k3_s2_e6_i256_o512_se0.25",
    "r8_k3_s1_e6_i512_o640_se0.25",
)
XL_TRAIN_IMAGE_SIZE = 384
XL_EVAL_IMAGE_SIZE = 512
XL_DROPOUT = 0.4

# automl "efficientnetv2-b0" (the base of the B family). Only used to cross-check these
# blocks against `keras.applications.EfficientNetV2B0`, which builds the same network.
B0_BLOCKS = (
    "r1_k3_s1_e1_i32_o16_c1",
    "r2_k3_s2_e4_i16_o32_c1",
    "r2_k3_s2_e4_i32_o48_c1",
    "r3_k3_s2_e4_i48_o96_se0.25",
    "r5_k3_s1_e6_i96_o112_se0.25",
    "r8_k3_s2_e6_i112_o192_se0.25",
)

# Paper and Keras: truncated normal fan-out initialisation for convolutions.
_CONV_INIT = keras.initializers.VarianceScaling(
    scale=2.0, mode="fan_out", distribution="truncated_normal"
)
# Batch-norm momentum of the reference (TF default 0.99 is too slow for fine-tuning).
_BN_MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class BlockArgs:
    """One stage of an EfficientNetV2, decoded from an automl block string."""

    num_repeat: int
    kernel_size: int
    strides: int
    expand_ratio: int
    input_filters: int
    output_filters: int
    se_ratio: float
    fused: bool


_BLOCK_RE = re.compile(r"^[a-z]+[0-9.]+$")


def parse_block_string(block: str) -> BlockArgs:
    """Decodes an automl block string such as ``"r4_k3_s1_e1_i32_o32_c1"``.

    Fields: r=repeats, k=kernel, s=stride (``s2`` or automl's ``s22``), e=expansion,
    i/o=input/output filters, se=squeeze-excite ratio, c1=fused MBConv.

    Example:
        >>> parse_block_string("r8_k3_s2_e4_i32_o64_c1").fused
        True
    """
    fields = {}
    for part in block.split("_"):
        if not _BLOCK_RE.match(part):
            raise ValueError(f"Malformed block string {block!r}: part {part!r}.")
        key = re.match(r"^[a-z]+", part).group(0)
        fields[key] = part[len(key):]
    missing = {"r", "k", "s", "e", "i", "o"} - set(fields)
    if missing:
        raise ValueError(
            f"Block string {block!r} lacks fields {sorted(missing)}; expected e.g. "
            "'r4_k3_s1_e1_i32_o32_c1'."
        )
    return BlockArgs(
        num_repeat=int(fields["r"]),
        kernel_size=int(fields["k"]),
        strides=int(fields["s"][0]),  # automl writes "s22" for (2, 2)
        expand_ratio=int(fields["e"]),
        input_filters=int(fields["i"]),
        output_filters=int(fields["o"]),
        se_ratio=float(fields.get("se", 0.0)),
        fused=fields.get("c", "0") == "1",
    )


def _round_filters(filters: float, width: float, divisor: int = 8) -> int:
    """Scales a channel count by `width`, rounded to a multiple of `divisor` (>= 8)."""
    scaled = filters * width
    return int(max(divisor, int(scaled + divisor / 2) // divisor * divisor))


def _conv(filters, kernel_size, strides=1, name=None, **kwargs):
    return layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False,
        kernel_initializer=_CONV_INIT, name=name, **kwargs,
    )


def _bn(name):
    return layers.BatchNormalization(momentum=_BN_MOMENTUM, name=name)


class _MBConvBase(layers.Layer):
    """Shared parts of both block kinds: squeeze-excite, projection and residual."""

    def __init__(self, input_filters, output_filters, expand_ratio=1, kernel_size=3,
                 strides=1, se_ratio=0.0, drop_rate=0.0, activation="swish", **kwargs):
        super().__init__(**kwargs)
        self.input_filters = input_filters
        self.output_filters = output_filters
        self.expand_ratio = expand_ratio
        self.kernel_size = kernel_size
        self.strides = strides
        self.se_ratio = se_ratio
        self.drop_rate = drop_rate
        self.activation = keras.activations.get(activation)
        self.activation_name = activation
        self.hidden_filters = input_filters * expand_ratio
        self.has_residual = strides == 1 and input_filters == output_filters

    def _make_se(self):
        # The squeeze width follows the *block input*, not the expanded width (paper, Keras).
        if 0 < self.se_ratio <= 1:
            squeeze = max(1, int(self.input_filters * self.se_ratio))
            self.se_reduce = layers.Conv2D(
                squeeze, 1, activation=self.activation_name,
                kernel_initializer=_CONV_INIT, name="se_reduce")
            self.se_expand = layers.Conv2D(
                self.hidden_filters, 1, activation="sigmoid",
                kernel_initializer=_CONV_INIT, name="se_expand")
        else:
            self.se_reduce = self.se_expand = None

    def _make_residual_dropout(self):
        # Stochastic depth: drop the whole residual branch per sample (noise over batch).
        self.drop = (layers.Dropout(self.drop_rate, noise_shape=(None, 1, 1, 1), name="drop")
                     if self.has_residual and self.drop_rate > 0 else None)

    def _build_se(self, hidden_shape):
        if self.se_reduce is not None:
            pooled = (hidden_shape[0], 1, 1, self.hidden_filters)
            self.se_reduce.build(pooled)
            self.se_expand.build(self.se_reduce.compute_output_shape(pooled))

    def _build_conv_bn(self, conv, bn, input_shape):
        # Build a conv and its batch norm; returns the conv's output shape.
        conv.build(input_shape)
        output_shape = conv.compute_output_shape(input_shape)
        bn.build(output_shape)
        return output_shape

    def _squeeze_excite(self, x):
        if self.se_reduce is None:
            return x
        scale = ops.mean(x, axis=(1, 2), keepdims=True)
        return x * self.se_expand(self.se_reduce(scale))

    def _residual(self, inputs, x, training):
        if not self.has_residual:
            return x
        if self.drop is not None:
            x = self.drop(x, training=training)
        return x + inputs

    def compute_output_shape(self, input_shape):
        def down(size):
            return None if size is None else math.ceil(size / self.strides)
        return (input_shape[0], down(input_shape[1]), down(input_shape[2]),
                self.output_filters)

    def get_config(self):
        return {
            **super().get_config(),
            "input_filters": self.input_filters,
            "output_filters": self.output_filters,
            "expand_ratio": self.expand_ratio,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "se_ratio": self.se_ratio,
            "drop_rate": self.drop_rate,
            "activation": self.activation_name,
        }


@keras.saving.register_keras_serializable(package="tfmem")
class FusedMBConv(_MBConvBase):
    """Fused-MBConv: one k×k convolution replaces MBConv's 1×1 expand + depthwise.

    With ``expand_ratio == 1`` the block is a single k×k conv + BN + activation;
    otherwise k×k expand (carrying the stride) → [squeeze-excite] → 1×1 project + BN.
    A residual (with stochastic depth) is added when shape is kept.

    Example:
        >>> y = FusedMBConv(32, 64, expand_ratio=4, strides=2)(keras.ops.ones((1, 8, 8, 32)))
        >>> tuple(y.shape)
        (1, 4, 4, 64)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Sub-layers are created in forward order so that `weights` lists them in the
        # same order as Keras's own EfficientNetV2 (used by the cross-check test).
        if self.expand_ratio != 1:
            self.expand_conv = _conv(self.hidden_filters, self.kernel_size, self.strides,
                                     name="expand_conv")
            self.expand_bn = _bn("expand_bn")
        self._make_se()
        fused_project = self.expand_ratio == 1
        self.project_conv = _conv(
            self.output_filters,
            self.kernel_size if fused_project else 1,
            self.strides if fused_project else 1,
            name="project_conv")
        self.project_bn = _bn("project_bn")
        self._make_residual_dropout()

    def build(self, input_shape):
        # Explicit so that a `.keras` file restores every sub-layer's variables.
        shape = input_shape
        if self.expand_ratio != 1:
            shape = self._build_conv_bn(self.expand_conv, self.expand_bn, shape)
        self._build_se(shape)
        self._build_conv_bn(self.project_conv, self.project_bn, shape)

    def call(self, inputs, training=None):
        x = inputs
        if self.expand_ratio != 1:
            x = self.activation(self.expand_bn(self.expand_conv(x), training=training))
        x = self._squeeze_excite(x)
        x = self.project_bn(self.project_conv(x), training=training)
        if self.expand_ratio == 1:
            # Without an expansion the projection *is* the block's only conv: activate it.
            x = self.activation(x)
        return self._residual(inputs, x, training)


@keras.saving.register_keras_serializable(package="tfmem")
class MBConv(_MBConvBase):
    """MBConv: 1×1 expand → k×k depthwise (stride) → [squeeze-excite] → 1×1 project.

    Example:
        >>> y = MBConv(96, 96, expand_ratio=6, se_ratio=0.25)(keras.ops.ones((1, 4, 4, 96)))
        >>> tuple(y.shape)
        (1, 4, 4, 96)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.expand_ratio != 1:
            self.expand_conv = _conv(self.hidden_filters, 1, name="expand_conv")
            self.expand_bn = _bn("expand_bn")
        self.depthwise_conv = layers.DepthwiseConv2D(
            self.kernel_size, strides=self.strides, padding="same", use_bias=False,
            depthwise_initializer=_CONV_INIT, name="depthwise_conv")
        self.depthwise_bn = _bn("depthwise_bn")
        self._make_se()
        self.project_conv = _conv(self.output_filters, 1, name="project_conv")
        self.project_bn = _bn("project_bn")
        self._make_residual_dropout()

    def build(self, input_shape):
        shape = input_shape
        if self.expand_ratio != 1:
            shape = self._build_conv_bn(self.expand_conv, self.expand_bn, shape)
        shape = self._build_conv_bn(self.depthwise_conv, self.depthwise_bn, shape)
        self._build_se(shape)
        self._build_conv_bn(self.project_conv, self.project_bn, shape)

    def call(self, inputs, training=None):
        x = inputs
        if self.expand_ratio != 1:
            x = self.activation(self.expand_bn(self.expand_conv(x), training=training))
        x = self.activation(self.depthwise_bn(self.depthwise_conv(x), training=training))
        x = self._squeeze_excite(x)
        x = self.project_bn(self.project_conv(x), training=training)
        return self._residual(inputs, x, training)


def efficientnetv2_backbone(
    blocks: tuple[str, ...],
    *,
    input_shape: tuple[int, int, int],
    width_coefficient: float = 1.0,
    depth_coefficient: float = 1.0,
    drop_connect_rate: float = 0.2,
    top_filters: int = 1280,
    activation: str = "swish",
    name: str = "efficientnetv2_backbone",
) -> keras.Model:
    """Builds the EfficientNetV2 feature extractor (stem, stages, 1×1 top conv).

    No preprocessing and no classifier: it maps normalised images to the last feature
    map (stride 32). `tfmem.models.build` adds input scaling and the head.

    Args:
        blocks: automl block strings, one per stage (e.g. `XL_BLOCKS`).
        input_shape: `(height, width, channels)`.
        width_coefficient: channel multiplier (1.0 for XL and B0).
        depth_coefficient: repeat multiplier (1.0 for XL and B0).
        drop_connect_rate: stochastic-depth rate of the last block; it grows linearly
            from 0 at the first block, as in the paper.
        top_filters: channels of the final 1×1 conv before its width scaling.
        activation: activation of every block.
        name: model name.

    Returns:
        A functional `keras.Model` with one layer per block.

    Example:
        >>> efficientnetv2_backbone(B0_BLOCKS, input_shape=(32, 32, 3)).count_params()
        5919312
    """
    stages = [parse_block_string(b) for b in blocks]
    repeats = [int(math.ceil(depth_coefficient * s.num_repeat)) for s in stages]
    total_blocks = float(sum(repeats))

    inputs = keras.Input(input_shape, name="image")
    x = _conv(_round_filters(stages[0].input_filters, width_coefficient), 3, 2,
              name="stem_conv")(inputs)
    x = layers.Activation(activation, name="stem_activation")(_bn("stem_bn")(x))
    block_index = 0
    for i, (stage, num_repeat) in enumerate(zip(stages, repeats), start=1):
        block_class = FusedMBConv if stage.fused else MBConv
        input_filters = _round_filters(stage.input_filters, width_coefficient)
        output_filters = _round_filters(stage.output_filters, width_coefficient)
        for j in range(num_repeat):
            # Only the first block of a stage changes stride and width.
            x = block_class(
                input_filters=input_filters if j == 0 else output_filters,
                output_filters=output_filters,
                expand_ratio=stage.expand_ratio,
                kernel_size=stage.kernel_size,
                strides=stage.strides if j == 0 else 1,
                se_ratio=stage.se_ratio,
                drop_rate=drop_connect_rate * block_index / total_blocks,
                activation=activation,
                name=f"stage{i}_block{j}",
            )(x)
            block_index += 1
    x = _conv(_round_filters(top_filters, width_coefficient), 1, name="top_conv")(x)
    x = layers.Activation(activation, name="top_activation")(_bn("top_bn")(x))
    return keras.Model(inputs, x, name=name)
