"""AccumModel is a drop-in `keras.Model` (TensorFlow backend).

Each test trains, copies or saves an AccumModel and a plain Keras model (or `keras.Model`
subclass) the same way on the same data and compares what Keras users see: weights, logs,
`optimizer.iterations`, errors, TensorBoard summaries.
"""

import glob
import pathlib
import re

import keras
import numpy as np
import pytest
import scipy.sparse
import tensorflow as tf

import subclass_models
import tfmem

RTOL = 1e-5
# The memory check plans functional graphs; these tests are about the train step.
NO_PLAN = dict(check_memory=False)


def _rel_diff(weights, reference):
    return max(
        float(np.max(np.abs(np.asarray(w, np.float64) - r)) / max(np.max(np.abs(r)), 1e-12))
        for w, r in zip(weights, reference)
    )


def _fit(model, *args, **kwargs):
    extra = NO_PLAN if isinstance(model, tfmem.AccumModel) else {}
    return model.fit(*args, shuffle=False, verbose=0, **extra, **kwargs).history


def _regression(num, features=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, features)).astype("float32")
    return x, rng.normal(size=(num, 3)).astype("float32")


# --- subclassing -----------------------------------------------------------------------------

def _subclass(base, **kwargs):
    """A model written the Keras 3 way: layers in `__init__`, the forward pass in `call`."""

    class Net(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            init = keras.initializers.GlorotUniform
            self.hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=init(1))
            self.dropout = keras.layers.Dropout(0.0)
            self.head = keras.layers.Dense(3, kernel_initializer=init(2))

        def call(self, inputs, training=None):
            return self.head(self.dropout(self.hidden(inputs), training=training))

    return Net(**kwargs)


def _functional_accum(k=2):
    inputs = keras.Input((6,))
    return tfmem.AccumModel(inputs, keras.layers.Dense(3)(inputs), accumulation_steps=k)


@pytest.mark.parametrize("built", [False, True])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_subclass_trains_like_a_keras_model_subclass(run_eagerly, built):
    x, y = _regression(32)
    _functional_accum()  # a functional AccumModel exists in the process before and after
    models = [_subclass(tfmem.AccumModel, accumulation_steps=4), _subclass(keras.Model)]
    _functional_accum()
    histories = []
    for model in models:
        if built:
            model(x[:2])
        model.compile("adam", "mse", metrics=["mae"], run_eagerly=run_eagerly)
        histories.append(_fit(model, x, y, batch_size=16, epochs=2))
    accum, plain = models
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == 4
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=RTOL)
    np.testing.assert_allclose(histories[0]["mae"], histories[1]["mae"], rtol=RTOL)


def test_subclassing_and_functional_construction_in_any_order():
    first = _subclass(tfmem.AccumModel, accumulation_steps=2)
    functional = _functional_accum(4)

    class Functional(tfmem.AccumModel):  # a subclass built from inputs and outputs
        pass

    inputs = keras.Input((6,))
    custom = Functional(inputs, keras.layers.Dense(3)(inputs), accumulation_steps=2)
    again = _subclass(tfmem.AccumModel, accumulation_steps=3)
    assert [m.accumulation_steps for m in (first, functional, custom, again)] == [2, 4, 2, 3]
    assert all(isinstance(m, tfmem.AccumModel) for m in (first, functional, custom, again))
    # Subclassed models have no graph until called; functional ones have theirs.
    assert [len(m.layers) for m in (functional, custom)] == [2, 2]
    assert again.built is False and len(again.layers) == 3


def test_subclass_saves_and_loads_with_its_steps(tmp_path):
    @keras.saving.register_keras_serializable(package="tfmem_tests")
    class Saved(tfmem.AccumModel):
        def __init__(self, units=3, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.head = keras.layers.Dense(units)

        def call(self, inputs):
            return self.head(inputs)

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    x, y = _regression(16)
    model = Saved(units=3, accumulation_steps=4)
    model.compile("sgd", "mse")
    _fit(model, x, y, batch_size=16)
    model.save(tmp_path / "saved.keras")
    restored = keras.saving.load_model(tmp_path / "saved.keras")
    assert type(restored) is Saved and restored.accumulation_steps == 4
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0))


# --- subclasses as Keras users write them (tests/training/subclass_models.py) ---------------

