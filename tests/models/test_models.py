"""Tests for tfmem.models: golden parameter counts, equivalence with keras.applications,
weights loading from local files, freezing, and input validation."""

import math
import sys

import keras
import numpy as np
import pytest

from tfmem import models
from tfmem.models import applications, efficientnetv2_xl, tiramisu, unet

RNG = np.random.default_rng(0)


def _pixels(shape):
    return RNG.uniform(0, 255, size=shape).astype("float32")


def _values(variables):
    # Copies: a numpy view of a CPU variable could follow later in-place updates.
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


def _backbone(model):
    (nested,) = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    return nested


# --- EfficientNetV2-XL -------------------------------------------------------------

# Built inside `models.shapes_only()`: its 208.9M weights are never initialised (drawing them
# would take most of the test's time); the forward pass is given weights of their shapes.
def test_efficientnetv2_xl_golden_count_builds_at_default_recursion_limit_and_runs():
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default; Keras's own builder needs more
    try:
        with models.shapes_only():
            model = models.build("efficientnetv2-xl", num_classes=1000, image_size=64)
    finally:
        sys.setrecursionlimit(old_limit)
    # automl's published size for efficientnetv2-xl with the 1000-class head.
    assert model.count_params() == 208_896_832
    backbone = _backbone(model)
    stage_sizes = {}
    for layer in backbone.layers:
        if layer.name.startswith("stage"):
            stage, _ = layer.name.split("_")
            stage_sizes[stage] = stage_sizes.get(stage, 0) + 1
    assert stage_sizes == {f"stage{i}": r for i, r in enumerate([4, 8, 8, 16, 24, 32, 8], 1)}
    assert model.get_layer("top_dropout").rate == 0.4
    # Calling it is what fails with Keras's block naming ("block6{"): run a forward pass, each
    # weight given as a constant (a kernel 1 / its inputs per output, a BatchNorm's gamma and
    # variance 1, the rest 0): broadcast views of one number until TensorFlow reads them.
    def constant(variable):
        shape = tuple(variable.shape)
        value = (1.0 / math.prod(shape[:-1]) if len(shape) > 1
                 else float(variable.name in ("gamma", "moving_variance")))
        return np.broadcast_to(np.float32(value), shape)

    probabilities, _ = model.stateless_call(
        [constant(v) for v in model.trainable_variables],
        [constant(v) for v in model.non_trainable_variables],
        _pixels((1, 64, 64, 3)), training=False)
    probabilities = np.asarray(probabilities)
    assert probabilities.shape == (1, 1000) and np.all(np.isfinite(probabilities))
    np.testing.assert_allclose(probabilities.sum(), 1.0, rtol=1e-5)
    spec = models.MODELS["efficientnetv2-xl"]
    assert (spec.default_image_size, spec.eval_image_size) == (384, 512)


@pytest.fixture(scope="module")
def b0_pair():
    ours = efficientnetv2_xl.efficientnetv2_backbone(
        efficientnetv2_xl.B0_BLOCKS, input_shape=(32, 32, 3))
    reference = keras.applications.EfficientNetV2B0(
        include_top=False, weights=None, input_shape=(32, 32, 3),
        include_preprocessing=False)
    return ours, reference


