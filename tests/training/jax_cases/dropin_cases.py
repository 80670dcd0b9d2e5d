"""AccumModel as a drop-in keras.Model on the JAX backend: prints the numbers the tests assert.

Run by tests/training/test_accumulation_dropin_jax.py with KERAS_BACKEND=jax (set by `common`).
Every case trains an AccumModel and a plain Keras model the same way on the same data.
"""

import common  # noqa: F401  (fixes the backend first)
import jax
import keras
import numpy as np
import scipy.sparse
import subclass_models
from common import emit, relative_difference

from tfmem import AccumModel

NO_PLAN = dict(check_memory=False)  # the memory check plans functional graphs only


def fit(model, *args, **kwargs):
    extra = NO_PLAN if isinstance(model, AccumModel) else {}
    return model.fit(*args, shuffle=False, verbose=0, **extra, **kwargs).history


def regression(num, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(num, 6)).astype("float32"), rng.normal(size=(num, 3)).astype("float32")


def subclass(base, frozen_bn=False, **kwargs):
    class Net(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            init = keras.initializers.Orthogonal
            self.hidden = keras.layers.Dense(16, kernel_initializer=init(seed=1))
            self.bn = keras.layers.BatchNormalization() if frozen_bn else None
            self.head = keras.layers.Dense(3, kernel_initializer=init(seed=2))

        def call(self, inputs, training=None):
            hidden = self.hidden(inputs)
            if self.bn is not None:
                hidden = self.bn(hidden, training=training)
            return self.head(keras.ops.tanh(hidden))

    return Net(**kwargs)


def functional_accum(k=2):
    inputs = keras.Input((6,))
    return AccumModel(inputs, keras.layers.Dense(3)(inputs), accumulation_steps=k)


def subclassing(run_eagerly):
    """Net(AccumModel) next to functional AccumModels vs Net(keras.Model), unbuilt."""
    x, y = regression(32)
    functional_accum()
    models = [subclass(AccumModel, accumulation_steps=4), subclass(keras.Model)]
    functional_accum()
    losses = []
    for model in models:
        model.compile("adam", "mse", run_eagerly=run_eagerly)
        losses.append(fit(model, x, y, batch_size=16, epochs=2)["loss"])
    accum, plain = models
    return {
        "weights": relative_difference(plain.get_weights(), accum.get_weights()),
        "losses": losses,
        "iterations": [int(m.optimizer.iterations) for m in models],
    }


def sparse(k):
    """keras.Input(sparse=True) fed scipy CSR rows (BCOO batches); one micro-batch is empty."""
    rng = np.random.default_rng(3)
    dense = (rng.uniform(size=(24, 6)) < 0.3) * rng.normal(size=(24, 6))
    dense[:4] = 0.0
    x = scipy.sparse.csr_matrix(dense.astype("float32"))
    y = rng.normal(size=(24, 3)).astype("float32")
    models, losses = [], []
    for cls, kwargs in ((AccumModel, dict(accumulation_steps=k)), (keras.Model, {})):
        keras.utils.set_random_seed(4)
        inputs = keras.Input((6,), sparse=True)
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)
        model.compile("adam", "mse")
        losses.append(fit(model, x, y, batch_size=12)["loss"])
        models.append(model)
    return {
        "weights": relative_difference(models[1].get_weights(), models[0].get_weights()),
        "losses": losses,
        "iterations": [int(m.optimizer.iterations) for m in models],
    }


def frozen_statistics(k):
    """A BatchNormalization with trainable=False keeps its statistics' bits at k = 3 or 6."""
    x, y = regression(24)
    results = {}
    for name, base, kwargs in (("accum", AccumModel, dict(accumulation_steps=k)),
                               ("plain", keras.Model, {})):
        model = subclass(base, frozen_bn=True, **kwargs)
        model(x[:1])
        model.bn.trainable = False
        rng = np.random.default_rng(7)
        model.bn.moving_mean.assign(rng.normal(size=16).astype("float32"))
        model.bn.moving_variance.assign(rng.uniform(0.1, 3.0, size=16).astype("float32"))
        start = [np.asarray(v).tobytes().hex() for v in model.bn.non_trainable_variables]
        model.compile("sgd", "mse")
        fit(model, x, y, batch_size=12, epochs=2)
        after = [np.asarray(v).tobytes().hex() for v in model.bn.non_trainable_variables]
        results[name] = {"unchanged": after == start, "weights": model.get_weights()}
    results["weights"] = relative_difference(
        results["plain"].pop("weights"), results["accum"].pop("weights"))
    return results


