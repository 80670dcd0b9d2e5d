"""small-cnn: a ~60k-parameter CNN for the demo, tests and quick checks on a CPU.

Not a model to fine-tune for real work: it is the registry's smallest member, so that
`scripts/finetune.py` with its defaults trains end to end on the demo shapes in about a
minute on two CPU cores. Its builder has the signature of a `keras.applications`
constructor (`include_top=False` only), so it plugs into the same registry and head.
"""

from __future__ import annotations

import keras
from keras import layers


def small_cnn(*, include_top: bool = False, weights: str | None = None,
              input_shape: tuple[int, int, int] = (32, 32, 3)) -> keras.Model:
    """Three 3×3 conv blocks (32, 64, 64 filters) with BatchNorm; no classifier.

    Args:
        include_top: must be False (the registry adds the pooled Dense head).
        weights: a local `.h5`/`.weights.h5` file of this backbone, or None.
        input_shape: (height, width, 3).

    Example:
        >>> small_cnn(input_shape=(32, 32, 3)).output_shape
        (None, 8, 8, 64)
    """
    if include_top:
        raise ValueError("small_cnn has no classifier of its own; use include_top=False.")
    inputs = keras.Input(input_shape)
    x = inputs
    for index, filters in enumerate((32, 64, 64)):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                          name=f"block{index + 1}_conv")(x)
        # momentum 0.5, not Keras's 0.99: in the demo's first epoch (32 updates) the
        # activations' scale changes with every update, and the moving statistics used at
        # evaluation must follow the last few batches, or the first validation is at chance.
        x = layers.BatchNormalization(momentum=0.5, name=f"block{index + 1}_bn")(x)
        x = layers.ReLU(name=f"block{index + 1}_relu")(x)
        if index < 2:
            x = layers.MaxPooling2D(name=f"block{index + 1}_pool")(x)
    model = keras.Model(inputs, x, name="small_cnn")
    if weights is not None:
        model.load_weights(weights)
    return model
