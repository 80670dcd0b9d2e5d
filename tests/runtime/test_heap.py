"""tfmem.runtime.heap: glibc's mmap threshold fixed in a real process and in those it starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfmem.runtime import heap

MIB = 2**20
HEAP_PY = Path(heap.__file__)

# Loads heap.py by its path (importing the tfmem package would import TensorFlow), frees a
# 16 MiB block (glibc's default threshold then rises to 16 MiB), and allocates, fills and frees
# 8 MiB: the bytes mapped for it (`mallinfo2`) and the resident set it leaves behind.
_CHILD = r"""
import ctypes, importlib.util, json, os, subprocess, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
def resident():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmRSS"))
fixed = heap.fix_mmap_threshold() if sys.argv[2] == "fix" else None
libc.free(libc.malloc(16 << 20))
before, mapped = resident(), libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
ctypes.memset(block, 1, 8 << 20)
mapped = libc.mallinfo2().hblkhd - mapped
libc.free(block)
result = {"fixed": fixed, "mapped": mapped, "kept": resident() - before}
if sys.argv[2] == "fix":  # a process started after the call, which does not call it
    started = subprocess.run([sys.executable, "-c", sys.argv[3], sys.argv[1], "inherit"],
                             capture_output=True, text=True, check=True)
    result["started"] = json.loads(started.stdout)
print(json.dumps(result))
"""


def _run(mode: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != heap.ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(HEAP_PY), mode, _CHILD],
                          capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout)


@pytest.mark.skipif(heap.glibc() is None, reason="glibc's malloc only (Linux with glibc)")
def test_fixed_threshold_gives_a_freed_block_back_in_the_process_and_those_it_starts():
    default, fixed = _run("default"), _run("fix")
    # The default heap keeps the freed 8 MiB resident, in the heap (nothing mapped for it).
    assert default["mapped"] == 0
    assert abs(default["kept"] - 8 * MIB) < MIB
    for result in (fixed, fixed["started"]):
        assert 8 * MIB <= result["mapped"] <= 8 * MIB + 4096  # its own mapping: 8 MiB + a page
        assert abs(result["kept"]) < MIB  # unmapped when freed
    assert fixed["fixed"] is True


def test_threshold_outside_what_glibc_accepts_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"`threshold` \(33554433 bytes\) must be between"):
        heap.fix_mmap_threshold(32 * MIB + 1)
    with pytest.raises(ValueError, match="`threshold`"):
        heap.fix_mmap_threshold(0)


def test_other_c_libraries_change_nothing(monkeypatch):
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.delenv(heap.ENVIRONMENT, raising=False)
    heap.glibc.cache_clear()  # the C library is found once a process
    try:
        assert heap.glibc() is None
        assert heap.fix_mmap_threshold() is False
        assert heap.ENVIRONMENT not in os.environ
    finally:
        heap.glibc.cache_clear()


@pytest.mark.skipif(heap.glibc() is None, reason="glibc's malloc only (Linux with glibc)")
def test_a_budget_says_whether_the_heap_keeps_freed_blocks(monkeypatch):
    from tfmem.runtime.budget import budget_for

    monkeypatch.delenv(heap.ENVIRONMENT, raising=False)
    assert budget_for(memory_budget=2**30).heap_keeps_freed is True
    monkeypatch.setenv(heap.ENVIRONMENT, str(MIB))  # as a process started with it
    assert budget_for(memory_budget=2**30).heap_keeps_freed is False
