"""On JAX a plan for a CPU counts what XLA:CPU keeps (`tfmem.memory.xla_rules`): checked
against XLA:CPU's memory analysis of the compiled train step and against a hand count, in a
JAX process; plans for a GPU and a TPU count what XLA:GPU and XLA:TPU keep, by hand count."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.jax_flags import jax_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]

_PROGRAM = r"""
import json
import keras
import numpy as np
import tfmem
from keras import ops
from tfmem.memory import probe_jax

L = keras.layers
SHAPE, BATCH = (16, 16, 16), 32
inputs = keras.Input(SHAPE)
x = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(16, 3, padding="same")(inputs)))
# MobileNetV3's block: a depthwise convolution, BatchNormalization and hard-swish.
x = L.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
x = L.Activation("hard_swish")(L.BatchNormalization()(x))
x = L.Conv2D(16, 3, padding="same", activation="swish")(x)
x = ops.relu(L.Conv2D(16, 3, padding="same")(x))
# A U-Net's level: pooled, convolved, upsampled and concatenated with what was pooled.
y = L.UpSampling2D()(L.Conv2D(16, 3, padding="same")(L.MaxPooling2D()(x)))
x = L.Conv2D(16, 3, padding="same")(L.Concatenate()([y, x]))
model = keras.Model(inputs, L.Dense(4)(L.GlobalAveragePooling2D()(x)))
model.compile(optimizer="sgd", loss="mse")
model.optimizer.build(model.trainable_variables)
batch = (np.zeros((BATCH,) + SHAPE, "float32"), np.zeros((BATCH, 4), "float32"))
plans = {kind: tfmem.plan(model, global_batch_size=BATCH, optimizer="sgd",
                         input_batches_in_flight=1, **where)
         for kind, where in (("cpu", {"memory_budget": 2**34}), ("gpu", {"device": "t4"}),
                             ("tpu", {"device": "tpu-v5e-8"}))}


class GeluDropout(keras.layers.Layer):  # no rule covers it: traced whole (JAX's residuals)
    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(0)

    def call(self, x, training=False):
        return keras.random.dropout(ops.gelu(x, approximate=True), 0.1, seed=self.seed)


TOKENS = (32, 16)


def gelu_mlp(initializer=keras.initializers.GlorotUniform):
    # Three Dense -> GELU and dropout -> Dense blocks, pooled into 4 outputs; each Dense's
    # kernel made by a new `initializer()`.
    tokens = keras.Input(TOKENS)
    x = tokens
    for _ in range(3):
        x = L.Dense(16, kernel_initializer=initializer())(
            GeluDropout()(L.Dense(64, kernel_initializer=initializer())(x)))
    return keras.Model(tokens, L.Dense(4)(L.GlobalAveragePooling1D()(x)))


mlp = gelu_mlp()
mlp.compile(optimizer="sgd", loss="mse")
mlp.optimizer.build(mlp.trainable_variables)
mlp_plan = tfmem.plan(mlp, global_batch_size=BATCH, optimizer="sgd",
                      input_batches_in_flight=1, memory_budget=2**34)
mlp_batch = (np.zeros((BATCH,) + TOKENS, "float32"), np.zeros((BATCH, 4), "float32"))
mlp_tpu_plan = tfmem.plan(mlp, global_batch_size=BATCH, optimizer="sgd",
                          input_batches_in_flight=1, device="tpu-v5e-8")
# Compiled for a device named (as for a TPU chip of a topology): here the CPU, the same step.
import jax
named = probe_jax.compiled_step_memory(mlp, mlp_batch, device=jax.devices()[0])
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
try:
    probe_jax.compiled_step_memory(mlp, mlp_batch, device=jax.devices()[0])
    refused = None
except ValueError as error:
    refused = str(error)
keras.distribution.set_distribution(None)
# A TPU to compile for, named as in the device table (with the TPU compiler installed or not).
import importlib.util
from tfmem.runtime.devices import ACCELERATORS
tpu = {}
for name in ["a100-80gb", "tpu-x9"] + [a.name for a in ACCELERATORS.values() if a.kind == "tpu"]:
    try:
        tpu[name] = probe_jax.tpu_device(name).device_kind
    except (ValueError, ImportError) as error:
        tpu[name] = f"{type(error).__name__}: {error}"
