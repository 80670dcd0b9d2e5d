"""glibc's heap with a fixed mmap threshold: freed tensors go back to the system.

glibc's `malloc` raises its mmap threshold to the largest block freed (up to 32 MiB on 64-bit)
and keeps freed blocks under it in its heap, so a CPU training step's resident set stays near
its peak and grows with the micro-batch by more than the tensors it holds. With the threshold
fixed, each block of that size or more is mapped on its own and unmapped when freed, and the
resident set follows TensorFlow's allocator. It costs time (each large block faulted in anew
at every step: docs/benchmarks.md), so tfmem leaves the choice to the user, and a CPU plan
counts what the default heap keeps unless the threshold is fixed. Only on Linux with glibc;
elsewhere (macOS, Windows, musl) nothing changes and `fix_mmap_threshold` returns False.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

MIB = 2**20
DEFAULT_THRESHOLD = MIB
ENVIRONMENT = "MALLOC_MMAP_THRESHOLD_"  # read by glibc when a process starts
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
_LARGEST = 32 * MIB  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None (found once: `platform.libc_ver`
    reads the Python executable)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def threshold_fixed() -> bool:
    """Whether glibc's mmap threshold is fixed in this process: by `fix_mmap_threshold`, or by
    `MALLOC_MMAP_THRESHOLD_` when it started. False elsewhere (another heap, kept unknown)."""
    return glibc() is not None and ENVIRONMENT in os.environ


def fix_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold at `threshold` bytes in this process and the processes it
    starts from now on (through `MALLOC_MMAP_THRESHOLD_` in `os.environ`).

    Call it before the first training step (blocks freed before stay in the heap) and
    before planning: a CPU plan made after it no longer counts what the default heap keeps.
    Less memory, more time: CPU training steps took 18-84% more CPU time with it.

    Args:
        threshold: blocks of this many bytes or more get their own mapping (1 to 32 MiB).

    Returns:
        True when set; False where the C library is not glibc (nothing changed).

    Raises:
        ValueError: `threshold` outside 1 byte to 32 MiB.

    Example:
        >>> from tfmem.runtime import fix_mmap_threshold
        >>> fix_mmap_threshold()  # on Linux with glibc
        True
    """
    if not 0 < threshold <= _LARGEST:
        raise ValueError(f"`threshold` ({threshold} bytes) must be between 1 byte and "
                         f"{_LARGEST // MIB} MiB, the largest glibc accepts; the default is "
                         f"{DEFAULT_THRESHOLD // MIB} MiB")
    libc = glibc()
    if libc is None:
        return False
    if not libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)):
        return False
    os.environ[ENVIRONMENT] = str(threshold)
    return True
