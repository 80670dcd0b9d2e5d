"""TensorFlow's recomputed function: the gradients of the function as written, its arguments
not copied, the recomputation made after the gradient it serves."""

import numpy as np
import pytest
import tensorflow as tf

from tfmem.remat.backend_tf import recompute_grad


def _block(w):
    def block(a, b):
        return tf.nn.relu(tf.concat([a, b], axis=-1) @ w)
    return block


@pytest.mark.parametrize("jit_compile", [False, True])
def test_gradients_are_those_of_the_function_as_written(jit_compile):
    rng = np.random.default_rng(0)
    a, b = (tf.constant(rng.normal(size=(4, 3)), tf.float32) for _ in range(2))
    w = tf.Variable(rng.normal(size=(6, 5)).astype("float32"))

    def gradients(wrap):
        @tf.function(jit_compile=jit_compile)
        def step(a, b):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                y = wrap(_block(w))(a, b)
                loss = tf.reduce_sum(y * y)
            return tape.gradient(loss, [a, b, w])
        return [g.numpy() for g in step(a, b)]

    plain, recomputed = gradients(lambda f: f), gradients(recompute_grad)
    for p, r in zip(plain, recomputed, strict=True):
        np.testing.assert_allclose(r, p, rtol=1e-6, atol=1e-7)
    assert np.abs(plain[2]).sum() > 0  # the kernel's gradient is not all zero


def _step_graph(wrap, block, w, loss=tf.reduce_sum):
    """The traced step taking the gradients of `loss(wrap(block)(a, b))` for `[w, a, b]`."""

    @tf.function
    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            value = loss(wrap(block)(a, b))
        return tape.gradient(value, [w, a, b])

    spec = tf.TensorSpec((4, 3), tf.float32)
    return step.get_concrete_function(spec, spec).graph


def _graph_ops(wrap):
    w = tf.Variable(tf.ones((6, 5)))
    return _step_graph(wrap, _block(w), w).get_operations()


def test_arguments_are_not_copied_and_the_recomputation_waits_for_its_gradient():
    ops = _graph_ops(recompute_grad)
    # TensorFlow's own adds a value made from the gradient to each argument (2 copies);
    # here the additions are to gradients: the kernel's, then the arguments' (below), none
    # to an argument.
    assert sum(op.type == "AddV2" for op in _graph_ops(tf.recompute_grad)) >= 2
    additions = [op for op in ops if op.type in ("AddV2", "Add")]
    assert [op.outputs[0].shape.as_list() for op in additions] == [[6, 5], [4, 3], [4, 3]]
    assert not any(op.inputs[0].op.type == "Placeholder" for op in additions)
    # The recomputed concatenation reads the arguments through identities that wait on the
    # incoming gradient; the forward one reads them directly.
    concats = [op for op in ops if op.type == "ConcatV2"
               and op.outputs[0].shape.as_list() == [4, 6]]
    assert len(concats) == 2
    waiting = [op for op in concats if all(
        t.op.type == "Identity" and t.op.control_inputs for t in op.inputs[:2])]
    assert len(waiting) == 1


def test_what_the_recomputation_draws_from_no_argument_waits_for_its_gradient_too():
    # A dropout's mask is drawn from its seed, not made from the arguments: without waiting,
    # the executor may draw the recomputation's during the forward pass and hold it until read.
    w = tf.Variable(tf.ones((6, 5)))

    def block(a, b):
        mask = tf.random.stateless_uniform((4, 5), seed=[1, 2]) >= 0.5
        return tf.where(mask, tf.concat([a, b], axis=-1) @ w, 0.0)

    graph = _step_graph(recompute_grad, block, w, loss=lambda y: tf.reduce_sum(y * y))
    draws = [op for op in graph.get_operations() if op.type == "StatelessRandomUniformV2"]
    selects = [op for op in graph.get_operations() if op.type == "SelectV2"]
    assert len(draws) == 2  # the forward pass's, then the recomputation's
    assert selects[0] not in _ancestors(draws[0], control=True)
    assert selects[0] in _ancestors(draws[1], control=True)  # through the loss's gradient


