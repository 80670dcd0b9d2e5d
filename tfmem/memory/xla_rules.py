"""What a step compiled by XLA (the JAX backend) keeps beyond `layer_rules`' tensors.

`layer_rules` writes down what TensorFlow's registered gradients read. On JAX the whole step
is one XLA program, which keeps a different set around element-wise activations and
normalizations. Each rule holds for the XLA targets it was measured on (`holds`: the device
kind of the plan, "cpu" for XLA:CPU, against XLA's own memory analysis,
`tfmem.memory.probe_jax.compiled_step_memory`; the per-kind table is in docs/planning.md);
a plan for another target counts what `layer_rules` says. A plan for a TPU (measured on
XLA:TPU, compiled ahead of time) applies two of them so far: a traced call's residual that
cheap element-wise ops make again, and a scalar broadcast, hold nothing. The rules:

- A piecewise activation (relu, relu6, elu, selu, hard_sigmoid) is differentiated on its
  input, not its output (TensorFlow's `ReluGrad` reads the output): XLA fuses the mask into
  the backward and recomputes it from the pre-activation, which stays alive, next to the
  activation itself where the next layer keeps that.
- A training BatchNormalization's output is recomputed from its input in each fusion that
  reads it (a following relu's mask too); a bias added just before it is not fused into
  the convolution or Dense, whose output before the bias stays alive as well.
- silu (swish) keeps its gate, sigmoid(x), beside its input (its input not where XLA
  recomputes that). An element-wise call (an add of a constant, a multiply) of recomputed
  tensors keeps none of them and is recomputed in turn: hard-swish after
  BatchNormalization keeps nothing.
- A trained convolution's kernel gradient reads a copy of its input in another layout, made
  in the backward: its workspace there is that copy and its input's and output's gradients.
  A concatenation it reads is made again inside that copy, so the concatenation's operands
  are kept, not its output (an operand XLA recomputes from kept tensors not even those).
  A grouped (or depthwise) convolution's kernel gradient is made as a dense kernel (every
  input channel to every output channel), whose groups are then copied out: two dense
  kernels while it runs, whatever the batch.
- Max pooling's backward scatters through the window positions its forward recorded: one
  int32 index per axis and output element is kept, not the input and output; the forward
  holds an int32 iota of the input per axis and its outputs while it runs.
- Of a traced call's residuals (JAX's own gradient, `gradient_trace.TracedCall`), one that
  cheap element-wise ops (no float division, no transcendental function) make from other
  kept tensors of its shape and scalars, and that no dot or convolution reads, is fused
  into the backward and made again there: it holds nothing (a tanh-approximate GELU keeps
  its input, the tanh and its output, which the next Dense reads; not x³'s term, 1 - t or
  (1 + t) / 2). A boolean mask made so, also from a smaller mask broadcast (a padding
  mask), holds nothing either; one compared from random bits (a dropout's) is held as
  those bits, two 32-bit words per element; another mask as the tensor it compares, in the
  compute dtype. A scalar broadcast (relu's zeros) holds nothing.
- A residual made by an expensive op (a reduction, rsqrt) that an element-wise op reads
  beside larger tensors (a softmax's row sum, a normalization's rsqrt) is held broadcast
  to that op's size.
"""

from __future__ import annotations

import math

import keras

from tfmem import _keras_internals as internals
from tfmem._sizes import itemsize

PIECEWISE = frozenset({"relu", "relu6", "elu", "selu", "hard_sigmoid"})
_GATED = frozenset({"silu", "swish"})

# The XLA targets (a plan's device kind) each rule holds for: where it was measured (XLA:TPU
# compiled ahead of time, against its own figure of the step).
_XLA_CPU = frozenset({"cpu"})
_XLA_CPU_TPU = frozenset({"cpu", "tpu"})
_TARGETS = {
    "activation": _XLA_CPU,
    "batch_normalization": _XLA_CPU,
    "boolean_residual": _XLA_CPU,
    "broadcast": _XLA_CPU_TPU,
    "broadcast_residual": _XLA_CPU,
    "convolution": _XLA_CPU,
    "derived_residual": _XLA_CPU_TPU,
    "element_wise": _XLA_CPU,
    "max_pooling": _XLA_CPU,
    "random_mask": _XLA_CPU,
}
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                 keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_MAX_POOLS = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D)
_INDEX_BYTES = 4  # int32, uint32
# Threefry's random bits for one element: the two 32-bit words XLA keeps to compare again.
_RANDOM_WORDS = 2


def holds(rule: str, target: str | None) -> bool:
    """Whether `rule` (a key of `_TARGETS`) holds for a step XLA compiles for `target`
    ("cpu", "gpu", "tpu"; None: not one XLA program, or no device given)."""
    return target in _TARGETS[rule]


def activation(walker, name: str, output, pre_activation=None) -> bool:
    """Keeps what XLA holds for activation `name` (`pre_activation` None: a tensor inside
    the layer); False where it holds what `layer_rules` says."""
    if not holds("activation", walker.target) or (name not in PIECEWISE
                                                  and name not in _GATED):
        return False
    fused = pre_activation is not None and walker.key(pre_activation) in walker.fused
    if pre_activation is None:
        walker.keep_new(output.shape, walker.dtype_of(output))
    elif not fused:
        walker.keep(pre_activation)
    elif name in PIECEWISE:  # made again from what its pre-activation is made from
        walker.fused.add(walker.key(output))
    if name in _GATED:
        walker.keep_new(output.shape, walker.dtype_of(output))  # sigmoid(x)
    return True


