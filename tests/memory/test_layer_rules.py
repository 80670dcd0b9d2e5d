"""Every rule of `layer_rules` equals what the framework's own gradient keeps for that layer."""

import keras
import pytest

from tfmem.memory import layer_rules
from tfmem.memory.saved_tensors import saved_tensors, traced_saved_tensors

L = keras.layers
ACTIVATIONS = sorted(layer_rules._KEEPS_OUTPUT | layer_rules._KEEPS_INPUT | {"linear"})


def _image(make_layer):
    """Input → a trainable 1×1 conv (so a gradient reaches the layer) → the layer."""
    def build():
        inputs = keras.Input((6, 6, 4))
        x = L.Conv2D(4, 1)(inputs)
        return keras.Model(inputs, make_layer()(x))
    return build


def _merge(make_layer):
    def build():
        inputs = keras.Input((6, 6, 4))
        a = L.Conv2D(4, 1)(inputs)
        b = L.Conv2D(4, 1, activation="tanh")(a)
        return keras.Model(inputs, make_layer()([a, b]))
    return build


def _vector(make_layer):
    def build():
        inputs = keras.Input((8,))
        return keras.Model(inputs, make_layer()(L.Dense(8)(inputs)))
    return build


def _sequence(make_layer):
    def build():
        inputs = keras.Input((6, 4))
        return keras.Model(inputs, make_layer()(L.Conv1D(4, 1)(inputs)))
    return build


CASES = {
    **{f"Conv2D-{name}": _image(lambda name=name: L.Conv2D(4, 3, padding="same",
                                                           activation=name))
       for name in ACTIVATIONS},
    **{f"Activation-{name}": _image(lambda name=name: L.Activation(name))
       for name in ACTIVATIONS},
    **{f"Dense-{name}": _vector(lambda name=name: L.Dense(8, activation=name))
       for name in ("relu", "sigmoid", "softmax", "silu")},
    "DepthwiseConv2D": _image(lambda: L.DepthwiseConv2D(3, padding="same")),
    "SeparableConv2D": _image(lambda: L.SeparableConv2D(4, 3, padding="same",
                                                        activation="relu")),
    "Conv2DTranspose": _image(lambda: L.Conv2DTranspose(4, 3, strides=2)),
    "EinsumDense": _vector(lambda: L.EinsumDense("ab,bc->ac", output_shape=8)),
    "BatchNormalization": _image(L.BatchNormalization),
    "ReLU": _image(L.ReLU), "ELU": _image(L.ELU), "Softmax": _image(L.Softmax),
    "LeakyReLU": _image(L.LeakyReLU), "MaxPooling2D": _image(L.MaxPooling2D),
    "GlobalAveragePooling2D": _image(L.GlobalAveragePooling2D),
    "UpSampling2D-nearest": _image(L.UpSampling2D),
    "UpSampling2D-bilinear": _image(lambda: L.UpSampling2D(interpolation="bilinear")),
    "Dropout": _image(lambda: L.Dropout(0.5)),
    "ZeroPadding2D": _image(L.ZeroPadding2D), "Cropping2D": _image(L.Cropping2D),
    "Rescaling": _image(lambda: L.Rescaling(0.5)), "Reshape": _image(lambda: L.Reshape((36, 4))),
    "Flatten": _image(L.Flatten), "Permute": _image(lambda: L.Permute((3, 1, 2))),
    "Identity": _image(L.Identity), "RepeatVector": _vector(lambda: L.RepeatVector(3)),
    "Add": _merge(L.Add), "Subtract": _merge(L.Subtract), "Concatenate": _merge(L.Concatenate),
    "Conv1D": _sequence(lambda: L.Conv1D(4, 3, activation="relu")),
    "Conv1DTranspose": _sequence(lambda: L.Conv1DTranspose(4, 3)),
    "DepthwiseConv1D": _sequence(lambda: L.DepthwiseConv1D(3)),
    "SeparableConv1D": _sequence(lambda: L.SeparableConv1D(4, 3, activation="sigmoid")),
    "MaxPooling1D": _sequence(L.MaxPooling1D),
    "GlobalAveragePooling1D": _sequence(L.GlobalAveragePooling1D),
    "ZeroPadding1D": _sequence(L.ZeroPadding1D), "Cropping1D": _sequence(L.Cropping1D),
}


# Mixed precision on a few layers of each kind (casts, float32 upcasts, shared inputs).
MIXED = ("Conv2D-relu", "BatchNormalization", "Add", "MaxPooling2D", "Dense-silu")


@pytest.mark.parametrize("case, precision", [(case, "float32") for case in sorted(CASES)]
                         + [(case, "mixed_float16") for case in MIXED])
def test_rule_equals_the_traced_gradient(case, precision):
    keras.mixed_precision.set_global_policy(precision)
    try:
        model = CASES[case]()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    walked = saved_tensors(model)
    assert not walked.traced_calls, f"no rule fired: {walked.traced_calls}"
    assert walked.saved_bytes == traced_saved_tensors(model).saved_bytes