def _ancestors(op, control=False) -> set:
    """The ops whose outputs `op` reads, directly or through others; with `control`, also
    those it waits for through control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        parents = [t.op for t in current.inputs] + (list(current.control_inputs)
                                                    if control else [])
        for parent in parents:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("wrap", [lambda f: f, recompute_grad], ids=["plain", "recomputed"])
def test_a_kernels_gradient_waits_for_every_read_of_the_kernel(wrap):
    # A linear layer's kernel gradient is its input times its output's gradient: it needs no
    # read of the kernel. The recomputation reads the kernel again (for the gradient it passes
    # on to its inputs); only a control edge would keep the kernel's update after that read,
    # and Grappler's dependency optimizer may drop it: the update then comes first, and the
    # gradient passed on is made with the updated kernel. So the kernel's gradient depends,
    # through its data, on the recomputation (and so on every read of the kernel).
    w = tf.Variable(tf.ones((6, 5)))
    graph = _step_graph(wrap, lambda a, b: tf.concat([a, b], axis=-1) @ w, w,
                        loss=lambda y: tf.reduce_sum(y * y))
    reads = [op for op in graph.get_operations()  # those read by any op (the others never run)
             if op.type == "ReadVariableOp" and op.outputs[0].consumers()]
    assert len(reads) >= (3 if wrap is recompute_grad else 1)  # the forward pass's, again
    kernel_gradient = graph.outputs[0].op
    assert set(reads) <= _ancestors(kernel_gradient)


@pytest.mark.parametrize("activation, run_again", [("linear", 0), ("relu", 1)])
def test_a_call_is_run_again_only_where_a_gradient_reads_its_output(activation, run_again):
    # A linear layer's gradients read its input and its kernel, not its output: recomputed,
    # only the concatenation it reads runs again (its kernel's gradient reads it); the
    # matrix product, whose output is the segment's (kept from the forward pass), does not.
    # A ReLU's gradient reads its output: then the product runs again, for it.
    w = tf.Variable(tf.ones((6, 5)))
    act = {"linear": tf.identity, "relu": tf.nn.relu}[activation]
    graph = _step_graph(recompute_grad, lambda a, b: act(tf.concat([a, b], axis=-1) @ w), w,
                        loss=lambda y: tf.reduce_sum(y * y))
    runs = set().union(*(_ancestors(t.op) | {t.op} for t in graph.outputs))
    products = [op for op in graph.get_operations() if op.type == "MatMul"
                and not op.get_attr("transpose_a") and not op.get_attr("transpose_b")]
    assert len(products) == 2  # the forward pass's and the recomputation's, both built
    assert sum(op in runs for op in products) == 1 + run_again
    concats = [op for op in graph.get_operations() if op.type == "ConcatV2"
               and op.outputs[0].shape.as_list() == [4, 6]]
    assert len(concats) == 2 and all(op in runs for op in concats)


def test_a_segment_is_recomputed_after_the_weights_gradients_of_the_one_after_it():
    # The second segment's recomputed tensors are read by its kernel's gradient. The first
    # segment's recomputation waits for the gradient the second passes on, which waits, through
    # its data, for that kernel's gradient: the two segments' recomputed tensors are not held at
    # once (TensorFlow's executor runs whatever is ready side by side).
    w1, w2 = tf.Variable(tf.ones((6, 5))), tf.Variable(tf.ones((5, 4)))
    first = recompute_grad(lambda a, b: tf.nn.relu(tf.concat([a, b], axis=-1) @ w1))
    second = recompute_grad(lambda h: tf.nn.relu(h @ w2))

    @tf.function
    def step(a, b):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(second(first(a, b)))
        return tape.gradient(loss, [w1, w2])

    spec = tf.TensorSpec((4, 3), tf.float32)
    graph = step.get_concrete_function(spec, spec).graph
    recomputed = [op for op in graph.get_operations() if op.type == "ConcatV2" and all(
        t.op.type == "Identity" and t.op.control_inputs for t in op.inputs[:2])]
    assert len(recomputed) == 1
    second_kernel_gradient = [op for op in graph.get_operations()
                              if op.type == "MatMul" and op.get_attr("transpose_a")
                              and op.outputs[0].shape.as_list() == [5, 4]]
    assert len(second_kernel_gradient) == 1
    assert second_kernel_gradient[0] in _ancestors(recomputed[0], control=True)


def test_only_calls_that_read_no_tensor_twice_have_their_gradients_ordered():
    # A wrapped call's gradient adds up, inside it, the gradients of a tensor it reads twice,
    # in another order than the whole segment's gradient would: so only calls that read
    # each tensor once (a Dense, a convolution) are wrapped; a normalization (its input for
    # the moments and the normalization) and an attention on one tensor are not.
    import keras

    from tfmem.remat.backend_tf import WeightsFirst

    def one_tensor(layer):
        return lambda x: layer(x, x)

    x4, x3 = tf.ones((2, 6, 6, 4)), tf.ones((2, 5, 4))
    cases = {"dense": (keras.layers.Dense(3, activation="relu"), x3),
             "conv": (keras.layers.Conv2D(3, 3), x4),
             "batch_norm": (keras.layers.BatchNormalization(), x4),
             "layer_norm": (keras.layers.LayerNormalization(), x3),
             "attention": (one_tensor(keras.layers.MultiHeadAttention(2, 4)), x3)}
    calls = WeightsFirst()

    @tf.function
    def forward():
        return [calls.observed(name, layer)(x * 1.0, training=True)
                if name.endswith("norm") else calls.observed(name, layer)(x * 1.0)
                for name, (layer, x) in cases.items()]

    forward.get_concrete_function()
    assert {name: calls.plain[id(name)] for name in cases} == {
        "dense": False, "conv": False, "batch_norm": True,
                           "layer_norm": True, "attention": True}
    assert WeightsFirst().ordered("dense", len) is len  # a call the forward pass did not see