@pytest.mark.parametrize("construction", ["positional", "keywords reversed", "mixed"])
def test_a_subclass_with_positional_sub_models_accumulates_exactly(construction):
    x, y = subclass_models.regression(8)
    Pair = subclass_models.pair_class(tfmem.AccumModel)
    encoder, decoder = subclass_models.sub_models()
    model = {
        "positional": lambda: Pair(encoder, decoder, accumulation_steps=2),
        "keywords reversed": lambda: Pair(decoder=decoder, accumulation_steps=2, encoder=encoder),
        "mixed": lambda: Pair(encoder, accumulation_steps=2, decoder=decoder),
    }[construction]()
    assert (model.encoder, model.decoder, model.accumulation_steps) == (encoder, decoder, 2)
    assert Pair.__bases__ == (tfmem.AccumModel,)  # a subclassed model, not made functional
    plain = subclass_models.pair_class(keras.Model)(*subclass_models.sub_models())
    reference = subclass_models.one_update(plain, x, y, loss="mse")
    update = subclass_models.one_update(model, x, y, loss="mse")
    assert subclass_models.relative_difference(update, reference) <= RTOL


def test_a_failed_construction_leaves_the_class_as_it_was():
    class Net(tfmem.AccumModel):  # no __init__ of its own: functional or subclassed
        def call(self, inputs):
            return inputs

    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(inputs)
    with pytest.raises(ValueError, match="must be KerasTensors"):  # Keras's own check
        Net(inputs, "not a tensor", accumulation_steps=2)
    with pytest.raises(ValueError, match="must be >= 1"):  # after Keras built the graph
        Net(inputs, outputs, accumulation_steps=0)
    assert Net.__bases__ == (tfmem.AccumModel,)
    subclassed = Net(accumulation_steps=2)
    assert not subclassed.built and subclassed.accumulation_steps == 2
    functional = Net(inputs, outputs, accumulation_steps=3)  # then functional for good
    assert len(functional.layers) == 2 and functional.accumulation_steps == 3

    Pair = subclass_models.pair_class(tfmem.AccumModel)
    with pytest.raises(ValueError, match="must be >= 1"):
        Pair(*subclass_models.sub_models(), accumulation_steps=0)
    assert Pair(*subclass_models.sub_models(), accumulation_steps=2).accumulation_steps == 2


def _own_step_class(base):
    """`Pair` with its own `train_step`, written as keras.io's VAE writes it."""

    class VAE(subclass_models.pair_class(base)):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            gradients = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply(gradients, self.trainable_weights)
            return {"loss": loss}

    return VAE


def test_a_subclass_with_its_own_train_step_is_refused_unless_it_does_not_accumulate():
    VAE = _own_step_class(tfmem.AccumModel)
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "accumulation.md").read_text()
    (documented,) = re.findall(r"^ValueError: (VAE overrides `train_step`.*)$", docs, re.M)
    for steps in (4, "auto"):
        with pytest.raises(ValueError) as raised:
            VAE(*subclass_models.sub_models(), accumulation_steps=steps)
        assert str(raised.value) == documented.replace("accumulation_steps=4 ",
                                                       f"accumulation_steps={steps!r} ")
    model = VAE(*subclass_models.sub_models())  # accumulation_steps=1: the user's step
    with pytest.raises(ValueError, match="VAE overrides `train_step`"):
        model.accumulation_steps = 2
    assert model.accumulation_steps == 1
    x, y = subclass_models.regression(8)
    plain = _own_step_class(keras.Model)(*subclass_models.sub_models())
    reference = subclass_models.one_update(plain, x, y)
    assert subclass_models.relative_difference(subclass_models.one_update(model, x, y),
                                               reference) <= RTOL


def test_a_subclass_with_its_own_compute_loss_accumulates_exactly():
    x, y = subclass_models.regression(8)
    plain = subclass_models.regularised_pair_class(keras.Model)(*subclass_models.sub_models())
    model = subclass_models.regularised_pair_class(tfmem.AccumModel)(
        *subclass_models.sub_models(), accumulation_steps=4)
    reference = subclass_models.one_update(plain, x, y)
    assert subclass_models.relative_difference(subclass_models.one_update(model, x, y),
                                               reference) <= RTOL


def test_a_subclass_with_positional_sub_models_saves_and_loads(tmp_path):
    Pair = keras.saving.register_keras_serializable(package="tfmem_tests", name="SavedPair")(
        subclass_models.pair_class(tfmem.AccumModel))
    x, y = subclass_models.regression(8)
    model = Pair(*subclass_models.sub_models(), accumulation_steps=2)
    subclass_models.one_update(model, x, y, loss="mse")
    model.save(tmp_path / "pair.keras")
    restored = keras.saving.load_model(tmp_path / "pair.keras")
    assert type(restored) is Pair and restored.accumulation_steps == 2
    assert Pair.__bases__ == (tfmem.AccumModel,)
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))


