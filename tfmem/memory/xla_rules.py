"""What a step compiled by XLA (the JAX backend) keeps beyond `layer_rules`' tensors.

`layer_rules` writes down what TensorFlow's registered gradients read. On JAX the whole step
is one XLA program, which keeps a different set around element-wise activations and
normalizations. Each rule holds for the XLA targets it was measured on (`holds`: the device
kind of the plan, "cpu" for XLA:CPU, against XLA's own memory analysis,
`tfmem.memory.probe_jax.compiled_step_memory`; the per-kind table is in docs/planning.md);
a plan for another target counts what `layer_rules` says. A plan for a TPU (measured on
XLA:TPU, compiled ahead of time) has rules of its own, below the XLA:CPU ones. The rules
for XLA:CPU:

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

XLA:TPU fuses element-wise ops into what reads them more than XLA:CPU does, convolutions'
and dots' operands and their kernel gradients included, and multiplies in bfloat16 at its
default precision:

- A convolution's or Dense's input is kept as a bfloat16 copy (a float32 model's), and not
  at all where it is made again from kept tensors (a BatchNormalization's output, an
  activation of it) or is the model's input (an argument of the step, read in place); a
  concatenation's operands are kept as they are instead (it is made again from them).
- A training BatchNormalization keeps its input in its own dtype and nothing else; what it
  computes, and an activation or element-wise call of that, is made again where it is read.
- An activation of a kept tensor keeps a byte an element for a piecewise-linear one (relu's
  mask; in a 16-bit compute dtype, its output, which what reads it keeps, and the mask made
  again from it), its input for another (silu, gelu), and its output is made again where
  read (gelu's, in a 16-bit compute dtype, is kept too).
- Max pooling keeps its input alone (its backward finds each window's maximum again).
- Of a traced call's residuals, those element-wise ops of any cost make from other kept
  tensors and smaller ones broadcast hold nothing, and one made so from a narrower tensor (a
  float32 cast of a bfloat16 convolution's output) is held at that tensor's size; a scalar
  broadcast holds nothing.
- A call's backward holds one gradient map beside the kept tensors (a concatenation its
  inputs and its output while it copies them, max pooling two maps).
- Each weight's update runs as soon as its gradient is made, in the backward: one gradient
  is held at a time, not all of them (`held_gradient_bytes`; not under mixed_float16's loss
  scaling, which checks that every gradient is finite before any update).
- Tensors are laid out in 8 × 128 tiles (`tpu_layout`), which the plan counts in a row of
  its own.

XLA:GPU (measured on steps compiled ahead of time for the card, `probe_jax.gpu_device`)
fuses element-wise ops as XLA:TPU does, and the rules above hold for it but where a library
call (cuDNN's convolutions, cuBLAS's and Triton's matrix products) reads or writes a tensor
whole:

- A convolution's or Dense's input is kept as the library reads it, in its compute dtype
  (a bfloat16 model's float32 input as a bfloat16 copy), a concatenation whole; not the
  model's input, which the step is given.
- An activation of a tensor the library wrote (a convolution's output) keeps that tensor,
  its pre-activation, and relu inside a convolution or Dense (fused into the call) its
  output; gelu keeps its output and terms of its derivative as well (one map in float32,
  two in a 16-bit compute dtype). A piecewise-linear activation of a tensor made again keeps
  its masks in float32, a byte an element per bound it clips at.
- An add of tensors made again or kept is made again (a residual block's sum); a global
  pooling of a tensor made again that another call reads too (a squeeze-excite's scale)
  keeps it, as the reduction writes it out for them.
- Of a traced call's residuals, one a contraction or a reduction reads is kept though
  element-wise ops make it again.
- Max pooling keeps its input. Its backward scatters into a map of zeros of its padded
  input, where no other call reads the input (else into that one's gradient): made as the
  backward runs, but where the input is unpadded (no padding in its windows, not a padding
  layer's output) the zeros of that shape that other ops read (a relu's, a dropout's) are
  one buffer, kept from the forward, and the scatter writes into a copy: two maps kept.
  While its backward runs it holds an int32 index an output element per axis.
- A call's backward holds one gradient map beside the kept tensors, a concatenation's too,
  and runs beside what it and the calls before it keep: what later calls keep is freed by
  then (`Walker.backward_peaks`).
- A training BatchNormalization of a map whose statistics are one column sum (at most 4096
  rows: the micro-batch × the map's positions) keeps its input less the mean, in float32;
  at larger micro-batches the sum is split in two and the difference made again
  (`_centred_input`, `Walker.keep_below`: a term of the activations up to that micro-batch).
- Beside the one gradient held at a time, a trained convolution's kernel is kept from the
  forward to its backward in cuDNN's layout, a copy (in float32; a 16-bit model's cast
  copy, counted with mixed precision, is that layout already) (`held_gradient_bytes`).
"""

