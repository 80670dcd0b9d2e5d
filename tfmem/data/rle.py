"""Kaggle's run-length-encoded CSV masks, read beside their image folder (`csv_source`).

The CSV has a row per image and class, in one of these layouts (column names are matched
without regard to case):

- `ImageId_ClassId,EncodedPixels` or `Image_Label,EncodedPixels`: `0011165.jpg_Fish`, the
  image and the class joined by the last `_` (Severstal steel, Understanding Clouds);
- `ImageId,ClassId,EncodedPixels`: the class in a column of its own;
- `ImageId,EncodedPixels`: one class (e.g. one row per ship, Airbus).

`EncodedPixels` is `start length start length ...`, empty for no pixel: the starts are 1-based
and count down the columns (column-major: pixel `(row, column)` of an image `height` rows high
is number `column * height + row + 1`). Classes are sorted by name (as numbers when all are).
When no two classes of an image share a pixel, the masks are class indices (0 background,
then the classes); when some do, one 0/1 channel per class (multi-label).

A CSV with rows of empty `EncodedPixels` writes out the images without masks, so it lists
every image, and an image of the folder without a row is an error (the wrong folder); a CSV
without such rows lists only the images with masks (Severstal's newer `train.csv`, a table
whose empty rows were dropped), and an image without a row has an empty mask (all background).
"""

from __future__ import annotations

import csv
import os
import random
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from tfmem._tf import tf

from tfmem.data import masks as masks_lib
from tfmem.data import sources

BACKGROUND = "background"
_RUNS = "encodedpixels"


def _columns(header: list[str], path: str) -> tuple[int, int | None, int, bool]:
    """(image column, class column or None, runs column, image and class joined in one)."""
    names = [name.strip().lower() for name in header]
    expected = ("expected ImageId_ClassId,EncodedPixels or Image_Label,EncodedPixels, "
                "ImageId,ClassId,EncodedPixels or ImageId,EncodedPixels")
    if _RUNS not in names:
        raise ValueError(f"{path!r} has no EncodedPixels column (its header: {header}); "
                         f"{expected}")
    runs = names.index(_RUNS)
    others = [index for index in range(len(names)) if index != runs]
    if len(others) == 2:
        return others[0], others[1], runs, False
    if len(others) == 1:
        first, _, second = names[others[0]].partition("_")
        joined = first.startswith("image") and second not in ("", "id", "name")
        return others[0], None, runs, joined
    raise ValueError(f"{path!r} has the columns {header}; {expected}")


def parse_runs(text: str) -> np.ndarray:
    """`"start length ..."` → an `(n, 2)` int64 array of 0-based `[start, stop)` runs."""
    values = np.array(text.split(), dtype=np.int64)
    if values.size % 2:
        raise ValueError("its runs are not pairs of start and length")
    pairs = values.reshape(-1, 2)
    return np.stack([pairs[:, 0] - 1, pairs[:, 0] - 1 + pairs[:, 1]], axis=1)


def decode(runs: np.ndarray, height: int, width: int) -> np.ndarray:
    """The `(height, width)` bool mask of 0-based runs counted down the columns."""
    if runs.size and (runs[:, 0].min() < 0 or (runs[:, 1] < runs[:, 0]).any()
                      or runs[:, 1].max() > height * width):
        raise ValueError(f"its runs leave the image's {height * width} pixels ({width}×{height}"
                         "), or have a negative start or length")
    flat = np.zeros(height * width + 1, np.int32)
    np.add.at(flat, runs[:, 0], 1)
    np.add.at(flat, runs[:, 1], -1)
    return (np.cumsum(flat[:-1]) > 0).reshape(width, height).T


def _overlap(runs_by_class: dict[str, np.ndarray]) -> bool:
    """Whether runs of two different classes share a pixel."""
    spans = sorted((start, stop, name) for name, runs in runs_by_class.items()
                   for start, stop in runs.tolist() if stop > start)
    reach: dict[str, int] = {}  # the furthest stop of each class so far
    for start, stop, name in spans:
        if any(end > start for other, end in reach.items() if other != name):
            return True
        reach[name] = max(reach.get(name, 0), stop)
    return False


def _sorted_classes(names: set[str]) -> list[str]:
    numeric = all(name.lstrip("-").isdigit() for name in names)
    return sorted(names, key=int if numeric else str)


