"""Checks that the records read are the records written, and the log of what was skipped.

Before the first batch, every shard a manifest lists must exist with the byte size the
manifest records. While a shard streams, the bytes of its records must add up to the file's
size (a bad CRC or a cut inside a record stops the reader early) and, when a manifest gives
it, the number of records must match (a cut at a record boundary). Each record keeps its
shard number and index, so a record that cannot be decoded or carries a label outside the
classes is named. `skip_corrupt=True` turns the damage into skipped records, printed on
stderr as they happen and kept, per shard, in a `SkippedRecords` log.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections.abc import Sequence

from tfmem._tf import tf

from tfmem.data import manifest as manifest_lib

RECORD_FRAMING_BYTES = 16  # uint64 length + CRC of the length + CRC of the data
UNKNOWN = -1  # expected record count of a foreign shard (no manifest)
_CHECK_BLOCK = 32  # records counted per step of the shard check


class SkippedRecords:
    """A log of the records `image_dataset(..., skip_corrupt=True)` skipped, per shard.

    Thread-safe (tf.data calls it from its own threads) and without repeats: an epoch that
    reads the same damaged shard again adds nothing new.

    Example:
        >>> skipped = tfmem.SkippedRecords()
        >>> train = tfmem.image_dataset("/data/train", image_size=(224, 224), batch_size=64,
        ...                             training=True, skip_corrupt=True, skipped=skipped)
        ...                                                              # doctest: +SKIP
        >>> model.fit(train); print(skipped.summary())                  # doctest: +SKIP
        skipped 18 record(s) in 1 shard(s):
          /data/train/shard-….tfrecord: records 494-511 (18): it holds 494 records, its ...
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, dict[tuple[int, int], str]] = {}

    def add(self, shard: str, first: int, count: int, reason: str) -> bool:
        """Records `count` records of `shard` from index `first` (count -1: an unknown number).

        Returns whether this skip is new.
        """
        with self._lock:
            entries = self._entries.setdefault(shard, {})
            new = (first, count) not in entries
            entries.setdefault((first, count), reason)
            return new

    @property
    def num_records(self) -> int:
        """Records skipped (those of an unknown count not included)."""
        with self._lock:
            return sum(max(count, 0) for entries in self._entries.values() for _, count in entries)

    def by_shard(self) -> dict[str, list[tuple[int, int, str]]]:
        """`{shard: [(first index, count, reason), ...]}`, in order of index."""
        with self._lock:
            return {shard: sorted((first, count, reason) for (first, count), reason in
                                  entries.items())
                    for shard, entries in sorted(self._entries.items())}

    def summary(self) -> str:
        """One line per shard and damage; empty when nothing was skipped."""
        shards = self.by_shard()
        if not shards:
            return ""
        lines = [f"skipped {self.num_records} record(s) in {len(shards)} shard(s):"]
        for shard, entries in shards.items():
            for first, count, reason in entries:
                if count < 0:
                    which = f"records from {first} on (an unknown number)"
                elif count == 1:
                    which = f"record {first}"
                else:
                    which = f"records {first}-{first + count - 1} ({count})"
                lines.append(f"  {shard}: {which}: {reason}")
        return "\n".join(lines)

    def _add_from_graph(self, shards, firsts, counts, reasons) -> None:
        for shard, first, count, reason in zip(shards.numpy(), firsts.numpy(), counts.numpy(),
                                               reasons.numpy()):
            shard, first, count, reason = shard.decode(), int(first), int(count), reason.decode()
            if self.add(shard, first, count, reason):  # each skip printed once per process
                what = f"record {first}" if count == 1 else f"records from {first}"
                print(f"tfmem: skipped {what} of {shard}: {reason}", file=sys.stderr,
                      flush=True)


def report_skips(log: SkippedRecords | None, shards, firsts, counts, reasons) -> None:
    """In a tf.data function: adds skips (vectors, one entry per skip) to `log` and prints
    them on stderr (without a log: prints them each time they happen)."""
    firsts, counts = tf.cast(firsts, tf.int64), tf.cast(counts, tf.int64)
    if log is not None:
        tf.py_function(log._add_from_graph, [shards, firsts, counts, reasons], [])
        return
    what = tf.where(counts == 1, tf.strings.join(["record ", tf.strings.as_string(firsts)]),
                    tf.strings.join(["records from ", tf.strings.as_string(firsts)]))
    lines = tf.strings.join(["tfmem: skipped ", what, " of ", shards, ": ", reasons])
    tf.print(tf.strings.reduce_join(lines, separator="\n"), output_stream=sys.stderr)