# --- the first step -------------------------------------------------------------------------

@pytest.mark.parametrize("data", ["arrays", "a repeated dataset"])
def test_no_variable_is_made_while_the_step_traces(data):
    """Without a strategy Keras makes the optimizer's and metrics' variables while the step
    traces, and TensorFlow then traces the step a second time and keeps both graphs; an
    AccumModel makes them before, from the data's shapes."""
    x, y = _regression(48)
    made_while_tracing = {}

    def recorded(owner):
        def creator(next_creator, **kwargs):
            if not tf.executing_eagerly():
                made_while_tracing.setdefault(owner, []).append(kwargs.get("name"))
            return next_creator(**kwargs)
        return creator

    models = {}
    for cls in (tfmem.AccumModel, keras.Model):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        kwargs = {"accumulation_steps": 2} if cls is tfmem.AccumModel else {}
        model = models[cls] = cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)
        model.compile("adam", "mse", metrics=["mae"])
        with tf.variable_creator_scope(recorded(cls)):
            if data == "arrays":
                _fit(model, x, y, batch_size=8, epochs=2)
            else:  # 6 batches, 4 an epoch
                batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
                _fit(model, batches, steps_per_epoch=4, epochs=2)
    assert tfmem.AccumModel not in made_while_tracing
    # What Keras does, for reference: Adam's slots are made while its step traces.
    assert any(name.endswith("_momentum") for name in made_while_tracing[keras.Model])
    accum, plain = models[tfmem.AccumModel], models[keras.Model]
    steps = 12 if data == "arrays" else 8
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == steps
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL


# --- clone_model -----------------------------------------------------------------------------

def test_clone_model_keeps_accumulation_steps():
    original = _functional_accum(4)
    clone = keras.models.clone_model(original)
    assert isinstance(clone, tfmem.AccumModel) and clone.accumulation_steps == 4
    assert type(clone) is type(original)
    assert all(a is not b for a, b in zip(clone.weights, original.weights))  # new weights
    shared = keras.models.clone_model(original, clone_function=lambda layer: layer)
    assert shared.accumulation_steps == 4 and shared.weights[0] is original.weights[0]
    original.compile("sgd", "mse")
    compiled = keras.models.clone_model(original)
    assert compiled.accumulation_steps == 4 and compiled.compiled
    auto = keras.models.clone_model(_functional_accum("auto"))
    assert auto.accumulation_steps == "auto"
    # A new model on an AccumModel's outputs takes its own (default) steps, not the inner one's.
    inputs = keras.Input((6,))
    assert tfmem.AccumModel(inputs, original(inputs)).accumulation_steps == 1
    assert tfmem.AccumModel(inputs, original(inputs), accumulation_steps=2).accumulation_steps == 2


def test_clone_trains_like_the_original():
    x, y = _regression(32)
    keras.utils.set_random_seed(3)
    original = _functional_accum(4)
    clone = keras.models.clone_model(original)
    clone.set_weights(original.get_weights())
    for model in (original, clone):
        model.compile("adam", "mse")
        _fit(model, x, y, batch_size=16)
    assert int(clone.optimizer.iterations) == 2
    np.testing.assert_array_equal(clone.get_weights()[0], original.get_weights()[0])


# --- sparse and ragged inputs ----------------------------------------------------------------

def _sparse_rows(num, features=6, seed=0):
    rng = np.random.default_rng(seed)
    dense = (rng.uniform(size=(num, features)) < 0.3) * rng.normal(size=(num, features))
    dense[4:8] = 0.0  # a micro-batch (of 4 rows) without any stored entry
    return dense.astype("float32"), rng.normal(size=(num, 3)).astype("float32")


def _sparse_model(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,), sparse=True)
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


@pytest.mark.parametrize(
    "kind,k", [("tf.SparseTensor", 2), ("scipy", 3), ("dataset", 4)]
)
def test_sparse_inputs_split_by_rows(kind, k):
    dense, y = _sparse_rows(48)
    if kind == "tf.SparseTensor":
        data = dict(x=tf.sparse.from_dense(dense), y=y, batch_size=12)
    elif kind == "scipy":
        data = dict(x=scipy.sparse.csr_matrix(dense), y=y, batch_size=12)
    else:  # rows not known when the step is traced
        pairs = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(dense), y))
        data = dict(x=pairs.batch(12))
    accum = _sparse_model(tfmem.AccumModel, accumulation_steps=k)
    plain = _sparse_model()
    histories = []
    for model in (accum, plain):
        model.compile("adam", "mse", metrics=["mae"])
        histories.append(_fit(model, **data))
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == 4
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=RTOL)
    np.testing.assert_allclose(histories[0]["mae"], histories[1]["mae"], rtol=RTOL)