# conv → BN → relu → max pooling, the pooling the relu's only reader; and with the relu
# zero-padded before the pooling: what a GPU plan counts for the pooling's zeros.
def pooled(padded):
    pixels = keras.Input(SHAPE)
    x = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(16, 3, padding="same")(pixels)))
    x = L.MaxPooling2D(3, 2)(L.ZeroPadding2D()(x)) if padded else L.MaxPooling2D()(x)
    x = L.GlobalAveragePooling2D()(L.Conv2D(16, 3, padding="same")(x))
    return keras.Model(pixels, L.Dense(4)(x))


gpu_bf16_plan = tfmem.plan(model, global_batch_size=BATCH, optimizer="sgd",
                           input_batches_in_flight=1, device="t4", precision="mixed_bfloat16")
gpu_f16_plan = tfmem.plan(model, global_batch_size=BATCH, optimizer="sgd",
                          input_batches_in_flight=1, device="t4", precision="mixed_float16")
gradients = {"gpu": plans["gpu"].gradient_bytes, "gpu_bf16": gpu_bf16_plan.gradient_bytes,
             "gpu_f16": gpu_f16_plan.gradient_bytes,
             "cpu": plans["cpu"].gradient_bytes, "tpu": plans["tpu"].gradient_bytes,
             "noted": [kind for kind, plan in [*plans.items(), ("gpu_f16", gpu_f16_plan)]
                       if any(note.startswith("gradients: XLA:")
                              for note in plan.notes)]}
pools = {}
for padded in (False, True):
    pool_plan = tfmem.plan(pooled(padded), global_batch_size=BATCH, optimizer="sgd",
                           input_batches_in_flight=1, device="t4")
    pools["padded" if padded else "unpadded"] = [pool_plan.activation_bytes_per_sample,
                                                 pool_plan.workspace_bytes_per_sample]
# A GPU to compile for, as well (with JAX's CUDA plugin installed or not), and the targets
# XLA:GPU compiles for without one.
gpu_targets = {a.name: probe_jax._gpu_target(a) for a in ACCELERATORS.values()
               if a.kind == "gpu" and a.compute_capability >= (6, 0)}
gpu = {}
for name in ["tpu-v3-8", "k80", "t4", "h200"]:
    try:
        gpu[name] = probe_jax.gpu_device(name).device_kind
    except (ValueError, ImportError) as error:
        gpu[name] = f"{type(error).__name__}: {error}"
# The same network built for its shapes alone (no weight initialised): the same step compiles.
made = []  # the shapes of the initial values made (not those only traced)


class Recorded(keras.initializers.GlorotUniform):
    def __call__(self, shape, dtype=None):
        value = super().__call__(shape, dtype)
        if not isinstance(value, jax.core.Tracer):
            made.append(tuple(shape))
        return value


def mlp_of_shapes():
    with tfmem.models.shapes_only():
        return gelu_mlp(Recorded)
shapes_mlp = mlp_of_shapes()
shapes_mlp.compile(optimizer="sgd", loss="mse")
with tfmem.models.shapes_only():
    shapes_mlp.optimizer.build(shapes_mlp.trainable_variables)
    shapes_peak = probe_jax.compiled_step_memory(shapes_mlp, mlp_batch)["peak_bytes"]
# An AccumModel of it, compiled for a TPU ahead of time where the TPU compiler is installed,
# refused for a platform whose loop runs on the host.
accum = tfmem.AccumModel.wrap(mlp_of_shapes())
accum.compile(optimizer="adam", loss="mse")
abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in mlp_batch]
with tfmem.models.shapes_only():
    try:
        accum.compiled_peaks(*abstract, batch_size=BATCH, device=jax.devices()[0])(2)
        on_host = None
    except ValueError as error:
        on_host = str(error)
    host_loop_peak = accum.compiled_peaks(*abstract, batch_size=BATCH)(2)  # this CPU's own
    tpu_peaks = None
    if importlib.util.find_spec("libtpu") is not None:
        peaks = accum.compiled_peaks(*abstract, batch_size=BATCH,
                                     device=probe_jax.tpu_device("tpu-v5e-8"))
        tpu_peaks = [peaks(1), peaks(2)]
