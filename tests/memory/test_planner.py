"""Planner numbers against hand counts and against Keras itself (no training here)."""

import types

import keras
import numpy as np
import pytest

import tfmem
from tfmem._sizes import format_bytes
from tfmem.memory import guard, plan_report, planner
from tfmem.memory.memory_plan import Term
from tfmem.memory.saved_tensors import traced_saved_tensors

GIB = 2**30


def small_model():
    """Conv(4, 3×3) → BN → Flatten → Dense(5) on 8×8×3: parameters countable by hand."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3)(inputs)  # 3·3·3·4 + 4 = 112
    x = keras.layers.BatchNormalization()(x)  # gamma, beta: 8 trainable; mean, var: 8 not
    x = keras.layers.Flatten()(x)  # 6·6·4 = 144
    outputs = keras.layers.Dense(5)(x)  # 144·5 + 5 = 725
    return keras.Model(inputs, outputs)


TRAINABLE = 112 + 8 + 725  # 845
ALL = TRAINABLE + 8  # 853


def built_under(policy, build):
    """`build()` under the global dtype policy `policy`; the previous policy is restored."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize(
    "optimizer, slot_floats",
    [
        (keras.optimizers.SGD(), 0),
        (keras.optimizers.SGD(momentum=0.9), TRAINABLE),
        (keras.optimizers.Adam(), 2 * TRAINABLE),
        (keras.optimizers.AdamW(), 2 * TRAINABLE),
        (keras.optimizers.Adam(amsgrad=True), 3 * TRAINABLE),
        (keras.optimizers.RMSprop(), TRAINABLE),
        (keras.optimizers.RMSprop(momentum=0.9, centered=True), 3 * TRAINABLE),
        # Keras 3 Adafactor: a full velocity + row/column factors of the two kernels
        # (27 + 36 for the conv's (3,3,3,4), 144 + 5 for the dense (144,5)) + two scalar
        # placeholders for each of the 4 rank-1 variables.
        (keras.optimizers.Adafactor(), TRAINABLE + 27 + 36 + 144 + 5 + 4 * 2),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v),
)
def test_state_bytes_equal_hand_counts_and_keras(optimizer, slot_floats):
    model = small_model()
    p = tfmem.plan(model, global_batch_size=8, optimizer=optimizer, memory_budget=GIB)
    assert p.num_parameters == ALL
    assert p.parameter_bytes == 4 * ALL
    assert p.gradient_bytes == 4 * TRAINABLE
    assert p.optimizer_bytes == 4 * slot_floats
    # Reference: the optimizer's own variables once Keras builds them.
    optimizer.build(model.trainable_variables)
    built = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables
                if v.name not in ("iteration", "learning_rate"))
    assert p.optimizer_bytes == built


def test_accumulation_buffers_only_when_k_above_one():
    p = tfmem.plan(small_model(), global_batch_size=8, optimizer="sgd", memory_budget=GIB)
    assert p.breakdown(8, 1)[Term.ACCUMULATION] == 0
    assert p.breakdown(2, 4)[Term.ACCUMULATION] == 4 * TRAINABLE
    # AccumModel holds the whole global batch: input data scales with b × k, not b. With no
    # loss given, each sample's targets are counted shaped as the output (5 floats).
    assert p.breakdown(2, 4)[Term.INPUT] == p.breakdown(8, 1)[Term.INPUT] == (
        8 * (8 * 8 * 3 + 5) * 4 * 2)


def test_accumulation_buffers_of_float64_weights_are_float64():
    model = built_under("float64", small_model)  # AccumModel sums float64 gradients in float64
    p = tfmem.plan(model, global_batch_size=8, optimizer="sgd", memory_budget=GIB)
    assert p.gradient_bytes == 8 * TRAINABLE
    assert p.breakdown(2, 4)[Term.ACCUMULATION] == 8 * TRAINABLE


