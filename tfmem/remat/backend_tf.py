"""Rematerialization on TensorFlow: a recomputed function, with the forward pass's state.

`tf.recompute_grad` runs the layer again when the gradient is taken; Keras's own `keras.remat`
lets that second run update BatchNormalization's statistics again and advance the Dropout
seeds. Here the second run reads the state the first one saw and its updates are dropped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import tensorflow as tf

from tfmem import _keras_internals as internals
from tfmem.remat import scope

# A recomputed segment's activations exist again only while it runs, on any device.
SAVES_ON_CPU = True


def rematerialized_call(layer, original):
    """The `call` of `layer` that is run again in the backward pass (`recompute_grad`)."""

    def call(*args, **kwargs):
        if internals.any_symbolic(args, kwargs) or not scope.is_training_call():
            return original(*args, **kwargs)
        state = list(layer.non_trainable_variables)
        seen = [tf.identity(variable.value) for variable in state]  # before the forward pass
        flat = tf.nest.flatten(args)
        runs = []
        calls, shapes, draws = WeightsFirst(), ForwardShapes(), ForwardDraws()

        def observed(node, call):
            call = shapes.observed(node, call)
            return calls.observed(node, call) if _weighted(node) else call

        def ordered(node, call):
            call = shapes.replayed(node, call)
            return calls.ordered(node, call) if _weighted(node) else call

        def then(ops):
            shapes.read_from_forward(ops)
            draws.read_from_forward(layer)

        @functools.partial(recompute_grad, then=then)
        def run(*tensors):
            rebuilt = tf.nest.pack_sequence_as(args, list(tensors))
            if not runs:  # the forward pass: its updates are the step's
                runs.append("forward")
                with scope.segment_calls(observed), draws.made("forward"):
                    return original(*rebuilt, **kwargs)
            runs.append("recomputed")
            with internals.stateless_scope(list(zip(state, seen))), \
                    scope.segment_calls(ordered), draws.made("recomputed"):
                return original(*rebuilt, **kwargs)

        return run(*flat)

    return call


def recompute_grad(function, then=None):
    """`tf.recompute_grad` without its copy of every argument; `then`, if given, is called
    with the ops the recomputation and its gradient made (`ForwardShapes.read_from_forward`).

    What waits for what (why, and what it saves: docs/rematerialization.md, docs/benchmarks.md):
    - the recomputation waits for the gradient it serves: through control dependencies, which
      copy nothing (under XLA, which drops them, through an addition XLA fuses), its ops that
      read none of its arguments (a dropout's mask) too;
    - the gradients passed on to the arguments wait for the weights' gradients, so the segment
      before is recomputed only once this one's tensors can be freed;
    - they wait for each other too (each read twice), so that Grappler does not fold the sums
      of a piece passed through several segments (`runner._units`) into one, made last.
    """

    @tf.custom_gradient
    def inner(*args):
        result = function(*args)

        def grad(*upstream, variables=None):
            variables = list(variables or [])
            with tf.GradientTape() as tape:
                ordered = _after(upstream[0], args)
                tape.watch(ordered)
                tape.watch(variables)
                made = _ops_made()
                with _waiting_for(upstream[0]):
                    recomputed = function(*ordered)
            grads = tape.gradient(recomputed, ordered + variables, output_gradients=upstream,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            ops = made()  # the recomputation's and its gradient's
            if then is not None:
                then(ops)
            weights = _after_reads(ops, grads[len(ordered):])
            passed = [gradient if _differentiable(argument) else None  # a mask, token ids
                      for argument, gradient in zip(args, grads[:len(ordered)])]
            return _after_values(weights + passed, passed), weights

        return result, grad

    return inner


class WeightsFirst:
    """The calls of layers with weights in a recomputed segment, whose gradients for their
    inputs are made only once those for their weights are (by control edges, which copy
    nothing), so that the input a weight's gradient reads is freed before the layers before
    it run their backward pass. Eagerly or under XLA (which drops control edges), calls run as
    they are. Only a call that reads no tensor twice is ordered (`observed` by the forward
    pass): one that does adds that tensor's gradient up in an order of its own, which rounds
    differently from the segment's (why it matters: docs/rematerialization.md).
    """

    def __init__(self):
        self.plain = {}  # id(node) → run as written: no floating input, or one read twice

    def observed(self, node, call):
        """`call` as it is, noting whether it is to run as written in the recomputation: it
        takes no floating-point tensor, returns something other than tensors, or reads a
        tensor twice."""

        if tf.executing_eagerly() or internals.in_xla_compilation():
            return call  # ops run as they come; XLA drops control edges

        def observing(*args, **kwargs):
            inputs = _float_inputs(args, kwargs)
            before = [set(tensor.consumers()) for tensor in inputs]
            result = call(*args, **kwargs)
            self.plain[id(node)] = not inputs or not all(
                isinstance(output, tf.Tensor) for output in tf.nest.flatten(result)
            ) or _reads_twice(inputs, before)
            return result

        return observing

    def ordered(self, node, call):
        """`call`, its input gradients made after its weights' (as it is where the forward
        pass found it to run as written, or did not see it)."""
        if self.plain.get(id(node), True):
            return call
        return _weights_first(call)


def weights_first(call):
    """`call`, its inputs' gradients made only once its weights' are (control edges): for a
    call outside the recomputed segments that reads a segment's output, so that the tensors
    its weights' gradients read (its output's gradient: a head's logits') are freed before
    the segment, which waits for its input gradient, is recomputed. The caller makes sure
    no other call reads its inputs: their gradients are then added up inside it as the
    step would add them. Eagerly or under XLA, as it is."""

    ordered = _weights_first(call)

    def running(*args, **kwargs):
        if (tf.executing_eagerly() or internals.in_xla_compilation()
                or not _float_inputs(args, kwargs)):
            return call(*args, **kwargs)
        return ordered(*args, **kwargs)

    return running


def _weights_first(call):
    """`call` under a custom gradient making its inputs' gradients after its weights'."""

    def ordering(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        inputs = _float_inputs(args, kwargs)  # some: the forward pass saw them
        made = []

        @tf.custom_gradient
        def inner(*tensors):
            by_id = dict(zip((id(tensor) for tensor in inputs), tensors))
            filled = [by_id.get(id(item), item) for item in flat]
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                filled_args, filled_kwargs = tf.nest.pack_sequence_as((args, kwargs),
                                                                      filled)
                result = call(*filled_args, **filled_kwargs)
            made.append(result)
            outputs = tf.nest.flatten(result)

            def grad(*upstream, variables=None):
                variables = list(variables or [])
                pairs = [(output, up) for output, up in zip(outputs, upstream)
                         if output.dtype.is_floating]
                grads = tape.gradient(
                    [output for output, _ in pairs], list(tensors) + variables,
                    output_gradients=[tf.zeros_like(output) if up is None else up
                                      for output, up in pairs])
                weights = grads[len(tensors):]
                first = [g for g in weights if isinstance(g, (tf.Tensor, tf.IndexedSlices))]
                if not first:
                    return grads[:len(tensors)], weights
                with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices)
                                              else g for g in first]):
                    return [_identity(g) for g in grads[:len(tensors)]], weights

            return outputs, grad

        outputs = inner(*inputs)
        internals.keep_keras_masks(tf.nest.flatten(made[0]), outputs)
        return tf.nest.pack_sequence_as(made[0], outputs)

    return ordering


def _weighted(node) -> bool:
    """Whether a graph segment's call is of a layer with trainable weights."""
    return bool(getattr(node.operation, "trainable_weights", None))


