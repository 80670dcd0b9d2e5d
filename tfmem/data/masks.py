"""Segmentation masks for the writer: checked, read from PNG files, stored as 8-bit PNG.

A mask holds a class index per pixel (`(H, W)`), or for classes that overlap one 0/1 channel
per class (`(H, W, C)`, multi-label), which the record packs into the bits of one 8-bit PNG
(bit `c` for class `c`). Mask files are PNGs: grey, or a palette whose indices are the
classes (as Pascal VOC ships them), read as those indices and not as the palette's colours.
Sources: `(images, masks)` arrays and a folder pair (`images/` + `masks/`, same file stems).
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import zlib
from collections.abc import Sequence

import numpy as np
from tfmem._tf import tf

from tfmem.data import sources
from tfmem.data.schema import Schema, image_format

# Records store masks as 8-bit PNG: class indices and the ignore value lie in [0, 255], and a
# multi-label mask has at most 8 channels (one bit each).
MAX_VALUE = 255
MAX_CHANNELS = 8


class MaskFormat:
    """The values a set's masks may hold, how one that does not is named, how masks are stored.

    Index masks: class indices in `[0, len(class_names))` (any 8-bit value when no class names
    are given) or `ignore_value`. Multi-label masks: 0 or 1 in each of their channels.
    """

    def __init__(self, class_names: Sequence[str] | None, ignore_value: int | None,
                 multi_label: bool):
        if class_names is not None and len(class_names) > MAX_VALUE + 1 - (
                ignore_value is not None):
            raise ValueError(f"{len(class_names)} classes do not fit an 8-bit mask beside the "
                             f"ignore value {ignore_value}; masks hold at most 255 classes.")
        self.class_names = None if class_names is None else list(class_names)
        # A multi-label pixel without a class has all its bits off: nothing to ignore.
        self.ignore_value = None if multi_label else ignore_value
        self.multi_label = multi_label

    def expected(self) -> str:
        if self.multi_label:
            return "0 or 1 in each channel (multi-label)"
        classes = (f"a class index in [0, {len(self.class_names)}) of the class_names"
                   if self.class_names is not None else f"a class index in [0, {MAX_VALUE}]")
        ignore = (f" or the ignore value {self.ignore_value} (`ignore_value`, "
                  "`--ignore-value`)" if self.ignore_value is not None else "")
        return classes + ignore

    @property
    def schema(self) -> Schema:
        """The layout of tfmem's segmentation records with these masks."""
        return dataclasses.replace(sources.SEGMENTATION_SCHEMA, ignore_value=self.ignore_value,
                                   multi_label=self.multi_label)

    @staticmethod
    def encode(mask: np.ndarray) -> bytes:
        """The record's mask: an 8-bit grey PNG of `pack(mask)`."""
        return tf.io.encode_png(pack(mask)[..., None]).numpy()

    def check(self, mask: np.ndarray, where: str) -> int:
        """The largest class in `mask` (-1: none); raises naming `where` on a bad value."""
        if self.multi_label:
            channels = mask.shape[-1]
            if channels > MAX_CHANNELS or (self.class_names is not None
                                           and channels != len(self.class_names)):
                named = (f" for {len(self.class_names)} class_names"
                         if self.class_names is not None else "")
                raise ValueError(
                    f"{where} has {channels} channels{named}; a multi-label mask has one "
                    f"channel per class, at most {MAX_CHANNELS} (the bits of an 8-bit PNG)")
        values = np.unique(mask)
        bad = values < 0
        if self.multi_label:
            bad |= values > 1
        else:
            top = len(self.class_names) - 1 if self.class_names is not None else MAX_VALUE
            bad |= (values > top) & (values != self.ignore_value)
        if bad.any():
            count = int((mask == values[bad][0]).sum())
            raise ValueError(
                f"{where} holds the value {values[bad][0]} ({count} such pixel(s)); expected "
                f"{self.expected()}. Fix the mask, or pass the full "
                "class_names (`--class-names`) and the ignore value")
        if self.multi_label:
            return mask.shape[-1] - 1  # every channel is a class, present or not
        classes = values[values != self.ignore_value]
        return int(classes.max()) if classes.size else -1


def pack(mask: np.ndarray) -> np.ndarray:
    """An `(H, W)` uint8 mask: class indices as they are, multi-label channels as bits."""
    if mask.ndim == 2:
        return mask.astype(np.uint8)
    bits = np.left_shift(mask.astype(np.uint8), np.arange(mask.shape[-1], dtype=np.uint8))
    return np.bitwise_or.reduce(bits, axis=-1).astype(np.uint8)


