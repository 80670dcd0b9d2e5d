"""The Keras backend tfmem runs on, read once at import: each backend-specific piece is chosen here.

Like Keras, which picks its trainer class when `keras.models` is imported, tfmem reads
`keras.backend.backend()` once and takes the matching half of `AccumModel`'s train step, of
runtime detection, of the planner's gradient trace (and whether rematerialization saves memory
on a CPU) and of the image metrics' checks inside a compiled function; nothing else in tfmem
asks which backend is running.
"""

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
    from tfmem.training.remat_jax import rematerialized_call

    # XLA's CPU scheduler runs each recomputation where it saves no memory (only time).
    REMAT_SAVES_ON_CPU = False
elif NAME == "tensorflow":
    from tfmem.memory.gradient_trace import trace_call_tensorflow as trace_call
    from tfmem.metrics import traced_tf as metric_checks
    from tfmem.runtime.distribute import current_runtime, detect, processes
    from tfmem.training.accumulation_tf import AccumTrainer
    from tfmem.training.remat_tf import rematerialized_call

    REMAT_SAVES_ON_CPU = True
else:
    raise ImportError(
        f"tfmem runs on Keras's TensorFlow or JAX backend, and KERAS_BACKEND is {NAME!r}. "
        "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before importing keras."
    )

__all__ = ["NAME", "REMAT_SAVES_ON_CPU", "AccumTrainer", "current_runtime", "detect",
           "metric_checks", "processes", "rematerialized_call", "trace_call"]
