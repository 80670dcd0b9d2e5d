"""AccumModel is a drop-in `keras.Model` on the Keras JAX backend (a subprocess, see
test_accumulation_jax): `jax_cases/dropin_cases.py` trains each case with an AccumModel and a plain
Keras model the same way and prints the numbers asserted here.
"""

import pytest
from test_accumulation_jax import _Case


@pytest.fixture(scope="module")
def dropin():
    case = _Case("dropin_cases", num_devices=1)
    try:
        yield case.results()
    finally:
        case.stop()


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_subclass_trains_like_a_keras_model_subclass(dropin, mode):
    result = dropin["subclassing"][mode]
    assert result["iterations"] == [4, 4]
    assert result["weights"] <= 1e-5
    accum, plain = result["losses"]
    assert accum == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("k", ["2", "4"])
def test_sparse_inputs_split_by_rows(dropin, k):
    result = dropin["sparse"][k]
    assert result["iterations"] == [2, 2]
    assert result["weights"] <= 1e-5
    accum, plain = result["losses"]
    assert accum == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("k", ["3", "6"])
def test_frozen_batch_norm_statistics_keep_their_bits(dropin, k):
    result = dropin["frozen_statistics"][k]
    assert result["accum"]["unchanged"] and result["plain"]["unchanged"]
    assert result["weights"] <= 1e-5


def test_a_partial_batch_fails_before_any_update(dropin):
    result = dropin["partial_last_batch"]
    assert result["raised"].startswith(
        "`global_batch_size` (2) must be divisible by replicas × accumulation_steps (1 × 4 = "
        "4). Try 4. If this is the last batch of an epoch, batch the data with "
        "`drop_remainder=True`.")
    assert result["iterations"] == 1  # the full batch before it
    assert result["change"] == 0.0


def test_a_missing_input_raises_keras_error(dropin):
    accum, plain = dropin["missing_input"]["accum"], dropin["missing_input"]["plain"]
    assert accum[0] == plain[0] == "ValueError"
    assert "is not optional, but None was passed" in accum[1]
    assert accum[2] == plain[2] == 0


def test_an_input_that_cannot_be_split_by_rows_is_named(dropin):
    message = dropin["unsplittable_input"]
    assert "so all need the same number of rows" in message
    assert "Give `x['extra']` one row per sample" in message


def test_clone_model_keeps_accumulation_steps(dropin):
    assert dropin["clone"]["steps"] == 4


def test_float64_model_accumulates_in_float64(dropin):
    result = dropin["float64"]
    assert result["dtypes"] == ["float64"]
    assert result["update"] <= 1e-12  # sums in float32 would agree to ~1e-7 only


def test_subclasses_as_keras_users_write_them(dropin):
    """tests/training/subclass_models.py on JAX (the TensorFlow tests: test_accumulation_dropin)."""
    result = dropin["subclasses"]
    assert result["positional"] <= 1e-5  # Pair(encoder, decoder, accumulation_steps=2)
    assert result["bases"] == ["AccumModel"]  # a subclassed model, not made functional
    assert result["compute_loss"] <= 1e-5  # its own compute_loss, at k = 4
    assert result["train_step refused"].startswith(
        "OwnStep overrides `train_step`, which replaces AccumModel's step that splits each "
        "batch into micro-batches: accumulation_steps=2 would not be applied.")
    assert result["train_step at 1"] <= 1e-5
    assert result["train_step traced"] == ["OwnStep"]
