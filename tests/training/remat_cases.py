"""The models and the run the rematerialization tests compare, on the backend Keras runs on.

`python remat_cases.py` (with KERAS_BACKEND set) prints, as JSON, how far a rematerialized
AccumModel's weights and BatchNorm statistics end from the same model trained without it (on
JAX, also under `tfmem.detect()`'s DataParallel over every device).
"""

import json
import sys

import keras
import numpy as np

import tfmem


@keras.saving.register_keras_serializable(package="tfmem_tests")
class Counted(keras.layers.Layer):
    """ReLU that counts how often its forward pass runs on real (not symbolic) tensors."""

    calls = 0

    def call(self, x):
        if not isinstance(x, keras.KerasTensor):
            Counted.calls += 1
        return keras.ops.relu(x)


@keras.saving.register_keras_serializable(package="tfmem_tests")
class Penalized(keras.layers.Layer):
    """Identity that adds a tenth of its input's mean square to the loss (`add_loss`)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def regularized(rematerialize=None, accumulation_steps=2, jit_compile="auto"):
    """A block (a nested functional model) whose layers add losses: activity and kernel
    regularizers, and `Penalized`'s `add_loss`."""
    keras.utils.set_random_seed(0)
    l2 = keras.regularizers.L2
    block_in = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False, kernel_regularizer=l2(0.1),
                            activity_regularizer=l2(0.01))(block_in)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = Penalized()(keras.layers.ReLU()(h))
    h = keras.layers.Conv2D(6, 3, padding="same", activity_regularizer=l2(0.01))(h)
    inputs = keras.Input((8, 8, 3))
    x = keras.Model(block_in, h, name="block")(inputs)
    x = keras.layers.Conv2D(4, 1, activity_regularizer=l2(0.01))(Penalized()(x))
    return _headed(inputs, x, rematerialize, accumulation_steps, jit_compile)


