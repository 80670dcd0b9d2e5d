"""Losses Keras divides by a count: one step of AccumModel against keras.Model on the whole batch.

Backend-neutral (Keras and NumPy only): `test_accumulation_losses.py` runs the cases on
TensorFlow, `jax_cases/loss_cases.py` on JAX. Each case is a tiny model, a global batch of 8
and one SGD step; `run` returns the two updates' relative difference and both runs' logs.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np
from keras import ops

import tfmem
from tfmem.data.demo import SEGMENTATION_CLASS_NAMES, demo_examples
from tfmem.metrics.segmentation import MultiLabelIoU
from tfmem.training.segmentation_losses import DiceLoss

BATCH = 8
IGNORE = 255
SHAPES = len(SEGMENTATION_CLASS_NAMES)  # the demo's background and 4 shapes


def pixel_labels(num_classes: int = 3, seed: int = 0) -> np.ndarray:
    """Per-pixel labels of 8 images of 4×4 with `IGNORE` pixels: at 4 micro-batches of 2
    images, 3 valid pixels in the first, none in the second, 30 and 32 in the others."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, (BATCH, 4, 4))
    labels[0:2] = IGNORE
    labels[0, 0, :3] = np.arange(3) % num_classes
    labels[2:4] = IGNORE
    labels[4, 0, :2] = IGNORE
    return labels


def _pixels(cls, num_classes=(3,), regularized=False, **kwargs):
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.Conv2D(
        4, 1, activation="tanh", name="hidden",
        kernel_regularizer=keras.regularizers.L2(0.01) if regularized else None,
        activity_regularizer=keras.regularizers.L2(0.01) if regularized else None)(inputs)
    outputs = [keras.layers.Conv2D(n, 1, name=f"head{i}")(hidden)
               for i, n in enumerate(num_classes)]
    return cls(inputs, outputs if len(outputs) > 1 else outputs[0], **kwargs)


def _tokens(cls, **kwargs):
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    return cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def _dense(cls, **kwargs):
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    return cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def _images(seed=1):
    return np.random.default_rng(seed).normal(size=(BATCH, 4, 4, 2)).astype("float32")


def _token_data():
    """Tokens with padding (0): micro-batch 0 (rows 0-1) holds 2 tokens, the rest 4 to 6 each."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 10, (BATCH, 6))
    lengths = [1, 1, 6, 5, 4, 6, 5, 6]
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
    return tokens.astype("int32"), rng.integers(0, 3, (BATCH, 6))


def _dense_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH, 5)).astype("float32")
    labels = np.array([0, 0, 0, 1, 2, 2, 1, 2])
    sample_weight = np.array([0.1, 0.0, 2.0, 1.0, 0.5, 3.0, 0.0, 1.5], "float32")
    return x, labels, sample_weight


def _demo_pixels(cls, channels=SHAPES, activation="softmax", **kwargs):
    inputs = keras.Input((16, 16, 3))
    hidden = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")(inputs)
    return cls(inputs, keras.layers.Conv2D(channels, 1, activation=activation)(hidden), **kwargs)


def demo_masks(num_examples: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """The demo segmentation set's first images (16 px, scaled to [0, 1]) and masks, each
    shape's outline `IGNORE` (as VOC marks its objects' borders): the micro-batches hold
    different numbers of valid pixels."""
    images, masks = map(np.stack, zip(*demo_examples(num_examples, 16, task="segmentation")))
    masks = masks.astype("int64")
    padded = np.pad(masks, ((0, 0), (1, 1), (1, 1)), mode="edge")
    outline = ((padded[:, :-2, 1:-1] != masks) | (padded[:, 2:, 1:-1] != masks)
               | (padded[:, 1:-1, :-2] != masks) | (padded[:, 1:-1, 2:] != masks))
    masks[outline] = IGNORE
    masks[0, 4:] = IGNORE  # one image mostly without a class, two others all but 2 rows
    masks[2:4, 2:] = IGNORE
    return (images / 255).astype("float32"), masks


def demo_multi_label() -> tuple[np.ndarray, np.ndarray]:
    """The demo images with a 0/1 channel per shape and one for "any shape", which overlaps
    them (as cloud classes overlap): 5 channels, no ignore value."""
    images, masks = map(np.stack, zip(*demo_examples(BATCH, 16, task="segmentation")))
    channels = np.eye(SHAPES)[masks][..., 1:]  # the 4 shapes, background left out
    return (images / 255).astype("float32"), np.concatenate(
        [channels, (masks > 0)[..., None]], -1).astype("float32")


def _demo_case(loss: str) -> dict:
    """The demo segmentation set under one of `SEGMENTATION_CASES`'s losses, its IoU metric."""
    if loss.startswith("multi_label"):
        x, y = demo_multi_label()
        losses = {"multi_label": lambda: keras.losses.BinaryCrossentropy(),
                  "multi_label:dice": lambda: DiceLoss(SHAPES, multi_label=True,
                                                       cross_entropy=True)}
        return dict(build=lambda cls, **kw: _demo_pixels(cls, activation="sigmoid", **kw),
                    x=x, y=y, loss=losses[loss], metrics=lambda: [MultiLabelIoU(SHAPES)])
    x, y = demo_masks()
    losses = {"cross_entropy": lambda: keras.losses.SparseCategoricalCrossentropy(
                  ignore_class=IGNORE),
              "dice": lambda: DiceLoss(SHAPES, ignore_class=IGNORE),
              "cross_entropy+dice": lambda: DiceLoss(SHAPES, ignore_class=IGNORE,
                                                     cross_entropy=True)}
    return dict(build=_demo_pixels, x=x, y=y, loss=losses[loss],
                metrics=lambda: [keras.metrics.MeanIoU(SHAPES, name="mean_iou",
                                                       ignore_class=IGNORE,
                                                       sparse_y_pred=False)])


