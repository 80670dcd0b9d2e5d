"""Imports TensorFlow once, with an error that says which extra installs it."""

try:
    import tensorflow as tf  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "tfmem needs TensorFlow, and none is installed in this environment "
        f"({error}). tfmem does not install TensorFlow by itself, so that it never "
        "adds a second TensorFlow flavour to a machine that has one. Install one "
        "with an extra: `pip install 'tfmem[cpu]'` (tensorflow-cpu: laptops, CI, "
        "TPU VMs with the JAX backend) or `pip install 'tfmem[tensorflow]'` "
        "(tensorflow with GPU support)."
    ) from error