def _grey_palette(data: bytes) -> bytes:
    """The PNG `data` with palette entry `i` replaced by the grey `(i, i, i)`, so that a
    decoder's colours are the indices themselves."""
    chunks, position = [data[:8]], 8
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        end = position + 12 + length
        if kind == b"PLTE":
            body = bytes(value for index in range(length // 3) for value in (index,) * 3)
            chunks.append(struct.pack(">I4s", length, kind) + body
                          + struct.pack(">I", zlib.crc32(kind + body)))
        else:
            chunks.append(data[position:end])
        position = end
    return b"".join(chunks)


def read(data: bytes, where: str) -> np.ndarray:
    """The `(H, W)` class indices of a mask file: a grey PNG (any bit depth), a palette PNG
    (its indices) or an RGB PNG whose channels are equal; raises naming `where` otherwise."""
    if image_format(data) != "png":
        raise ValueError(f"{where} is not a PNG file; masks must be PNG images of class "
                         "indices (lossless), grey or palette")
    depth, colour = data[24], data[25]
    dtype = tf.uint16 if depth == 16 else tf.uint8
    if colour == 3:  # palette: the index of each pixel is its class
        return tf.io.decode_png(_grey_palette(data), channels=3).numpy()[..., 0]
    if colour in (0, 4):  # grey (+ alpha, dropped)
        grey = tf.io.decode_png(data, channels=1, dtype=dtype).numpy()[..., 0]
        # libpng scales 1, 2 and 4-bit grey to 8 bits; the stored values are the classes.
        return grey // (MAX_VALUE // (2**depth - 1)) if depth < 8 else grey
    rgb = tf.io.decode_png(data, channels=3, dtype=dtype).numpy()
    if (rgb[..., 1:] != rgb[..., :1]).any():
        raise ValueError(
            f"{where} is a colour image: its pixels are colours, not class indices. Convert "
            "each colour to its class index (a grey or palette PNG)")
    return rgb[..., 0]


def _stems(root: str, what: str) -> dict[str, str]:
    """`{path without extension, relative to root: path}` of the files under `root`."""
    if not tf.io.gfile.isdir(root):
        raise ValueError(f"{what} folder {root!r} does not exist or is not a directory.")
    found = {}
    for directory, _, names in tf.io.gfile.walk(root):
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            stem = os.path.splitext(os.path.relpath(path, root))[0]
            if stem in found:
                raise ValueError(f"{found[stem]!r} and {path!r} have the same name: each "
                                 f"{what.lower()} needs a file stem of its own")
            found[stem] = path
    if not found:
        raise ValueError(f"Found no files in the {what.lower()} folder {root!r}.")
    return found


def folder_pair_source(images_root: str, masks_root: str, mask_format: MaskFormat,
                       skip_unreadable: bool, shuffle: bool, seed: int, skipped: list,
                       max_image_pixels: int) -> sources.Source:
    """`images/<stem>.{jpg,png}` with `masks/<stem>.png`: every image needs its mask and every
    mask its image (checked before anything is written)."""
    images, masks = _stems(images_root, "Image"), _stems(masks_root, "Mask")
    for found, other, what, partner, root in (
            (images, masks, "image", "mask", masks_root),
            (masks, images, "mask", "image", images_root)):
        alone = sorted(set(found) - set(other))
        if alone:
            raise ValueError(
                f"{what} {found[alone[0]]!r} has no {partner} in {root!r} (expected a file "
                f"named {alone[0]!r} with any extension; {len(alone)} {what}(s) without one); "
                f"each {what} needs its {partner} under the same name")
    pairs = sorted(images)
    if shuffle:
        random.Random(seed).shuffle(pairs)

    def items():
        for stem in pairs:
            image_path, mask_path = images[stem], masks[stem]
            image = sources.read_image(image_path, images_root, skip_unreadable, skipped,
                                       max_image_pixels)
            if image is None:
                continue
            data, encoding, shape = image
            where = f"mask {mask_path!r}"
            try:
                mask = read(tf.io.gfile.GFile(mask_path, "rb").read(), where)
            except tf.errors.OpError as error:
                raise ValueError(f"{where} cannot be decoded ({error.message}); fix or remove "
                                 "it and its image") from None
            if mask.shape != tuple(shape[:2]):
                raise ValueError(
                    f"{where} is {mask.shape[1]}×{mask.shape[0]} pixels but its image "
                    f"{image_path!r} is {shape[1]}×{shape[0]}; a mask must have its image's "
                    "size")
            largest = mask_format.check(mask, where)
            yield sources.Encoded(data, largest, *shape, encoding,
                                  os.path.relpath(image_path, images_root),
                                  mask_format.encode(mask))

    return sources.Source(mask_format.class_names, len(pairs), items(), mask_format.schema)


def numpy_source(images: np.ndarray, masks: np.ndarray, mask_format: MaskFormat, encoding: str,
                 shuffle: bool, seed: int) -> sources.Source:
    """`(images, masks)` arrays: uint8 `(N, H, W[, C])` with integer `(N, H, W)` class
    indices or `(N, H, W, C)` multi-label 0/1 channels; every mask checked before writing."""
    if masks.shape[1:3] != images.shape[1:3]:
        raise ValueError(f"Masks of shape {masks.shape} do not match images of shape "
                         f"{images.shape}: each mask needs its image's height and width.")
    if not (np.issubdtype(masks.dtype, np.integer) or masks.dtype == bool):
        raise ValueError(f"Masks must hold integer class indices; got {masks.dtype}.")
    largest = [mask_format.check(mask, f"masks[{index}]") for index, mask in enumerate(masks)]
    order = np.random.default_rng(seed).permutation(len(images)) if shuffle else range(
        len(images))

    def items():
        for index in order:
            image = images[index]
            data = (tf.io.encode_png(image) if encoding == "png"
                    else tf.io.encode_jpeg(image, quality=95)).numpy()
            yield sources.Encoded(data, largest[index], *image.shape, encoding, str(index),
                                  mask_format.encode(masks[index]))

    return sources.Source(mask_format.class_names, len(images), items(), mask_format.schema)