def test_blocks_reproduce_keras_efficientnetv2_b0_exactly(b0_pair):
    """The XL code, fed B0's block strings, is Keras's B0: same weights, same outputs."""
    ours, reference = b0_pair
    assert ours.count_params() == reference.count_params() == 5_919_312
    assert [w.shape for w in ours.weights] == [w.shape for w in reference.weights]
    ours.set_weights(reference.get_weights())
    images = RNG.uniform(-1, 1, size=(2, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(
        np.asarray(ours(images, training=False)),
        np.asarray(reference(images, training=False)), rtol=1e-4, atol=1e-5)


def test_blocks_save_and_load_as_keras_file(tmp_path):
    inputs = keras.Input((8, 8, 16))
    x = efficientnetv2_xl.FusedMBConv(16, 16, expand_ratio=4, se_ratio=0.25,
                                      drop_rate=0.1)(inputs)
    x = efficientnetv2_xl.MBConv(16, 24, expand_ratio=6, strides=2, se_ratio=0.25)(x)
    x = tiramisu.DenseBlock(2, 8, return_input=False)(x)
    model = keras.Model(inputs, x)
    path = tmp_path / "blocks.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    images = RNG.uniform(-1, 1, size=(1, 8, 8, 16)).astype("float32")
    assert restored.output_shape == (None, 4, 4, 16)
    np.testing.assert_allclose(np.asarray(restored(images)), np.asarray(model(images)),
                               rtol=1e-5, atol=1e-6)


def test_blocks_and_head_under_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # the TPU policy
    try:
        backbone = efficientnetv2_xl.efficientnetv2_backbone(
            ("r1_k3_s2_e4_i32_o16_c1", "r2_k3_s2_e4_i16_o24_se0.25"),
            input_shape=(32, 32, 3))
        model = models.build("unet", num_classes=2, image_size=32)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    features = backbone(RNG.uniform(-1, 1, (1, 32, 32, 3)).astype("float32"))
    assert keras.backend.standardize_dtype(features.dtype) == "bfloat16"
    assert {v.dtype for v in backbone.weights} == {"float32"}  # master weights
    assert tuple(features.shape) == (1, 4, 4, 1280)
    probabilities = model(_pixels((1, 32, 32, 3)))
    # The classifier stays float32 so the softmax is accurate.
    assert keras.backend.standardize_dtype(probabilities.dtype) == "float32"
    np.testing.assert_allclose(np.asarray(probabilities).sum(-1), 1.0, rtol=1e-5)


def test_block_string_parsing():
    args = efficientnetv2_xl.parse_block_string("r32_k3_s2_e6_i256_o512_se0.25")
    assert (args.num_repeat, args.kernel_size, args.strides, args.expand_ratio,
            args.input_filters, args.output_filters, args.se_ratio, args.fused) == (
                32, 3, 2, 6, 256, 512, 0.25, False)
    assert efficientnetv2_xl.parse_block_string("r4_k3_s11_e1_i32_o32_c1").strides == 1
    with pytest.raises(ValueError, match="lacks fields"):
        efficientnetv2_xl.parse_block_string("r4_k3_e1_i32_o32")


# --- keras.applications families -----------------------------------------------------

def test_classifier_matches_keras_applications_parameter_count():
    # Keras's size of EfficientNetV2B0 with its 1000-class top.
    model = models.build("efficientnetv2-b0", num_classes=1000, image_size=32)
    assert model.count_params() == 7_200_312
    assert model.output_shape == (None, 1000)


@pytest.mark.parametrize("mode, reference", [
    ("caffe", keras.applications.resnet.preprocess_input),
    ("tf", keras.applications.resnet_v2.preprocess_input),
    ("torch", keras.applications.densenet.preprocess_input),
])
def test_preprocessing_layer_matches_keras_preprocess_input(mode, reference):
    images = _pixels((2, 5, 5, 3))
    expected = reference(images.copy())
    layer = applications.ImagePreprocessing(mode)
    actual = np.asarray(layer(images))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4)
    clone = applications.ImagePreprocessing.from_config(layer.get_config())
    np.testing.assert_array_equal(np.asarray(clone(images)), actual)


def test_every_model_declares_raw_pixel_range_and_sizes():
    for name, spec in models.MODELS.items():
        assert spec.data_range == (0.0, 255.0), name
        assert spec.min_image_size <= spec.default_image_size, name
        assert spec.default_image_size % spec.image_size_multiple == 0, name


def test_freeze_backbone_trains_only_the_head():
    model = models.build("mobilenetv2", num_classes=3, image_size=32, freeze_backbone=True)
    backbone = _backbone(model)
    # keras.applications.MobileNetV2 (3,538,984 with 1000 classes) with a 3-class head.
    assert model.count_params() == 3_538_984 - (1280 * 1000 + 1000) + (1280 * 3 + 3)
    assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == 1280 * 3 + 3
    before = _values(backbone.weights)  # includes BN moving statistics
    # The bias: a random-init MobileNetV2 in inference mode emits ~1e-12 features,
    # so the kernel's gradient is negligible while the bias's is not.
    (head_before,) = _values([model.get_layer("predictions").bias])
    # Eager: the frozen/trainable split is the point here, not graph tracing time.
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss="sparse_categorical_crossentropy", run_eagerly=True)
    model.fit(_pixels((4, 32, 32, 3)), np.array([0, 1, 2, 0]), epochs=1, verbose=0)
    for old, new in zip(before, _values(backbone.weights)):
        np.testing.assert_array_equal(old, new)
    (head_after,) = _values([model.get_layer("predictions").bias])
    assert np.abs(head_after - head_before).max() > 1e-3
    models.set_backbone_trainable(model, True)
    assert len(model.trainable_weights) == len(backbone.trainable_weights) + 2
    assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == 2_227_715


