"""Memory read through psutil: the same numbers as Linux's /proc, and what a limit counts
where psutil reads less (macOS and Windows give no per-process swap)."""

import subprocess
import sys

import psutil
import pytest

from tfmem.runtime import devices, memory_cap

MIB = 2**20

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="compares psutil's readings with Linux's /proc")


def _status(pid, field):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@linux_only
def test_psutil_readings_agree_with_proc():
    held = subprocess.Popen([sys.executable, "-c", "import sys, time\nheld = bytearray(200 * "
                             "2**20)\nsys.stdout.write('ready\\n'); sys.stdout.flush()\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline() == "ready\n"
        rss = _status(held.pid, "VmRSS")
        assert devices.resident_bytes(held.pid) == pytest.approx(rss, abs=4 * MIB)
        assert memory_cap.process_memory(held.pid) == pytest.approx(
            rss + _status(held.pid, "VmSwap"), abs=4 * MIB)
        assert rss >= 200 * MIB
    finally:
        held.kill()
        held.wait()
    assert devices.resident_bytes(held.pid) is None  # gone
    assert memory_cap.process_memory(held.pid) is None
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo
                         if line.startswith("MemAvailable:"))
    # Other processes of the machine come and go between the two readings.
    assert devices.host_available_memory() == pytest.approx(available, abs=256 * MIB)


def test_a_limit_counts_swap_only_where_psutil_reads_it():
    process = psutil.Process()
    info = process.memory_info()
    try:
        full = process.memory_full_info()
    except psutil.AccessDenied:
        full = None
    if full is not None and "swap" in full._fields:  # Linux
        assert memory_cap.limit_note(full) is None
        assert memory_cap.held_bytes(info, full) == info.rss + full.swap
    # The readings macOS and Windows give (no `swap` field), made of this platform's real
    # `memory_info()`, which has none either; and a refused full reading (macOS may refuse it).
    assert "swap" not in info._fields
    for reading in (info, None):
        assert memory_cap.limit_note(reading) == (
            "--memory-limit counts the training process's resident memory only: psutil reads "
            "no per-process swap on this system, so memory pushed to swap is not counted")
        assert memory_cap.held_bytes(info, reading) == info.rss