@pytest.mark.parametrize("precision, extra", [
    ("float32", 0),
    # 2-byte compute copies of the conv and dense kernels/biases (not BN's) …
    ("mixed_bfloat16", 2 * (112 + 725)),
    # … plus LossScaleOptimizer's float32 unscaled gradients.
    ("mixed_float16", 2 * (112 + 725) + 4 * TRAINABLE),
])
def test_mixed_precision_copies(precision, extra):
    p = tfmem.plan(small_model(), global_batch_size=8, precision=precision, memory_budget=GIB)
    assert p.mixed_precision_bytes == extra
    assert p.parameter_bytes == 4 * ALL  # float32 master weights either way


def activation_model():
    inputs = keras.Input((16, 16, 3))
    c1 = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    b1 = keras.layers.BatchNormalization()(c1)
    a1 = keras.layers.Activation("swish")(b1)
    d1 = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")(a1)
    s = keras.layers.Add()([d1, a1])
    p = keras.layers.MaxPooling2D()(s)
    dr = keras.layers.Dropout(0.5)(p)
    g = keras.layers.GlobalAveragePooling2D()(dr)
    se = keras.layers.Dense(8, activation="sigmoid")(g)
    m = keras.layers.Multiply()([dr, keras.layers.Reshape((1, 1, 8))(se)])
    f = keras.layers.Flatten()(m)
    outputs = keras.layers.Dense(10, activation="softmax")(f)
    return keras.Model(inputs, outputs)


def test_activation_bytes_equal_hand_count_float32():
    big, small = 16 * 16 * 8 * 4, 8 * 8 * 8 * 4  # one 16×16×8 / 8×8×8 float32 map
    hand = (
        16 * 16 * 3 * 4  # conv keeps its input
        + big  # BN keeps its input (the conv output)
        + big  # swish keeps its input (the BN output)
        + big + big  # depthwise keeps its input (swish output); its relu keeps its output
        + big + small  # max-pool keeps input (the add) and output
        + 8 * 8 * 8  # dropout's boolean keep-mask, one byte per element
        + 8 * 4 + 8 * 4  # SE dense keeps its input; sigmoid its output
        + small  # multiply keeps the dropout output (its other input is the sigmoid output)
        + small + 10 * 4  # head dense keeps the (flattened, same buffer) product; softmax output
    )
    model = activation_model()
    p = tfmem.plan(model, global_batch_size=4, memory_budget=GIB)
    assert p.activation_bytes_per_sample == hand == 50792
    assert p.parameter_bytes == 4 * model.count_params()  # not the dropout's seed state
    # The workspace: the largest call's own transient, BatchNormalization's (4 tensors of its
    # input's size: its ops read the input and each other's outputs more than once, so
    # TensorFlow reuses no buffer there), from TensorFlow's gradient graph of that layer
    # alone at its size; swish's is one less (its last products are written over what only
    # they read).
    own = _own_transients(model)
    assert p.workspace_bytes_per_sample == own["batch_normalization"] == 4 * big
    assert own["activation"] == 3 * big
    assert p.input_bytes_per_sample == 16 * 16 * 3 * 4 + 10 * 4  # the image, targets as output


def test_activation_bytes_mixed_float16_hand_count():
    model = built_under("mixed_float16", activation_model)
    big, small = 16 * 16 * 8 * 2, 8 * 8 * 8 * 2  # float16 maps
    hand = (
        16 * 16 * 3 * 2  # conv keeps a float16 cast of the float32 input
        + 2 * big  # BN upcasts: keeps a float32 copy of its input
        + big + big + big  # swish input, depthwise input, relu output
        + big + small + 8 * 8 * 8  # max-pool input/output, dropout's boolean mask
        + 8 * 2 + 8 * 2 + small + small + 10 * 2
    )
    p = tfmem.plan(model, global_batch_size=4, precision="mixed_float16", memory_budget=GIB)
    assert p.activation_bytes_per_sample == hand == 29748


def test_frozen_backbone_keeps_nothing_before_first_trainable_layer():
    model = activation_model()
    for layer in model.layers[:3]:  # conv, BN frozen: no backward through them
        layer.trainable = False
    frozen = tfmem.plan(model, global_batch_size=4, memory_budget=GIB)
    full = tfmem.plan(activation_model(), global_batch_size=4, memory_budget=GIB)
    # Conv input, BN input and the swish input (nothing before it needs a gradient) are no
    # longer kept; the depthwise conv (trainable) still keeps the swish output, and the rest.
    assert full.activation_bytes_per_sample - frozen.activation_bytes_per_sample == (
        16 * 16 * 3 * 4 + 16 * 16 * 8 * 4 + 16 * 16 * 8 * 4)


