"""Runtime detection on the running backend: its half (`distribute` on TensorFlow,
`distribute_jax` on JAX) is chosen here."""

from typing import TYPE_CHECKING

from tfmem import backend

_HALF = backend.half(tensorflow="tfmem.runtime.distribute",
                     jax="tfmem.runtime.distribute_jax")
detect = _HALF.detect
current_runtime = _HALF.current_runtime
processes = _HALF.processes  # the processes of a run, and what each one reads and writes

if TYPE_CHECKING:  # the TensorFlow half's names, for type checkers and the API reference
    from tfmem.runtime.distribute import current_runtime, detect, processes  # noqa: F811

__all__ = ["current_runtime", "detect", "processes"]