def model(rematerialize=None, accumulation_steps=2):
    keras.utils.set_random_seed(0)
    block_in = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same")(block_in)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = keras.layers.Dropout(0.3)(Counted()(h))
    block = keras.Model(block_in, h, name="block")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 1, name="pointwise")(block(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
    accum = tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps,
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


def chain(rematerialize=None, accumulation_steps=2, jit_compile="auto"):
    """A functional graph with no nested model: 3 residual blocks (conv → BatchNorm → Counted
    ReLU → Dropout → conv, added to their input), for segments cut in the graph itself."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", name="stem")(inputs)
    for i in range(3):
        h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False, name=f"conv{i}a")(x)
        h = keras.layers.BatchNormalization(momentum=0.5, name=f"bn{i}")(h)
        h = keras.layers.Dropout(0.3, name=f"drop{i}")(Counted(name=f"relu{i}")(h))
        h = keras.layers.Conv2D(6, 3, padding="same", name=f"conv{i}b")(h)
        x = keras.layers.Add(name=f"add{i}")([x, h])
    return _headed(inputs, x, rematerialize, accumulation_steps, jit_compile)


def dense(rematerialize=None, accumulation_steps=2, jit_compile="auto"):
    """A backbone (a nested functional model, as keras-hub's and keras.applications' are)
    of a stem and FC-DenseNet's `DenseBlock` (a subclassed layer: BatchNorm → ReLU → conv →
    Dropout, concatenated, 4 times), which "full" cuts inside, two levels down."""
    from tfmem.models.tiramisu import DenseBlock

    keras.utils.set_random_seed(0)
    image = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="stem")(image)
    backbone = keras.Model(image, DenseBlock(4, 6, dropout=0.2, name="dense")(x),
                           name="backbone")
    inputs = keras.Input((8, 8, 3))
    return _headed(inputs, backbone(inputs), rematerialize, accumulation_steps, jit_compile)


class Unseeded(keras.layers.Layer):
    """Adds noise drawn by Keras's `keras.random.normal` without a seed (from Keras's global
    seed generator, which each draw advances; TensorFlow only: JAX refuses it)."""

    def call(self, x, training=None):
        return x + keras.random.normal(keras.ops.shape(x), stddev=0.5) if training else x


class Generated(keras.layers.Layer):
    """Adds noise drawn by a `tf.random.Generator` of its own (a stateful read of its state,
    then a stateless draw); counts its training calls and keeps its last input's mean in
    TensorFlow variables (`assign_add`, `assign`)."""

    def __init__(self, **kwargs):
        import tensorflow as tf

        super().__init__(**kwargs)
        self.generator = tf.random.Generator.from_seed(7)
        self.calls, self.mean = tf.Variable(0.0), tf.Variable(0.0)

    def call(self, x, training=None):
        import tensorflow as tf

        if not training:
            return x
        self.calls.assign_add(1.0)
        self.mean.assign(tf.reduce_mean(x))
        return x + self.generator.normal(tf.shape(x), stddev=0.5)


class Masked(keras.layers.Layer):
    """Drops a third of its input with a mask drawn by TensorFlow's stateful
    `tf.random.uniform` (an op seed given, so that two models draw alike)."""

    def call(self, x, training=None):
        import tensorflow as tf

        if not training:
            return x
        return x * tf.cast(tf.random.uniform(tf.shape(x), seed=5) > 1 / 3, x.dtype)


def noisy(rematerialize=None, accumulation_steps=2, jit_compile="auto",
          draws=("Unseeded", "Generated", "Masked")):
    """Convolutions, each followed by a layer drawing random numbers with a stateful op (one
    of `draws`: `Unseeded`, `Generated`, `Masked`) and a ReLU: TensorFlow only."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    tf.random.set_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = inputs
    layers = {"Unseeded": Unseeded, "Generated": Generated, "Masked": Masked}
    for i, noise in enumerate(layers[name] for name in draws):
        x = keras.layers.Conv2D(6, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(noise(name=f"noise{i}")(x))
    return _headed(inputs, x, rematerialize, accumulation_steps, jit_compile)


def normalized(synchronized, rematerialize=None):
    """3 × (conv → BatchNorm → ReLU) and a head, as an AccumModel with k = 2 (SGD); the
    BatchNormalizations `synchronized` across replicas or not."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5)(hidden)
        hidden = keras.layers.ReLU()(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden))
    accum = tfmem.AccumModel(inputs, outputs, accumulation_steps=2, rematerialize=rematerialize)
    accum.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accum


def by_replica_micro_batches(rows, replicas=2, k=2):
    """The order of `rows` (a multiple of 16) in which one device's micro-batches of a batch
    of 16 are those that `replicas` replicas, each taking its part of the batch, normalize
    together: micro-batch 0 of rows 0-3 and 8-11, then 4-7 and 12-15."""
    per_replica = 16 // replicas
    micro = per_replica // k
    within = [replica * per_replica + i * micro + j
              for i in range(k) for replica in range(replicas) for j in range(micro)]
    return np.concatenate([start + np.array(within) for start in range(0, rows, 16)])


def _headed(inputs, x, rematerialize, accumulation_steps, jit_compile):
    """`x` pooled into a 3-class head, as a compiled AccumModel (SGD, cross-entropy)."""
    outputs = keras.layers.Dense(3, name="head")(
        keras.layers.GlobalAveragePooling2D(name="pool")(x))
    accum = tfmem.AccumModel(inputs, outputs, accumulation_steps=accumulation_steps,
                             rematerialize=rematerialize)
    accum.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return accum


def fitted(build, rematerialize=None, callbacks=(), **options):
    """`build(rematerialize)`'s model after one epoch of `data()` in batches of 16 (3 steps),
    and the epoch's loss."""
    accum = build(rematerialize, **options)
    history = accum.fit(*data(), batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return accum, history.history["loss"][-1]


class CountsFromTrainBegin(keras.callbacks.Callback):
    """Sets `Counted.calls` to 0 when the training begins: what the steps trace is counted, not
    the traces before them (the memory check's, which a process reuses for a model built
    alike)."""

    def on_train_begin(self, logs=None):
        Counted.calls = 0


class CompilesAfterTheFirstStep(keras.callbacks.Callback):
    """Counts the XLA compilations JAX makes in a fit's steps after its first (`count`; not
    those of the epoch's logs at its end)."""

    def __init__(self):
        import jax

        super().__init__()
        self.compiles, self.count = [], None
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles.append(duration)

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.compiles.clear()
        self.count = len(self.compiles)

    def on_train_end(self, logs=None):
        import jax

        jax.monitoring.unregister_event_duration_listener(self._heard)


def regularized_differences(rematerialize, plain=None):
    """`regularized`'s weights' relative differences after 3 steps with and without, and the
    epoch's loss without and with (`plain`: `fitted(regularized)`, if fitted)."""
    plain, plain_loss = fitted(regularized) if plain is None else plain
    accum, loss = fitted(regularized, rematerialize)
    return _differences(plain.get_weights(), accum.get_weights()), [plain_loss, loss]


def _differences(plain, recomputed):
    return [float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))
            for a, b in zip(plain, recomputed, strict=True)]