from __future__ import annotations

import math

import keras

from tfmem import _keras_internals as internals
from tfmem._sizes import itemsize

PIECEWISE = frozenset({"relu", "relu6", "elu", "selu", "hard_sigmoid"})
_GATED = frozenset({"silu", "swish"})
# Activations XLA:TPU fuses into what reads them (`_fused_activation`): of the piecewise-linear
# ones, whose gradient is a mask, it keeps that mask, of the others their input; and of
# gelu in a 16-bit compute dtype its output too, rather than make it again where it is read
# (silu's it makes again).
_FUSED_ACTIVATIONS = PIECEWISE | _GATED | frozenset({
    "gelu", "sigmoid", "tanh", "softplus", "softsign", "exponential", "mish", "hard_swish",
    "hard_silu", "leaky_relu", "log_sigmoid", "celu"})
_MASKED = frozenset({"relu", "relu6", "hard_sigmoid"})
_KEPT_IN_16_BITS = frozenset({"gelu"})
# Activations XLA:GPU keeps their output and terms of their derivative for, made as the
# forward computes them: one map in float32, two in a 16-bit compute dtype.
_DERIVATIVE_KEPT = frozenset({"gelu"})
# The masks (a byte an element each) XLA:GPU keeps for a piecewise-linear activation of a
# tensor made again, in a float32 compute dtype: one per bound it clips at.
_GPU_MASKS = {"relu": 1, "relu6": 2, "hard_sigmoid": 2, "hard_swish": 2, "hard_silu": 2}

# The XLA targets (a plan's device kind) each rule holds for: where it was measured (XLA:TPU
# compiled ahead of time, against its own figure of the step).
_XLA_CPU = frozenset({"cpu"})
_XLA_CPU_TPU = frozenset({"cpu", "tpu"})
_XLA_TPU = frozenset({"tpu"})
_XLA_GPU = frozenset({"gpu"})
_XLA_TPU_GPU = frozenset({"tpu", "gpu"})
_XLA_CPU_TPU_GPU = frozenset({"cpu", "tpu", "gpu"})
_TARGETS = {
    "activation": _XLA_CPU,
    "batch_normalization": _XLA_CPU,
    "boolean_residual": _XLA_CPU,
    "broadcast": _XLA_CPU_TPU_GPU,
    "broadcast_residual": _XLA_CPU,
    "convolution": _XLA_CPU,
    "derived_residual": _XLA_CPU_TPU,
    "element_wise": _XLA_CPU_TPU_GPU,
    "max_pooling": _XLA_CPU,
    "random_mask": _XLA_CPU,
    "lane_padding": _XLA_TPU,
    "fusion": _XLA_TPU_GPU,
    "fused_residual": _XLA_TPU_GPU,
    "bfloat16_operands": _XLA_TPU,
    "library_operands": _XLA_GPU,
    "backward_in_order": _XLA_GPU,
    "updates_as_made": _XLA_TPU_GPU,
    "centred_input": _XLA_GPU,
}
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                 keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_MAX_POOLS = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D)
_INDEX_BYTES = 4  # int32, uint32
_PADDINGS = (keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D)
# The maps of zeros of its input's shape XLA:GPU keeps for max pooling whose windows read
# no padding, from the forward on: the zeros that the step's other ops of that shape read
# (a relu's, a dropout's) are one buffer, which the backward's scatter copies to write into.
_SHARED_ZERO_MAPS = 2
# Threefry's random bits for one element: the two 32-bit words XLA keeps to compare again.
_RANDOM_WORDS = 2
# The most rows XLA:GPU sums a column of in one kernel (a warp's 32 threads × 128 rows
# each), and the fewest positions of a map whose centred input it keeps for a
# BatchNormalization (`_centred_input`): on smaller maps it computes the statistics
# another way.
_COLUMN_SUM_ROWS = 32 * 128
_SMALLEST_MAP = 9