def test_keras_notop_h5_file_fills_the_backbone(tmp_path):
    # A Keras-format .h5 file, as keras.applications publishes `*_notop.h5`.
    source = keras.applications.MobileNetV2(include_top=False, weights=None,
                                            input_shape=(32, 32, 3))
    path = tmp_path / "mobilenet_v2_notop.h5"
    source.save(path)
    model = models.build("mobilenetv2", num_classes=2, image_size=32, weights=path)
    for expected, actual in zip(_values(source.weights), _values(_backbone(model).weights)):
        np.testing.assert_array_equal(expected, actual)
    # The file *with* the 1000-class top has more layers than the backbone.
    with_top = tmp_path / "mobilenet_v2.h5"
    keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3)).save(with_top)
    with pytest.raises(ValueError, match=r"pass Keras's `\*_notop\.h5` file"):
        models.build("mobilenetv2", num_classes=2, image_size=32, weights=with_top)


def test_whole_model_weights_round_trip_and_mismatch(tmp_path):
    original = models.build("unet", num_classes=2, image_size=32)
    path = tmp_path / "unet.weights.h5"
    original.save_weights(path)
    images = _pixels((1, 32, 32, 3))
    # Without the load, the restored model's random initialisation would differ.
    restored = models.build("unet", num_classes=2, image_size=32, weights=path)
    np.testing.assert_array_equal(np.asarray(restored(images)), np.asarray(original(images)))
    with pytest.raises(ValueError, match="num_classes=3"):
        models.build("unet", num_classes=3, image_size=32, weights=path)


# --- input validation ----------------------------------------------------------------

def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as error:
        models.build("efficientnet-xl", num_classes=10)
    message = str(error.value)
    assert "Did you mean 'efficientnetv2-xl'" in message
    assert "Valid names:" in message and "tiramisu-103" in message and "resnet152v2" in message


@pytest.mark.parametrize("name, image_size, message", [
    ("resnet50", 16, "at least 32×32"),
    ("tiramisu-56", 48, "divisible by 32 .* Try 32 or 64"),
    ("unet", (32, 40), "divisible by 16 .* Try 32 or 48"),
])
def test_bad_image_size(name, image_size, message):
    with pytest.raises(ValueError, match=message):
        models.build(name, num_classes=2, image_size=image_size)
    with pytest.raises(ValueError, match=message):  # the same check, nothing built
        models.input_shape(name, image_size)


def test_input_shape_is_the_built_models():
    assert models.input_shape("unet", (32, 48)) == (32, 48, 3)
    assert models.input_shape("resnet50") == (224, 224, 3)  # its training size
    with models.shapes_only():
        built = models.build("unet", num_classes=2, image_size=(32, 48))
    assert tuple(built.input_shape[1:]) == models.input_shape("unet", (32, 48))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_classes"):
        models.build("unet", num_classes=None, image_size=32)
    with pytest.raises(ValueError, match="never downloads"):
        models.build("resnet50", num_classes=2, image_size=32, weights="imagenet")
    bad = tmp_path / "weights.npz"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=r"expected a `\.weights\.h5`"):
        models.build("efficientnetv2-xl", num_classes=2, image_size=32, weights=bad)
    with pytest.raises(ValueError, match="no pretrained backbone"):
        models.build("unet", num_classes=2, image_size=32, freeze_backbone=True)
    with pytest.raises(TypeError, match="image_size"):
        models.build("unet", num_classes=2, image_size=32.0)
    with pytest.raises(ValueError, match="dropout"):
        models.build("unet", num_classes=2, image_size=32, dropout=1.0)


