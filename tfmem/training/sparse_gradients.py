"""Gradients that reach the optimizer as rows (`tf.IndexedSlices`), kept as rows over a window.

On TensorFlow the gradient of a variable read only by gathers is a `tf.IndexedSlices`: one row
per lookup (an `Embedding`), or one per distinct index where the lookup first made its indices
unique (`tf.nn.embedding_lookup_sparse`: a sparse input into a `Dense` layer). Keras's optimizers
update such a variable row by row (Adam squares each row before duplicate indices add up), so the
window's update takes the rows the whole batch would have given, scaled as a dense sum is, not
their dense sum (docs/accumulation.md): the `k` micro-batches' rows concatenated (`Rows`), or
those added up by index (`DistinctRows`). A micro-step returns its rows where a dense
gradient's sum goes (`add`); the loop writes them into one buffer per such variable (`buffers`,
`write`), and the update reads them back (`with_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tfmem.runtime.precision import accumulator_dtype


class Rows(NamedTuple):
    """A gradient's rows, one per lookup: a micro-batch's tensors, or a window's buffers of
    them (`tf.TensorArray`s of `k` elements)."""

    values: tf.Tensor | tf.TensorArray
    indices: tf.Tensor | tf.TensorArray


class DistinctRows(Rows):
    """A gradient's rows, one per distinct index: the window's are added up by index."""


# Ops whose output holds their first input's values: followed back from a gradient's indices to
# the `Unique` op that made them distinct, if any.
_SAME_VALUES = ("Identity", "Reshape", "ExpandDims", "Squeeze", "Cast")


def is_rows(gradient) -> bool:
    return isinstance(gradient, Rows)


def add(total, gradient):
    """A micro-step's new sum: `total + gradient`, or a sparse gradient's `Rows` (values in
    `accumulator_dtype`), for the loop to `write`. `total` may have lost its static shape
    (`relaxed`); the sum has the gradient's."""
    if isinstance(gradient, tf.IndexedSlices):
        kind = DistinctRows if _made_distinct(gradient.indices) else Rows
        return kind(tf.cast(gradient.values, accumulator_dtype(gradient.values.dtype)),
                    gradient.indices)
    gradient = tf.convert_to_tensor(gradient)
    total = total + tf.cast(gradient, total.dtype)
    total.set_shape(gradient.shape)
    return total


def _made_distinct(indices: tf.Tensor) -> bool:
    """Whether a `Unique` op made `indices` (read from the graph; eagerly there is none)."""
    if tf.executing_eagerly():
        return False
    op = indices.op
    while op.type in _SAME_VALUES:
        op = op.inputs[0].op
    return op.type == "Unique"


def relaxed(sums: list) -> list:
    """Specs of `sums` without their shapes: the micro-step is traced on these, so that it can be
    called both with a dense sum and with `without_sums`' scalar for a sparse variable."""
    return [tf.TensorSpec(None, total.dtype) for total in sums]


def buffers(gradients: list, k: int) -> dict[int, Rows]:
    """Empty buffers for each gradient that is `Rows`, by its position in `gradients` (the
    micro-step's outputs: which gradients are rows is a property of its graph)."""
    return {j: type(g)(_array(g.values, k), _array(g.indices, k))
            for j, g in enumerate(gradients) if is_rows(g)}


def _array(like: tf.Tensor, k: int) -> tf.TensorArray:
    # A micro-batch's row count is static for fixed-shape batches (one row per lookup) and may
    # differ between micro-batches otherwise (sparse inputs). Eagerly every shape is concrete,
    # so one micro-batch's count says nothing of the next's.
    shape = like.shape
    if tf.executing_eagerly():
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.TensorArray(like.dtype, size=k, element_shape=shape,
                          infer_shape=shape[0] is not None)


def without_sums(sums: list, rows: dict[int, Rows]) -> list:
    """`sums` with a scalar zero in place of each sparse variable's (unused) dense sum."""
    return [tf.zeros((), total.dtype) if j in rows else total for j, total in enumerate(sums)]


def write(rows: dict[int, Rows], i, gradients: list) -> dict[int, Rows]:
    """`rows` with micro-batch `i`'s rows (`gradients`, the micro-step's outputs) written."""
    return {j: type(buffer)(buffer.values.write(i, gradients[j].values),
                            buffer.indices.write(i, gradients[j].indices))
            for j, buffer in rows.items()}


def values(rows: dict[int, Rows], gradients: list) -> list:
    """The rows' values among a micro-step's outputs (`gradients`)."""
    return [gradients[j].values for j in rows]


def with_rows(sums: list, rows: dict[int, Rows], variables: list) -> list:
    """`sums` with each sparse gradient's rows of the window in its place, as a
    `tf.IndexedSlices` (unscaled: `scaled` scales it as a dense sum is): the `k` micro-batches'
    rows in order (`DistinctRows` added up by index, in the order of first appearance, as
    `Unique` orders them). `variables[j % len(variables)]` is position `j`'s variable (the sums
    of several gradient groups follow one another)."""
    sums = list(sums)
    for j, buffer in rows.items():
        values, indices = _read(buffer.values), _read(buffer.indices)
        if isinstance(buffer, DistinctRows):
            indices, segments = tf.unique(indices)
            values = tf.math.unsorted_segment_sum(values, segments, tf.size(indices))
        shape = tf.constant(list(variables[j % len(variables)].shape), indices.dtype)
        sums[j] = tf.IndexedSlices(values, indices, shape)
    return sums


def scaled(total, divide):
    """`divide` applied to a summed gradient, or to the values of a window's rows."""
    if isinstance(total, tf.IndexedSlices):
        return tf.IndexedSlices(divide(total.values), total.indices, total.dense_shape)
    return divide(total)


def added(a, b):
    """Two gradient groups' parts of one variable's gradient together. Rows and rows of the
    same lookups (the same number of rows: the same gathers, micro-batch after micro-batch) add
    up row by row, as TensorFlow adds two losses' gradients before they reach the gather; rows
    of other lookups are the rows of both; anything else is a dense sum."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        rows_a, rows_b = a.values.shape[0], b.values.shape[0]
        if rows_a is not None and rows_a == rows_b:
            check = tf.debugging.assert_equal(
                a.indices, b.indices, message="tfmem: two gradient groups' rows of one "
                "variable are of other lookups")
            with tf.control_dependencies([check]):
                return tf.IndexedSlices(a.values + b.values, tf.identity(a.indices),
                                        a.dense_shape)
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _read(array: tf.TensorArray) -> tf.Tensor:
    """All of `array`'s elements, concatenated along their rows."""
    if array.element_shape[0] is None:
        return array.concat()
    stacked = array.stack()  # elements of one static shape: what a compiled loop can stack
    return tf.reshape(stacked, [-1, *stacked.shape[2:]])
