"""The fast path for Keras's own layers: which tensors their backward pass reads, by rule.

Each rule is what the general path (`gradient_trace`, the framework's own gradient) finds
for that layer, written down so that a model of a thousand layers is analysed without
tracing each one; `tests/memory/test_layer_rules.py` checks every rule against the trace.
A layer, activation or option without a rule returns False and is traced instead.

From TensorFlow's registered gradients (`nn_grad.py`, `math_grad.py`) and Keras 3's layers:

- Conv*/Dense/EinsumDense: the kernel gradient reads the layer *input*, in the layer's
  compute dtype (a float32 input under mixed precision is kept as a new 2-byte copy).
  SeparableConv also keeps its depthwise intermediate.
- BatchNormalization (training) keeps a float32 copy of its input.
- Activations read their output (`ReluGrad`, `SigmoidGrad`, `TanhGrad`, softmax, …) or their
  input (silu's custom gradient, softplus, leaky ReLU).
- Add/Subtract/Concatenate/Reshape/padding/cropping/global average pools/Rescaling keep
  nothing; MaxPooling keeps input and output; Dropout keeps its boolean mask (one byte per
  element).
- A recurrent layer keeps what its cell keeps, once per timestep (the cell is traced).
"""

from __future__ import annotations

import math

import keras

from tfmem.memory import xla_rules

_KEEPS_OUTPUT = {"relu", "relu6", "sigmoid", "tanh", "softmax", "log_softmax", "elu", "selu",
                 "exponential", "hard_sigmoid"}
_KEEPS_INPUT = {"silu", "swish", "softplus", "softsign", "leaky_relu"}

_NO_SAVED_TENSORS = (
    keras.layers.Add, keras.layers.Subtract, keras.layers.Concatenate,
    keras.layers.Reshape, keras.layers.Flatten, keras.layers.Permute, keras.layers.RepeatVector,
    keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D,
    keras.layers.Cropping1D, keras.layers.Cropping2D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.Rescaling, keras.layers.Identity,
)
# Outputs that share their input's buffer (a rate-0 dropout returns its input).
VIEWS = (keras.layers.Reshape, keras.layers.Flatten, keras.layers.Identity)
DROPOUTS = (keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
            keras.layers.SpatialDropout3D, keras.layers.GaussianDropout,
            keras.layers.AlphaDropout)
_MAX_POOLS = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D)
_KERNEL_LAYERS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv1DTranspose,
                  keras.layers.Conv2DTranspose, keras.layers.DepthwiseConv1D,
                  keras.layers.DepthwiseConv2D, keras.layers.Dense, keras.layers.EinsumDense)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)


def activation_name(activation) -> str:
    """`keras.activations.relu` → "relu"; None → "linear"."""
    if activation is None:
        return "linear"
    return getattr(activation, "__name__", type(activation).__name__).lower()


def _activation(walker, name: str, output, pre_activation=None) -> bool:
    """Keeps what activation `name` reads (`pre_activation` None: a tensor inside the layer)."""
    if name == "linear":
        return True
    if xla_rules.activation(walker, name, output, pre_activation):
        return True
    if name in _KEEPS_OUTPUT:
        walker.keep(output)
        return True
    if name not in _KEEPS_INPUT:
        return False
    if pre_activation is None:
        walker.keep_new(output.shape, walker.dtype_of(output))
    else:
        walker.keep(pre_activation)
    return True


def _known_activation(walker, layer) -> bool:
    name = activation_name(getattr(layer, "activation", None))
    return (name in {"linear"} | _KEEPS_OUTPUT | _KEEPS_INPUT
            or xla_rules.fuses_activation(walker, name))


def apply(walker, layer, inputs, outputs, has_trainable: bool) -> bool:
    """Records what `layer`'s backward keeps by rule; False when no rule covers it.

    Exact types only (a subclass may change `call`), and only for calls with one tensor in
    (or a list of tensors for merge layers).
    """
    kind = type(layer)
    out = outputs[0]
    compute = walker.compute_dtype(layer)
    if kind in _SEPARABLE:
        if not _known_activation(walker, layer):
            return False
        if has_trainable:
            walker.keep(inputs[0], compute)
        channels = inputs[0].shape[-1] * layer.depth_multiplier
        walker.keep_new(tuple(out.shape[:-1]) + (channels,), compute)
        return _activation(walker, activation_name(layer.activation), out)
    if kind in _KERNEL_LAYERS:
        if not _known_activation(walker, layer):
            return False
        by_xla = has_trainable and xla_rules.contraction(walker, layer, inputs[0], out, compute)
        if has_trainable and not by_xla:
            walker.keep(inputs[0], compute)
        if getattr(layer, "groups", 1) > 1 and not by_xla:
            # Keras's TensorFlow backend runs a grouped convolution as an XLA call of its own:
            # its backward holds what XLA's does, a transient the gradient graph does not show.
            walker.transient = max(walker.transient, xla_rules.convolution_workspace(
                walker.sample_bytes(inputs[0], compute), walker.sample_bytes(out, compute)))
            # On a CPU that call's scratch stays in glibc's heap when freed (its default mmap
            # threshold moves up to the blocks freed): kh·kw × the input a sample, measured.
            scratch = math.prod(layer.kernel_size) * walker.sample_bytes(inputs[0], compute)
            walker.heap_scratch = max(walker.heap_scratch, scratch)
        return _activation(walker, activation_name(getattr(layer, "activation", None)), out)
    if kind is keras.layers.BatchNormalization:
        if layer.trainable and not walker.is_frozen(layer):
            walker.keep(inputs[0], xla_rules.batch_normalization_input_dtype(walker, inputs[0]))
            xla_rules.batch_normalization(walker, layer, inputs, out)
        return True
    if kind is keras.layers.Activation:
        return _activation(walker, activation_name(layer.activation), out, inputs[0])
    if kind in (keras.layers.ReLU, keras.layers.ELU) and xla_rules.activation(
            walker, "relu", out, inputs[0]):
        return True
    if kind in (keras.layers.ReLU, keras.layers.ELU, keras.layers.Softmax):
        walker.keep(out)
        return True
    if kind is keras.layers.LeakyReLU:
        walker.keep(inputs[0])
        return True
    if kind in _NO_SAVED_TENSORS:
        if kind in (keras.layers.Add, keras.layers.Subtract):
            xla_rules.merged(walker, inputs, out)
        elif kind in (keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D):
            xla_rules.reduced(walker, inputs[0])
        return True
    if kind is keras.layers.UpSampling2D:
        if layer.interpolation != "nearest":
            walker.keep(inputs[0])  # ResizeBilinearGrad reads the original image
        return True
    if xla_rules.max_pooling(walker, layer, inputs, out):
        return True
    if kind in _MAX_POOLS:
        walker.keep(inputs[0])
        walker.keep(out)
        return True
    if kind is keras.layers.Dropout:
        walker.keep_drawn(inputs[0].shape, "bool")  # SelectV2's keep-mask, one byte each
        return True
    if isinstance(layer, keras.layers.RNN) and len(inputs) == 1:
        walker.recurrent(layer, inputs[0], has_trainable)
        return True
    if kind is keras.layers.Bidirectional and len(inputs) == 1:
        for direction in (layer.forward_layer, layer.backward_layer):
            walker.recurrent(direction, inputs[0], has_trainable)
        return True
    return False