class _RaggedMean(keras.layers.Layer):
    def call(self, inputs):
        return tf.reduce_mean(inputs, axis=1)


def _ragged_model(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((None,), ragged=True, dtype="int32")
    embedded = keras.layers.Embedding(10, 4)(inputs)
    return cls(inputs, keras.layers.Dense(3)(_RaggedMean()(embedded)), **kwargs)


@pytest.mark.parametrize("k,dataset", [(3, False), (4, True)])
def test_ragged_inputs_split_by_rows(k, dataset):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 6, 24)
    tokens = tf.RaggedTensor.from_row_lengths(
        rng.integers(0, 10, lengths.sum()).astype("int32"), lengths)
    y = rng.normal(size=(24, 3)).astype("float32")
    data = (dict(x=tf.data.Dataset.from_tensor_slices((tokens, y)).batch(12)) if dataset
            else dict(x=tokens, y=y, batch_size=12))
    accum, plain = _ragged_model(tfmem.AccumModel, accumulation_steps=k), _ragged_model()
    histories = []
    for model in (accum, plain):
        model.compile("sgd", "mse")
        histories.append(_fit(model, **data))
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL
    np.testing.assert_allclose(histories[0]["loss"], histories[1]["loss"], rtol=RTOL)


def _two_inputs(extra_shape):
    inputs = {"features": keras.Input((6,), name="features"),
              "extra": keras.Input(batch_shape=extra_shape, name="extra")}
    hidden = keras.layers.Dense(3)(inputs["features"])
    outputs = keras.layers.Lambda(lambda t: t[0] * keras.ops.mean(t[1]))([hidden, inputs["extra"]])
    return tfmem.AccumModel(inputs, outputs, accumulation_steps=4)


@pytest.mark.parametrize(
    "extra,error,match",
    [
        (tf.constant(2.0), ValueError, r"`x\['extra'\]` is a scalar"),
        (tf.ones((1, 6)), ValueError, r"`x\['extra'\]` has 1 rows and `y` has 8"),
    ],
)
def test_an_input_that_cannot_be_split_by_rows_is_named(extra, error, match):
    x, y = _regression(8)
    model = _two_inputs(tuple(extra.shape))
    model.compile("sgd", "mse")
    batch = ({"features": tf.constant(x), "extra": extra}, tf.constant(y))
    with pytest.raises(error, match=match):
        model.fit(tf.data.Dataset.from_tensors(batch), verbose=0, **NO_PLAN)