def partial_last_batch():
    """At k = 4 a batch of 8 rows updates once; a partial batch of 2 fails before any update."""
    x, y = regression(10)
    model = functional_accum(4)
    model.compile("adam", "mse")
    model.train_on_batch(x[:8], y[:8])
    before = model.get_weights()
    try:
        model.train_on_batch(x[8:], y[8:])
        raised = None
    except ValueError as error:
        raised = str(error)
    return {
        "raised": raised,
        "iterations": int(model.optimizer.iterations),
        "change": relative_difference(before, model.get_weights()),
    }


def missing_input():
    """fit([None], y): the error plain Keras raises, from both."""
    _, y = regression(16)
    errors = {}
    for name, cls, kwargs in (("accum", AccumModel, dict(accumulation_steps=2)),
                              ("plain", keras.Model, {})):
        inputs = keras.Input((6,))
        model = cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)
        model.compile("sgd", "mse")
        try:
            fit(model, [None], y, batch_size=16)
            errors[name] = [None, "", int(model.optimizer.iterations)]
        except Exception as error:  # the type is what is compared
            errors[name] = [type(error).__name__, str(error), int(model.optimizer.iterations)]
    return errors


def unsplittable_input():
    """An input with 4 rows in a batch of 16 would split into micro-batches of 1 row: an error."""
    x, y = regression(16)
    inputs = {"features": keras.Input((6,), name="features"),
              "extra": keras.Input(batch_shape=(4, 6), name="extra")}
    hidden = keras.layers.Dense(3)(inputs["features"])
    outputs = keras.layers.Lambda(lambda t: t[0] * keras.ops.mean(t[1]))([hidden, inputs["extra"]])
    model = AccumModel(inputs, outputs, accumulation_steps=4)
    model.compile("sgd", "mse")
    try:
        model.train_on_batch({"features": x, "extra": np.ones((4, 6), "float32")}, y)
    except ValueError as error:
        return str(error)
    return None


def clone():
    original = functional_accum(4)
    return {"steps": keras.models.clone_model(original).accumulation_steps}


def subclasses():
    """The subclasses of tests/training/subclass_models.py: one SGD update of each against the
    same class on keras.Model on the whole batch; a `train_step` of its own (here one that calls
    AccumModel's) is refused at k > 1 and runs at k = 1."""
    models = subclass_models
    x, y = models.regression(8)
    traced = []

    class OwnStep(models.pair_class(AccumModel)):
        def train_step(self, state, data):
            traced.append(type(self).__name__)  # the user's step runs
            return super().train_step(state, data)

    try:
        OwnStep(*models.sub_models(), accumulation_steps=2)
        refused = None
    except ValueError as error:
        refused = str(error)
    reference = models.one_update(models.pair_class(keras.Model)(*models.sub_models()), x, y,
                                  loss="mse")
    regularised = models.one_update(
        models.regularised_pair_class(keras.Model)(*models.sub_models()), x, y)
    Pair = models.pair_class(AccumModel)
    runs = {
        "positional": (Pair(*models.sub_models(), accumulation_steps=2), reference, "mse"),
        "compute_loss": (models.regularised_pair_class(AccumModel)(
            *models.sub_models(), accumulation_steps=4), regularised, None),
        "train_step at 1": (OwnStep(*models.sub_models()), reference, "mse"),
    }
    result = {name: models.relative_difference(models.one_update(model, x, y, loss=loss), want)
              for name, (model, want, loss) in runs.items()}
    return {**result, "train_step refused": refused, "train_step traced": traced,
            "bases": [base.__name__ for base in Pair.__bases__]}


def float64():
    """float64 weights (JAX needs x64) accumulate in float64: the update equals plain Keras's."""
    jax.config.update("jax_enable_x64", True)
    keras.config.set_dtype_policy("float64")
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(32, 6)), rng.normal(size=(32, 3))
    models, initial = [], None
    for cls, kwargs in ((AccumModel, dict(accumulation_steps=4)), (keras.Model, {})):
        keras.utils.set_random_seed(9)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        models.append(cls(inputs, keras.layers.Dense(3)(hidden), **kwargs))
        initial = models[-1].get_weights()
        models[-1].compile(keras.optimizers.SGD(0.1), "mse")
        fit(models[-1], x, y, batch_size=16)
    updates = [[w - w0 for w, w0 in zip(m.get_weights(), initial)] for m in models]
    return {
        "dtypes": sorted({str(np.asarray(v).dtype) for m in models for v in m.trainable_variables}),
        "update": relative_difference(updates[1], updates[0]),
    }


emit(
    {
        "subclassing": {"graph": subclassing(False), "eager": subclassing(True)},
        "sparse": {"2": sparse(2), "4": sparse(4)},
        "frozen_statistics": {"3": frozen_statistics(3), "6": frozen_statistics(6)},
        "partial_last_batch": partial_last_batch(),
        "missing_input": missing_input(),
        "unsplittable_input": unsplittable_input(),
        "clone": clone(),
        "subclasses": subclasses(),
        "float64": float64(),  # last: it turns on JAX's float64 for the whole process
    }
)
