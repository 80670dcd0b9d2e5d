"""A memory cap on a child process, enforced from outside it: the machine never swaps to a halt.

`MemoryWatch` polls a process's memory through psutil (Linux, macOS, Windows: its resident set
every 20 ms, plus what it has in swap: Linux's VmSwap, elsewhere where psutil reads it) and kills
it at the cap. It runs in the parent, so a child busy in native code, holding
its GIL or swapping cannot delay it, and it needs no privilege (cgroups are often read-only in
containers and notebooks). It guarantees the child never holds more than the cap plus what it
can allocate in one poll (a few hundred MiB at memory bandwidth), and nothing about other
processes. Where a platform gives no per-process swap, `limit_note()` says so (once, at the start).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import psutil

from tfmem.runtime import devices

POLL_SECONDS = 0.02
# psutil reads a process's swap by walking its memory map (about 20 ms of CPU for a TensorFlow
# process; Linux's VmSwap is one small read): read less often than its resident set.
SWAP_POLL_SECONDS = 0.5

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """`"3GB"` → 3·10⁹ bytes, `"2.5GiB"` → 2.5·2³⁰, `"800M"` → 8·10⁸, `"1024"` → 1024.

    Raises:
        ValueError: not a positive size, naming the accepted forms.
    """
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size; write a positive number of bytes with a "
                         "unit, e.g. 3GB, 2.5GiB or 800MB")
    return int(float(match.group(1)) * _UNITS[unit])


def status_bytes(pid: int | str = "self") -> dict[str, int] | None:
    """The byte-sized fields of `/proc/<pid>/status` (`VmRSS`, `VmSwap`, `VmData`, `VmHWM`,
    ...) in bytes; None when the process is gone or the system has no /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = [line.split() for line in status]
    except OSError:
        return None
    return {fields[0].rstrip(":"): int(fields[1]) * 1024 for fields in lines
            if len(fields) == 3 and fields[2] == "kB"}


def process_memory(pid: int | str = "self") -> int | None:
    """Bytes a process holds in RAM and in swap (swap where the platform reports it, see
    `limit_note`); None when it is gone.

    Swap counts: a process pushed into swap frees RAM while the machine thrashes, which is
    what the cap is there to prevent.
    """
    try:
        process = psutil.Process(None if pid == "self" else int(pid))
        return process.memory_info().rss + _swap_bytes(process)
    except psutil.Error:
        return None


def _full_reading(process: psutil.Process):
    """psutil's `memory_full_info()` (with `swap` on Linux), or None where it is refused."""
    try:
        return process.memory_full_info()
    except psutil.AccessDenied:
        return None


def _swap_bytes(process: psutil.Process) -> int:
    """The swap `process` holds: Linux's VmSwap, else the `swap` of psutil's full reading where
    it has one (0 where it has none)."""
    status = status_bytes(process.pid)
    if status is not None and "VmSwap" in status:
        return status["VmSwap"]
    return getattr(_full_reading(process), "swap", 0)


def held_bytes(reading, full_reading=None) -> int:
    """Resident set (`reading.rss`) plus swap, where `full_reading` has a `swap` field."""
    return reading.rss + getattr(full_reading, "swap", 0)


def limit_note(full_reading) -> str | None:
    """What a memory limit cannot count, given psutil's `memory_full_info()` of a process here
    (None where it was refused): None when it counts RAM and swap."""
    if full_reading is not None and "swap" in full_reading._fields:
        return None
    return ("--memory-limit counts the training process's resident memory only: psutil "
            "reads no per-process swap on this system, so memory pushed to swap is not "
            "counted")


def limit_note_here() -> str | None:
    """`limit_note` of this platform (read from this process)."""
    return limit_note(_full_reading(psutil.Process()))


def default_cap() -> int:
    """80% of the RAM available now (`MemAvailable`): the cap `--memory-limit auto` takes."""
    return int(0.8 * devices.host_available_memory())


class MemoryWatch(threading.Thread):
    """Watches a process; kills it (SIGKILL, or TerminateProcess on Windows) when its memory reaches `limit` (None: only records).

    Attributes:
        highest: the most memory seen, in bytes.
        reason: empty, or the line that says the process was stopped and at how much.

    Example:
        >>> watch = MemoryWatch(child.pid, 3 * 2**30)
        >>> watch.start(); child.wait(); watch.stop()  # doctest: +SKIP
        >>> watch.reason  # doctest: +SKIP
        'stopped by the memory limit: resident set reached 3.00 GiB (limit 3.00 GiB)'
    """

    def __init__(self, pid: int, limit: int | None):
        super().__init__(daemon=True)
        self.pid, self.limit = pid, limit
        self.highest, self.reason = 0, ""
        self._done = threading.Event()

    def run(self) -> None:
        try:
            process = psutil.Process(self.pid)
        except psutil.Error:
            return
        swap, swap_read = 0, float("-inf")
        while not self._done.is_set():
            try:
                if time.monotonic() - swap_read >= SWAP_POLL_SECONDS:
                    swap = _swap_bytes(process)
                    swap_read = time.monotonic()
                held = process.memory_info().rss + swap
            except psutil.Error:  # it ended
                return
            self.highest = max(self.highest, held)
            if self.limit is not None and held >= self.limit:
                self.reason = (
                    f"stopped by the memory limit: resident set reached {held / 2**30:.2f} GiB "
                    f"(limit {self.limit / 2**30:.2f} GiB)")
                with contextlib.suppress(psutil.Error):  # it ended on its own meanwhile
                    process.kill()
                return
            time.sleep(POLL_SECONDS)

    def stop(self) -> None:
        self._done.set()
        self.join()