def _scalar_mean_square(y_true, y_pred):
    """A user's loss that returns its own mean: Keras cannot tell what it divided by."""
    return ops.mean(ops.square(ops.one_hot(ops.cast(y_true, "int32"), 3) - y_pred))


def _cross_entropy(**kwargs):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def case(name: str) -> dict:
    """The model builder, data, compile and fit arguments of case `name` (`CASES`)."""
    if name == "ignore_class":
        return dict(build=_pixels, x=_images(), y=pixel_labels(),
                    loss=lambda: _cross_entropy(ignore_class=IGNORE),
                    metrics=lambda: [keras.metrics.MeanIoU(3, name="iou", ignore_class=IGNORE,
                                                           sparse_y_pred=False)])
    if name == "mask_zero":
        tokens, labels = _token_data()
        return dict(build=_tokens, x=tokens, y=labels, loss=_cross_entropy,
                    metrics=lambda: ["sparse_categorical_accuracy"])
    if name.startswith(("sample_weight:", "class_weight:")):
        weighting, reduction = name.split(":")
        x, labels, sample_weight = _dense_data()
        fit = (dict(sample_weight=sample_weight) if weighting == "sample_weight"
               else dict(class_weight={0: 0.2, 1: 1.0, 2: 3.0}))
        return dict(build=_dense, x=x, y=labels, fit=fit,
                    loss=lambda: _cross_entropy(reduction=reduction),
                    metrics=lambda: ["sparse_categorical_accuracy"])
    if name == "two_outputs":
        labels = pixel_labels()
        other = pixel_labels(2, seed=5)
        other[4:8] = IGNORE  # the second output's valid pixels lie elsewhere
        other[6, 1, :] = [0, 1, 1, 0]
        return dict(build=lambda cls, **kw: _pixels(cls, num_classes=(3, 2), **kw),
                    x=_images(), y=[labels, other],
                    loss=lambda: [_cross_entropy(ignore_class=IGNORE)] * 2,
                    loss_weights=[0.5, 2.0])
    if name == "add_loss":
        return dict(build=lambda cls, **kw: _pixels(cls, regularized=True, **kw),
                    x=_images(), y=pixel_labels(), loss=lambda: _cross_entropy(
                        ignore_class=IGNORE))
    if name.startswith("demo:"):
        return _demo_case(name.removeprefix("demo:"))
    if name == "scalar_loss":
        x, labels, _ = _dense_data()
        return dict(build=_dense, x=x, y=labels, loss=lambda: _scalar_mean_square)
    raise ValueError(f"unknown case {name!r}; one of {CASES + SEGMENTATION_CASES}")


