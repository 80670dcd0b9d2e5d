"""Bytes of an optimizer's per-variable state, from the Keras 3 optimizers' `build()`.

Keras's own optimizers by their slot counts; any other optimizer (a subclass, another
library's) by building a fresh copy of it on stand-in variables.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np


def optimizer_slot_bytes(optimizer: Any, variables: list) -> int:
    """Bytes of the optimizer's per-variable state ("slots") for `variables`.

    Counts from the Keras 3 optimizers' `build()` (keras/src/optimizers/*.py): SGD one
    `momentum` if momentum > 0; Adam/AdamW/Nadam/Adamax/Lamb/Adadelta/Ftrl two
    (+1 `velocity_hat` with amsgrad); RMSprop `velocity` (+ `momentum` if momentum > 0,
    + `average_gradient` if centered); Adagrad/Lion one; Adafactor (Keras 3) a full `velocity`
    for every variable plus, for ≥2-D variables, a row and a column vector (shape[:-1] and
    shape[:-2] + shape[-1:]), for the others two scalar placeholders. `use_ema` adds one copy, `gradient_accumulation_steps` one.
    Slots take the variable's dtype (`add_variable_from_reference`).

    Args:
        optimizer: a Keras optimizer instance or name ("adam", "sgd", …).
        variables: the trainable variables (anything with `.shape` and `.dtype`).

    Example:
        >>> optimizer_slot_bytes("adam", model.trainable_variables)  # 2 × 4 bytes × params
    """
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    name = type(optimizer).__name__
    if type(optimizer) is not getattr(keras.optimizers, name, None):
        return built_slot_bytes(optimizer, variables)  # a subclass or another library's
    sizes = [(tuple(v.shape), np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize)
             for v in variables]
    full = sum(math.prod(shape) * itemsize for shape, itemsize in sizes)
    if name == "SGD":
        copies = 1 if optimizer.momentum > 0 else 0
    elif name in ("Adam", "AdamW"):
        copies = 3 if optimizer.amsgrad else 2
    elif name == "Nadam":
        return (2 + _base_optimizer_copies(optimizer)) * full + 4  # + the scalar `u_product`
    elif name in ("Adamax", "Lamb", "Adadelta", "Ftrl"):
        copies = 2
    elif name == "RMSprop":
        copies = 1 + (optimizer.momentum > 0) + bool(optimizer.centered)
    elif name in ("Adagrad", "Lion"):
        copies = 1
    elif name == "Adafactor":
        # Keras 3 keeps a full `velocity` for every variable *and* the factored row/column
        # statistics (two scalar placeholders for variables of rank < 2): more than Adam's
        # one slot, not less as in the paper's memory-saving form.
        factored = 0
        for shape, itemsize in sizes:
            if len(shape) < 2:
                factored += 2 * 4  # `backend.Variable(0)` placeholders, 4 bytes each
            else:
                factored += (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * itemsize
        return full + factored + _base_optimizer_copies(optimizer) * full
    else:
        return built_slot_bytes(optimizer, variables)
    return (copies + _base_optimizer_copies(optimizer)) * full


def _base_optimizer_copies(optimizer) -> int:
    # keras/src/optimizers/base_optimizer.py `build`: one `average` per variable with EMA,
    # one `gradient_accumulator` with Keras's own gradient accumulation.
    return int(bool(optimizer.use_ema)) + int(bool(optimizer.gradient_accumulation_steps))


def built_slot_bytes(optimizer: Any, variables: list) -> int:
    """Slot bytes of any optimizer, counted by building a fresh copy of it (the general path).

    One stand-in variable per distinct shape and dtype is built at a time, so the memory this
    takes is the slots of the largest variable, not of the model. Used for optimizers the
    table above does not know; tested to agree with the table on those it does.
    """
    groups: dict[tuple, int] = {}
    for v in variables:
        key = (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
        groups[key] = groups.get(key, 0) + 1
    config = optimizer.get_config()
    total = 0
    for (shape, dtype), count in groups.items():
        fresh = type(optimizer).from_config(config)
        stand_in = keras.Variable(np.zeros(shape, dtype), trainable=True, name="stand_in")
        fresh.build([stand_in])
        slots = sum(math.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
                    for v in fresh.variables if v.name not in ("iteration", "learning_rate"))
        total += slots * count
    return total
