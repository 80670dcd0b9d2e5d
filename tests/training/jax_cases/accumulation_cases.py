"""AccumModel's train step on the JAX backend: prints the numbers the tests assert.

Run by tests/test_accumulation_jax.py as `python tests/jax_cases/accumulation_cases.py`
with KERAS_BACKEND=jax (set by `common`) and 8 host devices. The cases here run on one device
with no distribution; data_parallel_cases.py's, which install one, run last.
"""

import collections
import logging

import common  # noqa: F401  (fixes the backend first)
import keras
import numpy as np
import data_parallel_cases
import loss_normalisation_cases
import tfmem
from common import compile_model, conv_model, data, dense_model, emit, relative_difference

K = 4  # accumulation steps in the equivalence cases


def equivalence(builder, shape, optimizer, weighted):
    """Three global batches of 32: plain keras.Model vs AccumModel with 4 micro-batches of 8."""
    x, y, sample_weight = data(shape, num_samples=96)
    sample_weight = sample_weight if weighted else None
    runs = []
    for accumulation_steps in (None, K):
        model = builder(accumulation_steps)
        initial = model.get_weights()
        compile_model(model, keras.optimizers.get(optimizer))
        history = model.fit(
            x, y, sample_weight=sample_weight, batch_size=32, epochs=1, shuffle=False, verbose=0
        ).history
        runs.append((model, initial, history))
    (plain, initial, plain_history), (accum, _, accum_history) = runs
    plain_update = [a - b for a, b in zip(plain.get_weights(), initial)]
    accum_update = [a - b for a, b in zip(accum.get_weights(), initial)]
    return {
        "weights": relative_difference(plain.get_weights(), accum.get_weights()),
        "update": relative_difference(plain_update, accum_update),
        "plain_loss": plain_history["loss"][0],
        "accum_loss": accum_history["loss"][0],
        "plain_accuracy": plain_history["accuracy"][0],
        "accum_accuracy": accum_history["accuracy"][0],
        "plain_iterations": int(plain.optimizer.iterations),
        "accum_iterations": int(accum.optimizer.iterations),
    }


def lr_schedule():
    """PiecewiseConstantDecay([2], [0.1, 0.0]): updates 0, 1, 2 move the weights, 3, 4 don't."""
    x, y, _ = data((6,), num_samples=16)
    results = {}
    for name, accumulation_steps in (("plain", None), ("accum", 2)):
        model = dense_model(accumulation_steps)
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.0])
        compile_model(model, keras.optimizers.SGD(schedule))
        changes = []
        for _ in range(5):
            before = model.get_weights()
            model.train_on_batch(x, y)
            changes.append(relative_difference(before, model.get_weights()))
        results[name] = {
            "changes": changes,
            "iterations": int(model.optimizer.iterations),
            "weights": model.get_weights(),
        }
    results["weights"] = relative_difference(
        results["plain"].pop("weights"), results["accum"].pop("weights")
    )
    return results