class ForwardShapes:
    """The shapes a recomputed segment and its gradient read, read from the forward pass's
    tensors instead of the recomputed ones.

    Where the batch size is not known when the step is traced, a call may read its input's
    shape (a dropout, its mask's), and a gradient the shapes of what it broadcast (a
    dropout's scaling): TensorFlow then makes those tensors again, and the ones they are
    made from, though no gradient reads their values (a convolution whose output only a
    dropout takes: its mask is drawn from its seed). The forward pass made the same tensors,
    call by call (the same ops, in the same order); their shapes are read as soon as they are
    made, so they are not held for it. Run eagerly, or under XLA (which knows every shape
    when it compiles), nothing is changed.
    """

    def __init__(self):
        self.forward = {}  # id(node) → the forward pass's tensors taken and ops made
        self.twins = {}  # a recomputed tensor's name → the forward pass's tensor

    def observed(self, node, call):
        """`call` as it is, noting the tensors it takes and the ops it makes."""
        if tf.executing_eagerly() or internals.in_xla_compilation():
            return call

        def observing(*args, **kwargs):
            made = _ops_made()
            result = call(*args, **kwargs)
            self.forward[id(node)] = _tensors(args, kwargs), made()
            return result

        return observing

    def replayed(self, node, call):
        """`call`, noting which of its tensors are the forward pass's again (none where the
        forward pass did not see it, or made other ops)."""
        if id(node) not in self.forward:
            return call

        def replaying(*args, **kwargs):
            made = _ops_made()
            result = call(*args, **kwargs)
            inputs, ops = self.forward[id(node)]
            taken = _tensors(args, kwargs)
            pairs = list(zip(taken, inputs)) if len(taken) == len(inputs) else []
            forward = _by_scope(ops)
            for name, op in _by_scope(made()).items():
                twin = forward.get(name)
                if twin is not None and twin.type == op.type and len(
                        twin.outputs) == len(op.outputs):
                    pairs += zip(op.outputs, twin.outputs)
            self.twins.update(
                (tensor.name, twin) for tensor, twin in pairs if tensor is not twin
                and tensor.dtype == twin.dtype and tensor.shape.rank is not None
                and tensor.shape.as_list() == twin.shape.as_list())
            return result

        return replaying

    def read_from_forward(self, ops) -> None:
        """Makes the shape reads among `ops` read the forward pass's tensors (where the
        graph cannot be changed so, they read the recomputed ones, as written)."""
        for op in ops if self.twins else ():
            if op.type in _SHAPE_ONLY:
                for index, tensor in enumerate(op.inputs):
                    if tensor.name in self.twins:
                        try:
                            internals.replace_op_input(op, index, self.twins[tensor.name])
                        except (TypeError, ValueError, tf.errors.OpError):
                            return


