"""The image metrics' TensorFlow half: inside `tf.function`, values are checked by graph asserts."""

from __future__ import annotations


def is_traced(x) -> bool:
    """True inside a `tf.function`, where values are unknown until run time."""
    import tensorflow as tf

    del x
    return not tf.executing_eagerly()


def check_range(y_true, y_pred, low: float, high: float, metric: str, fix: str):
    """Asserts in the graph that both batches lie in [low, high] and are not [0, 1] images
    declared as 0..255; returns None (every image valid: a violation stops the step)."""
    import tensorflow as tf

    message = f"{metric}: values outside the declared data_range ({low:g}, {high:g}); {fix}."
    for x in (y_true, y_pred):
        tf.debugging.assert_greater_equal(x, tf.constant(low, x.dtype), message=message)
        tf.debugging.assert_less_equal(x, tf.constant(high, x.dtype), message=message)
    if high - low > 1:
        tf.debugging.assert_greater(
            tf.maximum(tf.reduce_max(y_true), tf.reduce_max(y_pred)),
            tf.constant(low + 1, y_true.dtype),
            message=f"{metric}: every value lies in [{low:g}, {low + 1:g}] but "
                    f"data_range is ({low:g}, {high:g}): [0, 1] images declared as "
                    "0..255? Pass data_range=1.0.")
    return None