def mixed_precision(policy):
    """Plain vs AccumModel(k=4) update under a mixed policy; for float16 an injected inf."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y, _ = data((6,), num_samples=32)
        models = {}
        for name, accumulation_steps in (("plain", None), ("accum", K)):
            model = dense_model(accumulation_steps)
            compile_model(model, keras.optimizers.SGD(0.1))
            models[name] = (model, model.get_weights())
            model.train_on_batch(x, y)
        (plain, initial), (accum, _) = models["plain"], models["accum"]
        results = {
            "update": relative_difference(
                [a - b for a, b in zip(plain.get_weights(), initial)],
                [a - b for a, b in zip(accum.get_weights(), initial)],
            ),
            "optimizer": type(accum.optimizer).__name__,
        }
        if policy == "mixed_float16":
            # Row 9 is in micro-batch 1 of 4 (rows 8..15): micro-batches 0, 2, 3 stay finite,
            # so only skipping the whole window leaves the weights alone.
            poisoned = x.copy()
            poisoned[9, 0] = np.inf
            before = accum.get_weights()
            scale_before = float(accum.optimizer.dynamic_scale)
            iterations_before = int(accum.optimizer.iterations)
            accum.train_on_batch(poisoned, y)
            results["poisoned"] = {
                "change": relative_difference(before, accum.get_weights()),
                "scale_before": scale_before,
                "iterations_before": iterations_before,
                "scale_after": float(accum.optimizer.dynamic_scale),
                "iterations": int(accum.optimizer.iterations),
            }
            before = accum.get_weights()
            accum.train_on_batch(x, y)
            results["clean_after"] = {
                "change": relative_difference(before, accum.get_weights()),
                "scale": float(accum.optimizer.dynamic_scale),
                "iterations": int(accum.optimizer.iterations),
            }
        return results
    finally:
        keras.mixed_precision.set_global_policy("float32")


def batch_norm():
    """Moving statistics after one step vs momentum·old + (1 − momentum)·mean of micro-batches."""
    x, y, _ = data((8, 8, 3), num_samples=16)
    model = conv_model(2, batch_norm=True)
    compile_model(model, keras.optimizers.SGD(0.1))
    layer = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    features = keras.Model(model.inputs, layer.input)
    old_mean, old_var = (np.asarray(v) for v in (layer.moving_mean, layer.moving_variance))
    # One device: micro-batch j is rows [8j, 8j + 8) of the global batch of 16.
    micro = [
        np.asarray(features.predict(x[8 * j : 8 * j + 8], verbose=0), np.float64) for j in range(2)
    ]
    means = [m.mean(axis=(0, 1, 2)) for m in micro]
    variances = [m.var(axis=(0, 1, 2)) for m in micro]
    expected_mean = 0.9 * old_mean + 0.1 * np.mean(means, axis=0)
    expected_var = 0.9 * old_var + 0.1 * np.mean(variances, axis=0)
    # What k separate momentum steps would give: the semantics AccumModel does not have.
    sequential_mean = old_mean
    for mean in means:
        sequential_mean = 0.9 * sequential_mean + 0.1 * mean
    model.train_on_batch(x, y)
    scale = np.abs(expected_mean - old_mean).max()
    return {
        "mean_error": float(np.abs(np.asarray(layer.moving_mean) - expected_mean).max() / scale),
        "var_error": float(
            np.abs(np.asarray(layer.moving_variance) - expected_var).max()
            / np.abs(expected_var - old_var).max()
        ),
        "sequential_gap": float(np.abs(sequential_mean - expected_mean).max() / scale),
    }


def dropout_seeds():
    """Each micro-batch draws a fresh dropout mask: k=2 advances the seed as 2 plain steps do."""
    x, y, _ = data((8, 8, 3), num_samples=8)
    states = {}
    runs = (("accum_1", 2, 1), ("plain_1", None, 1), ("plain_2", None, 2))
    for name, accumulation_steps, num_steps in runs:
        model = conv_model(accumulation_steps, dropout=0.5)
        compile_model(model, keras.optimizers.SGD(0.1))
        for _ in range(num_steps):
            model.train_on_batch(x, y)
        seeds = [v for v in model.non_trainable_variables if "seed" in v.path]
        states[name] = np.concatenate([np.asarray(v).ravel() for v in seeds]).tolist()
    return states


def error(num_samples, optimizer):
    """The error train_on_batch raises for AccumModel(k=4), as [type, message]."""
    x, y, _ = data((6,), num_samples=num_samples)
    model = compile_model(dense_model(4), optimizer)
    try:
        model.train_on_batch(x, y)
    except ValueError as raised:
        return ["ValueError", str(raised)]
    return [None, ""]


def placement_cases():
    """CPU's host loop and the in-graph loop: the same update, statistics and dropout seeds."""
    from tfmem.training import accumulation_jax, placement

    host_calls = []
    call = accumulation_jax.HostLoopStep.__call__

    def counted(self, state, batch):
        host_calls.append(self.model.name)
        return call(self, state, batch)

    accumulation_jax.HostLoopStep.__call__ = counted
    x, y, sample_weight = data((8, 8, 3), num_samples=64)
    runs, calls = {}, {}
    try:
        for name, platforms in (("host", ("cpu",)), ("graph", ())):
            placement.HOST_LOOP_PLATFORMS = platforms
            model = conv_model(K, batch_norm=True, dropout=0.3)
            compile_model(model, keras.optimizers.Adam(0.01))
            history = model.fit(x, y, sample_weight=sample_weight, batch_size=32, epochs=1,
                                shuffle=False, verbose=0).history
            runs[name] = (model, history)
            calls[name] = host_calls.count(model.name)
    finally:
        accumulation_jax.HostLoopStep.__call__ = call
        placement.HOST_LOOP_PLATFORMS = ("cpu",)
    (host, host_history), (graph, graph_history) = runs["host"], runs["graph"]
    return {
        "host_loop_steps": calls["host"],
        "graph_loop_host_steps": calls["graph"],
        "weights": relative_difference(graph.get_weights(), host.get_weights()),
        "non_trainable": relative_difference(
            [v.value for v in graph.non_trainable_variables],
            [v.value for v in host.non_trainable_variables],
        ),
        "host_loss": host_history["loss"][0],
        "graph_loss": graph_history["loss"][0],
        "iterations": [int(host.optimizer.iterations), int(graph.optimizer.iterations)],
    }