class ForwardDraws:
    """The values of a segment's stateful ops, read by its recomputation from the forward
    pass instead of being made again; the variables it writes, not written twice.

    A stateful random op (`tf.random.normal`, a `tf.random.Generator`'s draw, an unseeded
    `keras.random` call) run again would draw other numbers: its readers in the recomputation
    read the forward pass's tensor. A write to a TensorFlow variable that adds adds 0, one that
    assigns writes what the forward pass wrote, any other is an error (writes to Keras
    variables are dropped by `rematerialized_call`). Other stateful ops run again as written;
    ops inside a loop or a nested function are not looked into; eagerly, nothing changes.
    """

    def __init__(self):
        self.forward = []  # the ops the forward pass made
        self.recomputed = []  # the recomputation's, without its gradient

    @contextlib.contextmanager
    def made(self, which: str):
        """Inside, the ops made are noted as the `which` run's ("forward", "recomputed")."""
        made = _ops_made()
        try:
            yield
        finally:
            setattr(self, which, made())

    def read_from_forward(self, layer) -> None:
        """Makes the readers of the recomputation's stateful ops read the forward pass's, and
        its writes to variables write nothing new.

        Raises:
            ValueError: the forward pass made no such op under the same name (its code took
                another path), or the recomputation writes a variable otherwise.
        """
        written, writes = _written(self.forward), _writing(self.recomputed)
        again = _changing(self.recomputed, written) | writes
        if not again:
            return
        twins = {key: op for key, op in _by_scope(self.forward).items()
                 if op.op_def.is_stateful}
        for key, op in _by_scope(self.recomputed).items():
            if op not in again:
                continue
            twin = twins.get(key)
            if twin is None or twin.type != op.type or [t.dtype for t in twin.outputs] != [
                    t.dtype for t in op.outputs]:
                raise _not_again(layer, op, "the forward pass made no such op to read its "
                                 "value from")
            for output, value in zip(op.outputs, twin.outputs):
                for reader in list(output.consumers()):
                    for index, tensor in enumerate(reader.inputs):
                        if tensor is output:
                            internals.replace_op_input(reader, index, value)
            if op in writes:
                _write_nothing_new(layer, op, twin)