# The same AccumModel with its weights initialised, for this CPU.
accum_of_weights = tfmem.AccumModel.wrap(gelu_mlp())
accum_of_weights.compile(optimizer="adam", loss="mse")
host_loop_of_weights = accum_of_weights.compiled_peaks(*abstract, batch_size=BATCH)(2)
from tfmem import _keras_internals
text = {"tpu": tpu, "libtpu": importlib.util.find_spec("libtpu") is not None, "gpu": gpu,
        "gpu_targets": gpu_targets, "pools": pools, "gradients": gradients,
        "bounded": {kind: plan.bounded_activations for kind, plan in plans.items()},
        "bounded_notes": [note for plan in plans.values() for note in plan.notes
                          if note.startswith("activations: up to")],
        "cuda_plugin": probe_jax._installed("jax_plugins.xla_cuda12"),
        "shapes_peak": shapes_peak, "initial_values": len(made), "accum_on_host": on_host,
        "host_loop_peak": host_loop_peak, "host_loop_of_weights": host_loop_of_weights,
        "accum_tpu_peaks": tpu_peaks,
        # weights, optimizer slots and gradient sums (not the optimizers' scalar step counts)
        "initialised": sum(_keras_internals.is_initialized(v) and len(v.shape) > 0
                           for v in shapes_mlp.weights + accum.weights
                           + shapes_mlp.optimizer.variables + accum.optimizer.variables),
        "jax": jax.__version__,"mlp_xla": probe_jax.compiled_step_memory(mlp, mlp_batch)["peak_bytes"],
        "mlp_named": named, "refused": refused,
        "mlp_plan": mlp_plan.peak_bytes(BATCH, 1) - mlp_plan.runtime_bytes,
        "mlp_activation": mlp_plan.activation_bytes_per_sample,
        "mlp_tpu_activation": mlp_tpu_plan.activation_bytes_per_sample,
        "mlp_tpu_workspace": mlp_tpu_plan.workspace_bytes_per_sample}
print(json.dumps({"backend": keras.backend.backend(), **text,
                  "xla": probe_jax.compiled_step_memory(model, batch)["peak_bytes"],
                  # XLA's buffers, not the host's framework runtime a CPU plan adds
                  "plan": plans["cpu"].peak_bytes(BATCH, 1) - plans["cpu"].runtime_bytes,
                  **{f"{kind}_{term}": getattr(plan, f"{term}_bytes_per_sample")
                     for kind, plan in plans.items() for term in ("activation", "workspace")},
                  **{f"{kind}_fixed_workspace": plan.workspace_fixed_bytes
                     for kind, plan in plans.items()}}))