def compiled_memory(build, shape, policy):
    """XLA's memory analysis of plain `fit`'s step at micro-batch 8 and AccumModel(8 × 4)'s
    in-graph step (what GPUs and TPUs run), with the bytes accumulating must add: the float32
    gradient sums and the rest of the global batch."""
    from tfmem.memory import probe_jax
    from tfmem.runtime import precision
    from tfmem.training import placement

    keras.mixed_precision.set_global_policy(policy)
    placement.HOST_LOOP_PLATFORMS = ()
    try:
        x, y, _ = data(shape, num_samples=8 * K)
        results = {}
        for name, accumulation_steps in (("plain", None), ("accum", K)):
            keras.utils.set_random_seed(0)
            model = build(keras.Input(shape))
            if accumulation_steps:
                model = tfmem.AccumModel.wrap(model, accumulation_steps=accumulation_steps)
            compile_model(model, keras.optimizers.SGD(0.1), metrics=())
            model.optimizer.build(model.trainable_variables)
            batch = (x, y) if accumulation_steps else (x[:8], y[:8])
            results[name] = probe_jax.compiled_step_memory(model, batch)["peak_bytes"]
        results["sums_bytes"] = sum(precision.accumulator_nbytes(v.shape, v.dtype)
                                    for v in model.trainable_variables)
        results["more_batch_bytes"] = x[8:].nbytes + y[8:].nbytes
        return results
    finally:
        placement.HOST_LOOP_PLATFORMS = ("cpu",)
        keras.mixed_precision.set_global_policy("float32")


def small_convolutions(inputs):
    """Two convolutions: activations outweigh weights, as in image models."""
    hidden = inputs
    for filters in (32, 64):
        hidden = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(hidden))


def pooled_convolutions(inputs):
    """Two convolution → relu → max-pooling blocks, which the plan puts under XLA:CPU's
    figure (what max pooling's backward holds there, docs/planning.md)."""
    hidden = inputs
    for filters in (32, 64):
        hidden = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(hidden)
        hidden = keras.layers.MaxPooling2D()(keras.ops.relu(hidden))
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(hidden))


def wide_dense(inputs):
    """Weights outweigh activations: what a step keeps per weight shows."""
    hidden = keras.layers.Flatten()(inputs)
    for _ in range(2):
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(hidden))