def _not_again(layer, op, why: str) -> ValueError:
    what = getattr(layer, "description", None) or f"layer {layer.name!r}"
    return ValueError(
        f"rematerialize: {what} cannot be recomputed as its forward pass ran: its "
        f"op {op.name!r} ({op.type}) is stateful and {why}; draw random numbers with "
        "keras.random and a keras.random.SeedGenerator (as keras.layers.Dropout does), keep "
        "state in Keras variables, or leave the layer out of rematerialize")


def _write_nothing_new(layer, op, twin) -> None:
    """Makes the recomputation's write `op` add 0, or assign what the forward pass's `twin`
    assigned.

    Raises:
        ValueError: `op` writes otherwise.
    """
    amount = _AMOUNTS.get(op.type)
    if amount is not None:
        internals.replace_op_input(op, amount, tf.zeros_like(op.inputs[amount]))
    elif op.type == "AssignVariableOp":
        internals.replace_op_input(op, 1, twin.inputs[1])
    else:
        raise _not_again(layer, op, "writes a TensorFlow variable again when recomputed")


# The input that says how much an adding write adds.
_AMOUNTS = {"AssignAddVariableOp": 1, "AssignSubVariableOp": 1, "RngReadAndSkip": 2,
            "RngSkip": 2}


def _written(ops) -> set:
    """The names of the variable handles that ops among `ops` write."""
    return {tensor.name for op in _writing(ops) for tensor in op.inputs
            if tensor.dtype == tf.resource}


def _writing(ops) -> set:
    """The ops among `ops` that write a variable: assign to it, scatter into it, or move a
    random generator's state (a collective's handle, which only orders it, is not)."""
    return {op for op in ops if op.op_def.is_stateful and _WRITES.search(op.type)}


def _changing(ops, written) -> set:
    """The ops among `ops` that give another value when run again: random draws of stateful
    ops, and reads of variables `written` (handles' names). Other stateful ops (a collective
    all-reduce, a table lookup) give the same value for the same inputs and are run again as
    they are; so are the ops inside a loop or a nested function."""
    return {op for op in ops
            if op.op_def.is_stateful
            and any(t.dtype not in (tf.resource, tf.variant) for t in op.outputs)
            and (_DRAWS.search(op.type) or (op.type in _READS and any(
                tensor.name in written for tensor in op.inputs)))}


_DRAWS = re.compile(r"^(Random|TruncatedNormal|ParameterizedTruncatedNormal|Multinomial|Rng"
                    r"|Stateful(?!PartitionedCall))")
_WRITES = re.compile(r"Assign|Scatter|^Rng|^Stateful(?!PartitionedCall)")
_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"})


def _by_scope(ops) -> dict:
    """`ops` by their names within the name scope they share (a call's ops are named alike
    in the forward pass and in the recomputation, under other outer scopes): the same op of
    one call has the same key in both."""
    scopes = [op.name.split("/")[:-1] for op in ops]
    shared = len(os.path.commonprefix(scopes)) if scopes else 0
    return {"/".join(op.name.split("/")[shared:]): op for op in ops}


def _tensors(args, kwargs) -> list:
    """The tensors among a call's arguments, in order."""
    return [item for item in tf.nest.flatten((args, kwargs)) if isinstance(item, tf.Tensor)]


def _float_inputs(args, kwargs) -> list:
    """The floating-point tensors of a call's arguments, each once."""
    return list({id(item): item for item in tf.nest.flatten((args, kwargs))
                 if isinstance(item, tf.Tensor) and item.dtype.is_floating}.values())


_SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Rank", "Size"})


def _reads_twice(inputs, before) -> bool:
    """Whether two ops made since `before` (the inputs' consumers then) read one tensor:
    an input, or one made from them since."""
    todo = [(tensor, seen) for tensor, seen in zip(inputs, before)]
    visited = set()
    while todo:
        tensor, seen = todo.pop()
        readers = [op for op in tensor.consumers()
                   if op not in seen and op.type not in _SHAPE_ONLY]
        if len(readers) > 1:
            return True
        for op in readers:
            if op not in visited:
                visited.add(op)
                todo.extend((output, ()) for output in op.outputs)
    return False


