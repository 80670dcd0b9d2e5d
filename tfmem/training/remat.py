"""Rematerialization of chosen layers: their activations are recomputed in the backward pass.

A rematerialized layer (a block, a nested model, any layer) keeps only its inputs for the
backward pass and runs its forward again there, so the activations inside it are not held
between the two passes. What makes it exact, unlike `keras.remat`:

- the recomputation sees the layer's state as the forward pass saw it (BatchNormalization's
  moving statistics, the seed of a Dropout), so it draws the same masks;
- what the recomputation would update is dropped: BatchNormalization's statistics are
  updated once per step, by the forward pass.

The backend's half (`remat_tf`: `tf.recompute_grad`; `remat_jax`: `jax.checkpoint` over a
stateless call) is chosen in `tfmem.backend`. Only training calls are rematerialized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import keras

from tfmem import _keras_internals as internals

_HOOKED = "_tfmem_rematerialized"


def check_setting(value) -> tuple[str, ...] | None:
    """`rematerialize`: None, or layer names (a list or tuple of str)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not value or not all(
            isinstance(name, str) and name for name in value):
        raise ValueError(
            f"`rematerialize` must be None or a list of layer names, got {value!r}; e.g. "
            "rematerialize=['block_3', 'block_4'] (model.summary() lists the names)")
    return tuple(value)


def names_of(flag: str | None) -> list[str] | None:
    """`--rematerialize down0_dense, down1_dense` → the names; None when none are given."""
    names = [name.strip() for name in (flag or "").split(",") if name.strip()]
    return names or None


def apply(model: keras.Model, names: Sequence[str]) -> list[keras.layers.Layer]:
    """Rematerializes the layers of `model` named `names` (found at any depth); returns them.

    Raises:
        ValueError: a name that is no layer of the model (naming the layers it has).
    """
    from tfmem.backend import rematerialized_call

    layers = {layer.name: layer for layer in internals.flatten_layers(model)
              if layer is not model}
    missing = [name for name in names if name not in layers]
    if missing:
        raise ValueError(
            f"rematerialize: {', '.join(map(repr, missing))} "
            f"{'is not a layer' if len(missing) == 1 else 'are not layers'} of "
            f"{model.name!r}; its layers: {', '.join(layers)}")
    chosen = [layers[name] for name in names]
    for layer in chosen:
        if not getattr(layer, _HOOKED, False):
            original = layer.call
            layer.call = rematerialized_call(layer, original)  # this instance only
            setattr(layer, _HOOKED, True)
    return chosen


_AS_WRITTEN = []  # non-empty while the planner measures layers without rematerialization


@contextlib.contextmanager
def as_written():
    """Inside, rematerialized layers run as written: the planner measures what each keeps
    inside, and counts the rematerialization itself."""
    _AS_WRITTEN.append(True)
    try:
        yield
    finally:
        _AS_WRITTEN.pop()


def is_training_call() -> bool:
    """Whether the layer call now running is a training one to rematerialize (Keras's call
    context), and not one the planner measures as written."""
    return not _AS_WRITTEN and bool(internals.call_training())
