"""What a step compiled by XLA (the JAX backend) keeps beyond `layer_rules`' tensors.

`layer_rules` writes down what TensorFlow's registered gradients read. On JAX the whole step
is one XLA program, which keeps a different set around element-wise activations and
normalizations (each rule measured on XLA:CPU against XLA's own memory analysis,
`tfmem.memory.probe_jax.compiled_step_memory`; the per-kind table is in docs/planning.md):

- A piecewise activation (relu, relu6, elu, selu, hard_sigmoid) is differentiated on its
  input, not its output (TensorFlow's `ReluGrad` reads the output): XLA fuses the mask into
  the backward and recomputes it from the pre-activation, which stays alive, next to the
  activation itself where the next layer keeps that.
- A training BatchNormalization's output is recomputed from its input in each fusion that
  reads it (a following relu's mask too); a bias added just before it is not fused into
  the convolution or Dense, whose output before the bias stays alive as well.
- silu (swish) keeps its gate, sigmoid(x), beside its input.
- The backward's workspace is three tensors of the largest size, not two: a convolution's
  output gradient, its input gradient, and a copy of its input in the layout its kernel
  gradient reads.
- A boolean residual of JAX's own gradient (the mask of a comparison, in a traced call) is
  held as the tensor it compares, in the compute dtype, for the same reason.
"""

from __future__ import annotations

import numpy as np

from tfmem import _keras_internals as internals

PIECEWISE = frozenset({"relu", "relu6", "elu", "selu", "hard_sigmoid"})
_GATED = frozenset({"silu", "swish"})


def activation(walker, name: str, output, pre_activation=None) -> bool:
    """Keeps what XLA holds for activation `name` (`pre_activation` None: a tensor inside
    the layer); False where it holds what `layer_rules` says."""
    if name not in PIECEWISE and name not in _GATED:
        return False
    if pre_activation is None:
        walker.keep_new(output.shape, walker.dtype_of(output))
    elif name in _GATED or walker.key(pre_activation) not in walker.fused:
        walker.keep(pre_activation)
    if name in _GATED:
        walker.keep_new(output.shape, walker.dtype_of(output))  # sigmoid(x)
    return True


def batch_normalization(walker, inputs, output) -> None:
    """What XLA holds for a training BatchNormalization besides its input (`layer_rules`):
    its output is recomputed from that input wherever the backward reads it; a biased
    convolution or Dense before it keeps its output before the bias too."""
    walker.fused.add(walker.key(output))
    producer = internals.node_of(inputs[0]).operation
    activation = getattr(producer, "activation", None)
    if (getattr(producer, "use_bias", False) and getattr(producer, "kernel", None) is not None
            and getattr(activation, "__name__", "linear") == "linear"):
        walker.keep_new(inputs[0].shape, walker.dtype_of(inputs[0]))


def residual_bytes(nbytes: int, dtype: str, compute_dtype: str | None) -> int:
    """Bytes XLA holds for a residual of `nbytes` in `dtype` that JAX's gradient keeps: a
    boolean mask as the compared tensor in `compute_dtype` (default float32)."""
    if dtype != "bool":
        return nbytes
    return nbytes * np.dtype(compute_dtype or "float32").itemsize


def workspace_tensors(xla: bool) -> int:
    """How many tensors of the largest size the backward's workspace holds at least."""
    return 3 if xla else 2
