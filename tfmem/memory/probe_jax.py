"""What JAX itself can say about memory: per-device allocator stats and a compiled step's plan.

Two readings the planner's probe (`tfmem/memory/probe.py`) uses on the Keras JAX backend:

- `device_memory_stats()`: the allocator counters of each local device (`bytes_in_use`,
  `peak_bytes_in_use`, `bytes_limit`, …) as `jax.Device.memory_stats()` reports them on GPUs
  and TPUs. CPU devices keep no such counters (there the probe measures process RSS instead).
- `compiled_step_memory(model, data)`: XLA's memory analysis of the model's jitted train step
  for one batch, before running it: argument, output, aliased (donated) and temporary bytes
  per device. Available on every platform, including CPU.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from keras import tree


def device_memory_stats(device: jax.Device | None = None) -> dict[str, int]:
    """The allocator counters of one device, or `{}` where the platform keeps none (CPU).

    Args:
        device: a `jax.Device`; the first local device when omitted.

    Returns:
        JAX's `memory_stats()` dict, e.g. `{"bytes_in_use": …, "peak_bytes_in_use": …,
        "bytes_limit": …}` on a GPU or TPU.

    Example:
        >>> stats = device_memory_stats()
        >>> stats.get("peak_bytes_in_use")  # None on CPU
    """
    device = device if device is not None else jax.local_devices()[0]
    return dict(device.memory_stats() or {})


def peak_bytes_in_use() -> int | None:
    """The largest `peak_bytes_in_use` over this process's devices; `None` on CPU.

    JAX's counter covers the whole process lifetime (it cannot be reset), so read it in a fresh
    process that runs only the steps being measured, as `tfmem.probe` does.

    Example:
        >>> model.fit(x, y, batch_size=64, epochs=1)  # doctest: +SKIP
        >>> peak_bytes_in_use()  # bytes on the busiest GPU/TPU device
    """
    peaks = [device_memory_stats(d).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [peak for peak in peaks if peak is not None]
    return max(peaks) if peaks else None


def compiled_step_memory(model: keras.Model, data) -> dict[str, int]:
    """XLA's memory analysis of `model.train_step` compiled for one batch shaped like `data`.

    The step is lowered exactly as `fit` runs it: `jax.jit` with the state donated, and under
    a `keras.distribution` the batch sharded over its devices, so the numbers are per device.
    Nothing runs and no variable changes.

    Args:
        model: a compiled model that has been built for training (it has run `fit` or
            `train_on_batch` once, so its optimizer and metrics have their variables).
        data: one batch as `fit` sees it: `(x, y)` or `(x, y, sample_weight)`; arrays or
            `jax.ShapeDtypeStruct`s.

    Returns:
        `{"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
        "generated_code_bytes", "peak_bytes"}`, where `peak_bytes` = argument + output −
        alias + temp, XLA's own bound on what the step holds at once.

    Raises:
        ValueError: the model is not compiled, or its optimizer has no variables yet.

    Example:
        >>> model.train_on_batch(x[:64], y[:64])  # doctest: +SKIP
        >>> compiled_step_memory(model, (x[:64], y[:64]))["peak_bytes"]
    """
    if not model.compiled:
        raise ValueError(
            "compiled_step_memory() needs a compiled model: call `model.compile(...)` first."
        )
    if not model.optimizer.built:
        raise ValueError(
            "The model's optimizer has no variables yet, so there is no train step to "
            "compile. Run one step first (`model.train_on_batch(x, y)` or a 1-step `fit`)."
        )
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    abstract_state = tree.map_structure(_abstract, state)
    abstract_data = tree.map_structure(_abstract_batch, data)
    compiled = (
        jax.jit(model.train_step, donate_argnums=0).lower(abstract_state, abstract_data).compile()
    )
    analysis = compiled.memory_analysis()
    sizes = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
        "generated_code_bytes": analysis.generated_code_size_in_bytes,
    }
    sizes["peak_bytes"] = (
        sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    )
    return {name: int(value) for name, value in sizes.items()}


def _abstract(value) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)


def _abstract_batch(value):
    """A batch leaf laid out as `fit` lays it out: sharded on the batch axis if distributed."""
    if value is None:
        return None
    shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = distribution.device_mesh.backend_mesh
    spec = jax.sharding.PartitionSpec(distribution.batch_dim_name)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def saved_residuals(layer: keras.layers.Layer, inputs: list) -> tuple:
    """Which tensors JAX's backward of `layer(*inputs)` keeps, read from `jax.vjp`'s residuals.

    The JAX counterpart of `tfmem.memory.saved_tensors.traced_saved_tensors`, with the same
    result: the residuals of `jax.vjp` over the layer's stateless call (weights and inputs),
    traced abstractly with a symbolic batch dimension, so nothing runs. A residual with the
    batch dimension and the shape and dtype of an input (or an output) is counted as that
    tensor; the others are the layer's own.

    Args:
        layer: a built Keras layer.
        inputs: its symbolic input tensors (`keras.KerasTensor`s with a batch dimension).

    Returns:
        (indices of inputs kept, indices of outputs kept, bytes per sample of each other
        kept tensor, bytes per sample of the largest output).

    Example:
        >>> saved_residuals(keras.layers.Dense(4, activation="relu"), [keras.Input((8,))])
        ([0], [], [4, 16], 16)  # doctest: +SKIP
    """
    from tfmem import _keras_internals as internals

    (batch,) = jax.export.symbolic_shape("batch")
    specs = [jax.ShapeDtypeStruct((batch,) + tuple(t.shape[1:]), t.dtype) for t in inputs]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    kwargs = {"training": True} if internals.call_has_training_arg(layer) else {}

    def forward(trainable, *xs):
        return layer.stateless_call(trainable, non_trainable, *xs, **kwargs)[0]

    trainable = [v.value for v in layer.trainable_variables]
    residuals = jax.eval_shape(lambda *args: jax.vjp(forward, *args)[1], trainable, *specs)
    outputs = tree.flatten(jax.eval_shape(forward, trainable, *specs))

    def per_sample(leaf) -> int | None:
        shape = tuple(leaf.shape)
        if not shape or isinstance(shape[0], int) or not all(isinstance(d, int) for d in shape[1:]):
            return None  # a weight or a constant: no batch dimension
        return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(leaf.dtype).itemsize

    def signature(leaf):
        return tuple(leaf.shape[1:]), np.dtype(leaf.dtype)

    unmatched_inputs = {i: signature(s) for i, s in enumerate(specs)}
    unmatched_outputs = {i: signature(o) for i, o in enumerate(outputs)}
    kept_inputs, kept_outputs, internal = [], [], []
    for leaf in jax.tree_util.tree_leaves(residuals):
        size = per_sample(leaf)
        if size is None:
            continue
        found = [i for i, s in unmatched_inputs.items() if s == signature(leaf)]
        if found:
            kept_inputs.append(found[0])
            del unmatched_inputs[found[0]]
            continue
        found = [i for i, s in unmatched_outputs.items() if s == signature(leaf)]
        if found:
            kept_outputs.append(found[0])
            del unmatched_outputs[found[0]]
            continue
        internal.append(size)
    largest = max((per_sample(o) or 0 for o in outputs), default=0)
    return sorted(kept_inputs), sorted(kept_outputs), internal, largest
