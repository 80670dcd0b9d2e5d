"""Sizes in bytes: the bytes of one element of a dtype, and the one wording of a size for
every message and report tfmem prints."""

import keras
import numpy as np


def itemsize(dtype) -> int:
    """Bytes of one element of `dtype` (any spelling Keras accepts, bfloat16 included)."""
    return np.dtype(keras.backend.standardize_dtype(dtype)).itemsize


def format_bytes(num_bytes: float) -> str:
    """`1536 * 2**20` → "1.50 GiB"; below 1 GiB in MiB."""
    if abs(num_bytes) >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"
