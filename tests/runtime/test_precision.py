"""The precision policy: the choice per device, and setting it with a one-line explanation;
the dtype (and bytes) of an accumulated sum."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.runtime.precision import accumulator_dtype, accumulator_nbytes
from tfmem.runtime.runtime import Runtime


@pytest.fixture(autouse=True)
def restore_global_policy():
    before = keras.mixed_precision.global_policy().name
    yield
    keras.mixed_precision.set_global_policy(before)


def _gpu(name, capability):
    return Runtime("gpu", None, 1, device_name=name, compute_capability=capability)


@pytest.mark.parametrize(
    "runtime, cpu_bfloat16, expected",
    [
        (Runtime("tpu", None, 8, device_name="TPU v3-8"), False, "mixed_bfloat16"),
        (_gpu("Tesla V100-SXM2-16GB", (7, 0)), False, "mixed_float16"),
        (_gpu("Tesla T4", (7, 5)), False, "mixed_float16"),
        (_gpu("NVIDIA H100 80GB HBM3", (9, 0)), False, "mixed_float16"),
        (_gpu("Tesla P100-PCIE-16GB", (6, 0)), False, "float32"),
        (_gpu("Tesla K80", (3, 7)), False, "float32"),
        (_gpu("unknown", None), False, "float32"),
        (Runtime("cpu", None, 1), False, "float32"),
        (Runtime("cpu", None, 1), True, "mixed_bfloat16"),
        (_gpu("Tesla T4", (7, 5)), True, "mixed_float16"),  # cpu_bfloat16 only affects CPUs
    ],
)
def test_policy_for(runtime, cpu_bfloat16, expected):
    assert tfmem.policy_for(runtime, cpu_bfloat16=cpu_bfloat16) == expected


def test_policy_for_does_not_change_the_global_policy():
    tfmem.policy_for(Runtime("tpu", None, 8))
    assert keras.mixed_precision.global_policy().name == "float32"


def test_set_policy_sets_keras_policy_and_logs_one_line_why(caplog):
    with caplog.at_level(logging.INFO, logger="tfmem.runtime.precision"):
        assert tfmem.set_policy(_gpu("Tesla T4", (7, 5))) == "mixed_float16"
    assert [record.getMessage() for record in caplog.records] == [
        "precision policy mixed_float16: Tesla T4 has compute capability 7.5 >= 7.0 "
        "(float16 tensor cores)."
    ]
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert (layer.compute_dtype, layer.variable_dtype) == ("float16", "float32")


def test_bfloat16_on_cpu_when_asked_really_computes_in_bfloat16(caplog):
    runtime = tfmem.detect(prefer="cpu")
    with caplog.at_level(logging.INFO, logger="tfmem.runtime.precision"):
        assert tfmem.set_policy(runtime, cpu_bfloat16=True) == "mixed_bfloat16"
    assert "bfloat16 on CPU was asked for" in caplog.records[0].getMessage()
    layer = keras.layers.Dense(2, kernel_initializer="ones")
    outputs = layer(tf.constant([[1.0, 2.0, 3.0]]))
    assert outputs.dtype == tf.bfloat16
    assert outputs.numpy().astype("float32").tolist() == [[6.0, 6.0]]


def test_explicit_policy_and_argument_errors(caplog):
    with caplog.at_level(logging.INFO, logger="tfmem.runtime.precision"):
        assert tfmem.set_policy(policy="mixed_bfloat16") == "mixed_bfloat16"
    assert [record.getMessage() for record in caplog.records] == [
        "precision policy mixed_bfloat16: asked for explicitly."
    ]
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    with pytest.raises(ValueError, match=r"`policy` must be one of .*got 'fp16'"):
        tfmem.set_policy(policy="fp16")
    with pytest.raises(TypeError, match="needs exactly one of `runtime`"):
        tfmem.set_policy()
    with pytest.raises(TypeError, match="needs exactly one of `runtime`"):
        tfmem.set_policy(Runtime("cpu", None, 1), policy="float32")


@pytest.mark.parametrize("dtype, expected", [
    ("float16", "float32"), ("bfloat16", "float32"), ("float32", "float32"),
    ("float64", "float64"), (np.dtype("float16"), "float32"), (np.dtype("float64"), "float64"),
])
def test_sums_are_float32_or_wider(dtype, expected):
    assert accumulator_dtype(dtype) == expected


def test_accumulator_bytes_are_those_of_the_sum():
    # 3 × 4 elements: 4 bytes each below float64, 8 for float64.
    assert accumulator_nbytes((3, 4), "bfloat16") == 48
    assert accumulator_nbytes((3, 4), "float32") == 48
    assert accumulator_nbytes((3, 4), "float64") == 96
    assert accumulator_nbytes((), "float16") == 4