# `class_weight` reaches the loss as a sample weight: its case is the reduction that divides by
# the weights.
CASES = ("ignore_class", "mask_zero",
         *(f"sample_weight:{reduction}"
           for reduction in ("sum_over_batch_size", "sum", "mean_with_sample_weight")),
         "class_weight:mean_with_sample_weight", "two_outputs", "add_loss", "scalar_loss")

# The segmentation losses of finetune.py's `--loss` (class indices with an ignore value, and
# multi-label masks), with their IoU metric, on the demo segmentation set.
SEGMENTATION_CASES = tuple(f"demo:{loss}" for loss in (
    "cross_entropy", "dice", "cross_entropy+dice", "multi_label", "multi_label:dice"))


def run(name: str, accumulation_steps: int = 4, strategy=None, keras_accumulation=False,
        repeat: int = 1, rematerialize=None, **compile_kwargs) -> dict:
    """One step of the global batch: AccumModel (or, with `keras_accumulation`, a keras.Model
    whose optimizer accumulates `accumulation_steps` micro-batches itself) against a
    keras.Model on the whole batch, under `strategy` if given. `repeat` makes the global batch
    that many copies of the case's 8 rows (one per replica of a data-parallel run);
    `rematerialize` is the AccumModel's.

    Returns `update` (max |Δ - Δ_plain| / max |Δ_plain| over all weights), both logs
    (`history`, `plain_history`), `finite` and the AccumModel warnings (`warnings`).
    """
    spec = case(name)
    def scope():
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    with scope():
        keras.utils.set_random_seed(1)
        if keras_accumulation:
            accum = spec["build"](keras.Model)
        else:
            accum = spec["build"](tfmem.AccumModel, accumulation_steps=accumulation_steps,
                                  rematerialize=rematerialize)
        initial = accum.get_weights()
        accum.compile(optimizer=keras.optimizers.SGD(
            0.5, gradient_accumulation_steps=accumulation_steps if keras_accumulation else None),
            **_compiled(spec), **compile_kwargs)

    def tiled(value):
        return keras.tree.map_structure(
            lambda array: np.concatenate([array] * repeat), value)

    x, y = tiled(spec["x"]), tiled(spec["y"])
    fit = {key: tiled(value) if key == "sample_weight" else value
           for key, value in spec.get("fit", {}).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = BATCH * repeat // (accumulation_steps if keras_accumulation else 1)
        history = accum.fit(x, y, batch_size=batch, shuffle=False, verbose=0, **fit).history
    # The whole-batch step depends on the case, the batch, the strategy and how it compiles
    # only: each is run once.
    key = (name, repeat, id(strategy), tuple(sorted(compile_kwargs.items())))
    if key not in _PLAIN:
        with scope():
            plain = spec["build"](keras.Model)
            plain.set_weights(initial)
            plain.compile(optimizer=keras.optimizers.SGD(0.5), **_compiled(spec),
                          **compile_kwargs)
        plain_history = plain.fit(x, y, batch_size=BATCH * repeat, shuffle=False, verbose=0,
                                  **fit).history
        _PLAIN[key] = initial, plain.get_weights(), plain_history, strategy
    plain_initial, plain_weights, plain_history, _ = _PLAIN[key]
    assert all(np.array_equal(a, b) for a, b in zip(initial, plain_initial, strict=True))
    accum_update = _flat(accum.get_weights()) - _flat(initial)
    plain_update = _flat(plain_weights) - _flat(initial)
    return {
        "update": float(np.max(np.abs(accum_update - plain_update))
                        / np.max(np.abs(plain_update))),
        "finite": bool(np.all(np.isfinite(accum_update))),
        "history": {key: [float(v) for v in values] for key, values in history.items()},
        "plain_history": {key: [float(v) for v in values]
                          for key, values in plain_history.items()},
        "warnings": [str(w.message) for w in caught if "AccumModel:" in str(w.message)],
    }


# The whole-batch runs `run` made, by what they ran: the initial weights, the weights after,
# the history (and the strategy, kept so that its id names no other).
_PLAIN = {}


def _compiled(spec) -> dict:
    """A case's `compile` arguments besides the optimizer, made anew for each model."""
    return dict(loss=spec["loss"](), loss_weights=spec.get("loss_weights"),
                metrics=spec.get("metrics", lambda: None)())


def _flat(weights) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])