def check_shards(manifest: manifest_lib.Manifest, files: Sequence[str], skip_corrupt: bool,
                 log: SkippedRecords | None) -> list[str]:
    """The `files` that exist; every listed shard compared with the manifest's byte size.

    Raises:
        ValueError: a shard is missing or has another size (unless `skip_corrupt`, which
            drops missing shards and reads short ones as far as they go).
    """
    sizes = {shard.name: shard for shard in manifest.shards}
    problems, present = [], []
    for path in files:
        shard = sizes[os.path.basename(path)]
        if not tf.io.gfile.exists(path):
            problems.append(f"{path} is missing")
            if skip_corrupt:
                reason = "the shard is missing"
                if log is None or log.add(path, 0, shard.num_examples, reason):
                    print(f"tfmem: skipped records 0-{shard.num_examples - 1} of {path}: "
                          f"{reason}", file=sys.stderr)
            continue
        present.append(path)
        size = tf.io.gfile.stat(path).length
        if size != shard.num_bytes:
            problems.append(f"{path} has {size} bytes, the manifest says {shard.num_bytes}")
            if skip_corrupt:  # read as far as it goes; the stream check names what is lost
                print(f"tfmem: {problems[-1]}; reading what it holds", file=sys.stderr)
    if problems and not skip_corrupt:
        raise ValueError(
            f"the set in {manifest.directory} does not match its {manifest_lib.MANIFEST_NAME}: "
            f"{'; '.join(problems)}; copy or write the set again, or pass skip_corrupt=True "
            "(`--skip-corrupt`) to read what is left")
    if not present:
        raise ValueError(f"none of the {len(files)} shard(s) of {manifest.directory} exists; "
                         "copy or write the set again")
    return present


def checked_records(filename, shard, size, expected, skip_corrupt: bool,
                    log: SkippedRecords | None) -> tf.data.Dataset:
    """`(record, shard, index)` for each record of one shard, then a check of the whole file.

    The end-of-shard check compares the bytes read with the file's size and, when `expected`
    is known, the records read with it. Damage raises `InvalidArgumentError` naming the shard,
    or with `skip_corrupt` is reported and skipped.
    """
    # Counted in blocks of records: one scan step per block instead of per record keeps the
    # check far below the cost of decoding an image. Blocks stay small: each open shard
    # holds one.
    blocks = tf.data.TFRecordDataset(filename).ignore_errors().batch(_CHECK_BLOCK)
    # An end marker after the last block lets a `scan` compare what was read with the file.
    marked = blocks.map(lambda b: (b, False)).concatenate(
        tf.data.Dataset.from_tensors((tf.constant([], tf.string), True)))

    def step(state, element):
        num_bytes, num_records = state
        block, is_end = element
        first = num_records
        num_bytes += tf.reduce_sum(tf.cast(tf.strings.length(block), tf.int64)
                                   + RECORD_FRAMING_BYTES)
        num_records += tf.size(block, out_type=tf.int64)
        short = num_bytes != size
        wrong_count = tf.logical_and(expected >= 0, num_records != expected)
        if is_end and (short or wrong_count):  # autograph: a tf.cond, evaluated per block
            lost = tf.where(expected >= 0, expected - num_records, UNKNOWN)
            reason = tf.where(
                short,
                tf.strings.join(["truncated or corrupted: its records stop at byte ",
                                 tf.strings.as_string(num_bytes), " of ",
                                 tf.strings.as_string(size)]),
                tf.strings.join(["it holds ", tf.strings.as_string(num_records),
                                 " records, its manifest says ", tf.strings.as_string(expected)]))
            if skip_corrupt:
                if lost != 0:
                    report_skips(log, filename[None], num_records[None], lost[None],
                                 reason[None])
            else:
                read = tf.where(
                    expected >= 0,
                    tf.strings.join(["read ", tf.strings.as_string(num_records), " of ",
                                     tf.strings.as_string(expected), " records"]),
                    tf.strings.join(["read ", tf.strings.as_string(num_records),
                                     " records, the rest is lost"]))
                tf.debugging.Assert(False, [tf.strings.join([
                    "tfmem: shard ", filename, ": ", reason, "; ", read, ". Copy or write the "
                    "set again, or pass skip_corrupt=True (`--skip-corrupt`) to skip what "
                    "cannot be read"])])
        return (num_bytes, num_records), (block, first, is_end)

    initial = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
    shard = tf.cast(shard, tf.int32)
    return marked.scan(initial, step).filter(lambda b, first, is_end: not is_end).map(
        lambda b, first, is_end: (b, tf.fill(tf.shape(b), shard),
                                  first + tf.range(tf.size(b, out_type=tf.int64)))).unbatch()


def count_records(path: str) -> int | None:
    """Complete records in a local TFRecord file, from its framing (lengths only, payloads
    skipped); a record cut by the end of the file is not counted (the reader names it).

    None for remote files (a URL such as gs://...), where one seek per record is slow.
    """
    if "://" in path:
        return None
    count, offset, size = 0, 0, os.path.getsize(path)
    with open(path, "rb") as file:
        while True:
            header = file.read(8)
            if len(header) < 8:
                break
            (length,) = struct.unpack("<Q", header)
            offset += length + RECORD_FRAMING_BYTES
            if offset > size:
                break
            file.seek(offset)
            count += 1
    return count
