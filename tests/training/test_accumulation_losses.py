"""AccumModel's step is keras.Model's whole-batch step for every loss reduction Keras has
(TensorFlow; the same cases on JAX: test_accumulation_jax.py). Cases: `loss_cases.py`."""

import warnings

import keras
import numpy as np
import pytest

import tfmem
from tests.training import loss_cases

# float32 exactness budget: relative to the size of the update.
RTOL = 1e-5


def _assert_whole_batch_step(result, metrics=()):
    assert result["finite"]
    assert result["update"] <= RTOL
    history, plain = result["history"], result["plain_history"]
    for name in ("loss", *metrics):
        np.testing.assert_allclose(history[name], plain[name], rtol=RTOL, err_msg=name)


@pytest.mark.parametrize("name", [name for name in loss_cases.CASES if name != "scalar_loss"])
def test_one_step_is_the_whole_batch_step(name):
    result = loss_cases.run(name)
    metrics = [key for key in result["plain_history"] if key != "loss"]
    _assert_whole_batch_step(result, metrics)  # per-output losses, MeanIoU, masked accuracy
    assert result["warnings"] == []


def test_a_none_reduction_trains_on_the_sum_and_logs_the_mean():
    # Keras on TensorFlow trains a "none" loss on the gradient of its sum (JAX refuses it).
    result = loss_cases.run("sample_weight:none")
    _assert_whole_batch_step(result)


@pytest.mark.parametrize("name,mode", [("two_outputs", "run_eagerly"),
                                       ("add_loss", "run_eagerly"), ("add_loss", "jit_compile"),
                                       ("two_outputs", "rematerialize")])
def test_masked_groups_in_every_kind_of_step(name, mode):
    # add_loss: two gradient groups (the regularisers' and the masked loss's); two_outputs:
    # two counted outputs with loss weights.
    setting = {"rematerialize": ["hidden"]} if mode == "rematerialize" else {mode: True}
    result = loss_cases.run(name, **setting)
    _assert_whole_batch_step(result, [k for k in result["plain_history"] if k != "loss"])


def test_masked_losses_under_mirrored_strategy_match_keras_there(two_cpu_strategy):
    # Keras divides by each replica's valid count (and by the replicas); so does AccumModel.
    result = loss_cases.run("add_loss", accumulation_steps=2, strategy=two_cpu_strategy)
    _assert_whole_batch_step(result)


def test_a_loss_returning_a_scalar_is_averaged_with_one_warning():
    result = loss_cases.run("scalar_loss")
    assert len(result["warnings"]) == 1
    assert "'_scalar_mean_square'" in result["warnings"][0]
    assert "averages the 4 values" in result["warnings"][0]
    _assert_whole_batch_step(result)  # unmasked: the mean of equal micro-batches is exact


@pytest.mark.parametrize("name", ["ignore_class", "mask_zero"])
def test_keras_own_accumulation_is_not_the_whole_batch_step(name):
    # What docs/accumulation.md says: Keras's `gradient_accumulation_steps` averages the
    # micro-batch means, so a micro-batch with few valid elements weighs as much as a full one.
    result = loss_cases.run(name, keras_accumulation=True)
    assert result["update"] > 0.1


def test_an_overridden_compute_loss_is_averaged_with_one_warning():
    class Net(tfmem.AccumModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.square(y_pred - y))

    class Plain(keras.Model):
        compute_loss = Net.compute_loss

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    models = []
    for cls in (Net, Plain):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        kwargs = {"accumulation_steps": 4} if cls is Net else {}
        models.append(cls(inputs, keras.layers.Dense(2)(inputs), **kwargs))
        models[-1].compile(keras.optimizers.SGD(0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model in models:
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if "AccumModel:" in str(w.message)]
    assert len(messages) == 1 and "Net overrides `compute_loss`" in messages[0]
    np.testing.assert_allclose(models[0].get_weights()[0], models[1].get_weights()[0],
                               rtol=1e-5)