def test_a_tpu_plan_names_what_the_lanes_of_xla_tpu_pad_for_channels_off_128():
    inputs = keras.Input((8, 8, 128))

    def convolution(filters):
        return keras.Model(inputs, keras.layers.Conv2D(filters, 3, padding="same")(inputs))

    def lanes(model, device):
        plan = tfmem.plan(model, global_batch_size=8, device=device)
        return [note for note in plan.notes if "128 lanes" in note]

    assert lanes(convolution(256), "tpu-v5e-1") == []
    for filters in (16, 192):
        (note,) = lanes(convolution(filters), "tpu-v5e-1")
        assert f"(here from {filters})" in note and "probe_jax.tpu_device" in note
    assert lanes(convolution(16), "a100-80gb") == []


def test_choice_is_largest_dividing_micro_batch_that_fits():
    model = activation_model()
    loose = tfmem.plan(model, global_batch_size=64, memory_budget=100 * GIB)
    assert (loose.micro_batch_size, loose.accumulation_steps) == (64, 1)
    # A budget between the peaks of 16 × 4 and 32 × 2 must choose 16 × 4.
    budget = (loose.peak_bytes(16, 4) + loose.peak_bytes(32, 2)) // 2
    p = tfmem.plan(model, global_batch_size=64, memory_budget=int(budget / 0.8) + 1)
    assert (p.micro_batch_size, p.accumulation_steps, p.fits) == (16, 4, True)
    assert p.peak_bytes(16, 4) <= p.budget_bytes < p.peak_bytes(32, 2)
    b = p.max_micro_batch
    assert p.peak_bytes(b, 1) <= p.budget_bytes < p.peak_bytes(b + 1, 1)


