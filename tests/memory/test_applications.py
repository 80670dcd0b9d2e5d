"""The planner sizes every `keras.applications` family (plan only, at a small valid size).

One model of each family (each Keras module) is planned: the others in it are the same code
with other depths and widths, the same layer kinds in other numbers. Models are built inside
`tfmem.models.shapes_only()`: their weights are never initialised, which the planner does not
need (it reads shapes).
"""

import functools
import math

import keras
import numpy as np
import pytest

import tfmem
from tfmem.memory.saved_tensors import traced_saved_tensors

GIB = 2**30
NAMES = sorted(name for name in dir(keras.applications) if name[0].isupper())
# The smallest input each accepts where it is above 32 × 32.
SMALLEST = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}


# The smallest model of each family.
PLANNED = ("ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "EfficientNetV2B0",
           "InceptionResNetV2", "InceptionV3", "MobileNet", "MobileNetV2", "MobileNetV3Small",
           "NASNetMobile", "ResNet50", "ResNet50V2", "VGG16", "VGG19", "Xception")


def _family(name):
    return getattr(keras.applications, name).__module__


@functools.cache
def _build(name):
    size = SMALLEST.get(name, 32)
    with tfmem.models.shapes_only():
        return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3))


def test_the_list_is_every_application_and_one_of_each_family_is_planned():
    assert len(NAMES) >= 40 and {"ConvNeXtTiny", "MobileNetV3Small", "NASNetLarge"} <= set(NAMES)
    families = [_family(name) for name in PLANNED]
    assert len(set(families)) == len(PLANNED) and set(families) == {_family(n) for n in NAMES}


@pytest.mark.parametrize("name", PLANNED)
def test_every_keras_application_family_plans(name):
    model = _build(name)
    p = tfmem.plan(model, global_batch_size=2, optimizer="adam", memory_budget=64 * GIB)
    trainable = sum(math.prod(w.shape) for w in model.trainable_weights)
    assert p.num_parameters == model.count_params()
    # Each weight in its own dtype (float32, and EfficientNet's int64 Normalization count).
    assert p.parameter_bytes == sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize
                                    for w in model.weights)
    assert p.gradient_bytes == 4 * trainable and p.optimizer_bytes == 8 * trainable  # Adam
    size = SMALLEST.get(name, 32)
    # The first convolution keeps the image: the activations are at least that.
    assert p.activation_bytes_per_sample > 4 * size * size * 3
    assert p.input_bytes_per_sample == 4 * size * size * 3
    assert not [note for note in p.notes if "upper bound" in note or "loop" in note]
    assert (p.micro_batch_size, p.accumulation_steps) == (2, 1)


def test_an_application_with_keras_ops_equals_its_whole_model_trace():
    model = _build("MobileNetV3Small")  # hard-swish and squeeze-excite as keras.ops nodes
    p = tfmem.plan(model, global_batch_size=2, memory_budget=64 * GIB)
    assert p.activation_bytes_per_sample == traced_saved_tensors(model).saved_bytes