class Lowerings(logging.Handler):
    """The step programs JAX lowers for XLA while it is installed (JAX logs each one it
    lowers; a call served by a jitted function's cache lowers nothing): `counts` maps each
    program's name and argument shapes to how many times one was lowered."""

    LOGGER = logging.getLogger("jax._src.interpreters.pxla")
    STEPS = ("train_step", "_micro_step", "_update")  # AccumModel's programs

    def __enter__(self):
        self.counts = collections.Counter()
        self.level = self.LOGGER.level
        self.LOGGER.setLevel(logging.DEBUG)
        self.LOGGER.addHandler(self)
        return self

    def __exit__(self, *exc_info):
        self.LOGGER.removeHandler(self)
        self.LOGGER.setLevel(self.level)

    def emit(self, record):
        message = record.getMessage()
        if message.split()[:2] in (["Compiling", f"jit({name})"] for name in self.STEPS):
            self.counts[message.split(". Argument mapping")[0]] += 1


def guard_with_xla():
    """fit where XLA's figure of the compiled step (with the plan's framework runtime, which
    it leaves out) decides over the plan, which puts a dense net above it: a set k the plan
    refuses, and "auto" at a budget between the compiled peaks of micro-batch 32 and 8;
    weighted rows, as `fit` takes them."""
    from tfmem.memory import guard

    x, y, sample_weight = data((6,), num_samples=32)
    probe = compile_model(dense_model(1), keras.optimizers.SGD(0.1), metrics=())
    probe.optimizer.build(probe.trainable_variables)
    runtime = tfmem.plan(probe, global_batch_size=32, memory_budget=2**30,
                         optimizer="sgd").runtime_bytes
    compiled = {}

    def peak(k, plan=None):
        if k not in compiled:
            probe.accumulation_steps = k
            compiled[k] = probe.compiled_step_memory((x, y, sample_weight))["peak_bytes"]
        return compiled[k]

    peaks = {k: peak(k) for k in (1, 4)}
    budget = int(((peaks[1] + peaks[4]) / 2 + runtime) / 0.8)  # the plan's budget: 80% of it
    plain = compile_model(dense_model(), keras.optimizers.SGD(0.1), metrics=())
    plain.fit(x, y, sample_weight=sample_weight, batch_size=32, verbose=0, shuffle=False)
    results = {"peaks": [peaks[1], peaks[4]], "runtime_bytes": runtime}
    for name, steps, memory_budget in (("fixed", 1, int((peaks[1] + runtime) / 0.8) + 1),
                                       ("auto", "auto", budget)):
        model = compile_model(dense_model(steps), keras.optimizers.SGD(0.1), metrics=())
        try:  # the plan alone
            plan_steps = guard.guard(model, global_batch_size=32, accumulation_steps=steps,
                                     memory_budget=memory_budget,
                                     optimizer="sgd").accumulation_steps
        except tfmem.MemoryPlanError:
            plan_steps = None
        # The check alone, then fit (which checks again): what each lowers of the step.
        with Lowerings() as checked:
            model.plan_memory(x, 32, memory_budget=memory_budget, y=y,
                              sample_weight=sample_weight)
        with Lowerings() as trained:
            model.fit(x, y, sample_weight=sample_weight, batch_size=32, verbose=0,
                      shuffle=False, memory_budget=memory_budget)
        k = model.accumulation_steps
        results[name] = {
            "budget_bytes": 0.8 * memory_budget,  # the plan's safety: 80% of it
            "plan_steps": plan_steps,  # None: refused
            "accumulation_steps": k,
            "compiled_peak": peak(k),
            "iterations": int(model.optimizer.iterations),
            "weights": relative_difference(plain.get_weights(), model.get_weights()),
            "check_lowerings": sum(checked.counts.values()),
            "fit_lowerings": sum(trained.counts.values()),
        }
        if k > 1:
            results[name]["half_steps_peak"] = peak(k // 2)
    # A set k that XLA's figure refuses too (the guard, given the compiled peaks above): the
    # message names what XLA fits.
    try:
        guard.guard(probe, global_batch_size=32, accumulation_steps=1, memory_budget=budget,
                    optimizer="sgd", compiled_peak=peak)
        results["refused"] = None
    except tfmem.MemoryPlanError as error:
        results["refused"] = str(error).splitlines()[0]
    results["accepted"] = accepted_over_xla()
    return results


def accepted_over_xla():
    """fit with "auto" where the plan accepts micro-batch 32 and XLA's compiled step of it
    does not fit: two pooled convolution blocks, which the plan puts under XLA:CPU's
    figure. A budget
    between the two figures of micro-batch 32; the reference is a plain keras.Model."""
    from tfmem.memory import guard

    x, y, _ = data((16, 16, 3), num_samples=32)

    def build(accumulation_steps=None):
        keras.utils.set_random_seed(0)
        model = pooled_convolutions(keras.Input((16, 16, 3)))
        if accumulation_steps is not None:
            model = tfmem.AccumModel.wrap(model, accumulation_steps=accumulation_steps)
        return compile_model(model, keras.optimizers.SGD(0.1), metrics=())

    probe = build(1)
    probe.optimizer.build(probe.trainable_variables)
    xla = probe.compiled_step_memory((x, y))["peak_bytes"]
    plan = tfmem.plan(probe, global_batch_size=32, memory_budget=2**30, optimizer="sgd")
    planned = plan.peak_bytes(32, 1)  # with the framework runtime
    budget = int((planned + xla + plan.runtime_bytes) / 2 / 0.8)
    plain = build()
    plain.fit(x, y, batch_size=32, verbose=0, shuffle=False)
    model = build("auto")
    plan_steps = guard.guard(model, global_batch_size=32, accumulation_steps="auto",
                             memory_budget=budget, optimizer="sgd").accumulation_steps
    with Lowerings() as checked:
        run = model.plan_memory(x, 32, memory_budget=budget, y=y)
    with Lowerings() as trained:
        model.fit(x, y, batch_size=32, verbose=0, shuffle=False, memory_budget=budget)
    return {
        "budget_bytes": 0.8 * budget,
        "runtime_bytes": plan.runtime_bytes,
        "planned": planned,  # micro-batch 32, the plan's
        "compiled_32": xla,  # micro-batch 32, XLA's
        "plan_steps": plan_steps,
        "accumulation_steps": model.accumulation_steps,
        "compiled_peak": run.compiled_peak_bytes,
        "table": run.table(),
        "iterations": int(model.optimizer.iterations),
        "weights": relative_difference(plain.get_weights(), model.get_weights()),
        "check_lowerings": sum(checked.counts.values()),
        "fit_lowerings": sum(trained.counts.values()),
    }


emit(
    {
        "guard_with_xla": guard_with_xla(),
        "compiled_memory": {
            "convolutions": compiled_memory(small_convolutions, (16, 16, 3), "mixed_bfloat16"),
            "dense": compiled_memory(wide_dense, (8, 8, 3), "mixed_bfloat16"),
        },
        "placement": placement_cases(),
        "dense_sgd_weighted": equivalence(dense_model, (6,), "sgd", weighted=True),
        "dense_adam_weighted": equivalence(dense_model, (6,), "adam", weighted=True),
        "conv_sgd_weighted": equivalence(conv_model, (8, 8, 3), "sgd", weighted=True),
        "conv_adam": equivalence(conv_model, (8, 8, 3), "adam", weighted=False),
        "lr_schedule": lr_schedule(),
        "float16": mixed_precision("mixed_float16"),
        "bfloat16": mixed_precision("mixed_bfloat16"),
        "batch_norm": batch_norm(),
        "dropout_seeds": dropout_seeds(),
        "losses": loss_normalisation_cases.results(),
        "errors": {
            "indivisible_batch": error(30, keras.optimizers.SGD(0.1)),
            "double_accumulation": error(
                32, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
            ),
        },
        "data_parallel": data_parallel_cases.results(),  # last: it installs a distribution
    }
)
