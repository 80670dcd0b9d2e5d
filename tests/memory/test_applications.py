"""The planner sizes every `keras.applications` family (plan only, at a small valid size).

One model of each family (each Keras module) is planned: the others in it are the same code
with other depths and widths, the same layer kinds in other numbers. Models are built inside
`tfmem.models.shapes_only()`: their weights are never initialised, which the planner does not
need (it reads shapes).
"""

import functools
import warnings
import math

import keras
import numpy as np
import pytest

import tfmem
from tfmem.memory.guard import UnplannedRunWarning
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
    # The image, and with no loss given each sample's targets shaped as the output.
    assert p.input_bytes_per_sample == 4 * size * size * 3 + 4 * math.prod(model.output.shape[1:])
    assert not [note for note in p.notes if "upper bound" in note or "loop" in note]
    assert (p.micro_batch_size, p.accumulation_steps) == (2, 1)


def test_an_application_with_keras_ops_equals_its_whole_model_trace():
    model = _build("MobileNetV3Small")  # hard-swish and squeeze-excite as keras.ops nodes
    p = tfmem.plan(model, global_batch_size=2, memory_budget=64 * GIB)
    assert p.activation_bytes_per_sample == traced_saved_tensors(model).saved_bytes


def _text_classifier(backbone, length: int):
    """keras-hub's way: a backbone of any length, called on fixed-length token ids."""
    names = [name for name in ("token_ids", "segment_ids", "padding_mask")
             if name in backbone.input]
    inputs = {name: keras.Input((length,), dtype="int32", name=name) for name in names}
    outputs = backbone(inputs)
    features = outputs["pooled_output"] if isinstance(outputs, dict) else outputs[:, 0]
    return keras.Model(inputs, keras.layers.Dense(2)(features))


@pytest.mark.parametrize("name", ["BertBackbone", "GPT2Backbone"])
def test_keras_hub_text_backbones_plan_with_and_without_rematerialization(name):
    import keras_hub

    backbone = getattr(keras_hub.models, name)(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=32, dropout=0.0)
    assert backbone.input["token_ids"].shape == (None, None)  # any length
    plans = {setting: tfmem.plan(_text_classifier(backbone, 16), global_batch_size=8,
                                 memory_budget=GIB, **({"rematerialize": setting} if setting
                                                       else {}))
             for setting in (None, "full")}
    # Cut inside the backbone: only the segments' inputs kept, one layer's insides at a time.
    assert {path for path, _ in plans["full"].rematerialized} == {backbone.name}
    assert (plans["full"].activation_bytes_per_sample
            < 0.6 * plans[None].activation_bytes_per_sample)
    # Twice the tokens: more than twice the bytes (the attention scores grow as its square).
    longer = tfmem.plan(_text_classifier(backbone, 32), global_batch_size=8, memory_budget=GIB)
    assert longer.activation_bytes_per_sample > 2 * plans[None].activation_bytes_per_sample


def test_a_keras_hub_bert_trains_rematerialized_as_keras_on_the_whole_batch():
    import keras_hub

    def classifier():
        keras.utils.set_random_seed(0)
        return _text_classifier(keras_hub.models.BertBackbone(
            vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
            max_sequence_length=16, dropout=0.0), 16)

    rng = np.random.default_rng(0)
    mask = (np.arange(16)[None] < rng.integers(4, 17, (8, 1))).astype("int32")
    x = {"token_ids": rng.integers(1, 64, (8, 16)).astype("int32") * mask,
         "segment_ids": np.zeros((8, 16), "int32"), "padding_mask": mask}
    y = rng.integers(0, 2, (8,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = classifier()
    reference.compile(keras.optimizers.SGD(0.1), loss)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    accum = tfmem.AccumModel.wrap(classifier(), accumulation_steps=2, rematerialize="full")
    accum.compile(keras.optimizers.SGD(0.1), loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnplannedRunWarning)  # planned and checked
        accum.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  memory_budget=4 * GIB)
    assert accum.rematerialized_segments
    for ours, theirs in zip(accum.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