def holds(rule: str, target: str | None) -> bool:
    """Whether `rule` (a key of `_TARGETS`) holds for a step XLA compiles for `target`
    ("cpu", "gpu", "tpu"; None: not one XLA program, or no device given)."""
    return target in _TARGETS[rule]


def activation(walker, name: str, output, pre_activation=None) -> bool:
    """Keeps what XLA holds for activation `name` (`pre_activation` None: a tensor inside
    the layer); False where it holds what `layer_rules` says."""
    if fuses_activation(walker, name):
        return _fused_activation(walker, name, output, pre_activation)
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


def gradient_maps(target: str | None, operation=None) -> int:
    """How many maps of a call's size it holds at once beside the kept tensors: its output's
    gradient and its input's; one on XLA:TPU, whose fusions compute the input's gradient as
    they read the output's, but for a concatenation, whose inputs are alive while it copies
    them into its output, and for max pooling, whose backward scatters into a map of zeros
    beside its output's gradient; one on XLA:GPU, a concatenation's and max pooling's too (its
    transient is counted apart)."""
    if holds("library_operands", target):
        return 1
    if holds("fusion", target) and not isinstance(operation,
                                                      (keras.layers.Concatenate, *_MAX_POOLS)):
        return 1
    return 2


def fuses_activation(walker, name: str) -> bool:
    """Whether the target fuses activation `name` (`_fused_activation`)."""
    return holds("fusion", walker.target) and name in _FUSED_ACTIVATIONS


def _fused_activation(walker, name: str, output, pre_activation) -> bool:
    """XLA:TPU: an activation of a tensor made again from kept ones is made again in turn
    and keeps nothing; else a piecewise-linear one keeps its mask (a byte an element),
    another its input, and its output is made again inside what reads it. XLA:GPU: made
    again in turn, with its masks in float32; else it keeps the tensor the library wrote
    (its pre-activation; relu inside the call its output), gelu its output and derivative's
    terms too."""
    if pre_activation is not None and walker.key(pre_activation) in walker.fused:
        walker.fused.add(walker.key(output))
        if holds("library_operands", walker.target) and itemsize(walker.dtype_of(output)) > 2:
            for _ in range(_GPU_MASKS.get(name, 0)):  # made as the forward runs
                walker.keep_new(output.shape, "bool")
        return True
    if holds("library_operands", walker.target):
        if pre_activation is not None:
            walker.keep(pre_activation)
        elif name in _MASKED:  # fused into the library call: the mask made from the output
            walker.keep(output)
        else:
            walker.keep_new(output.shape, walker.dtype_of(output))
        if name in _DERIVATIVE_KEPT:
            walker.keep(output)
            for _ in range(1 if itemsize(walker.dtype_of(output)) > 2 else 2):
                walker.keep_new(output.shape, walker.dtype_of(output))
        elif pre_activation is not None:
            walker.fused.add(walker.key(output))
        return True
    if name in _MASKED:
        if itemsize(walker.dtype_of(output)) <= 2:
            walker.keep(output)  # in 16 bits, as what reads it keeps it: the mask made again
        else:
            walker.keep_new(output.shape, "bool")
        return True
    if pre_activation is None:
        walker.keep_new(output.shape, walker.dtype_of(output))
    else:
        walker.keep(pre_activation)
    if name in _KEPT_IN_16_BITS and itemsize(walker.dtype_of(output)) <= 2:
        walker.keep(output)
    else:
        walker.fused.add(walker.key(output))
    return True


def batch_normalization_input_dtype(walker, tensor) -> str:
    """The dtype a training BatchNormalization keeps its input in: float32 (TensorFlow's
    gradient, XLA:CPU), the input's own on XLA:TPU, which fuses the normalization."""
    return walker.dtype_of(tensor) if holds("fusion", walker.target) else "float32"