def test_choice_equals_trying_every_divisor_and_is_immediate_for_huge_batches():
    loose = tfmem.plan(activation_model(), global_batch_size=64, memory_budget=100 * GIB)
    for budget in (loose.peak_bytes(8, 8), loose.peak_bytes(24, 2), loose.peak_bytes(64, 1)):
        for batch in range(1, 200):
            p = loose.replace(global_batch_size=batch, memory_per_replica=budget,
                              safety=1.0)
            tried = [(m, batch // m) for m in range(batch, 0, -1) if batch % m == 0
                     and p.peak_bytes(m, batch // m) <= budget]
            assert (p.micro_batch_size, p.accumulation_steps) == (tried or [(0, 0)])[0]
    # 10**12 = 2**12 × 5**12 (the input of the global batch left out, or nothing would fit):
    # the largest 2**a × 5**b whose micro-batch fits, by hand.
    without_input = loose.replace(input_bytes_per_sample=0)
    huge = without_input.replace(global_batch_size=10**12, safety=1.0,
                                 memory_per_replica=without_input.peak_bytes(1001, 2))
    expected = max(2**a * 5**b for a in range(13) for b in range(13)
                   if huge.peak_bytes(2**a * 5**b, 10**12 // (2**a * 5**b))
                   <= huge.budget_bytes)
    assert (huge.micro_batch_size, huge.accumulation_steps) == (expected, 10**12 // expected)
    assert expected == 1000  # = 2**3 × 5**3; the next divisor, 1024, is over the budget


def test_what_is_not_a_model_or_an_optimizer_is_named():
    with pytest.raises(TypeError, match=r"`model` must be a built keras\.Model .*, got object"):
        tfmem.plan(object(), global_batch_size=8, memory_budget=GIB)
    with pytest.raises(ValueError, match=r"`optimizer` \(`--optimizer`\) 'bogus' is not an "
                                         r"optimizer Keras knows; use one of adadelta, .*adamw, "
                                         r".*sgd, or pass a keras\.optimizers\.Optimizer"):
        tfmem.plan(small_model(), global_batch_size=8, memory_budget=GIB, optimizer="bogus")


def test_runtime_duck_type_and_device_table():
    runtime = types.SimpleNamespace(memory_per_replica=16 * GIB, num_replicas=8, kind="tpu")
    p = tfmem.plan(small_model(), global_batch_size=64, runtime=runtime)
    assert (p.num_replicas, p.per_replica_batch_size, p.runtime_bytes) == (8, 8, 0)
    assert p.budget_bytes == int(0.8 * 16 * GIB)
    t4 = tfmem.plan(small_model(), global_batch_size=64, device="tpu-v3-8")
    assert (t4.num_replicas, t4.memory_per_replica) == (8, 16 * GIB)
    cpu = tfmem.plan(small_model(), global_batch_size=64, memory_budget=GIB)
    assert cpu.runtime_bytes > 700 * 2**20  # TF's own host RAM is part of a CPU plan
    with pytest.raises(ValueError, match=r"\(60\) must be divisible by replicas × "
                                         r"accumulation_steps \(8 × 1 = 8\)\. Try 56 or 64"):
        tfmem.plan(small_model(), global_batch_size=60, runtime=runtime)


def test_guard_message_names_need_budget_and_fitting_setting():
    model = activation_model()
    loose = tfmem.plan(model, global_batch_size=64, memory_budget=100 * GIB)
    budget = (loose.peak_bytes(16, 4) + loose.peak_bytes(32, 2)) // 2
    p = tfmem.plan(model, global_batch_size=64, memory_budget=int(budget / 0.8) + 1)
    with pytest.raises(tfmem.MemoryPlanError) as caught:
        planner.check(p, accumulation_steps=1)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert f"global batch 64 = micro-batch 64 × 1 accumulation step × 1 replica needs " \
           f"{format_bytes(p.peak_bytes(64, 1))}" in message
    assert (f"micro-batch 16 × 4 accumulation steps fits in "
            f"{format_bytes(p.peak_bytes(16, 4))}" in message)
    assert "activations" in message and "allow_over_budget=True" in message
    planner.check(p, accumulation_steps=1, allow_over_budget=True)  # the explicit override
    planner.check(p, accumulation_steps=4)  # 16 × 4 fits: no error
    with pytest.raises(ValueError, match=r"`global_batch_size` \(64\) must be divisible by "
                                         r"replicas × accumulation_steps \(1 × 3 = 3\)\. Try "
                                         r"63 or 66\.$"):
        planner.check(p, accumulation_steps=3)


def test_guard_when_nothing_fits_says_why():
    p = tfmem.plan(small_model(), global_batch_size=8, memory_budget=100 * 2**20)
    assert not p.fits and p.max_micro_batch == 0
    with pytest.raises(tfmem.MemoryPlanError, match="nothing fits, not even micro-batch 1"):
        planner.check(p)


def test_a_layer_without_a_rule_is_traced_and_named():
    inputs = keras.Input((4,))
    outputs = keras.layers.Lambda(lambda t: t * 2)(keras.layers.Dense(3)(inputs))
    p = tfmem.plan(keras.Model(inputs, outputs), global_batch_size=2, memory_budget=GIB)
    # Dense keeps its 4-float input; `t * 2`'s gradient reads only the constant.
    assert p.activation_bytes_per_sample == 4 * 4
    assert any("Lambda" in note and "tracing" in note for note in p.notes)


@pytest.mark.parametrize("builder, total, trainable", [
    # keras.applications published counts (1000-class heads).
    (lambda: keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3)),
     25_636_712, 25_583_592),
])
def test_known_architecture_parameter_bytes(builder, total, trainable):
    p = tfmem.plan(builder(), global_batch_size=2, optimizer="adam", memory_budget=100 * GIB)
    assert p.num_parameters == total
    assert p.parameter_bytes == 4 * total
    assert p.gradient_bytes == 4 * trainable
    assert p.optimizer_bytes == 2 * 4 * trainable


def test_guard_auto_picks_k_so_the_global_batch_holds():
    model = activation_model()
    loose = tfmem.plan(model, global_batch_size=96, memory_budget=100 * GIB, num_replicas=2)
    budget = (loose.peak_bytes(12, 4) + loose.peak_bytes(16, 3)) // 2
    auto = guard.guard(model, global_batch_size=96, num_replicas=2,
                         memory_budget=int(budget / 0.8) + 1)
    # 48 per replica: the largest dividing micro-batch under the budget is 12, so k = 4.
    assert (auto.micro_batch_size, auto.accumulation_steps) == (12, 4)
    assert auto.micro_batch_size * auto.accumulation_steps * auto.num_replicas == 96
    with pytest.raises(tfmem.MemoryPlanError, match="micro-batch 12 × 4 accumulation steps fits"):
        guard.guard(model, global_batch_size=96, num_replicas=2, accumulation_steps=2,
                      memory_budget=int(budget / 0.8) + 1)
    kept = guard.guard(model, global_batch_size=96, num_replicas=2, accumulation_steps=2,
                         memory_budget=int(budget / 0.8) + 1, allow_over_budget=True)
    assert kept.global_batch_size == 96


def test_detected_runtime_plans_on_this_host():
    runtime = tfmem.detect(prefer="cpu")
    p = tfmem.plan(small_model(), global_batch_size=2 * runtime.num_replicas, runtime=runtime)
    assert p.device_kind == "cpu" and p.num_replicas == runtime.num_replicas
    assert p.memory_per_replica >= runtime.memory_per_replica
    unknown = types.SimpleNamespace(memory_per_replica=None, num_replicas=1, kind="gpu",
                                    device_name="Some GPU")
    with pytest.raises(ValueError, match="pass `device=`"):
        tfmem.plan(small_model(), global_batch_size=2, runtime=unknown)


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_rule_table_equals_tensorflows_own_gradient_graph(precision):
    """Reference: the forward tensors TensorFlow's backward reads, from one whole-model trace."""
    model = built_under(precision, activation_model)
    traced = traced_saved_tensors(model)
    p = tfmem.plan(model, global_batch_size=4, precision=precision, memory_budget=GIB)
    assert p.activation_bytes_per_sample == traced.saved_bytes
    assert p.workspace_bytes_per_sample == max(2 * traced.largest_tensor_bytes,
                                               *_own_transients(model).values())


def _own_transients(model) -> dict:
    """Each one-input layer's transient (`gradient_trace`), traced alone at its size."""
    from tfmem.memory.gradient_trace import trace_call_tensorflow

    found = {}
    for layer in model.layers[1:]:
        if isinstance(layer.input, (list, tuple)):
            continue  # merges: `2 × largest` counts them (test_layer_rules)
        shape, dtype = tuple(layer.input.shape[1:]), layer.input.dtype
        kind = layer.name.rstrip("_0123456789")
        found[kind] = max(found.get(kind, 0), trace_call_tensorflow(
            lambda xs, layer=layer: layer(xs[0], training=True), [(shape, dtype)],
            differentiable=[True], trainable=layer.trainable_weights,
            non_trainable=layer.non_trainable_weights).transient_bytes)
    return found


def test_float32_model_planned_mixed_counts_two_byte_activations():
    """A model built in float32 and planned under a mixed policy is counted as if built so."""
    built_mixed = built_under("mixed_float16", activation_model)
    reference = tfmem.plan(built_mixed, global_batch_size=4, precision="mixed_float16",
                           memory_budget=GIB)
    planned = tfmem.plan(activation_model(), global_batch_size=4, precision="mixed_float16",
                         memory_budget=GIB)
    assert planned.activation_bytes_per_sample == reference.activation_bytes_per_sample == 29748
    assert any("built in float32, planned mixed_float16" in note for note in planned.notes)


def test_custom_block_is_traced_not_guessed():
    class Residual(keras.layers.Layer):
        """conv → swish (a function call, invisible to a layer walk) → + input."""

        def build(self, shape):
            self.conv = keras.layers.Conv2D(shape[-1], 3, padding="same")
            self.conv.build(shape)

        def call(self, x):
            return x + keras.activations.silu(self.conv(x))

    inputs = keras.Input((8, 8, 4))
    model = keras.Model(inputs, Residual()(inputs))
    p = tfmem.plan(model, global_batch_size=2, memory_budget=GIB)
    # conv keeps its input (the model input), silu keeps its input (the conv output).
    assert p.activation_bytes_per_sample == 8 * 8 * 4 * 4 * 2
    assert any("Residual" in note and "tracing" in note for note in p.notes)


def _accum_data(global_batch=64):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (global_batch, 16, 16, 3)).astype("float32")
    labels = rng.integers(0, 10, global_batch)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch,
                                                                      drop_remainder=True)


def _accum_model(accumulation_steps):
    base = activation_model()
    model = tfmem.AccumModel.wrap(base, accumulation_steps=accumulation_steps)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _budget_between_16x4_and_32x2(model):
    loose = tfmem.plan(model, global_batch_size=64, optimizer="sgd", memory_budget=100 * GIB)
    return int((loose.peak_bytes(16, 4) + loose.peak_bytes(32, 2)) / 2 / 0.8) + 1


def test_accum_fit_is_stopped_before_the_first_step_when_over_budget():
    model = _accum_model(accumulation_steps=1)
    before = [w.copy() for w in model.get_weights()]
    budget = _budget_between_16x4_and_32x2(model)
    with pytest.raises(tfmem.MemoryPlanError, match="micro-batch 16 × 4 accumulation steps fits"):
        model.fit(_accum_data(), epochs=1, verbose=0, memory_budget=budget)
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    model.fit(_accum_data(), epochs=1, verbose=0, memory_budget=budget, check_memory=False)
    assert int(model.optimizer.iterations) == 1  # the explicit override runs


def test_each_interface_names_its_own_switches_when_over_budget():
    model = _accum_model(accumulation_steps=1)
    budget = _budget_between_16x4_and_32x2(model)
    # AccumModel.fit: k is its `accumulation_steps`, the override its `check_memory=False`.
    with pytest.raises(tfmem.MemoryPlanError) as raised:
        model.fit(_accum_data(), epochs=1, verbose=0, memory_budget=budget)
    first = str(raised.value).splitlines()[0]
    assert first.endswith("fits in " + format_bytes(raised.value.plan.peak_bytes(
        16, 4)) + " (accumulation_steps=4). Pass `check_memory=False` to run anyway.")
    memory_plan = raised.value.plan
    # The guard and tfmem.plan's check, from Python: their own argument.
    with pytest.raises(tfmem.MemoryPlanError, match="Pass `allow_over_budget=True` to run"):
        guard.guard(model, global_batch_size=64, accumulation_steps=1, memory_budget=budget,
                    optimizer="sgd")
    # The command line: its flags, spelled by the caller.
    with pytest.raises(tfmem.MemoryPlanError) as raised:
        planner.check(memory_plan, accumulation_steps=1, switches=plan_report.COMMAND_LINE)
    assert "(--accumulation-steps 4). Pass `--allow-over-budget` to run anyway." in str(
        raised.value)


def test_accum_fit_refuses_a_keyword_it_does_not_take():
    model = _accum_model(accumulation_steps=1)
    budget = _budget_between_16x4_and_32x2(model)
    for keywords in ({"allow_over_budget": True}, {"epoch": 1, "verbos": 0}):
        with pytest.raises(TypeError, match="unexpected keyword argument") as raised:
            model.fit(_accum_data(), memory_budget=budget, **keywords)
        assert all(repr(name) in str(raised.value) for name in keywords)
    assert int(model.optimizer.iterations) == 0


def test_accum_auto_takes_k_from_the_plan():
    model = _accum_model(accumulation_steps="auto")
    model.fit(_accum_data(), epochs=1, verbose=0,
              memory_budget=_budget_between_16x4_and_32x2(model))
    assert model.accumulation_steps == 4  # 64 = micro-batch 16 × 4 steps
    assert int(model.optimizer.iterations) == 1
    assert model.get_config()["accumulation_steps"] == "auto"
    with pytest.raises(ValueError, match="is chosen when `fit` starts"):
        _accum_model("auto").train_on_batch(*next(iter(_accum_data())))