def batch_normalization(walker, inputs, output) -> None:
    """What XLA holds for a training BatchNormalization besides its input (`layer_rules`):
    its output is recomputed from that input wherever the backward reads it; a biased
    convolution or Dense before it keeps its output before the bias too."""
    if not holds("batch_normalization", walker.target):
        return
    walker.fused.add(walker.key(output))
    producer = internals.node_of(inputs[0]).operation
    activation = getattr(producer, "activation", None)
    if (getattr(producer, "use_bias", False) and getattr(producer, "kernel", None) is not None
            and getattr(activation, "__name__", "linear") == "linear"):
        walker.keep_new(inputs[0].shape, walker.dtype_of(inputs[0]))


def residual_bytes(target: str | None, nbytes: int, dtype: str, compute_dtype: str | None,
                   derived: bool = False, drawn: bool = False, widened: int = 0) -> int:
    """Bytes XLA holds for a residual of `nbytes` in `dtype` that JAX's gradient keeps
    (`derived`, `drawn`, `widened`: `gradient_trace.TracedCall`'s): none for one made again
    by cheap element-wise ops from kept tensors; a mask compared from random bits as those
    bits (two 32-bit words per element); another boolean mask as the compared tensor in
    `compute_dtype` (default float32); one an element-wise op broadcasts at that op's size
    (`widened`)."""
    if derived and holds("derived_residual", target):
        return 0
    if drawn and holds("random_mask", target):
        return nbytes * _RANDOM_WORDS * _INDEX_BYTES
    if widened and holds("broadcast_residual", target):
        return max(nbytes, widened)
    if dtype != "bool" or not holds("boolean_residual", target):
        return nbytes
    return nbytes * itemsize(compute_dtype or "float32")


def element_wise(walker, inputs, outputs, result) -> bool:
    """An element-wise call (traced: `result`) of a tensor XLA recomputes is fused into what
    reads it: it keeps none of the recomputed tensors; where all its inputs are kept or
    recomputed, none of its own (hard-swish's) either, and its outputs are recomputed too.
    False where it keeps what it traced."""
    if not holds("element_wise", walker.target) or result.kept_outputs or not inputs:
        return False
    shapes = {tuple(tensor.shape) for tensor in inputs}
    keys = [walker.key(tensor) for tensor in inputs]
    if (not all(tuple(tensor.shape) in shapes for tensor in outputs)
            or not any(key in walker.fused for key in keys)):
        return False
    for index in result.kept_inputs:
        if keys[index] not in walker.fused:
            walker.keep(inputs[index])
    if all(key in walker.fused or key in walker.sizes for key in keys):
        walker.fused.update(walker.key(tensor) for tensor in outputs)
    else:
        walker.keep_internal(result)
    return True


def convolution(walker, layer, tensor, output, dtype: str) -> bool:
    """Keeps what XLA holds of trained convolution `layer`'s input `tensor` (in `dtype`) and
    notes its workspace; False where `layer_rules`' own rule holds."""
    if not holds("convolution", walker.target) or type(layer) not in _CONVOLUTIONS:
        return False
    input_bytes = walker.sample_bytes(tensor, dtype)
    walker.transient = max(walker.transient,
                           convolution_workspace(input_bytes, walker.sample_bytes(output)))
    # Grouped (a depthwise convolution's groups are its channels): its kernel's gradient
    # is made for every input channel to every output channel, `groups` times the kernel.
    kernel = layer.kernel.shape  # (*window, channels per group, outputs or multiplier)
    groups = kernel[-2] if type(layer) in _DEPTHWISE else getattr(layer, "groups", 1)
    if groups > 1:
        walker.fixed_transient = max(walker.fixed_transient,
                                     2 * math.prod(kernel) * groups * itemsize(dtype))
    found = (internals.concatenation(internals.node_of(tensor))
             if dtype == walker.dtype_of(tensor) else None)
    if found is None:
        walker.keep(tensor, dtype)
        return True
    for operand in found[1]:
        if walker.key(operand) not in walker.fused:
            walker.keep(operand)
    return True


def convolution_workspace(input_bytes: int, output_bytes: int) -> int:
    """A convolution's backward: its input's copy and gradient, its output's gradient."""
    return 2 * input_bytes + output_bytes


def max_pooling(walker, layer, inputs, output) -> bool:
    """Keeps what XLA holds for max pooling `layer` and notes its forward's transient;
    False where `layer_rules`' own rule holds."""
    if not holds("max_pooling", walker.target) or type(layer) not in _MAX_POOLS:
        return False
    rank = len(output.shape)
    walker.keep_new(tuple(output.shape) + (rank,), "int32")
    walker.transient = max(walker.transient, max_pooling_transient(
        walker.sample_bytes(inputs[0], "int8"), walker.sample_bytes(output, "int8"),
        walker.sample_bytes(output), rank))
    return True


def max_pooling_transient(input_elements: int, output_elements: int, output_bytes: int,
                          rank: int) -> int:
    """What max pooling's forward holds while it runs on XLA:CPU, besides its input: an
    int32 iota of the input per axis, its output, and an int32 index per axis and output
    element."""
    return rank * _INDEX_BYTES * (input_elements + output_elements) + output_bytes


def traced_transient(target: str | None, windows) -> int:
    """The largest of the transients above among a traced call's `windows`
    (`gradient_trace.TracedCall.windows`); 0 where the rules do not hold."""
    largest = 0
    for primitive, input_elements, output_elements, size, rank in windows:
        if primitive == "conv_general_dilated" and holds("convolution", target):
            largest = max(largest, convolution_workspace(input_elements * size,
                                                         output_elements * size))
        elif primitive == "reduce_window_max" and holds("max_pooling", target):
            largest = max(largest, max_pooling_transient(
                input_elements, output_elements, output_elements * size, rank))
    return largest
