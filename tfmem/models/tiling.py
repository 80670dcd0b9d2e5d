"""Prediction of a per-pixel model on images of any size, by overlapping tiles.

Tiles of the size the model takes cover the image, each step a multiple of the model's stride
(so each tile sees the pooling grid the whole image would), the last one flush with the border
(on that grid only where the image's size less the tile's is a multiple of the stride); each
output pixel comes from the tile in which it lies farthest from an edge inside the image.
"""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np


def predict_tiled(model: keras.Model, images, tile_size: int | tuple[int, int] | None = None,
                  *, overlap: int | tuple[int, int] | None = None, batch_size: int = 1,
                  stride: int | tuple[int, int] | None = None) -> np.ndarray:
    """The model's per-pixel predictions of `images`, computed by overlapping tiles.

    Where the model's receptive field reaches at most `overlap // 2` pixels from a
    pixel, and the tile offsets are multiples of its stride, the result equals the model's
    prediction of each whole image: each pixel is taken from the tile in which it lies
    farthest from an edge inside the image (the middle of each overlap is the seam).

    Args:
        model: a model mapping `(batch, height, width, channels)` to outputs of the same
            height and width (`(batch, height, width, ...)`).
        images: `(num_images, height, width, channels)`, of any height and width; an image
            smaller than a tile is padded with zeros below and to the right, and its
            prediction cropped back.
        tile_size: an int (square) or `(height, width)` the model takes; None: the model's
            input size (for a model built for one size).
        overlap: pixels consecutive tiles share at least, an int or `(height, width)`, each
            below the tile's; None: a quarter of the tile.
        batch_size: tiles per model call; where there are several calls, the last is filled
            up with zeros to this size (one input shape: one compiled function).
        stride: the model's total downsampling (e.g. 16 for a U-Net that pools 4 times), an
            int or `(height, width)`: tile offsets are multiples of it (but the last, flush
            with the border), the step between them `tile - overlap` rounded down to a
            multiple of it. None: found from the
            model, as the smallest step between input sizes it maps to outputs of the same
            size.

    Returns:
        A NumPy array `(num_images, height, width, ...)`: the model's output for each pixel.

    Raises:
        ValueError: `images` not of rank 4, a tile the model does not take (`tile_size`), an
            `overlap` not below the tile or leaving no step of the stride, a `batch_size`
            below 1.

    Example:
        >>> model = tfmem.models.build("unet", num_classes=3, image_size=128)
        >>> images = np.zeros((2, 360, 480, 3), "float32")
        >>> tfmem.predict_tiled(model, images, overlap=32, batch_size=4).shape
        (2, 360, 480, 3)
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"`images` must be (num_images, height, width, channels); got an "
                         f"array of shape {images.shape}. Add the batch axis to one image "
                         "(`images[None]`).")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or (
            batch_size < 1):
        raise ValueError(f"`batch_size` must be an int ≥ 1 (tiles per model call); got "
                         f"{batch_size!r}.")
    tile = _tile_size(model, tile_size, images.shape[-1])
    overlap = _pair(overlap, "overlap") if overlap is not None else tuple(t // 4 for t in tile)
    for axis, (t, o) in enumerate(zip(tile, overlap)):
        if not 0 <= o < t:
            raise ValueError(f"`overlap` {overlap} must be ≥ 0 and below the tile ({tile}) on "
                             f"each axis; got {o} for {('height', 'width')[axis]}. Pass "
                             f"overlap < {t}, e.g. {t // 4}.")
    stride = (_pair(stride, "stride") if stride is not None
              else _stride(any_size_model(model), tile, images.shape[-1]))
    steps = []
    for axis, (t, o, s) in enumerate(zip(tile, overlap, stride)):
        step = (t - o) // s * s
        if step < 1:
            raise ValueError(
                f"`overlap` {o} leaves a step of {t - o} pixels between tiles of {t} "
                f"({('height', 'width')[axis]}), less than the model's stride {s}, to which "
                f"tile offsets are aligned; pass overlap ≤ {t - s}.")
        steps.append(step)
    _, height, width, _ = images.shape
    rows = _placements(height, tile[0], steps[0])
    columns = _placements(width, tile[1], steps[1])
    padded = np.pad(images, ((0, 0), (0, max(tile[0] - height, 0)),
                             (0, max(tile[1] - width, 0)), (0, 0)))
    tiles = [(n, row, column) for n in range(len(images)) for row in rows for column in columns]
    output = None
    for start in range(0, len(tiles), batch_size):
        chunk = tiles[start:start + batch_size]
        batch = np.stack([padded[n, r[0]:r[0] + tile[0], c[0]:c[0] + tile[1]]
                          for n, r, c in chunk])
        if len(tiles) > batch_size > len(chunk):  # each call one shape: one compiled function
            batch = np.pad(batch, ((0, batch_size - len(chunk)), (0, 0), (0, 0), (0, 0)))
        predicted = keras.ops.convert_to_numpy(model.predict_on_batch(batch))
        if output is None:
            output = np.zeros((len(images), height, width, *predicted.shape[3:]),
                              predicted.dtype)
        for (n, (top, first_row, end_row), (left, first_column, end_column)), values in zip(
                chunk, predicted):
            output[n, first_row:end_row, first_column:end_column] = values[
                first_row - top:end_row - top, first_column - left:end_column - left]
    return output


def _pair(value, argument: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, numbers.Integral) else value
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                       for v in pair)):
        raise ValueError(f"`{argument}` must be an int or (height, width) ints; got {value!r}.")
    return int(pair[0]), int(pair[1])


def any_size_model(model: keras.Model) -> keras.Model:
    """`model` (its layers and weights shared), taking inputs of any height and width: the same
    graph called on an input without spatial sizes where the model was built for one size."""
    if None in tuple(model.input_shape[1:3]):
        return model
    return keras.models.clone_model(
        model, input_tensors=keras.Input((None, None, model.input_shape[-1])),
        clone_function=lambda layer: layer)  # the layer itself: weights shared, not copied


def _takes(model: keras.Model, size: tuple[int, int], channels: int) -> bool:
    """Whether the model (of any input size) maps inputs of `size` to outputs of the same
    height and width, worked out on shapes alone."""
    try:
        output = model.compute_output_spec(keras.KerasTensor((1, *size, channels)))
    except (ValueError, TypeError):  # a shape its layers refuse (JAX's shape errors: TypeError)
        return False
    shape = getattr(output, "shape", None)
    return shape is not None and len(shape) >= 3 and tuple(shape[1:3]) == tuple(size)


def _tile_size(model: keras.Model, tile_size, channels: int) -> tuple[int, int]:
    """The tile `(height, width)`, checked: one the model takes."""
    fixed = tuple(model.input_shape[1:3])
    if tile_size is None:
        if None in fixed:
            raise ValueError(f"`tile_size` is needed: the model takes inputs of any size "
                             f"({model.input_shape}); pass the size it was trained at.")
        return fixed
    tile = _pair(tile_size, "tile_size")
    if None not in fixed and tile != fixed:
        raise ValueError(f"`tile_size` {tile}: the model takes only {fixed[0]}×{fixed[1]} "
                         f"inputs (its input shape {model.input_shape}); pass "
                         f"tile_size={fixed}, or leave it out.")
    if tile == fixed:
        return tile
    if min(tile) < 1 or not _takes(model, tile, channels):
        raise ValueError(f"`tile_size` {tile}: the model does not map {tile[0]}×{tile[1]} "
                         "inputs to outputs of that size; pass a size it takes (the size it "
                         "trains at).")
    return tile


def _stride(model: keras.Model, tile: tuple[int, int], channels: int) -> tuple[int, int]:
    """Per axis, the smallest step between input sizes the model maps to outputs of the same
    size: the smallest divisor `d` of the tile for which it takes the tile grown by `d`."""
    stride = []
    for axis, size in enumerate(tile):
        grown = list(tile)
        for step in (d for d in range(1, size + 1) if size % d == 0):
            grown[axis] = size + step
            if _takes(model, tuple(grown), channels):
                stride.append(step)
                break
        else:
            raise ValueError(
                f"`stride` is needed: the model takes no {('height', 'width')[axis]} other "
                f"than the tile's {size} (up to {2 * size}), so the step between tiles that "
                "keeps its pooling grid is unknown; pass stride=<its total downsampling>.")
    return tuple(stride)


def _placements(size: int, tile: int, step: int) -> list[tuple[int, int, int]]:
    """Along one axis: `(offset, first, end)` of each tile, the pixels `first:end` taken from
    it. Offsets step by `step`, the last flush with the border (0 when the image is smaller
    than the tile); each pixel belongs to the tile where it lies farthest from an edge that
    is not the image's border."""
    offsets = [0] if size <= tile else [*range(0, size - tile, step), size - tile]
    pixels = np.arange(size)
    distances = []
    for offset in offsets:
        top = pixels - offset if offset > 0 else np.full(size, math.inf)
        bottom = (offset + tile - 1 - pixels if offset + tile < size
                  else np.full(size, math.inf))
        inside = (pixels >= offset) & (pixels < offset + tile)
        distances.append(np.where(inside, np.minimum(top, bottom), -1.0))
    owner = np.argmax(np.stack(distances), axis=0)  # ties: the earlier tile
    placements = []
    for index, offset in enumerate(offsets):
        owned = np.flatnonzero(owner == index)
        if owned.size:
            placements.append((offset, int(owned[0]), int(owned[-1]) + 1))
    return placements
