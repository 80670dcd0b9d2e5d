"""Named model builders: `keras.applications` families, EfficientNetV2-XL, FC-DenseNet, U-Net;
the prediction of a per-pixel model by tiles (`predict_tiled`, tiling.py).

`build(name, ...)` returns a `keras.Model` taking raw RGB pixels in
``MODELS[name].data_range``; each family's input scaling is a layer inside the model.
Classifiers nest one backbone model, which `freeze_backbone=True` freezes. Nothing is
downloaded: `weights` is a path to a file on disk.

Example:
    >>> model = tfmem.models.build("efficientnetv2-b0", num_classes=10, image_size=64)
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import types
from typing import Callable

import keras
from keras import layers

from tfmem import _keras_internals as internals
from tfmem.models import applications, efficientnetv2_xl, tiramisu, unet as unet_module
from tfmem.models.tiling import predict_tiled

__all__ = ["MODELS", "ModelSpec", "build", "check_weights", "input_shape", "predict_tiled",
           "spec", "set_backbone_trainable", "shapes_only"]

_RAW_PIXELS = (0.0, 255.0)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the rest of tfmem needs to know about a named model before building it.

    Attributes:
        name: registry name, e.g. "efficientnetv2-xl".
        task: "classification" (one label per image) or "segmentation" (per pixel).
        default_image_size: training resolution of the reference recipe.
        min_image_size: smallest height/width the network accepts.
        image_size_multiple: height and width must be multiples of this.
        data_range: (low, high) of the pixels the model's input expects; feed the
            data pipeline and the metrics this same range.
        preprocessing: what the model does to its input first, in words.
        default_dropout: dropout used when `build(dropout=None)`.
        eval_image_size: evaluation resolution of the reference recipe, if different.
    """

    name: str
    task: str
    default_image_size: int
    min_image_size: int
    image_size_multiple: int
    data_range: tuple[float, float]
    preprocessing: str
    default_dropout: float
    eval_image_size: int | None = None


_PREPROCESSING_WORDS = {
    None: "built into the Keras backbone (include_preprocessing=True)",
    "caffe": "RGB->BGR, minus ImageNet BGR means (Keras 'caffe' mode)",
    "tf": "x / 127.5 - 1 (Keras 'tf' mode)",
    "torch": "x / 255, ImageNet mean/std normalisation (Keras 'torch' mode)",
}


def _registry() -> tuple[dict[str, ModelSpec], dict[str, Callable]]:
    specs, builders = {}, {}
    for name, family in applications.FAMILIES.items():
        specs[name] = ModelSpec(
            name, "classification", family.default_image_size, 32, 1, _RAW_PIXELS,
            _PREPROCESSING_WORDS[family.preprocessing], family.default_dropout)
    specs["efficientnetv2-xl"] = ModelSpec(
        "efficientnetv2-xl", "classification", efficientnetv2_xl.XL_TRAIN_IMAGE_SIZE, 32, 1,
        _RAW_PIXELS, "x / 128 - 1 (as Keras's EfficientNetV2-S/M/L)",
        efficientnetv2_xl.XL_DROPOUT, eval_image_size=efficientnetv2_xl.XL_EVAL_IMAGE_SIZE)
    # FC-DenseNet was trained at 224×224 crops of CamVid; five poolings → multiple of 32.
    for depth in tiramisu.VARIANTS:
        specs[f"tiramisu-{depth}"] = ModelSpec(
            f"tiramisu-{depth}", "segmentation", 224, 32, 32, _RAW_PIXELS, "x / 255",
            tiramisu.DROPOUT)
        builders[f"tiramisu-{depth}"] = _tiramisu_builder(depth)
    # The paper's headline model.
    specs["tiramisu"] = dataclasses.replace(specs["tiramisu-103"], name="tiramisu")
    builders["tiramisu"] = builders["tiramisu-103"]
    specs["unet"] = ModelSpec("unet", "segmentation", 128, 16, 16, _RAW_PIXELS, "x / 255", 0.0)
    builders["unet"] = unet_module.unet
    return specs, builders


def _tiramisu_builder(depth):
    def build_fc_densenet(**kwargs):
        return tiramisu.fc_densenet(depth, **kwargs)
    return build_fc_densenet


_SPECS, _SEGMENTATION_BUILDERS = _registry()
MODELS = types.MappingProxyType(_SPECS)
"""Read-only mapping of every model name to its `ModelSpec`."""


def shapes_only():
    """A context in which models are built without their weights, to be planned, not trained.

    Building EfficientNetV2-XL this way takes seconds and no memory for its 209M weights; the
    planner reads only shapes. The weights stay uninitialised for good (Keras would otherwise
    initialise them at its next stateless scope), so such a model cannot be trained.

    Example:
        >>> with tfmem.models.shapes_only():
        ...     xl = tfmem.models.build("efficientnetv2-xl", num_classes=104, image_size=384)
        >>> tfmem.plan(xl, global_batch_size=64, device="tpu-v3-8")  # doctest: +SKIP
    """
    return internals.shapes_only()


