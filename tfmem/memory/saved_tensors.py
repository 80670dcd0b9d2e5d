"""Per-sample bytes of the tensors a training step keeps alive for its backward pass.

Walks a functional Keras model node by node (nested models included) and asks, for each
layer call, which tensors its gradient reads. The answers come from the gradient functions
TensorFlow registers for the ops Keras 3 emits (`tensorflow/python/ops/nn_grad.py`,
`math_grad.py`) and from the Keras 3 layer code:

- Conv*/Dense/EinsumDense: the kernel gradient reads the layer *input* (`Conv2DBackpropFilter`,
  `MatMul`); the input gradient reads only the kernel. The input is kept in the layer's
  compute dtype (under mixed precision Keras casts it, so a float32 input is kept as a new
  float16 copy). SeparableConv also keeps its depthwise intermediate.
- BatchNormalization (training): Keras 3 upcasts to float32, computes `tf.nn.moments` and
  `x * inv + b`; `SquaredDifference` and `Mul` read the float32 input, nothing else of size.
- Activations read their output (`ReluGrad`, `Relu6Grad`, `SigmoidGrad`, `TanhGrad`,
  `EluGrad`, softmax) or their input (`nn.silu`'s custom gradient, `SoftplusGrad`,
  `LeakyReluGrad`): one tensor of the output's size; GELU/hard-swish/mish keep two.
- Add/Subtract/Concatenate/Reshape/padding/cropping/average pools/nearest upsampling/
  Rescaling: gradients need only shapes, nothing is kept.
- Multiply/Maximum/Minimum keep their inputs; MaxPooling keeps input and output
  (`MaxPoolGrad`); Dropout (`stateless_dropout`: `where(mask, x * scale, 0)`) keeps its
  boolean mask, one byte per element.
- Any other layer (a custom block such as MBConv) is traced once per configuration and
  input shape with TensorFlow: forward and `GradientTape` backward in one graph, and the
  forward tensors the backward ops read are the saved ones (`traced_saved_tensors`); on the
  JAX backend, `jax.vjp`'s residuals (`tfmem.memory.probe_jax.saved_residuals`). A layer that
  cannot be traced is counted as keeping its inputs and outputs (an upper bound) and named in
  the plan's notes.

A layer whose output needs no gradient (frozen weights and no trainable layer before it)
keeps nothing: TensorFlow builds no backward op for it.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np

# Activations by the tensor their gradient reads (see the module docstring).
_KEEPS_OUTPUT = {"relu", "relu6", "sigmoid", "tanh", "softmax", "log_softmax", "elu", "selu",
                 "exponential", "hard_sigmoid"}
_KEEPS_INPUT = {"silu", "swish", "softplus", "softsign", "leaky_relu"}
_KEEPS_TWO = {"gelu", "hard_silu", "hard_swish", "mish"}

_NO_SAVED_TENSORS = (
    keras.layers.Add, keras.layers.Subtract, keras.layers.Average, keras.layers.Concatenate,
    keras.layers.Reshape, keras.layers.Flatten, keras.layers.Permute, keras.layers.RepeatVector,
    keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D,
    keras.layers.Cropping1D, keras.layers.Cropping2D, keras.layers.Cropping3D,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D, keras.layers.AveragePooling3D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalAveragePooling3D, keras.layers.Rescaling, keras.layers.Normalization,
    keras.layers.Identity, keras.layers.Embedding, keras.layers.InputLayer,
)
_VIEWS = (keras.layers.Reshape, keras.layers.Flatten, keras.layers.Identity)
_KEEPS_INPUTS = (keras.layers.Multiply, keras.layers.Maximum, keras.layers.Minimum)
_MAX_POOLS = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D)
_GLOBAL_MAX_POOLS = (keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
                     keras.layers.GlobalMaxPooling3D)
_DROPOUTS = (keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
             keras.layers.SpatialDropout3D, keras.layers.GaussianDropout,
             keras.layers.AlphaDropout)
_TWO_TENSOR_NORMS = (keras.layers.LayerNormalization, keras.layers.GroupNormalization)


@dataclasses.dataclass(frozen=True)
class SavedTensors:
    """What one sample costs in the activations a training step keeps for backward.

    Attributes:
        saved_bytes: bytes of the distinct tensors the backward pass reads, for one sample.
        largest_tensor_bytes: bytes of the largest single tensor of the forward pass (one sample).
        input_bytes: bytes of one sample of the model's inputs, as fed (float32 images).
        unknown_layers: class names counted as keeping inputs and outputs (an upper bound).
        traced_layers: class names measured by tracing their backward pass (TensorFlow's
            gradient graph, or JAX's vjp residuals).
    """

    saved_bytes: int
    largest_tensor_bytes: int
    input_bytes: int
    unknown_layers: tuple[str, ...]
    traced_layers: tuple[str, ...] = ()


def _sample_bytes(shape, dtype) -> int:
    dims = tuple(shape)[1:]
    if any(d is None for d in dims):
        raise ValueError(
            f"A tensor of shape {tuple(shape)} has an unknown size beyond the batch dimension. "
            "The planner needs concrete shapes: build the model with a concrete input shape, "
            "e.g. `keras.Input((224, 224, 3))` instead of `(None, None, 3)`."
        )
    return math.prod(dims) * np.dtype(keras.backend.standardize_dtype(dtype)).itemsize


def _activation_name(activation) -> str:
    if activation is None:
        return "linear"
    return getattr(activation, "__name__", type(activation).__name__).lower()


class _Walker:
    def __init__(self):
        self.canonical: dict[int, int] = {}  # id(KerasTensor) -> id of the tensor it aliases
        self.sizes: dict[object, int] = {}  # key -> bytes per sample of each kept tensor
        self.needs_grad: set[int] = set()
        self.largest = 0
        self.unknown: set[str] = set()
        self.traced_layers: set[str] = set()
        self.trace_cache: dict = {}
        self._tensors: list = []  # keep walked tensors alive so their ids stay unique

    def key(self, tensor) -> int:
        return self.canonical.get(id(tensor), id(tensor))

    def keep(self, tensor, dtype=None) -> None:
        """Keeps `tensor` (shared by identity) or, cast to another dtype, a new copy of it."""
        dtype = keras.backend.standardize_dtype(dtype or tensor.dtype)
        if dtype == keras.backend.standardize_dtype(tensor.dtype):
            self.sizes[self.key(tensor)] = _sample_bytes(tensor.shape, dtype)
        else:
            self.sizes[(self.key(tensor), dtype)] = _sample_bytes(tensor.shape, dtype)

    def keep_new(self, shape, dtype) -> None:
        self.sizes[("new", len(self.sizes))] = _sample_bytes(shape, dtype)

    def keep_activation(self, name: str, output, pre_activation=None) -> None:
        """Keeps what activation `name` reads; `pre_activation` None: an internal tensor."""
        if name == "linear":
            return
        if name in _KEEPS_OUTPUT:
            self.keep(output)
            return
        if name not in _KEEPS_INPUT:
            if name not in _KEEPS_TWO:
                self.unknown.add(f"activation {name}")
            self.keep(output)
        if pre_activation is None:
            self.keep_new(output.shape, output.dtype)
        else:
            self.keep(pre_activation)

    def walk(self, model) -> None:
        if isinstance(model, keras.Sequential):
            model = model._functional  # Sequential keeps a Functional once built
        for depth in sorted(model._nodes_by_depth, reverse=True):
            for node in model._nodes_by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                self._tensors.extend(node.input_tensors + node.outputs)
                self.layer_call(node.operation, node.input_tensors, node.outputs)

    def layer_call(self, layer, inputs, outputs) -> None:
        functional = isinstance(layer, keras.Model) and hasattr(layer, "_nodes_by_depth")
        if functional or isinstance(layer, keras.Sequential):
            self.nested(layer, inputs, outputs)
            return
        for tensor in outputs:
            self.largest = max(self.largest, _sample_bytes(tensor.shape, tensor.dtype))
        if isinstance(layer, _VIEWS) or (isinstance(layer, _DROPOUTS) and not layer.rate):
            # Reshapes share their input's buffer; a rate-0 dropout returns its input.
            self.canonical[id(outputs[0])] = self.key(inputs[0])
            if self.key(inputs[0]) in self.needs_grad:
                self.needs_grad.add(self.key(outputs[0]))
            return
        has_trainable = any(w.trainable for w in layer.weights) and layer.trainable
        needs_grad = has_trainable or any(self.key(t) in self.needs_grad for t in inputs)
        if not needs_grad:
            return
        self.needs_grad.update(self.key(t) for t in outputs)
        self.saved_by(layer, inputs, outputs, has_trainable)

    def nested(self, model, inputs, outputs) -> None:
        inner = model._functional if isinstance(model, keras.Sequential) else model
        for outer, inner_input in zip(inputs, inner.inputs):
            self.canonical[id(inner_input)] = self.key(outer)
        self.walk(inner)
        for outer, inner_output in zip(outputs, inner.outputs):
            self.canonical[id(outer)] = self.key(inner_output)
            if self.key(inner_output) in self.needs_grad:
                self.needs_grad.add(self.key(outer))

    def saved_by(self, layer, inputs, outputs, has_trainable: bool) -> None:
        compute = layer.compute_dtype
        out = outputs[0]
        if isinstance(layer, keras.layers.SeparableConv2D | keras.layers.SeparableConv1D):
            if has_trainable:
                self.keep(inputs[0], compute)
            # The depthwise result feeds the pointwise kernel gradient.
            channels = inputs[0].shape[-1] * layer.depth_multiplier
            self.keep_new(tuple(out.shape[:-1]) + (channels,), compute)
            self.keep_activation(_activation_name(layer.activation), out)
        elif hasattr(layer, "kernel") and not isinstance(layer, keras.layers.Embedding):
            # Conv*, DepthwiseConv*, Conv*Transpose, Dense, EinsumDense.
            if has_trainable:
                self.keep(inputs[0], compute)
            self.keep_activation(_activation_name(getattr(layer, "activation", None)), out)
        elif isinstance(layer, keras.layers.BatchNormalization):
            if layer.trainable:
                self.keep(inputs[0], "float32")
        elif isinstance(layer, _TWO_TENSOR_NORMS):
            self.keep(inputs[0], "float32")
            self.keep_new(out.shape, "float32")
        elif isinstance(layer, keras.layers.Activation):
            self.keep_activation(_activation_name(layer.activation), out, inputs[0])
        elif isinstance(layer, keras.layers.ReLU | keras.layers.ELU | keras.layers.Softmax):
            self.keep(out)
        elif isinstance(layer, keras.layers.LeakyReLU | keras.layers.PReLU):
            self.keep(inputs[0])
        elif isinstance(layer, _NO_SAVED_TENSORS):
            pass
        elif isinstance(layer, keras.layers.UpSampling2D):
            if layer.interpolation != "nearest":
                self.keep(inputs[0])  # ResizeBilinearGrad reads the original image
        elif isinstance(layer, _KEEPS_INPUTS):
            for tensor in inputs:
                self.keep(tensor, compute)
        elif isinstance(layer, _MAX_POOLS):
            self.keep(inputs[0])
            self.keep(out)
        elif isinstance(layer, _GLOBAL_MAX_POOLS):
            self.keep(inputs[0])
        elif isinstance(layer, _DROPOUTS):
            self.keep_new(inputs[0].shape, "bool")  # SelectV2's keep-mask, one byte each
        else:
            self.traced(layer, inputs, outputs)

    def traced(self, layer, inputs, outputs) -> None:
        try:
            cache_key = (type(layer), repr(sorted((k, v) for k, v in layer.get_config().items()
                                                  if k != "name")),
                         tuple((tuple(t.shape[1:]), str(t.dtype)) for t in inputs),
                         layer.trainable)
        except (NotImplementedError, TypeError):
            cache_key = None
        result = self.trace_cache.get(cache_key) if cache_key else None
        if result is None:
            try:
                result = _trace(layer, inputs)
            except Exception as error:  # noqa: BLE001 - any trace failure: fall back, say so
                self.unknown.add(f"{type(layer).__name__} ({type(error).__name__})")
                for tensor in list(inputs) + list(outputs):
                    self.keep(tensor)
                return
            if cache_key:
                self.trace_cache[cache_key] = result
        self.traced_layers.add(type(layer).__name__)
        input_indices, output_indices, internal, largest = result
        for index in input_indices:
            self.keep(inputs[index])
        for index in output_indices:
            self.keep(outputs[index])
        for nbytes in internal:
            self.sizes[("new", len(self.sizes))] = nbytes
        self.largest = max(self.largest, largest)


def saved_tensors(model: keras.Model) -> SavedTensors:
    """Per-sample bytes the backward pass of `model` keeps, read from its functional graph.

    Args:
        model: a built functional or Sequential Keras model with concrete input shapes.

    Raises:
        TypeError: `model` is a subclassed model (it has no graph to walk).
        ValueError: a tensor has an unknown non-batch dimension.
    """
    if isinstance(model, keras.Sequential):
        if model._functional is None:
            raise ValueError("The Sequential model is not built: give its first layer an "
                             "`input_shape` or call `model.build((None, H, W, C))` first.")
    elif not hasattr(model, "_nodes_by_depth"):
        raise TypeError(
            f"{type(model).__name__} is a subclassed model: the planner reads activations "
            "from a functional graph. Build it functionally (`keras.Model(inputs, outputs)`) "
            "or measure it with `tfmem.probe`."
        )
    walker = _Walker()
    inputs = model._functional.inputs if isinstance(model, keras.Sequential) else model.inputs
    walker.walk(model)
    return SavedTensors(
        saved_bytes=int(sum(walker.sizes.values())),
        largest_tensor_bytes=int(walker.largest),
        input_bytes=int(sum(_sample_bytes(t.shape, t.dtype) for t in inputs)),
        unknown_layers=tuple(sorted(walker.unknown)),
        traced_layers=tuple(sorted(walker.traced_layers)),
    )


def _trace(layer, inputs):
    """The backend's own answer: TensorFlow's gradient graph, or on JAX `jax.vjp`'s residuals."""
    if keras.backend.backend() == "jax":
        from tfmem.memory import probe_jax

        return probe_jax.saved_residuals(layer, inputs)
    return traced_saved_tensors(layer, inputs)


# Ops whose outputs alias an input's buffer, and ops that read only a tensor's shape (the
# dataflow executor runs those as soon as the forward tensor exists, so they keep nothing).
_ALIASING_OPS = {"Reshape", "Identity", "IdentityN", "Squeeze", "ExpandDims", "StopGradient"}
_SHAPE_OPS = {"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "ZerosLike",
              "OnesLike"}


def traced_saved_tensors(layer, inputs):
    """Which tensors the TensorFlow backward of `layer(*inputs)` reads, from its graph.

    Builds forward and `GradientTape` backward of one call in a `tf.function` with a
    symbolic batch dimension; every forward tensor with that batch dimension that a backward
    op (one created by `tape.gradient`) reads is saved. Reshape-like ops share their input's
    buffer and are followed to it; shape-only reads keep nothing.

    Returns:
        (indices of inputs kept, indices of outputs kept, bytes per sample of each other
        kept tensor, bytes per sample of the largest forward tensor).
    """
    import tensorflow as tf

    boundary = {}

    @tf.function(autograph=False)
    def forward_backward(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = tf.nest.flatten(layer(*xs, training=True))
            loss = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32)) for y in ys])
        boundary["ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        boundary["outputs"] = ys
        return tape.gradient(loss, list(xs) + layer.trainable_variables)

    specs = [tf.TensorSpec((None,) + tuple(t.shape[1:]), t.dtype) for t in inputs]
    graph = forward_backward.get_concrete_function(*specs).graph
    operations = graph.get_operations()
    forward = {op.name for op in operations[:boundary["ops"]]}

    def root(tensor):
        while tensor.op.type in _ALIASING_OPS and tensor.op.inputs:
            index = tensor.value_index if tensor.op.type == "IdentityN" else 0
            tensor = tensor.op.inputs[index]
        return tensor

    def per_sample(tensor) -> int | None:
        shape = tensor.shape
        if shape.rank is None or shape.rank == 0 or shape[0] is not None:
            return None  # not a batch tensor: a weight, a constant or a shape
        if not shape[1:].is_fully_defined() or tensor.dtype == tf.resource:
            return None
        return int(np.prod(shape[1:], dtype=np.int64)) * tensor.dtype.size

    saved = {}
    for op in operations[boundary["ops"]:]:
        if op.type in _SHAPE_OPS:
            continue
        for tensor in op.inputs:
            tensor = root(tensor)
            if tensor.op.name in forward and per_sample(tensor):
                saved[tensor.ref()] = tensor
    placeholders = [t for t in graph.inputs if t.dtype != tf.resource][:len(inputs)]
    input_refs = {t.ref(): i for i, t in enumerate(placeholders)}
    output_refs = {root(t).ref(): i for i, t in enumerate(boundary["outputs"])}
    kept_inputs, kept_outputs, internal = [], [], []
    for ref, tensor in saved.items():
        if ref in input_refs:
            kept_inputs.append(input_refs[ref])
        elif ref in output_refs:
            kept_outputs.append(output_refs[ref])
        else:
            internal.append(per_sample(tensor))
    largest = max((per_sample(t) or 0 for op in operations[:boundary["ops"]]
                   for t in op.outputs), default=0)
    return kept_inputs, kept_outputs, internal, largest
