"""What a call's backward pass keeps, read from the framework's own gradient: the general path.

`trace_call_tensorflow` and `trace_call_jax` run one call (a layer, a `keras.ops` node, a
recurrent cell, a whole subclassed model) forward and backward on symbolic inputs, and report
which forward tensors the backward reads. On TensorFlow that is the graph `tf.GradientTape`
builds (every forward tensor a gradient op takes as input); on JAX, the residuals `jax.vjp`
saves. Nothing is computed: weights enter as symbolic values through `keras.StatelessScope`,
so a model whose variables were never initialised can be traced too.

On TensorFlow a call is traced once with a symbolic batch axis: a tensor's bytes per sample
are its size beyond that axis. Where that cannot be read (a reshape folds the batch into
another axis), and always on JAX, it is traced at two batch sizes and a tensor's bytes per
sample are the difference, so weights and their casts drop out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import keras
import numpy as np

from tfmem.memory import jaxpr_residuals

# Two batch sizes for the difference, neither 1 (a size-1 axis can be squeezed or broadcast).
_BATCHES = (2, 3)

# TensorFlow ops whose output is a view of an input, and ops that read only a tensor's shape
# (the executor runs those as soon as the forward tensor exists, so they keep nothing).
_ALIASING_OPS = {"Reshape", "Identity", "IdentityN", "Squeeze", "ExpandDims", "StopGradient"}
_SHAPE_OPS = {"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "ZerosLike",
              "OnesLike"}
# TensorFlow kernels that write an output into the buffer of an input of the same shape and
# dtype when nothing else holds that input (`forward_input_or_allocate_output`): the
# element-wise ops and their gradients, bias-add, softmax, AddN, select, and the
# cross-entropy ops, whose gradient over the logits takes the logits' buffer.
_FORWARDING_OPS = frozenset({
    "Abs", "Neg", "Sign", "Reciprocal", "Square", "Sqrt", "Rsqrt", "Exp", "Expm1", "Log",
    "Log1p", "Sin", "Cos", "Tanh", "Sigmoid", "Erf", "Erfc", "Floor", "Ceil", "Round",
    "Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "LeakyRelu",
    "AddV2", "Add", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan", "Maximum",
    "Minimum", "Pow", "SquaredDifference", "Xdivy", "Xlogy", "ClipByValue",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad", "SoftsignGrad",
    "LeakyReluGrad", "TanhGrad", "SigmoidGrad", "SqrtGrad", "RsqrtGrad", "ReciprocalGrad",
    "BiasAdd", "Softmax", "LogSoftmax", "AddN", "Select", "SelectV2",
    "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits",
})


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """The tensors one call's backward pass keeps, per sample.

    Attributes:
        kept_inputs: indices (into the flat tensor arguments) of inputs the backward reads.
        kept_outputs: indices (into the flat outputs) of outputs the backward reads.
        internal: `(bytes per sample, dtype)` of each other forward tensor the backward reads.
        largest_bytes: bytes per sample of the largest tensor of the forward pass.
        output_bytes: bytes per sample of each flat output.
        has_loop: the call runs a loop whose per-iteration intermediates the backward keeps in
            a list this analysis cannot size (TensorFlow `while` accumulators).
        transient_bytes: what the call's forward and backward hold at their peak besides the
            kept tensors, per sample: its output's incoming gradient, its input's outgoing
            one, and the temporaries between (`transient_bytes` below); 0 where not known.
        broadcasts: `(bytes per sample, dtype)` of each internal tensor that is a scalar
            broadcast to a shape (relu's zeros in a JAX trace), which a compiler may fuse
            into what reads it (`xla_rules`); not in `internal`.
        windows: `(primitive, input elements, output elements, itemsize, rank, padded input
            elements)` per sample of each convolution and max pooling of a JAX trace, whose
            transients depend on the compiler (`xla_rules.traced_transient`).
        derived: indices into `internal` of a JAX trace's residuals made by cheap
            element-wise ops from other kept tensors of their shape and scalars (a boolean
            mask also from broadcasts of smaller tensors), which no contraction reads
            (`jaxpr_residuals`): a compiler that fuses them into their readers holds none.
        drawn: indices into `internal` of a JAX trace's boolean residuals compared from
            random bits (a dropout's mask), which a compiler may keep as those bits.
        widened: `(index into internal, bytes per sample)` of a JAX trace's residuals not
            made by a cheap element-wise op that an element-wise op reads beside larger
            tensors (a softmax's sum, a normalization's rsqrt), at that op's size: a
            compiler may keep the broadcast.
        fused: indices into `internal` of a JAX trace's residuals made by element-wise ops
            of any cost from other kept tensors of their shape and from smaller tensors
            broadcast, whether or not a contraction reads them (`jaxpr_residuals`): a
            compiler that fuses element-wise producers into every reader, contractions
            included, holds none.
        internal_shapes: the shape of one sample of each tensor of `internal` where a JAX
            trace has the batch first (None elsewhere): how a target's tiles lay it out
            (`tpu_layout`).
        narrowed: `(index into internal, bytes per sample)` of a JAX trace's residuals not
            `fused` that element-wise ops make from a narrower tensor of their shape, at
            that tensor's size: a compiler that fuses them keeps that tensor instead.
        read_whole: indices into `internal` of a JAX trace's residuals a contraction (a
            dot, a convolution) or a reduction reads: a compiler that calls a library for a
            contraction, which reads its operands whole, or that writes a reduction's
            operand out for its other readers, keeps them though they are `fused`.
    """

    kept_inputs: tuple[int, ...]
    kept_outputs: tuple[int, ...]
    internal: tuple[tuple[int, str], ...]
    largest_bytes: int
    output_bytes: tuple[int, ...] = ()
    has_loop: bool = False
    transient_bytes: int = 0
    windows: tuple[tuple[str, int, int, int, int, int], ...] = ()
    broadcasts: tuple[tuple[int, str], ...] = ()
    derived: tuple[int, ...] = ()
    drawn: tuple[int, ...] = ()
    widened: tuple[tuple[int, int], ...] = ()
    fused: tuple[int, ...] = ()
    internal_shapes: tuple[tuple[int, ...] | None, ...] = ()
    narrowed: tuple[tuple[int, int], ...] = ()
    read_whole: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Trace:
    kept_inputs: frozenset
    kept_outputs: frozenset
    internal: dict  # a name stable across traces -> (bytes, dtype)
    forward: dict  # name -> bytes of every forward tensor
    outputs: tuple  # bytes of each flat output
    has_loop: bool
    ambiguous: bool = False  # a symbolic-batch trace that cannot say what is per sample
    transient: int = 0  # `transient_bytes` of the whole trace (per sample only if `batch` None)
    windows: tuple = ()  # `TracedCall.windows`, at the trace's batch
    derived: frozenset = frozenset()  # names in `internal` (`TracedCall.derived`)
    drawn: frozenset = frozenset()  # names in `internal` (`TracedCall.drawn`)
    widened: dict = dataclasses.field(default_factory=dict)  # name -> `TracedCall.widened`
    fused: frozenset = frozenset()  # names in `internal` (`TracedCall.fused`)
    narrowed: dict = dataclasses.field(default_factory=dict)  # `TracedCall.narrowed`
    read_whole: frozenset = frozenset()  # names in `internal` (`TracedCall.read_whole`)
    shapes: dict = dataclasses.field(default_factory=dict)  # name -> shape, the batch first


def trace_call_tensorflow(call: Callable, specs: Sequence[tuple[tuple, str]], *,
                          differentiable: Sequence[bool], trainable: Sequence,
                          non_trainable: Sequence, held: Sequence[int] = (),
                          owned: Sequence[int] = ()) -> TracedCall:
    """Which forward tensors the backward pass of `call(*tensors)` reads, on TensorFlow.

    The walk (`saved_tensors`) takes this function or `trace_call_jax`, chosen once.

    Args:
        call: takes the flat list of input tensors and returns the output structure; it may
            read `trainable` and `non_trainable` variables, which are mapped to symbolic values.
        specs: `(shape without the batch axis, dtype)` of each input tensor.
        differentiable: per input, whether a gradient flows into it (an earlier layer trains).
        trainable: the variables the gradient is taken for.
        non_trainable: the other variables `call` reads (statistics, seeds).
        held: indices of inputs alive for the whole call in `transient_bytes` (a loss's
            prediction, which the step holds until its metrics update).
        owned: indices of inputs that nothing but the call reads (a loss's prediction that no
            metric holds), whose buffers its ops may write over; the others' may be read
            elsewhere in the step (a layer's input by a skip connection), so they keep theirs.

    Raises:
        whatever the framework raises when the call cannot be traced; callers fall back.
    """
    arguments = (call, specs, differentiable, trainable, non_trainable, held, owned)
    symbolic = _trace_tensorflow(*arguments, batch=None)
    if not symbolic.ambiguous:
        return TracedCall(tuple(sorted(symbolic.kept_inputs)),
                          tuple(sorted(symbolic.kept_outputs)),
                          tuple(v for v in symbolic.internal.values() if v[0] > 0),
                          max(symbolic.forward.values(), default=0), symbolic.outputs,
                          symbolic.has_loop, symbolic.transient)
    return _per_sample(_trace_tensorflow, arguments)


def trace_call_jax(call: Callable, specs: Sequence[tuple[tuple, str]], *,
                   differentiable: Sequence[bool], trainable: Sequence,
                   non_trainable: Sequence, held: Sequence[int] = (),
                   owned: Sequence[int] = ()) -> TracedCall:
    """`trace_call_tensorflow` on JAX: the residuals `jax.vjp` saves, at two batch sizes
    (no transient is sized, so `held` and `owned` change nothing)."""
    del held, owned
    return _per_sample(_trace_jax, (call, specs, differentiable, trainable, non_trainable))


def _per_sample(trace, arguments) -> TracedCall:
    """Bytes per sample from traces at two batch sizes: the difference, so weights drop out."""
    small, large = (trace(*arguments, batch=batch) for batch in _BATCHES)

    def per_sample(name, small_bytes, large_bytes):
        if name not in small_bytes:  # no twin: assume the tensor grows with the batch
            return large_bytes[name] // _BATCHES[1]
        return (large_bytes[name] - small_bytes[name]) // (_BATCHES[1] - _BATCHES[0])

    small_internal = {name: nbytes for name, (nbytes, _) in small.internal.items()}
    large_internal = {name: nbytes for name, (nbytes, _) in large.internal.items()}
    internal, broadcasts, derived, drawn, widened, fused = [], [], [], [], [], []
    shapes, narrowed, read_whole = [], [], []
    for name, (_, dtype) in large.internal.items():
        nbytes = per_sample(name, small_internal, large_internal)
        if nbytes <= 0:  # a weight or a cast of one, not an activation
            continue
        if name.startswith(_BROADCAST):
            broadcasts.append((nbytes, dtype))
            continue
        for names, indices in ((large.derived, derived), (large.drawn, drawn),
                               (large.fused, fused), (large.read_whole, read_whole)):
            if name in names:
                indices.append(len(internal))
        if name in large.widened:
            widened.append((len(internal), per_sample(name, small.widened, large.widened)))
        if name in large.narrowed:
            narrowed.append((len(internal), per_sample(name, small.narrowed, large.narrowed)))
        internal.append((nbytes, dtype))
        shape = large.shapes.get(name)
        shapes.append(tuple(shape[1:]) if shape and shape[0] == _BATCHES[1]
                      and small.shapes.get(name, (None,))[0] == _BATCHES[0] else None)
    largest = max((per_sample(name, small.forward, large.forward) for name in large.forward),
                  default=0)
    outputs = tuple((big - little) // (_BATCHES[1] - _BATCHES[0])
                    for big, little in zip(large.outputs, small.outputs))
    transient = (large.transient - small.transient) // (_BATCHES[1] - _BATCHES[0])
    step = _BATCHES[1] - _BATCHES[0]
    windows = tuple((name, (big_in - little_in) // step, (big_out - little_out) // step,
                     itemsize, rank, (big_padded - little_padded) // step)
                    for (name, big_in, big_out, itemsize, rank, big_padded),
                    (_, little_in, little_out, _, _, little_padded)
                    in zip(large.windows, small.windows))
    return TracedCall(tuple(sorted(large.kept_inputs)), tuple(sorted(large.kept_outputs)),
                      tuple(internal), max(largest, 0), outputs, large.has_loop,
                      max(transient, 0), windows, tuple(broadcasts), tuple(derived),
                      tuple(drawn), tuple(widened), tuple(fused), tuple(shapes),
                      tuple(narrowed), tuple(read_whole))


def _map_variables(trainable, non_trainable, trainable_values, non_trainable_values):
    return list(zip(trainable, trainable_values)) + list(zip(non_trainable, non_trainable_values))


def _float_sum(outputs, cast, reduce_sum, is_float):
    """The scalar the trace differentiates: the sum of every floating output."""
    total = None
    for y in keras.tree.flatten(outputs):
        if is_float(y):
            part = reduce_sum(cast(y))
            total = part if total is None else total + part
    return total


def _trace_tensorflow(call, specs, differentiable, trainable, non_trainable, held=(),
                      owned=(), *, batch) -> _Trace:
    """One trace; with `batch` None, every size is already per sample (a tensor without the
    symbolic batch axis is a weight or a reduction over the batch: 0)."""
    import tensorflow as tf

    boundary = {}

    @tf.function(autograph=False)
    def forward_backward(xs, trainable_values, non_trainable_values):
        xs = list(xs)
        watched = [x for x, wanted in zip(xs, differentiable) if wanted] + list(trainable_values)
        with tf.GradientTape() as tape:
            tape.watch(watched)
            mapping = _map_variables(trainable, non_trainable, trainable_values,
                                     non_trainable_values)
            with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
                outputs = call(xs)
            flat = [tf.convert_to_tensor(y) for y in keras.tree.flatten(outputs)]
            loss = _float_sum(flat, lambda y: tf.cast(y, tf.float32), tf.reduce_sum,
                              lambda y: y.dtype.is_floating)
        boundary["ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        boundary["inputs"] = xs
        boundary["outputs"] = flat
        if loss is None or not watched:
            return []
        return [g for g in tape.gradient(loss, watched) if g is not None]

    def spec_of(shape, dtype):
        return tf.TensorSpec((batch,) + tuple(shape), tf.as_dtype(dtype))  # batch None: symbolic

    graph = forward_backward.get_concrete_function(
        [spec_of(shape, dtype) for shape, dtype in specs],
        [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in trainable],
        [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in non_trainable],
    ).graph
    operations = graph.get_operations()
    forward_names = {op.name for op in operations[:boundary["ops"]]}

    ambiguous = False

    def nbytes(tensor) -> int:
        nonlocal ambiguous
        shape = tensor.shape
        if tensor.dtype in (tf.resource, tf.variant) or shape.rank is None:
            return 0
        if batch is not None:
            return int(np.prod(shape, dtype=np.int64)) * tensor.dtype.size
        if shape.rank == 0 or shape[0] is not None:
            return 0  # no batch axis: a weight, a constant, or reduced over the batch
        if not shape[1:].is_fully_defined():
            ambiguous = True  # a size that depends on the batch in some other way
            return 0
        return int(np.prod(shape[1:], dtype=np.int64)) * tensor.dtype.size

    kept_inputs, kept_outputs, internal, has_loop = _kept_by_backward(
        operations[boundary["ops"]:], forward_names, boundary["inputs"], boundary["outputs"],
        nbytes)
    forward = {t.name: nbytes(t) for op in operations[:boundary["ops"]] for t in op.outputs}
    outputs = tuple(nbytes(t) for t in boundary["outputs"])
    if batch is None:
        ambiguous = ambiguous or any(_folds_batch(op) for op in operations[:boundary["ops"]])
    kept = (sum(nbytes(boundary["inputs"][i]) for i in kept_inputs)
            + sum(outputs[i] for i in kept_outputs) + sum(b for b, _ in internal.values()))
    # Sized without marking the trace ambiguous: a gradient's temporary whose shape the
    # graph leaves open (broadcast to a computed shape) counts as nothing.
    results = list(graph.outputs) + list(graph.control_outputs) + list(boundary["outputs"])
    inputs = boundary["inputs"]
    transient = transient_bytes(operations, _sized(nbytes, batch), results,
                                [inputs[i] for i in held],
                                [x for i, x in enumerate(inputs) if i not in owned]) - kept
    return _Trace(frozenset(kept_inputs), frozenset(kept_outputs), internal, forward, outputs,
                  has_loop, ambiguous, max(transient, 0))


def _kept_by_backward(backward_ops, forward_names, inputs, outputs, nbytes):
    """What the backward ops read of the forward pass: `(indices of the inputs, indices of
    the outputs, {name: (bytes, dtype)} of the forward's own tensors, whether a loop keeps
    its intermediates)`."""
    input_refs = {_root(t).ref(): i for i, t in enumerate(inputs)}
    output_refs = {_root(t).ref(): i for i, t in enumerate(outputs)}
    kept_inputs, kept_outputs, internal, has_loop = set(), set(), {}, False
    for op in backward_ops:
        if op.type in _SHAPE_OPS:
            continue
        for tensor in op.inputs:
            tensor = _root(tensor)
            if tensor.op.name not in forward_names:
                continue
            if tensor.ref() in input_refs:
                kept_inputs.add(input_refs[tensor.ref()])
            elif tensor.ref() in output_refs:
                kept_outputs.add(output_refs[tensor.ref()])
            elif tensor.dtype.name == "variant":
                has_loop = True  # a while loop's accumulator (a TensorList)
            elif tensor.shape.rank and nbytes(tensor):
                internal[tensor.name] = (nbytes(tensor), tensor.dtype.name)
    return kept_inputs, kept_outputs, internal, has_loop


def _root(tensor):
    """The tensor whose buffer `tensor` is a view of (itself if it is not one)."""
    while tensor.op.type in _ALIASING_OPS and tensor.op.inputs:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        tensor = tensor.op.inputs[index]
    return tensor


def _sized(nbytes, batch):
    """`nbytes` for `transient_bytes`: 0 for a tensor whose size is not known."""

    def size(tensor) -> int:
        shape = tensor.shape
        known = shape if batch is not None else shape[1:] if shape.rank else shape
        if shape.rank is None or not known.is_fully_defined():
            return 0
        return nbytes(tensor)

    return size


def transient_bytes(operations, nbytes, results=None, held=(), pinned=()) -> int:
    """The most bytes the tensors of `operations` hold at once, run one at a time in the
    order they were built (the forward, then the backward the tape built in reverse): a
    tensor is held from the op that makes it to the last op that reads it (not counting ops
    that read only its shape), and a view (`_ALIASING_OPS`) holds nothing of its own.

    With `results` (the tensors the run returns or hands on: the call's outputs and the
    gradients), only the ops they need run, as a TensorFlow function prunes the others: a
    custom gradient computes gradients for every input, also a constant's (swish's `beta`:
    three tensors of the input's size that no step computes). Tensors in `held` are held
    to the last op.

    TensorFlow's executor runs ops as soon as their inputs are ready, on more than one
    thread, so this is an estimate of its peak, not a bound. For Keras's BatchNormalization
    on TensorFlow, the largest case among Keras's layers, it is 4 tensors of the input's size
    besides the input; TensorFlow's own allocator measures 4.07 for the same function on a
    CPU (`TF_CPU_ALLOCATOR_USE_BFC=true`), and 4 to 8 inside whole training steps, with the
    micro-batches it is read between (docs/benchmarks.md).

    An op of `_FORWARDING_OPS` that is the only reader of an input of its output's shape and
    dtype writes its output there (TensorFlow's kernels take over the buffer of an input
    nothing else holds): no new tensor. An input with other readers keeps its buffer, as the
    executor may run them in any order (the cross-entropy's gradient takes the logits' buffer
    that only the loss reads; BatchNormalization's ops each read tensors others read too), and
    so do tensors in `pinned` (inputs that the rest of the step may read).
    """
    if results is not None:
        needed = _needed(results)
        operations = [op for op in operations if op.name in needed]
    last, readers = {}, {}
    for position, op in enumerate(operations):
        if op.type in _SHAPE_OPS:
            continue  # run as soon as the tensor exists: it does not hold it
        for tensor in op.inputs:
            last[_root(tensor).ref()] = position
            if op.type not in _ALIASING_OPS:  # a view's readers read it
                readers.setdefault(_root(tensor).ref(), set()).add(op.name)
    for tensor in held:
        last[_root(tensor).ref()] = len(operations) - 1
    for tensor in pinned:
        readers[_root(tensor).ref()] = None  # no op is its only reader
    freed: dict[int, int] = {}  # position -> bytes its op is the last to read
    held = peak = 0
    for position, op in enumerate(operations):
        if op.type not in _ALIASING_OPS:
            sole = (_sole_inputs(op, position, last, readers)
                    if op.type in _FORWARDING_OPS else [])
            for tensor in op.outputs:
                size = nbytes(tensor)
                end = max(last.get(tensor.ref(), position), position)
                taken = next((root for given, root in sole if _same_buffer(
                    given, root, tensor, nbytes)), None)
                if taken is not None:  # written over an input only it reads, whose buffer lives on
                    sole = [entry for entry in sole if entry[1] is not taken]
                    freed[position] -= size
                else:
                    held += size
                freed[end] = freed.get(end, 0) + size
        peak = max(peak, held)
        held -= freed.pop(position, 0)
    return peak


def _sole_inputs(op, position: int, last: dict, readers: dict) -> list:
    """`(input, the tensor whose buffer it is)` of each input that only `op` reads (not held
    to the end: `last`)."""
    sole, seen = [], set()
    for tensor in op.inputs:
        root = _root(tensor)
        if (last.get(root.ref()) == position and readers.get(root.ref()) == {op.name}
                and root.ref() not in seen):
            seen.add(root.ref())
            sole.append((tensor, root))
    return sole


def _same_buffer(given, root, output, nbytes) -> bool:
    """Whether `output` fits the buffer of `root`, read by its op as `given`: same dtype,
    shape and size (TensorFlow forwards only an input of the output's own shape)."""
    return (given.dtype == output.dtype and given.shape.rank is not None
            and given.shape.as_list() == output.shape.as_list()
            and nbytes(root) == nbytes(output) > 0)


def _needed(results) -> set:
    """The names of the ops `results` (tensors or ops) depend on, through data or control."""
    needed, stack = set(), [getattr(r, "op", r) for r in results]
    while stack:
        op = stack.pop()
        if op.name not in needed:
            needed.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return needed


def _folds_batch(op) -> bool:
    """A reshape that moves part of the batch axis elsewhere (`(-1, C)` of a `(B, H, W, C)`):
    its symbolic leading axis no longer counts samples."""
    if op.type != "Reshape":
        return False
    before, after = op.inputs[0].shape, op.outputs[0].shape
    if before.rank is None or after.rank is None or not before.rank or not after.rank:
        return False
    if before[0] is not None or after[0] is not None:
        return before[0] != after[0] and None in (before[0], after[0])
    return (before[1:].is_fully_defined() and after[1:].is_fully_defined()
            and before[1:].num_elements() != after[1:].num_elements())


def _trace_jax(call, specs, differentiable, trainable, non_trainable, *, batch) -> _Trace:
    import jax
    import jax.numpy as jnp

    def run(xs, trainable_values, non_trainable_values):
        mapping = _map_variables(trainable, non_trainable, trainable_values,
                                 non_trainable_values)
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
            outputs = call(list(xs))
        return [jnp.asarray(y) for y in keras.tree.flatten(outputs)]

    wanted = [i for i, flag in enumerate(differentiable) if flag]

    def with_residuals(xs, trainable_values, non_trainable_values):
        def differentiated(chosen, weights):
            full = list(xs)
            for index, value in zip(wanted, chosen):
                full[index] = value
            outputs = run(full, weights, non_trainable_values)
            loss = _float_sum(outputs, lambda y: y.astype(jnp.float32), jnp.sum,
                              lambda y: jnp.issubdtype(y.dtype, jnp.floating))
            return (jnp.zeros((), jnp.float32) if loss is None else loss), outputs

        primals = ([xs[i] for i in wanted], list(trainable_values))
        _, vjp, outputs = jax.vjp(differentiated, *primals, has_aux=True)
        return outputs, jax.tree_util.tree_leaves(vjp)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

    closed, shapes = jax.make_jaxpr(with_residuals, return_shape=True)(
        [abstract((batch,) + tuple(shape), dtype) for shape, dtype in specs],
        [abstract(v.shape, keras.backend.standardize_dtype(v.dtype)) for v in trainable],
        [abstract(v.shape, keras.backend.standardize_dtype(v.dtype)) for v in non_trainable],
    )
    jaxpr = closed.jaxpr
    num_outputs = len(shapes[0])
    input_vars = {id(v): i for i, v in enumerate(jaxpr.invars[:len(specs)])}
    output_vars = {id(v): i for i, v in enumerate(jaxpr.outvars[:num_outputs])}
    # A scalar broadcast to a residual's shape (relu's zeros): named apart (`broadcasts`).
    broadcasts = {id(v) for eqn in jaxpr.eqns if eqn.primitive.name == "broadcast_in_dim"
                  and not getattr(getattr(eqn.invars[0], "aval", None), "shape", ())
                  for v in eqn.outvars}
    kept_inputs, kept_outputs, internal, residuals = set(), set(), {}, {}
    for position, var in enumerate(jaxpr.outvars[num_outputs:]):
        aval = getattr(var, "aval", None)
        if aval is None or not getattr(aval, "shape", ()):
            continue
        if id(var) in broadcasts:
            internal[f"{_BROADCAST}{position}"] = (math.prod(aval.shape) * aval.dtype.itemsize,
                                                   str(aval.dtype))
        elif id(var) in input_vars:
            kept_inputs.add(input_vars[id(var)])
        elif id(var) in output_vars:
            kept_outputs.add(output_vars[id(var)])
        elif type(var).__name__ != "Literal":
            internal[f"residual{position}"] = (math.prod(aval.shape) * aval.dtype.itemsize,
                                               str(aval.dtype))
            residuals[f"residual{position}"] = var
    forward = {f"eqn{i}.{j}": math.prod(v.aval.shape) * v.aval.dtype.itemsize
               for i, eqn in enumerate(jaxpr.eqns) for j, v in enumerate(eqn.outvars)
               if hasattr(v.aval, "shape")}
    outputs = tuple(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                    for v in jaxpr.outvars[:num_outputs])
    windows = tuple((eqn.primitive.name, math.prod(eqn.invars[0].aval.shape),
                     math.prod(eqn.outvars[0].aval.shape), eqn.outvars[0].aval.dtype.itemsize,
                     len(eqn.outvars[0].aval.shape), _padded_elements(eqn))
                    for eqn in _equations(jaxpr) if eqn.primitive.name in _WINDOWS)
    kept = [v for i, v in enumerate(jaxpr.invars[:len(specs)]) if i in kept_inputs] + [
        v for i, v in enumerate(jaxpr.outvars[:num_outputs]) if i in kept_outputs]
    derived, drawn, widened, fused, narrowed, read_whole = jaxpr_residuals.origins(
        jaxpr, residuals, kept)
    return _Trace(frozenset(kept_inputs), frozenset(kept_outputs), internal, forward, outputs,
                  False, windows=windows, derived=derived, drawn=drawn, widened=widened,
                  fused=fused, narrowed=narrowed, read_whole=read_whole,
                  shapes={name: tuple(var.aval.shape) for name, var in residuals.items()})


# The name of a JAX trace's residual that is a broadcast scalar (`TracedCall.broadcasts`).
_BROADCAST = "broadcast"
# The forward ops whose transients depend on the compiler (`TracedCall.windows`).
_WINDOWS = ("conv_general_dilated", "reduce_window_max")


def _padded_elements(eqn) -> int:
    """The elements of a window op's input with the padding it reads around it (a
    convolution's: its input's)."""
    shape = eqn.invars[0].aval.shape
    padding = eqn.params.get("padding") if eqn.primitive.name == "reduce_window_max" else None
    if not padding or len(padding) != len(shape):
        return math.prod(shape)
    return math.prod(size + low + high for size, (low, high) in zip(shape, padding))


def _equations(jaxpr):
    """The equations of `jaxpr` and of the jaxprs inside them (a nested jit's), in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)
