"""The Keras backend tfmem runs on, read once at import, and how a feature picks its half.

Like Keras, which picks its trainer class where `Model` is defined, each feature names its
TensorFlow and JAX halves where it is defined (`half`, `choose`): this module reads
`keras.backend.backend()` and imports nothing of tfmem above it. Nothing else in tfmem asks
which backend is running.
"""

import importlib

try:
    import keras
except ImportError:
    # Keras's TensorFlow backend imports TensorFlow: if that is what is missing, say which
    # extra installs it; any other import error surfaces as it is.
    from tfmem import _tf  # noqa: F401

    raise

NAME = keras.backend.backend()

if NAME not in ("tensorflow", "jax"):
    raise ImportError(
        f"tfmem runs on Keras's TensorFlow or JAX backend, and KERAS_BACKEND is {NAME!r}. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before importing keras."
    )


def choose(*, tensorflow, jax):
    """The value given for the running backend."""
    return tensorflow if NAME == "tensorflow" else jax


def half(*, tensorflow: str, jax: str):
    """The module named for the running backend, imported (only that one: the other half may
    need a framework that is not installed)."""
    return importlib.import_module(choose(tensorflow=tensorflow, jax=jax))


__all__ = ["NAME", "choose", "half"]