def _identity(gradient):
    """`gradient` as it is, made within the control dependencies around it (None stays)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), gradient.indices,
                                gradient.dense_shape)
    return tf.identity(gradient)


def _differentiable(tensor) -> bool:
    """Whether `tensor` has a gradient: floating point or complex (not a bool mask or ids)."""
    dtype = getattr(tensor, "dtype", None)
    return dtype is not None and (dtype.is_floating or dtype.is_complex)


def _after(dependency, tensors) -> list:
    """`tensors` as they are, made only once `dependency` exists."""
    if internals.in_xla_compilation():  # as `tf.recompute_grad` does
        return _after_values([dependency], tensors)
    with tf.control_dependencies([dependency]):
        return [tf.identity(tensor) for tensor in tensors]


def _waiting_for(dependency):
    """Inside, the ops made wait for `dependency` too where they read no tensor made inside
    (a dropout's mask drawn from its seed, which the executor would otherwise make during the
    forward pass and hold until the recomputation reads it); under XLA, which drops control
    edges and schedules the step itself, nothing changes."""
    if internals.in_xla_compilation():
        return contextlib.nullcontext()
    return tf.control_dependencies([dependency])


def _ops_made():
    """A function returning the graph's ops made since this call by the replica making them
    ([] when executing eagerly, where ops run as they come).

    `MirroredStrategy` traces each replica in a thread of its own, into one graph, and
    switches threads where the replicas synchronize (a synchronized BatchNormalization's
    all-reduce): ops another replica made meanwhile are left out by their names, which are
    under its scope (`replica_1/`, ...; replica 0's under none).
    """
    if tf.executing_eagerly():
        return list
    graph = tf.compat.v1.get_default_graph()
    count = len(graph.get_operations())
    replica = _replica_scope(graph.get_name_scope() + "/")
    return lambda: [op for op in graph.get_operations()[count:]
                    if _replica_scope(op.name) == replica]


def _replica_scope(name: str) -> str:
    """The `replica_N/` scope a name is under, "" if none."""
    match = re.match(r"replica_\d+/", name)
    return match.group(0) if match else ""


def _after_reads(ops, gradients) -> list:
    """The variables' `gradients`, made only once the recomputation's `ops` have read the
    variables: through their data (one addition over the weights' size, which XLA fuses),
    since a control edge alone may be dropped by Grappler and the optimizer could then update
    a kernel before the recomputation reads it. Nothing waits for the recomputed outputs: a
    call whose output no gradient reads is not run again.
    """
    return _after_values([output for op in ops if any(
        tensor.dtype == tf.resource for tensor in op.inputs) for output in op.outputs],
        gradients)


def _after_values(dependencies, tensors) -> list:
    """`tensors` plus a 0 that exists only once `dependencies` do (an addition TensorFlow
    makes in place where the tensor has no other reader); as they are if no dependency is a
    number. A None (no gradient) stays None."""
    zero = zero_once_made(dependencies)
    if zero is None:
        return list(tensors)
    return [None if tensor is None else _plus(tensor, zero) for tensor in tensors]


def zero_once_made(tensors):
    """A float32 0 that exists only once `tensors` do (NaN where a first element is NaN):
    made from the first element of each (one read, not the whole tensor). None when none is
    a dense tensor of numbers (sparse and ragged ones are passed over)."""
    firsts = [tf.cast(tf.reshape(tensor, [-1])[:1], tf.float32)  # none of an empty batch
              for tensor in tensors
              if isinstance(tensor, tf.Tensor) and (tensor.dtype.is_floating
                                                    or tensor.dtype.is_integer
                                                    or tensor.dtype == tf.bool)]
    if not firsts:
        return None
    first = tf.reduce_max(tf.concat(firsts, axis=0))  # -inf if there is none: 0 all the same
    return tf.where(tf.math.is_nan(first), float("nan"), 0.0)


def _plus(gradient, zero):
    """`gradient + zero` in the gradient's dtype; an IndexedSlices (a gather's) stays one."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values + tf.cast(zero, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient + tf.cast(zero, gradient.dtype)
