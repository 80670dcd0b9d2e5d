"""TensorFlow for the modules that need it, or an ImportError naming the extra that installs it.

Keras's TensorFlow backend and tfmem's TFRecord pipeline (`tfmem.data`) need TensorFlow; with
`KERAS_BACKEND=jax` the rest of tfmem runs without it. Modules that need it import `tf` from here.
"""

from tfmem import _import_banner
from tfmem._install import install_command

try:
    with _import_banner.set_aside():  # on the JAX backend, TensorFlow is first imported here
        import tensorflow as tf
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        f"TensorFlow is not installed in this environment ({error}). tfmem needs it for "
        "Keras's TensorFlow backend and for its TFRecord pipeline (tfmem.image_dataset, "
        "tfmem.write_image_tfrecords and the rest of tfmem.data); with KERAS_BACKEND=jax "
        "everything else runs without it. tfmem does not install TensorFlow by itself, so "
        "that it never adds a second TensorFlow flavour to a machine that has one. Install "
        f"one with an extra: {install_command('cpu')} (tensorflow-cpu: laptops, CI, TPU VMs "
        f"with the JAX backend) or {install_command('tensorflow')} (tensorflow with GPU "
        "support)."
    ) from error

__all__ = ["tf"]