# --- segmentation: FC-DenseNet and U-Net ---------------------------------------------

def _conv(cin, cout, k, bias=True):
    return k * k * cin * cout + (cout if bias else 0)


def _batch_norm(channels):  # gamma, beta, moving mean, moving variance
    return 4 * channels


def _fc_densenet_count(block_sizes, growth, num_classes):
    """Parameter count derived by hand from the paper's Tables 1-2 (not from the code)."""
    total, channels, skips = _conv(3, 48, 3), 48, []
    half = len(block_sizes) // 2
    for size in block_sizes[:half]:
        for _ in range(size):
            total += _batch_norm(channels) + _conv(channels, growth, 3)
            channels += growth
        skips.append(channels)
        total += _batch_norm(channels) + _conv(channels, channels, 1)  # transition down
    for _ in range(block_sizes[half]):
        total += _batch_norm(channels) + _conv(channels, growth, 3)
        channels += growth
    upsampled = block_sizes[half] * growth
    for size, skip in zip(block_sizes[half + 1:], reversed(skips)):
        total += _conv(upsampled, upsampled, 3)  # transition up (3×3 transposed conv)
        channels = upsampled + skip
        for _ in range(size):
            total += _batch_norm(channels) + _conv(channels, growth, 3)
            channels += growth
        upsampled = size * growth
    return total + _conv(channels, num_classes, 1)


@pytest.mark.parametrize("depth, block_sizes, growth, exact, paper_millions", [
    (56, (4,) * 11, 12, 1_397_963, 1.4),  # the paper prints 1.5M; see docs/models.md
    (67, (5,) * 11, 16, 3_502_923, 3.5),
    (103, (4, 5, 7, 10, 12, 15, 12, 10, 7, 5, 4), 16, 9_425_163, 9.4),
])
def test_tiramisu_parameter_counts(depth, block_sizes, growth, exact, paper_millions):
    model = models.build(f"tiramisu-{depth}", num_classes=11, image_size=32)  # CamVid: 11
    assert _fc_densenet_count(block_sizes, growth, 11) == exact
    assert model.count_params() == exact
    assert round(exact / 1e6, 1) == paper_millions
    probabilities = np.asarray(model(_pixels((2, 32, 32, 3)), training=False))
    assert probabilities.shape == (2, 32, 32, 11)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, rtol=1e-5)


def test_tiramisu_alias_and_dense_block_config():
    assert models.MODELS["tiramisu"].task == "segmentation"
    block = tiramisu.DenseBlock(3, 8, return_input=False, name="b")
    clone = tiramisu.DenseBlock.from_config(block.get_config())
    assert clone.get_config() == block.get_config()
    assert tuple(clone(np.zeros((1, 4, 4, 5), "float32")).shape) == (1, 4, 4, 24)


def test_unet_parameter_count_and_output():
    model = unet.unet(input_shape=(32, 32, 3), num_classes=2)
    expected, cin = 0, 3
    widths = [16, 32, 64, 128]
    for width in widths + [256]:  # encoder levels, then the bottleneck
        expected += _conv(cin, width, 3, bias=False) + _conv(width, width, 3, bias=False)
        expected += 2 * _batch_norm(width)
        cin = width
    for width in reversed(widths):
        expected += _conv(cin, width, 2)  # 2×2 transposed conv
        expected += _conv(2 * width, width, 3, bias=False) + _conv(width, width, 3, bias=False)
        expected += 2 * _batch_norm(width)
        cin = width
    expected += _conv(16, 2, 1)
    assert model.count_params() == expected == 1_945_538
    assert model.output_shape == (None, 32, 32, 2)
