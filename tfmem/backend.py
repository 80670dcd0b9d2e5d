"""The Keras backend tfmem runs on, read once at import: each backend-specific piece is chosen here.

Like Keras, which picks its trainer class when `keras.models` is imported, tfmem reads
`keras.backend.backend()` once and takes the matching half of `AccumModel`'s train step, of
runtime detection, of the planner's gradient trace (and whether rematerialization saves memory
on a CPU) and of the image metrics' checks inside a compiled function; nothing else in tfmem
asks which backend is running.
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

if NAME == "jax":
    from tfmem.memory.gradient_trace import trace_call_jax as trace_call
    from tfmem.metrics import traced_jax as metric_checks
    from tfmem.runtime.distribute_jax import current_runtime, detect, processes
    from tfmem.training.accumulation_jax import AccumTrainer
elif NAME == "tensorflow":
    from tfmem.memory.gradient_trace import trace_call_tensorflow as trace_call
    from tfmem.metrics import traced_tf as metric_checks
    from tfmem.runtime.distribute import current_runtime, detect, processes
    from tfmem.training.accumulation_tf import AccumTrainer
else:
    raise ImportError(
        f"tfmem runs on Keras's TensorFlow or JAX backend, and KERAS_BACKEND is {NAME!r}. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before importing keras."
    )



def half(*, tensorflow: str, jax: str):
    """The module of the running backend's half of a feature, imported: a feature names its
    two halves where it is defined (as Keras picks its trainer class in `keras.models`)."""
    return importlib.import_module({"tensorflow": tensorflow, "jax": jax}[NAME])


__all__ = ["NAME", "AccumTrainer", "current_runtime", "detect", "half", "metric_checks",
           "processes", "trace_call"]