def spec(name: str) -> ModelSpec:
    """Returns the `ModelSpec` of `name`, or raises a ValueError listing valid names.

    Example:
        >>> spec("densenet121").data_range
        (0.0, 255.0)
    """
    if name in _SPECS:
        return _SPECS[name]
    close = difflib.get_close_matches(str(name), _SPECS, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"Unknown model {name!r}.{hint} Valid names: {', '.join(sorted(_SPECS))}.")


def input_shape(name: str, image_size=None) -> tuple[int, int, int]:
    """The input shape `build(name, image_size=image_size)` makes, `(height, width, 3)`,
    checked without building the model.

    Raises:
        ValueError: an unknown name, or an image size the model cannot take (under its
            smallest, or not a multiple of what it pools by).
        TypeError: `image_size` is neither an int nor `(height, width)` ints.
    """
    return _image_shape(spec(name), image_size)


def _image_shape(model_spec: ModelSpec, image_size) -> tuple[int, int, int]:
    if image_size is None:
        image_size = model_spec.default_image_size
    sizes = (image_size, image_size) if isinstance(image_size, numbers.Integral) else (
        tuple(image_size) if isinstance(image_size, (tuple, list)) else ())
    if len(sizes) != 2 or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                  for s in sizes):
        raise TypeError(
            f"`image_size` must be an int or (height, width) of ints; got {image_size!r}.")
    low, multiple = model_spec.min_image_size, model_spec.image_size_multiple
    for size in sizes:
        if size < low:
            raise ValueError(
                f"{model_spec.name} needs images of at least {low}×{low} pixels; got "
                f"image_size={image_size!r}. Use image_size >= {low} (its training "
                f"size is {model_spec.default_image_size}).")
        if size % multiple:
            lower, upper = size // multiple * multiple, (size // multiple + 1) * multiple
            raise ValueError(
                f"{model_spec.name} needs height and width divisible by {multiple} (it "
                f"pools {multiple}× and upsamples back); got image_size={image_size!r}. "
                f"Try {max(lower, low)} or {upper}.")
    return (*(int(s) for s in sizes), 3)


def check_weights(name: str, weights: str | os.PathLike) -> str:
    """Raises ValueError, naming the file and the fix, unless `weights` is a file `build(name,
    weights=...)` can load: a readable HDF5 file (only its header is read) of an accepted kind.
    Returns its path.

    Example:
        >>> check_weights("small-cnn", "notes.txt")  # doctest: +SKIP
        ValueError: Cannot load 'notes.txt' into small-cnn: expected a `.weights.h5` ...
    """
    path = os.fspath(weights)
    if os.path.isdir(path):
        raise ValueError(f"Weights file {path!r} is a directory; pass the weights file in it "
                         "(a `.weights.h5`, or Keras's `*_notop.h5` backbone file)")
    if not os.path.isfile(path):
        raise ValueError(
            f"Weights file {path!r} does not exist. tfmem never downloads weights: copy "
            "the file to this machine first (on Kaggle attach it as a dataset, on Colab "
            "copy it from Drive/GCS), then pass its local path.")
    keras_family = spec(name).name in applications.FAMILIES
    if not (path.endswith(".weights.h5") or (path.endswith(".h5") and keras_family)):
        accepted = ("a `.weights.h5` of this whole model (`model.save_weights`)"
                    + (" or the Keras `*_notop.h5` backbone file" if keras_family else ""))
        raise ValueError(f"Cannot load {path!r} into {name}: expected {accepted}.")
    import h5py  # Keras's own dependency for weights files

    try:
        with h5py.File(path, "r"):
            pass
    except OSError as error:
        detail = str(error).split("(")[-1].rstrip(")") if "(" in str(error) else str(error)
        raise ValueError(
            f"Weights file {path!r} cannot be read as HDF5 ({detail}): it is not a Keras "
            "weights file, or a copy that was cut short; copy it again (its size should "
            "match the original's), or pass another file") from None
    return path


