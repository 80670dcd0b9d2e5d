"""A memory cap on a child process, enforced from outside it: the machine never swaps to a halt.

`MemoryWatch` polls a process's memory (resident set plus what it has in swap, from /proc) every
20 ms and SIGKILLs it at the cap. It runs in the parent, so a child busy in native code, holding
its GIL or swapping cannot delay it, and it needs no privilege (cgroups are often read-only in
containers and notebooks). It guarantees the child never holds more than the cap plus what it
can allocate in one poll (a few hundred MiB at memory bandwidth), and nothing about other
processes. Linux only (it reads /proc); elsewhere it records nothing and stops nothing.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from tfmem.runtime import devices

POLL_SECONDS = 0.02

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
    """Bytes a process holds in RAM and in swap (`VmRSS` + `VmSwap`); None when it is gone.

    Swap counts: a process pushed into swap frees RAM while the machine thrashes, which is
    what the cap is there to prevent.
    """
    fields = status_bytes(pid)
    if fields is None:
        return devices.resident_bytes(pid)
    return fields.get("VmRSS", 0) + fields.get("VmSwap", 0) or None


def default_cap() -> int:
    """80% of the RAM available now (`MemAvailable`): the cap `--memory-limit auto` takes."""
    return int(0.8 * devices.host_available_memory())


class MemoryWatch(threading.Thread):
    """Watches a process; SIGKILLs it when its memory reaches `limit` (None: only records).

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
        while not self._done.is_set():
            held = process_memory(self.pid)
            if held is None:
                return
            self.highest = max(self.highest, held)
            if self.limit is not None and held >= self.limit:
                self.reason = (
                    f"stopped by the memory limit: resident set reached {held / 2**30:.2f} GiB "
                    f"(limit {self.limit / 2**30:.2f} GiB)")
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended on its own meanwhile
                    pass
                return
            time.sleep(POLL_SECONDS)

    def stop(self) -> None:
        self._done.set()
        self.join()