def batch_normalization(walker, layer, inputs, output) -> None:
    """What XLA holds for a training BatchNormalization besides its input (`layer_rules`):
    its output is recomputed from that input wherever the backward reads it; on XLA:CPU a
    biased convolution or Dense before it keeps its output before the bias too; on XLA:GPU
    its centred input, in float32, at micro-batches whose statistics are one column sum."""
    if holds("fusion", walker.target):
        walker.fused.add(walker.key(output))
        _centred_input(walker, layer, inputs[0])
        return
    if not holds("batch_normalization", walker.target):
        return
    walker.fused.add(walker.key(output))
    producer = internals.node_of(inputs[0]).operation
    activation = getattr(producer, "activation", None)
    if (getattr(producer, "use_bias", False) and getattr(producer, "kernel", None) is not None
            and getattr(activation, "__name__", "linear") == "linear"):
        walker.keep_new(inputs[0].shape, walker.dtype_of(inputs[0]))


def _centred_input(walker, layer, tensor) -> None:
    """XLA:GPU sums a column of up to `_COLUMN_SUM_ROWS` rows in one kernel: there a
    BatchNormalization's statistics of a map (channels last, the batch and spatial axes
    summed) write its input less the mean out, in float32, and the backward reads it; above
    that the sum is split in two and the difference made again in each part. Kept at
    micro-batches up to the bound. Not for maps of fewer than `_SMALLEST_MAP` elements a
    channel or features without spatial axes (a Dense's output), nor of a concatenation,
    which the sums' kernel writes out beside them: XLA:GPU makes the difference again."""
    shape = tuple(tensor.shape)
    axis = getattr(layer, "axis", -1)
    if (not holds("centred_input", walker.target) or len(shape) < 3
            or axis not in (-1, len(shape) - 1) or len(_concatenated(tensor)) > 1):
        return
    rows = math.prod(shape[1:-1])
    if rows >= _SMALLEST_MAP and _COLUMN_SUM_ROWS // rows:
        walker.keep_below(shape, "float32", _COLUMN_SUM_ROWS // rows)


def residual_bytes(target: str | None, nbytes: int, dtype: str, compute_dtype: str | None,
                   derived: bool = False, drawn: bool = False, widened: int = 0,
                   fused: bool = False, narrowed: int = 0, read_whole: bool = False) -> int:
    """Bytes XLA holds for a residual of `nbytes` in `dtype` that JAX's gradient keeps
    (`derived`, `drawn`, `widened`, `fused`, `narrowed`: `gradient_trace.TracedCall`'s):
    none for one made again by cheap element-wise ops from kept tensors (on XLA:TPU, by any
    element-wise ops); on XLA:TPU one made from a narrower tensor as that tensor; a mask
    compared from random bits as those bits (two 32-bit words per element); another boolean
    mask as the compared tensor in `compute_dtype` (default float32); one an element-wise op
    broadcasts at that op's size (`widened`)."""
    if read_whole and holds("library_operands", target):
        fused = False  # a library's operand, whole
    if (derived and holds("derived_residual", target)) or (fused
                                                           and holds("fused_residual", target)):
        return 0
    if narrowed and holds("fused_residual", target):
        return narrowed
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
    if _made_again_from(walker, keys):
        walker.fused.update(walker.key(tensor) for tensor in outputs)
    else:
        walker.keep_internal(result)
    return True


def merged(walker, inputs, output) -> None:
    """An add or subtract of tensors XLA:GPU makes again or keeps, one made again at least
    (a BatchNormalization's output and a shortcut), is made again in turn where it is read."""
    if not holds("library_operands", walker.target):
        return
    keys = [walker.key(tensor) for tensor in inputs]
    if any(key in walker.fused for key in keys) and _made_again_from(walker, keys):
        walker.fused.add(walker.key(output))


def _made_again_from(walker, keys) -> bool:
    """Whether every tensor of `keys` is made again or kept: what reads them all can be."""
    return all(key in walker.fused or key in walker.sizes for key in keys)


def reduced(walker, tensor) -> None:
    """A reduction (a global pooling) of a tensor made again that another call reads too (a
    squeeze-excite's scale) writes it out once for them all on XLA:GPU: it is kept."""
    if (holds("library_operands", walker.target) and walker.key(tensor) in walker.fused
            and walker.read_by_others(tensor)):
        walker.keep(tensor)


def contraction(walker, layer, tensor, output, dtype: str) -> bool:
    """Keeps what XLA holds of the input `tensor` of trained kernel layer `layer` (a
    convolution or Dense, computing in `dtype`) and, on XLA:CPU, notes its workspace; False
    where `layer_rules`' own rule holds. XLA:TPU multiplies in bfloat16 at its default
    precision, so it keeps a float32 input as a bfloat16 copy; none of the model's input (an
    argument of the step, read in place) or of an input made again from kept tensors (a
    normalization's output, an activation of it), which it makes again inside the kernel
    gradient's fusion; of a concatenation, which it makes again too, its operands as they
    are. XLA:GPU's library keeps the input whole in `dtype`, but the model's input (given
    to the step)."""
    if holds("library_operands", walker.target):
        if walker.key(tensor) not in walker.model_inputs or dtype != walker.dtype_of(tensor):
            walker.keep(tensor, dtype)  # not the model's input, which the step is given
        return True
    if holds("fusion", walker.target):
        parts = _concatenated(tensor)
        copied = len(parts) == 1 and parts[0] is tensor  # not a concatenation
        for part in parts:
            key = walker.key(part)
            if key not in walker.fused and key not in walker.model_inputs:
                walker.keep(part, ("bfloat16" if itemsize(dtype) > 2 else dtype) if copied
                            else walker.dtype_of(part))
        return True
    return convolution(walker, layer, tensor, output, dtype)


def _concatenated(tensor) -> list:
    """What `tensor` concatenates, down through concatenations of concatenations (a dense
    block's); `[tensor]` for any other tensor."""
    found = internals.concatenation(internals.node_of(tensor))
    if found is None:
        return [tensor]
    return [part for operand in found[1] for part in _concatenated(operand)]


def convolution(walker, layer, tensor, output, dtype: str) -> bool:
    """Keeps what XLA:CPU holds of trained convolution `layer`'s input `tensor` (in `dtype`)
    and notes its workspace; False where `layer_rules`' own rule holds."""
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
    False where `layer_rules`' own rule holds. XLA:TPU keeps the input alone: its backward
    finds each window's maximum again; so does XLA:GPU, whose backward scatters into a map
    of zeros of its padded input (none where another call reads the input: it adds into
    that one's gradient), kept from the forward where it is the zeros other ops of that
    shape share (`_SHARED_ZERO_MAPS`), else made as the backward runs, beside the indices
    it holds then (`scattered_transient`)."""
    if holds("fusion", walker.target) and type(layer) in _MAX_POOLS:
        walker.keep(inputs[0])
        if holds("library_operands", walker.target):
            shape = tuple(inputs[0].shape)
            padded = _padded(layer, shape)
            zeros = math.prod(padded[1:]) * itemsize(walker.dtype_of(inputs[0]))
            producer = getattr(internals.node_of(inputs[0]), "operation", None)
            made_as_it_runs = 0
            if not walker.read_by_others(inputs[0]):  # else it adds into that one's gradient
                if padded == shape and not isinstance(producer, _PADDINGS):
                    walker.keep_bytes(_SHARED_ZERO_MAPS * zeros)
                else:
                    made_as_it_runs = zeros
            walker.transient = max(walker.transient, made_as_it_runs + scattered_transient(
                walker.sample_bytes(output, "int8"), len(output.shape)))
        return True
    if not holds("max_pooling", walker.target) or type(layer) not in _MAX_POOLS:
        return False
    rank = len(output.shape)
    walker.keep_new(tuple(output.shape) + (rank,), "int32")
    walker.transient = max(walker.transient, max_pooling_transient(
        walker.sample_bytes(inputs[0], "int8"), walker.sample_bytes(output, "int8"),
        walker.sample_bytes(output), rank))
    return True


def _padded(layer, shape: tuple) -> tuple:
    """`shape` (batch first) of max pooling `layer`'s input with the padding its windows read
    ("same": what makes the windows cover the input at its strides)."""
    if getattr(layer, "padding", "valid") != "same":
        return shape
    first = getattr(layer, "data_format", "channels_last") == "channels_first"
    axes = range(2, len(shape)) if first else range(1, len(shape) - 1)
    padded = list(shape)
    for axis, window, stride in zip(axes, layer.pool_size, layer.strides):
        size = shape[axis]
        outputs = -(-size // stride)
        padded[axis] = size + max((outputs - 1) * stride + window - size, 0)
    return tuple(padded)


def scattered_transient(output_elements: int, rank: int) -> int:
    """The indices max pooling's backward holds while it runs on XLA:GPU, as it finds each
    window's maximum again: an int32 index per axis and output element."""
    return rank * _INDEX_BYTES * output_elements


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
    for primitive, input_elements, output_elements, size, rank, padded in windows:
        if primitive == "conv_general_dilated" and holds("convolution", target):
            largest = max(largest, convolution_workspace(input_elements * size,
                                                         output_elements * size))
        elif primitive == "reduce_window_max" and holds("max_pooling", target):
            largest = max(largest, max_pooling_transient(
                input_elements, output_elements, output_elements * size, rank))
        elif primitive == "reduce_window_max" and holds("library_operands", target):
            zeros = padded * size if padded != input_elements else 0  # made as it runs
            largest = max(largest, zeros + scattered_transient(output_elements, rank))
    return largest


def traced_zero_maps(target: str | None, windows) -> int:
    """Bytes a sample of the maps of zeros XLA:GPU keeps for the max poolings among a traced
    call's `windows` that read no padding (`_SHARED_ZERO_MAPS`); 0 elsewhere."""
    if not holds("library_operands", target):
        return 0
    return sum(_SHARED_ZERO_MAPS * padded * size
               for primitive, input_elements, _, size, _, padded in windows
               if primitive == "reduce_window_max" and padded == input_elements)


def held_gradient_bytes(target: str | None, layers, trainable, precision: str) -> int | None:
    """What a step compiled for `target` holds for the gradients of `trainable` (the
    variables trained, of `layers`) at its peak, in `precision`; None where all of them are
    held together until the update (TensorFlow's `apply_gradients`; under mixed_float16's
    loss scaling, whose check that every gradient is finite comes before any update).
    XLA:TPU and XLA:GPU update each weight as its gradient is made: the largest gradient;
    on XLA:GPU also a copy of each trained convolution's kernel in cuDNN's layout, made in
    the forward and held to its backward (but in a mixed precision, whose 16-bit copies of
    the weights are counted apart)."""
    if not _updates_as_made(target, precision):
        return None
    trained = {id(v) for v in trainable}
    largest = max((math.prod(v.shape) * itemsize(v.dtype) for v in trainable), default=0)
    if precision.startswith("mixed") or not holds("library_operands", target):
        return largest
    copies = sum(math.prod(layer.kernel.shape) * itemsize(layer.kernel.dtype)
                 for layer in layers if isinstance(layer, _CONVOLUTIONS)
                 and id(getattr(layer, "kernel", None)) in trained)
    return largest + copies


def _updates_as_made(target: str | None, precision: str) -> bool:
    """Whether a step compiled for `target` in `precision` updates each weight as its
    gradient is made (not under mixed_float16's loss scaling, which checks every gradient
    first)."""
    return holds("updates_as_made", target) and precision != "mixed_float16"


def held_gradients_note(target: str | None, precision: str) -> tuple[str, ...]:
    """The plan's note on its gradients row where `held_gradient_bytes` counts them."""
    if not _updates_as_made(target, precision):
        return ()
    gpu = holds("library_operands", target)
    kernels = (" and, in float32, the trained convolutions' kernels, which it keeps in "
               "cuDNN's layout from the forward to their backward" if gpu else "")
    return (f"gradients: {'XLA:GPU' if gpu else 'XLA:TPU'} updates each weight as its "
            f"gradient is made, so the row is the largest gradient{kernels}",)