def read_csv(path: str) -> tuple[dict[str, dict[str, np.ndarray]], bool]:
    """`{image id: {class: runs}}` of a Kaggle RLE CSV, the rows of one image and class (one
    per object) joined, and whether it has a row of empty runs (so lists every image)."""
    with tf.io.gfile.GFile(path, "r") as file:
        rows = csv.reader(file)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{path!r} is empty; expected a CSV of run-length-encoded masks.")
        image_column, class_column, runs_column, joined = _columns(header, path)
        table: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        lists_every_image = False
        for number, row in enumerate(rows, start=2):
            if not row:
                continue
            image, name = row[image_column], "1"
            if joined:
                image, _, name = image.rpartition("_")
            elif class_column is not None:
                name = row[class_column]
            try:
                runs = parse_runs(row[runs_column])
            except (ValueError, IndexError) as error:
                raise ValueError(f"{path!r} line {number} ({image!r}, class {name!r}): "
                                 f"{error}; expected `start length ...` pairs") from None
            table[image][name].append(runs)
            lists_every_image = lists_every_image or not runs.size
    return ({image: {name: np.concatenate(runs) for name, runs in by_class.items()}
             for image, by_class in table.items()}, lists_every_image)


def csv_source(images_root: str, csv_path: str, class_names: Sequence[str] | None,
               ignore_value: int | None, skip_unreadable: bool, shuffle: bool, seed: int,
               skipped: list, max_image_pixels: int) -> sources.Source:
    """The images of `images_root` with their masks from the RLE CSV `csv_path`."""
    table, lists_every_image = read_csv(csv_path)
    found = sorted({name for by_class in table.values() for name in by_class})
    classes = list(class_names) if class_names is not None else _sorted_classes(set(found))
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ValueError(f"{csv_path!r} has the class(es) {unknown}, not among the class_names "
                         f"{classes}; pass every class, or leave class_names out")
    multi_label = any(_overlap(by_class) for by_class in table.values())
    if not tf.io.gfile.isdir(images_root):
        raise ValueError(f"Image folder {images_root!r} does not exist or is not a directory.")
    files = {name: os.path.join(images_root, name) for name in tf.io.gfile.listdir(images_root)
             if not name.startswith(".")
             and not tf.io.gfile.isdir(os.path.join(images_root, name))}
    stems = {os.path.splitext(name)[0]: path for name, path in files.items()}
    paths = {image: files.get(image, stems.get(image)) for image in table}
    missing = sorted(image for image, path in paths.items() if path is None)
    if missing:
        raise ValueError(f"{csv_path!r} has masks for {len(missing)} image(s) not in "
                         f"{images_root!r}, e.g. {missing[0]!r}; each mask needs its image")
    used = set(paths.values())
    alone = sorted(path for path in files.values() if path not in used)
    if alone and lists_every_image:
        raise ValueError(
            f"image {alone[0]!r} has no row in {csv_path!r} ({len(alone)} such image(s)), which "
            "lists every image (it has rows of empty EncodedPixels); check that the images "
            "folder is the CSV's, or give each image without a mask a row of empty "
            "EncodedPixels")
    for path in alone:  # the CSV lists only the images with masks: the rest have none
        image = os.path.relpath(path, images_root)
        table[image], paths[image] = {}, path
    mask_format = masks_lib.MaskFormat(
        classes if multi_label else [BACKGROUND, *classes], ignore_value, multi_label)
    order = sorted(table)
    if shuffle:
        random.Random(seed).shuffle(order)

    def items():
        for image in order:
            path = paths[image]
            read = sources.read_image(path, images_root, skip_unreadable, skipped,
                                      max_image_pixels)
            if read is None:
                continue
            data, encoding, shape = read
            height, width = shape[:2]
            channels = np.zeros((height, width, len(classes)), np.uint8)
            for name, runs in table[image].items():
                try:
                    channels[..., classes.index(name)] = decode(runs, height, width)
                except ValueError as error:
                    raise ValueError(f"{csv_path!r}, image {image!r}, class {name!r}: "
                                     f"{error}") from None
            if multi_label:
                mask = channels
            else:  # no pixel has two classes: at most one channel is on
                mask = (channels * np.arange(1, len(classes) + 1, dtype=np.uint8)).sum(
                    axis=-1).astype(np.uint8)
            largest = mask_format.check(mask, f"the mask of {image!r} in {csv_path!r}")
            yield sources.Encoded(data, largest, height, width, shape[2], encoding,
                                  os.path.relpath(path, images_root), mask_format.encode(mask))

    return sources.Source(mask_format.class_names, len(order), items(), mask_format.schema)
