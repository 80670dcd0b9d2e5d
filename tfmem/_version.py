"""tfmem's version, kept apart so that setup.cfg can read it without importing TensorFlow."""

__version__ = "0.1.0"
