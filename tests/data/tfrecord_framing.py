"""Reading a TFRecord file's framing directly (not through TensorFlow), for tests that damage
files at exact record boundaries."""

import struct


def record_lengths(path) -> list[int]:
    """Lengths of the records of a TFRecord file: each record is an 8-byte little-endian
    length, a 4-byte CRC of it, the data, and a 4-byte CRC of the data (16 bytes of framing)."""
    data, offset, lengths = open(path, "rb").read(), 0, []
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        lengths.append(length)
        offset += length + 16
    return lengths
