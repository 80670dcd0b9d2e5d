"""What a tensor takes in XLA:TPU's memory: its two minor dimensions padded to the tile.

XLA:TPU stores an array in tiles of 8 × 128 elements (32 × 128 for 1-byte types) over its two
minor dimensions. For an activation it lays either the channels (the last axis) or the
batch along the 128 lanes, with another axis across the 8 sublanes, whichever pads less: a
feature map of 24 channels at micro-batch 8 takes 128/24 = 5.3 × its bytes, at micro-batch
32 128/32 = 4 × (the batch on the lanes), and none from micro-batch 128 on. So the bytes a
plan counts for a TPU are a step function of the micro-batch, not a line
(`MemoryPlan.lane_padding_bytes`).
"""

from __future__ import annotations

import math

LANES = 128


def _rows(itemsize: int) -> int:
    """The sublane tile of a type: 8 rows, 32 for a 1-byte type (packed four to a word)."""
    return 32 if itemsize == 1 else 8


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_elements(shape: tuple[int, ...], itemsize: int) -> int:
    """Elements XLA:TPU allocates for an array of `shape` (the batch first): the least over
    the batch or the last axis on the lanes and any other axis on the sublanes."""
    if len(shape) < 2:
        return _up(math.prod(shape), LANES)
    total = math.prod(shape)
    best = None
    for minor in {0, len(shape) - 1}:
        for second in range(len(shape)):
            if second == minor or shape[minor] == 0 or shape[second] == 0:
                continue
            rest = total // (shape[minor] * shape[second])
            count = rest * _up(shape[minor], LANES) * _up(shape[second], _rows(itemsize))
            best = count if best is None else min(best, count)
    return total if best is None else best


def padding_bytes(tensors, micro_batch: int) -> int:
    """Bytes beyond their values that XLA:TPU's tiles add to `tensors`, `((sample shape,
    itemsize), bytes per sample)` pairs, at `micro_batch`."""
    extra = 0
    for (sample_shape, size), nbytes in tensors:
        shape = (micro_batch,) + tuple(sample_shape)
        values = math.prod(shape)
        if values:
            extra += nbytes * micro_batch * (padded_elements(shape, size) - values) // values
    return extra