"""


@pytest.fixture(scope="module")
def on_jax():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=jax_xla_flags())
    result = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert results["backend"] == "jax"
    return results


def test_the_plan_of_a_cpu_is_within_the_band_of_xlas_compiled_step(on_jax):
    # The planned peak for XLA:CPU against XLA:CPU's own figure of the same step (conv → BN
    # → relu, depthwise conv → BN → hard-swish, conv with silu, conv → keras.ops.relu, max
    # pooling, a concatenation into a convolution): within ±15%, never more than 10% under.
    assert 0.90 * on_jax["xla"] <= on_jax["plan"] <= 1.15 * on_jax["xla"]


FEATURE_MAP = 16 * 16 * 16 * 4  # bytes per sample


def test_xla_cpu_keeps_the_pre_activation_silus_gate_and_the_pooling_indices(on_jax):
    # The model's input (the first convolution's); BatchNormalization's input, which is
    # also relu's pre-activation's source; relu's input (XLA recomputes the mask from it)
    # and output (the depthwise convolution's input); the second BatchNormalization's input
    # (hard-swish after it keeps nothing) and hard-swish's output (the next convolution's
    # input); silu's input and gate, its output (the third convolution's input); ops.relu's
    # pre-activation (JAX's mask, held as the float it compares; its broadcast zeros hold
    # nothing): 10 feature maps. Max pooling's int32 index per axis (4) and output element
    # (a quarter of the map's): 1. The pooled map (a convolution's input): 1/4. The
    # concatenation's operands, not its output: 2. The Dense layer's 16 inputs.
    assert on_jax["cpu_activation"] == 13 * FEATURE_MAP + FEATURE_MAP // 4 + 16 * 4
    # Max pooling's forward: an int32 iota of its input per axis, its indices and output.
    elements = FEATURE_MAP // 4
    assert on_jax["cpu_workspace"] == 4 * 4 * (elements + elements // 4) + FEATURE_MAP // 4
    # The depthwise kernel's gradient as a dense 3×3×16×16 kernel, and its diagonal's copy.
    assert on_jax["cpu_fixed_workspace"] == 2 * 3 * 3 * 16 * 16 * 4


def test_a_gpu_plan_counts_what_xla_gpu_keeps(on_jax):
    # XLA:GPU fuses BatchNormalization and the activations of it as XLA:TPU does, but keeps
    # whole what a library call (cuDNN's convolution, cuBLAS's matrix product) reads, in its
    # compute dtype. Kept: the two BatchNormalizations' inputs; the masks of the activations
    # of them, a byte an element per bound (relu's one, hard-swish's two: 3/4); the inputs of
    # the depthwise convolution (relu's output), of the third convolution (hard-swish's
    # output) and of the fourth (silu's output); silu's pre-activation inside the third;
    # ops.relu's traced residual, its boolean mask (1/4; its broadcast zeros hold nothing);
    # max pooling's input (no zeros for its backward, which adds into the concatenation's
    # gradient); the pooled map (1/4) and the concatenation (2), convolutions' inputs; the
    # Dense layer's 16 inputs. Not the model's input, which the step is given.
    assert on_jax["gpu_activation"] == 10 * FEATURE_MAP + FEATURE_MAP // 4 + 16 * 4
    # Each call's workspace beside what it and the calls before it keep: the largest, the
    # last convolution's, the gradient of the concatenation it reads (2 maps) beside the
    # 10¼ maps kept up to it.
    assert on_jax["gpu_workspace"] == (10 * FEATURE_MAP + FEATURE_MAP // 4 + 2 * FEATURE_MAP
                                       - on_jax["gpu_activation"])
    assert on_jax["gpu_fixed_workspace"] == 0


def test_a_gpu_plan_holds_normalizations_centred_inputs_where_one_kernel_sums_them(on_jax):
    # XLA:GPU sums a column of up to 4096 rows in one kernel: a BatchNormalization's
    # statistics of 16×16 maps are one sum up to micro-batch 16 (4096 rows), where its input
    # less the mean is written out in float32 and kept for the backward; two
    # BatchNormalizations, a float32 map each. Above 16 the sum is split and nothing kept.
    assert on_jax["bounded"] == {"cpu": [], "gpu": [[16, 2 * FEATURE_MAP]], "tpu": []}
    assert on_jax["bounded_notes"] == [
        "activations: up to micro-batch 16, 32.0 KiB/sample more, BatchNormalizations' "
        "inputs less their mean, which XLA:GPU keeps in float32 where one kernel sums their "
        "statistics"]


def test_an_xla_device_plan_holds_one_gradient_at_a_time(on_jax):
    # XLA:GPU and XLA:TPU update each weight as its gradient is made: the largest gradient
    # (the last convolution's kernel, 3×3 × 32 × 16) is held, not all. On XLA:GPU each
    # convolution's kernel is kept from the forward to its backward in cuDNN's layout: four
    # 3×3 × 16 × 16, the depthwise 3×3 × 16 and that last 3×3 × 32 × 16, in float32; in
    # mixed_bfloat16 those are the 16-bit copies of the weights, counted apart.
    largest = 3 * 3 * 32 * 16 * 4
    kernels = 4 * 3 * 3 * 16 * 16 * 4 + 3 * 3 * 16 * 4 + largest
    gradients = on_jax["gradients"]
    assert gradients["gpu"] == largest + kernels
    assert gradients["gpu_bf16"] == gradients["tpu"] == largest
    assert gradients["noted"] == ["gpu", "tpu"]  # each plan says how it counted the row
    # Planned for XLA:CPU, and under mixed_float16's loss scaling, whose check that every
    # gradient is finite comes before any update: every gradient, held together until the
    # update (the kernels, five convolutions' biases, two BatchNormalizations' scales and
    # offsets, the Dense layer's kernel and bias).
    weights = kernels + 5 * 16 * 4 + 2 * 2 * 16 * 4 + 16 * 4 * 4 + 4 * 4
    assert gradients["cpu"] == gradients["gpu_f16"] == weights


def test_a_tpu_plan_counts_what_xla_tpu_keeps(on_jax):
    # XLA:TPU makes what BatchNormalization, an activation of it and hard-swish compute again
    # inside the fusions that read it (a convolution's kernel gradient included), and reads
    # the model's input in place. Kept in float32: the two BatchNormalizations' inputs, silu's
    # pre-activation, max pooling's input (4 maps); as bfloat16 copies for the kernel
    # gradients (XLA:TPU multiplies in bfloat16): the concatenation (two maps in 2 bytes: 1),
    # the pooled map (1/8) and the Dense layer's 16 inputs; ops.relu's mask, compared from a
    # tensor not kept, a byte an element (1/4).
    assert on_jax["tpu_activation"] == (
        5 * FEATURE_MAP + FEATURE_MAP // 4 + FEATURE_MAP // 8 + 16 * 2)
    # One gradient map, but at the concatenation, which holds its two inputs while it copies
    # them into its output: four maps.
    assert on_jax["tpu_workspace"] == 4 * FEATURE_MAP
    assert on_jax["tpu_fixed_workspace"] == 0


WIDE = 32 * 64 * 4  # bytes per sample of the block's width


def test_a_traced_gelu_keeps_what_xla_keeps_and_a_dropout_its_random_bits(on_jax):
    # Within the band of XLA:CPU's figure of the same step.
    assert 0.90 * on_jax["mlp_xla"] <= on_jax["mlp_plan"] <= 1.15 * on_jax["mlp_xla"]
    # Each traced block (tanh-approximate GELU, then a dropout) keeps its input and the
    # tanh; the rest of JAX's residuals of the GELU (x³'s term, 1 - t, (1 + t) / 2) are
    # made again from those by cheap element-wise ops, and nothing is kept for them. The
    # dropout's mask is held as the two 32-bit words of random bits it is compared from:
    # 8 bytes per element. The Dense after it keeps its input (the block's output), the
    # Dense before it its own (32 × 16); the head its 16 pooled features.
    assert on_jax["mlp_activation"] == 3 * (2 * WIDE + 2 * WIDE + WIDE + 32 * 16 * 4) + 16 * 4
    # For XLA:TPU, which makes the GELU's tanh and products again from its input, each block
    # keeps that input and the dropout's mask (a byte an element); the Dense after it a
    # bfloat16 copy of the block's output, the Dense of the next block one of its own input
    # (32 × 16), the head one of its 16 pooled features; the first Dense reads the model's
    # input in place. One gradient map of the block's width.
    assert on_jax["mlp_tpu_activation"] == (
        3 * (WIDE + WIDE // 4 + WIDE // 2) + 2 * 32 * 16 * 2 + 16 * 2)
    assert on_jax["mlp_tpu_workspace"] == WIDE


def test_xla_cpu_holds_a_traced_calls_transcendental_residuals_and_row_sums_broadcast():
    # JAX's residuals of tanh, a product and a softmax, traced as the planner traces a call.
    jnp = pytest.importorskip("jax.numpy")
    from tfmem.memory import gradient_trace, xla_rules

    def call(xs):
        x = xs[0]
        e = jnp.exp(x * (1 - jnp.tanh(x)))
        return e / jnp.sum(e, axis=-1, keepdims=True)

    traced = gradient_trace.trace_call_jax(call, [((8,), "float32")], differentiable=[True],
                                           trainable=[], non_trainable=[])
    row = 8 * 4
    widened = dict(traced.widened)

    def held(target):
        return sum(xla_rules.residual_bytes(target, nbytes, dtype, None,
                                            derived=index in traced.derived,
                                            drawn=index in traced.drawn,
                                            widened=widened.get(index, 0),
                                            fused=index in traced.fused,
                                            read_whole=index in traced.read_whole)
                   for index, (nbytes, dtype) in enumerate(traced.internal))

    assert traced.kept_inputs == (0,)
    # JAX saves (besides the input) t = tanh(x), two differences 1 - t, the exp, the row
    # sum and its inverse square: what a plan of no XLA target counts.
    assert held(None) == 4 * row + 2 * 4
    # XLA:CPU: t and the exp (transcendental, not made twice) and the row sum broadcast to
    # the row; the differences and the inverse square are made again from them.
    assert held("cpu") == 3 * row
    # XLA:TPU, which fuses element-wise ops of any cost into what reads them: the row sum
    # (one float, made by a reduction); t, the exp, the differences and the inverse square
    # are made again from the input and it.
    assert held("tpu") == 4
    # XLA:GPU fuses them as well, but writes out the exp, which the row sum reduces and the
    # division reads too, whole.
    assert held("gpu") == row + 4


def test_xla_gpu_keeps_what_a_reduction_reads_through_a_cast():
    # y = x², its mean taken in float32 (keras's mean of a bfloat16 tensor), y scaled by it.
    jnp = pytest.importorskip("jax.numpy")
    from tfmem.memory import gradient_trace, xla_rules

    def call(xs):
        y = xs[0] * xs[0]
        return y * jnp.mean(y.astype(jnp.float32), axis=-1, keepdims=True).astype(y.dtype)

    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        traced = gradient_trace.trace_call_jax(call, [((8,), dtype)], differentiable=[True],
                                               trainable=[], non_trainable=[])

        def held(target):
            return sum(xla_rules.residual_bytes(target, nbytes, kind, None,
                                                fused=index in traced.fused,
                                                read_whole=index in traced.read_whole)
                       for index, (nbytes, kind) in enumerate(traced.internal))

        # JAX keeps y and the mean. XLA:TPU makes y again from the input; XLA:GPU writes y
        # out, whole, for the reduction, whether it reads y or y's float32 cast.
        assert held("tpu") == size
        assert held("gpu") == 8 * size + size


def test_a_gpu_plan_holds_the_zeros_max_poolings_backward_scatters_into(on_jax):
    # A traced relu → 2×2 max pooling of an 8×8×4 map: without padding, the relu's zeros
    # and the pooling's are one buffer kept from the forward, the scatter writing into a
    # copy: two maps of the input. With a pixel of padding around it, one map of the padded
    # 10×10×4 input, made as the backward runs, beside an int32 index per axis and pooled
    # element (4 × 5×5×4).
    jax = pytest.importorskip("jax")
    from tfmem.memory import gradient_trace, xla_rules

    def pooled(padding):
        def call(xs):
            return jax.lax.reduce_window(jax.numpy.maximum(xs[0], 0.0), -jax.numpy.inf,
                                         jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), padding)
        return gradient_trace.trace_call_jax(call, [((8, 8, 4), "float32")],
                                             differentiable=[True], trainable=[],
                                             non_trainable=[]).windows

    unpadded, padded = pooled("VALID"), pooled(((0, 0), (1, 1), (1, 1), (0, 0)))
    assert xla_rules.traced_zero_maps("gpu", unpadded) == 2 * 8 * 8 * 4 * 4
    assert xla_rules.traced_transient("gpu", unpadded) == 4 * 4 * (4 * 4 * 4)
    assert xla_rules.traced_zero_maps("gpu", padded) == 0
    assert xla_rules.traced_transient("gpu", padded) == 10 * 10 * 4 * 4 + 4 * 4 * (5 * 5 * 4)
    assert xla_rules.traced_zero_maps("tpu", unpadded) == 0
    # The same in a functional graph, planned for a GPU: conv → BN → relu → max pooling
    # (16×16×16 maps). Kept: BatchNormalization's input, relu's mask (1/4), the pooling's
    # input and the two maps of zeros, the pooled map (1/4, the next convolution's input),
    # the Dense layer's 16 inputs.
    activation, workspace = on_jax["pools"]["unpadded"]
    assert activation == 4 * FEATURE_MAP + 2 * FEATURE_MAP // 4 + 16 * 4
    # The pooling's backward, beside the 4¼ maps kept up to it: its input's gradient (the
    # indices, 4 × ¼ map, as large).
    assert workspace == 4 * FEATURE_MAP + FEATURE_MAP // 4 + FEATURE_MAP - activation
    # Zero-padded first (18×18): the pooling keeps its padded input and no zeros; its
    # backward makes a map of zeros of that input beside the indices (4 × 8×8×16 × 4 bytes).
    padded_map = 18 * 18 * 16 * 4
    activation, workspace = on_jax["pools"]["padded"]
    assert activation == FEATURE_MAP + 2 * FEATURE_MAP // 4 + padded_map + 16 * 4
    assert workspace == (FEATURE_MAP + FEATURE_MAP // 4 + padded_map + padded_map
                         + FEATURE_MAP - activation)


def test_a_step_compiled_for_a_named_device_is_the_step_and_a_mesh_places_it_alone(on_jax):
    # `device=` lays the state and the batch on that one device (a TPU chip of a topology,
    # compiled ahead of time); on the CPU it names, the program is the one compiled without it.
    assert on_jax["mlp_named"]["peak_bytes"] == on_jax["mlp_xla"]
    assert on_jax["mlp_named"]["argument_bytes"] > 0
    # Under a keras.distribution the mesh places the step: `device` is refused, by name.
    assert on_jax["refused"] and "`device`" in on_jax["refused"]


def test_a_tpu_to_compile_for_is_named_as_in_the_device_table(on_jax):
    tpu = dict(on_jax["tpu"])
    assert tpu.pop("a100-80gb") == (
        "ValueError: tpu_device(device='a100-80gb'): NVIDIA A100 80 GB is no TPU; name one, "
        'e.g. device="tpu-v5e-8" or "tpu-v3-8"')
    assert tpu.pop("tpu-x9").startswith(
        "ValueError: tpu_device(device='tpu-x9'): 'tpu-x9' is not a known accelerator")
    # Every TPU of the table is one of a generation XLA compiles for, without the hardware
    # where the TPU compiler is installed; where it is not, the error says how to install it.
    assert len(tpu) >= 6
    for name, found in tpu.items():
        if on_jax["libtpu"]:
            assert found.startswith("TPU v"), (name, found)
        else:
            assert found == (
                f"ImportError: tpu_device(device={name!r}) needs the TPU compiler, libtpu, to "
                f'compile for a TPU on this machine: pip install "jax[tpu]=={on_jax["jax"]}" '
                "(it pins the libtpu of this JAX)")


def test_a_gpu_to_compile_for_is_named_as_in_the_device_table(on_jax):
    gpu = on_jax["gpu"]
    assert gpu["tpu-v3-8"] == (
        "ValueError: gpu_device(device='tpu-v3-8'): TPU v3-8: 8 cores × 16 GiB HBM (Kaggle "
        "'TPU v3-8') is no GPU; name one, e.g. device=\"t4\" or \"a100-80gb\"")
    assert gpu["k80"] == (
        "ValueError: gpu_device(device='k80'): JAX's CUDA plugin compiles for compute "
        'capability 6.0 and later; name a newer GPU, e.g. device="t4"')
    for name, description in (("t4", "NVIDIA T4 16 GB (Colab/Kaggle 'T4')"),
                              ("h200", "NVIDIA H200 141 GB")):
        if on_jax["cuda_plugin"]:  # XLA:GPU describes the card from the table, no GPU here
            assert gpu[name] == description
        else:
            assert gpu[name] == (
                f"ImportError: gpu_device(device={name!r}) needs JAX's CUDA plugin to compile "
                "for a GPU on this machine (no GPU or driver needed): pip install "
                f'"jax[cuda12]=={on_jax["jax"]}"')


def test_a_gpus_target_is_the_device_tables_card(on_jax):
    targets = on_jax["gpu_targets"]
    t4 = targets.pop("t4")
    # XLA's GpuTargetConfig, text format: the card's compute capability and memory, and
    # what CUDA's guide gives for capability 7.5 (64 KiB of shared memory, 1024 threads).
    assert "cuda_compute_capability { major: 7 minor: 5 }" in t4
    assert f"device_memory_size: {15360 * 2**20}\n" in t4
    assert "shared_memory_per_core: 65536\n" in t4
    assert "threads_per_core_limit: 1024\n" in t4
    assert "core_count: 40\n" in t4
    assert 'device_description_str: "NVIDIA T4 16 GB (Colab/Kaggle \'T4\')"' in t4
    # Every other GPU of the table that JAX compiles for has one, of its own capability.
    assert len(targets) >= 7
    for name, target in targets.items():
        assert "cuda_compute_capability { major: " in target and "core_count: " in target


def test_a_model_built_for_its_shapes_compiles_its_step_without_a_weight(on_jax):
    # XLA's figure of the step of a model made under `shapes_only` is the initialised one's,
    # and no weight, slot or sum was made for it.
    assert on_jax["shapes_peak"] == on_jax["mlp_xla"]
    assert on_jax["initialised"] == 0 and on_jax["initial_values"] == 0
    # AccumModel's step on this CPU (the micro-batch loop from the host) compiles too, to the
    # figure of the same model with its weights.
    assert on_jax["host_loop_peak"] == on_jax["host_loop_of_weights"] > 0
    # AccumModel's step for one named device: refused for a platform whose micro-batch loop
    # runs on the host (this CPU), compiled for a TPU where its compiler is installed.
    assert on_jax["accum_on_host"] == (
        "compiled_step_memory(device=cpu:0): a step for a cpu loops from the host; compile it "
        "where it runs, without `device`")
    if on_jax["libtpu"]:
        assert all(peak > 0 for peak in on_jax["accum_tpu_peaks"])
    else:
        assert on_jax["accum_tpu_peaks"] is None