def build(
    name: str,
    *,
    num_classes: int | None,
    image_size: int | tuple[int, int] | None = None,
    weights: str | os.PathLike | None = None,
    include_top: bool = True,
    dropout: float | None = None,
    freeze_backbone: bool = False,
    classifier_activation: str | None = "softmax",
) -> keras.Model:
    """Builds a registered model; the input is RGB pixels in `MODELS[name].data_range`.

    Args:
        name: a key of `MODELS` (e.g. "efficientnetv2-xl", "resnet50", "tiramisu").
        num_classes: classes of the classifier (per pixel for segmentation); may be
            None only with `include_top=False`.
        image_size: int or (height, width); None uses the model's training size.
        weights: local file, loaded after building. ``*.weights.h5`` (from
            `model.save_weights` of a model built here with the same name and
            `num_classes`) fills the whole model; for `keras.applications` families a
            Keras ``*_notop.h5`` file (e.g. ``efficientnetv2-b0_notop.h5``) fills the
            backbone and the new head starts from scratch. Never downloaded.
        include_top: add the classifier; otherwise the output is the backbone's last
            feature map (segmentation: the last features before the 1×1 classifier).
        dropout: rate before the classifier (segmentation: inside the network);
            None uses `MODELS[name].default_dropout`.
        freeze_backbone: True freezes the backbone (transfer learning: only the head
            trains, BatchNorm runs in inference mode); False trains every layer.
        classifier_activation: "softmax", or None for logits.

    Returns:
        A `keras.Model`; its classifier computes in float32 under mixed precision.

    Raises:
        ValueError: unknown name, image too small or not a multiple of the network's
            stride, missing/unfitting weights file, bad `num_classes` or `dropout`.
        TypeError: `image_size` that is not an int or a pair of ints.

    Example:
        >>> model = build("resnet50", num_classes=5, image_size=64, freeze_backbone=True)
        >>> len(model.trainable_weights)  # the Dense kernel and bias
        2
    """
    model_spec = spec(name)
    image_shape = _image_shape(model_spec, image_size)
    if include_top and (not isinstance(num_classes, int) or num_classes < 1):
        raise ValueError(
            f"`num_classes` must be a positive int when include_top=True; got "
            f"{num_classes!r}. Pass the number of labels in your data.")
    dropout = model_spec.default_dropout if dropout is None else dropout
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1); got {dropout!r}.")
    family = applications.FAMILIES.get(name)
    weights = None if weights is None else check_weights(name, weights)
    backbone_weights = weights if weights and not weights.endswith(".weights.h5") else None

    if model_spec.task == "segmentation":
        if freeze_backbone:
            raise ValueError(
                f"{name} is trained from scratch as one network and has no pretrained "
                "backbone to freeze; use freeze_backbone=False.")
        model = _SEGMENTATION_BUILDERS[name](
            input_shape=image_shape, num_classes=num_classes, dropout=dropout,
            include_top=include_top, classifier_activation=classifier_activation,
            name=name)
    else:
        if family is not None:
            try:
                backbone = family.backbone(image_shape, backbone_weights)
            except ValueError as error:
                if backbone_weights is None:
                    raise
                raise ValueError(
                    f"{backbone_weights!r} does not fit the {name} backbone: pass Keras's "
                    f"`*_notop.h5` file for {name} (the file with the classifier top does "
                    f"not fit). Keras says: {error}") from error
            scale = (applications.ImagePreprocessing(family.preprocessing, name="preprocess")
                     if family.preprocessing else None)
        else:  # the one classification model not in keras.applications
            backbone = efficientnetv2_xl.efficientnetv2_backbone(
                efficientnetv2_xl.XL_BLOCKS, input_shape=image_shape,
                name="efficientnetv2-xl_backbone")
            scale = layers.Rescaling(1.0 / 128.0, offset=-1.0, name="preprocess")
        model = _classifier(name, backbone, scale, image_shape, num_classes, dropout,
                            include_top, classifier_activation)
    if weights and weights.endswith(".weights.h5"):
        try:
            model.load_weights(weights)
        except ValueError as error:
            raise ValueError(
                f"{weights!r} does not fit {name} with num_classes={num_classes}, "
                f"include_top={include_top}: build the model exactly as the one that "
                f"saved the file. Keras says: {error}") from error
    if freeze_backbone:
        set_backbone_trainable(model, False)
    return model


def _classifier(name, backbone, scale, input_shape, num_classes, dropout, include_top,
                classifier_activation):
    inputs = keras.Input(input_shape, name="image")
    x = backbone(scale(inputs) if scale is not None else inputs)
    if include_top:
        x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
        if dropout > 0:
            x = layers.Dropout(dropout, name="top_dropout")(x)
        # float32 output so the softmax stays accurate under a mixed-precision policy.
        x = layers.Dense(num_classes, activation=classifier_activation, dtype="float32",
                         name="predictions")(x)
    return keras.Model(inputs, x, name=name)


def set_backbone_trainable(model: keras.Model, trainable: bool) -> None:
    """Freezes (transfer learning) or unfreezes (full fine-tuning) a model's backbone.

    Recompile the model afterwards: Keras fixes the trainable set at `compile`.
    A frozen backbone's BatchNorm layers run in inference mode, so their statistics
    stay those of the pretrained weights.

    Args:
        model: a classification model from `build`.
        trainable: False to freeze, True to train every layer.

    Example:
        >>> model = build("densenet121", num_classes=3, image_size=32)
        >>> set_backbone_trainable(model, False)
        >>> [w.name for w in model.trainable_weights]
        ['kernel', 'bias']
    """
    nested = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    if len(nested) != 1:
        raise ValueError(
            f"Model {model.name!r} has {len(nested)} nested backbones, expected exactly "
            "one; set_backbone_trainable works on classification models from "
            "tfmem.models.build (segmentation models there have no backbone).")
    nested[0].trainable = trainable