def test_an_input_with_other_rows_fails_the_step_naming_it():
    x, y = _regression(16)
    model = _two_inputs((None, 6))
    model.compile("sgd", "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).map(
        lambda f, t: ({"features": f, "extra": tf.ones((tf.shape(f)[0] // 8, 6))}, t))
    message = r"rows of `x\[.*extra.*\]` \(x below\) and `y`"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        model.fit(dataset, verbose=0, **NO_PLAN)
    assert int(model.optimizer.iterations) == 0


# --- missing inputs, failed steps --------------------------------------------------------------

def test_a_missing_input_raises_keras_error():
    _, y = _regression(16)
    errors = []
    for cls, kwargs in ((keras.Model, {}), (tfmem.AccumModel, dict(accumulation_steps=2))):
        inputs = keras.Input((6,))
        model = cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)
        model.compile("sgd", "mse")
        with pytest.raises(ValueError, match="is not optional, but None was passed") as raised:
            _fit(model, [None], y, batch_size=16)
        errors.append(raised.value)
        assert int(model.optimizer.iterations) == 0
    assert type(errors[0]) is type(errors[1])


class _Snapshot(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.weights = [np.array(w) for w in self.model.get_weights()]
        self.iterations = int(self.model.optimizer.iterations)


def test_a_failed_partial_last_batch_changes_nothing():
    x, y = _regression(18)  # batches of 8, 8, then 2: 2 % 4 != 0
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = tfmem.AccumModel(inputs, keras.layers.Dense(3)(hidden), accumulation_steps=4)
    model.compile("adam", "mse", metrics=["mae"])
    snapshot = _Snapshot()
    with pytest.raises(tf.errors.InvalidArgumentError, match="drop_remainder=True"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[snapshot], **NO_PLAN)
    assert snapshot.iterations == int(model.optimizer.iterations) == 2
    for after, before in zip(model.get_weights(), snapshot.weights):  # BN statistics included
        np.testing.assert_array_equal(after, before)


# --- frozen statistics, float64 ----------------------------------------------------------------

def _frozen_bn_model(base=keras.Model, frozen="trainable", **kwargs):
    """A model whose BatchNormalization is frozen (`trainable=False`) or called with
    `training=False` (which a subclass's `call` can do; a functional graph's call is overridden
    by `fit`'s training mode)."""
    keras.utils.set_random_seed(6)

    class Net(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            init = keras.initializers.Orthogonal
            self.hidden = keras.layers.Dense(64, kernel_initializer=init(seed=1))
            self.bn = keras.layers.BatchNormalization()
            self.bn.trainable = frozen != "trainable"
            self.head = keras.layers.Dense(3, kernel_initializer=init(seed=2))

        def call(self, inputs, training=None):
            hidden = self.hidden(inputs)
            return self.head(self.bn(hidden, training=False if frozen == "inference" else training))

    model = Net(**kwargs)
    model(np.zeros((1, 6), "float32"))
    rng = np.random.default_rng(7)
    model.bn.moving_mean.assign(rng.normal(size=64).astype("float32"))
    model.bn.moving_variance.assign(rng.uniform(0.1, 3.0, size=64).astype("float32"))
    return model, model.bn


@pytest.mark.parametrize("k", [3, 6])
@pytest.mark.parametrize("frozen", ["trainable", "inference"])
def test_frozen_batch_norm_statistics_keep_their_bits(k, frozen):
    x, y = _regression(24)
    (accum, accum_bn), (plain, plain_bn) = (
        _frozen_bn_model(tfmem.AccumModel, frozen, accumulation_steps=k),
        _frozen_bn_model(frozen=frozen))
    start = [np.asarray(v).copy() for v in accum_bn.non_trainable_variables]
    for model in (accum, plain):
        model.compile("sgd", "mse")
        _fit(model, x, y, batch_size=12, epochs=2)
    for mine, reference, initial in zip(accum_bn.non_trainable_variables,
                                        plain_bn.non_trainable_variables, start):
        assert np.asarray(mine).tobytes() == np.asarray(reference).tobytes() == initial.tobytes()
    assert _rel_diff(accum.get_weights(), plain.get_weights()) <= RTOL


@pytest.fixture
def float64_policy():
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_dtype_policy("float32")


def test_float64_model_accumulates_in_float64(float64_policy):
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(32, 6)), rng.normal(size=(32, 3))
    models, initial = [], None
    for cls, kwargs in ((tfmem.AccumModel, dict(accumulation_steps=4)), (keras.Model, {})):
        keras.utils.set_random_seed(9)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        models.append(cls(inputs, keras.layers.Dense(3)(hidden), **kwargs))
        initial = models[-1].get_weights()
    for model in models:
        assert all(v.dtype == "float64" for v in model.trainable_variables)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        _fit(model, x, y, batch_size=16)
    updates = [[w - w0 for w, w0 in zip(m.get_weights(), initial)] for m in models]
    # Sums in float32 would agree to ~1e-7 only.
    assert _rel_diff(updates[0], updates[1]) <= 1e-12


# --- TensorBoard -------------------------------------------------------------------------------

def _keras_summaries(log_dir) -> list[str]:
    """The model configurations TensorBoard's `keras` summary holds, from the event files."""
    configs = []
    for path in glob.glob(str(log_dir / "train" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "keras":
                    configs.append(tf.make_ndarray(value.tensor).item().decode())
    return configs


@pytest.mark.parametrize("form", ["functional", "subclass"])
def test_tensorboard_writes_the_keras_model_summary_as_for_keras(tmp_path, form):
    x, y = _regression(16)
    written = {}
    for name, cls, kwargs in (("accum", tfmem.AccumModel, dict(accumulation_steps=2)),
                              ("plain", keras.Model, {})):
        if form == "functional":
            inputs = keras.Input((6,))
            model = cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)
        else:
            model = _subclass(cls, **kwargs)
        model.compile("sgd", "mse")
        callback = keras.callbacks.TensorBoard(tmp_path / name, write_graph=True)
        _fit(model, x, y, batch_size=8, callbacks=[callback])
        written[name] = _keras_summaries(tmp_path / name)
    # Keras writes the summary for functional models only.
    assert len(written["accum"]) == len(written["plain"]) == (1 if form == "functional" else 0)
    if form == "functional":
        assert '"accumulation_steps": 2' in written["accum"][0]