def jax_step_checkpoints(accum) -> int:
    """How many `jax.checkpoint`s (remat) the JAX train step of a fitted model traces."""
    import jax

    x, y = data()
    state = ([v.value for v in accum.trainable_variables],
             [v.value for v in accum.non_trainable_variables],
             [v.value for v in accum.optimizer.variables],
             [v.value for v in accum.metrics_variables])
    return str(jax.make_jaxpr(accum.train_step)(state, (x[:16], y[:16]))).count("remat")


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 8, 8, 3)).astype("float32"), np.arange(48) % 3


def trained(rematerialize):
    """Weights after 3 steps of 16 (k = 2), and how often the steps traced Counted's forward."""
    accum = model(rematerialize)
    x, y = data()
    accum.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[CountsFromTrainBegin()])
    return accum.get_weights(), Counted.calls


def relative_differences(rematerialize, plain=None):
    """Relative differences of `trained` weights with and without (`plain`, if trained)."""
    plain = trained(None)[0] if plain is None else plain
    return _differences(plain, trained(rematerialize)[0])


if __name__ == "__main__":
    initial = model().get_weights()
    plain, _ = trained(None)
    found = {
        "backend": keras.backend.backend(),
        "block": relative_differences(["block"], plain),
        "layers": relative_differences(["pointwise", "block"], plain),
        "changed": [bool(np.any(a != b)) for a, b in zip(initial, plain)],
        "checkpoints": {},
    }
    plains, compiles = {}, []
    for name, build in (("chain", chain), ("dense", dense)):
        plains[name] = fitted(build)[0].get_weights()
        if keras.backend.backend() == "jax":
            compiles.append(CompilesAfterTheFirstStep())
        accum, _ = fitted(build, "full", callbacks=compiles[-1:])
        differences = _differences(plains[name], accum.get_weights())
        found[f"{name} full"] = {"differences": differences,
                                 "segments": accum.rematerialized_segments}
        if keras.backend.backend() == "jax":  # each segment is one jax.checkpoint in the step
            found["checkpoints"][name] = [
                jax_step_checkpoints(accum),
                sum(len(ranges) for _, ranges in accum.rematerialized_segments)]
    plain_regularized = fitted(regularized)
    for setting in (["block"], "full"):  # the losses layers add inside a segment
        differences, losses = regularized_differences(setting, plain_regularized)
        found[f"regularized {setting}"] = {"differences": differences, "losses": losses}
    if keras.backend.backend() == "jax":  # planned: no saving on a CPU, one on a GPU
        from tfmem.memory.levers import levers_for
        from tfmem.memory.memory_plan import Term

        planned, unfitted = {}, {setting: chain(setting) for setting in (None, "full")}
        for device, where in (("cpu", dict(memory_budget=2**30)), ("gpu", dict(device="T4"))):
            plain_plan = tfmem.plan(unfitted[None], global_batch_size=16, **where)
            full_plan = tfmem.plan(unfitted["full"], global_batch_size=16, **where)
            planned[device] = {
                "kind": plain_plan.device_kind,
                # The activations row at the global batch, a sample's share (a GPU plan's
                # holds terms of small micro-batches too: `bounded_activations`).
                "activations": [plan.breakdown(16, 1)[Term.ACTIVATIONS] // 16
                                for plan in (plain_plan, full_plan)],
                "segments": sum(len(ranges) for _, ranges in full_plan.rematerialized),
                "notes": list(full_plan.notes),
                "levers": [lever.group for lever in levers_for(unfitted[None], plain_plan)]}
        found["planned"] = planned
    if keras.backend.backend() == "jax":  # then over every device (XLA_FLAGS may add some)
        found["replicas"] = tfmem.detect().num_replicas
        found["data_parallel"] = relative_differences(["block"])
        found["data_parallel full"] = _differences(
            *(fitted(chain, setting)[0].get_weights() for setting in (None, "full")))
    found["compiles after the first step"] = [callback.count for callback in compiles]
    print(json.dumps(found))
    sys.exit(0)
