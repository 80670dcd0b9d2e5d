"""Which blocks of a CPU training step glibc's heap serves, keeps and maps, from a log of the
process's allocations.

    python benchmarks/heap_blocks.py --model convnext-tiny --batches 32,64 --settings none,full
    python benchmarks/heap_blocks.py --model grouped-conv --batches 32

A small C library (compiled here with `cc`, preloaded with LD_PRELOAD) logs each block of
64 KiB or more that `malloc`, `calloc`, `realloc`, `memalign`, `posix_memalign` or
`aligned_alloc` return and `free` frees: its chunk size, its address, and whether glibc
mapped it on its own. The child is `heap_growth.py`'s (the same model, optimizer and step,
glibc's default heap); both steps are logged, the first (traced) and the second. Printed per
micro-batch and setting, in MiB: the peak resident set of the second step above import; the
second step's peak of live logged blocks, and of those in the heap; the heap's footprint (the
address space its logged blocks covered: in the second step, in both); the largest block served from the heap
and the smallest mapped; and, of the block sizes with several blocks alive at once, the one
whose blocks hold the most, with their count (a grouped convolution's per-group buffers). Linux with glibc and a C compiler only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MIB = 2**20
_LOGGER = r"""
#include <stddef.h>
#include <stdint.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <stdatomic.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t); extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
#define RECORDS (8u << 20)
#define SMALLEST (64u << 10)
/* op in bit 62 (0 returned, 1 freed), mapped in bit 61, the chunk size below */
typedef struct { uint64_t op_size; uint64_t address; } record;
static record records[RECORDS];
static atomic_uint count;
static volatile int logging;
static inline void note(int op, void *p) {
  if (!logging || !p) return;
  uint64_t header = ((uint64_t *)p)[-1], size = header & ~7ull;
  if (size < SMALLEST) return;
  unsigned i = atomic_fetch_add(&count, 1);
  if (i >= RECORDS) return;
  records[i].op_size = ((uint64_t)op << 62) | ((header & 2) ? 1ull << 61 : 0) | size;
  records[i].address = (uint64_t)p;
}
void *malloc(size_t s) { void *p = __libc_malloc(s); note(0, p); return p; }
void *calloc(size_t n, size_t s) { void *p = __libc_calloc(n, s); note(0, p); return p; }
void *realloc(void *q, size_t s) {
  note(1, q); void *p = __libc_realloc(q, s); note(0, p); return p; }
void free(void *p) { note(1, p); __libc_free(p); }
void *memalign(size_t a, size_t s) { void *p = __libc_memalign(a, s); note(0, p); return p; }
void *aligned_alloc(size_t a, size_t s) { void *p = __libc_memalign(a, s); note(0, p); return p; }
int posix_memalign(void **r, size_t a, size_t s) {
  void *p = __libc_memalign(a, s); if (!p) return ENOMEM; *r = p; note(0, p); return 0; }
void log_start(void) { atomic_store(&count, 0); logging = 1; }
unsigned log_stop(const char *path) {
  logging = 0; unsigned n = atomic_load(&count); if (n > RECORDS) n = RECORDS;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  size_t left = (size_t)n * sizeof(record); char *b = (char *)records;
  while (left) { ssize_t w = write(fd, b, left); if (w <= 0) break; b += w; left -= w; }
  close(fd); return n; }
"""


def child(model: str, batch: int, setting: str, image_size: int, prefix: str) -> None:
    """Two steps of heap_growth's child, each logged to `prefix`.1 and `prefix`.2."""
    import ctypes

    import heap_growth

    logger = ctypes.CDLL(os.environ["LD_PRELOAD"])
    baseline = heap_growth._resident()["VmRSS"]
    accum, x, y = heap_growth.step_case(model, image_size, batch, setting)
    for step in (1, 2):
        if step == 2:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # VmHWM back to the resident set now
        logger.log_start()
        accum.train_on_batch(x, y)
        logger.log_stop(f"{prefix}.{step}".encode())
    print(json.dumps({"peak": heap_growth._resident()["VmHWM"] - baseline}))


def _records(path: str):
    raw = np.fromfile(path, dtype=np.uint64).reshape(-1, 2)
    freed = (raw[:, 0] >> np.uint64(62)).astype(bool)
    mapped = ((raw[:, 0] >> np.uint64(61)) & np.uint64(1)).astype(bool)
    size = (raw[:, 0] & np.uint64((1 << 61) - 1)).astype(np.int64)
    return freed, mapped, size, raw[:, 1].astype(np.int64)


def _footprint(prefix: str, steps) -> int:
    """The bytes of address space the heap's logged blocks covered in `steps`."""
    spans = []
    for step in steps:
        freed, mapped, size, address = _records(f"{prefix}.{step}")
        served = ~freed & ~mapped
        spans += zip(address[served], address[served] + size[served])
    covered, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            covered, end = covered + stop - start, stop
        elif stop > end:
            covered, end = covered + stop - end, stop
    return covered


def summary(prefix: str) -> dict:
    """The second step's live peaks and block sizes, and the heap's footprint in both."""
    freed, mapped, size, address = _records(f"{prefix}.2")
    live: dict = {}
    now = {True: 0, False: 0}
    peak_all = peak_heap = 0
    of_size: collections.Counter = collections.Counter()
    most: collections.Counter = collections.Counter()
    for was_freed, was_mapped, nbytes, at in zip(freed, mapped, size, address):
        if not was_freed:
            live[at] = (nbytes, was_mapped)
            now[was_mapped] += nbytes
            of_size[nbytes] += 1
            most[nbytes] = max(most[nbytes], of_size[nbytes])
        elif at in live:
            nbytes, was_mapped = live.pop(at)
            now[was_mapped] -= nbytes
            of_size[nbytes] -= 1
        peak_all = max(peak_all, now[True] + now[False])
        peak_heap = max(peak_heap, now[False])
    footprint = {steps: _footprint(prefix, steps) for steps in ((2,), (1, 2))}
    served = ~freed
    # Of the sizes with several blocks alive at once, the one whose blocks hold the most.
    block, blocks = max(((size, count) for size, count in most.items() if count > 1),
                        key=lambda item: item[0] * item[1], default=(0, 0))
    return {"live": peak_all / MIB, "heap live": peak_heap / MIB,
            "footprint": footprint[(2,)] / MIB, "footprint, both": footprint[(1, 2)] / MIB,
            "largest heap block": size[served & ~mapped].max(initial=0) / MIB,
            "smallest mapped": (size[served & mapped].min() if (served & mapped).any() else 0)
            / MIB,
            "blocks": f"{blocks} × {block / MIB:.2f}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="grouped-conv")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batches", default="32")
    parser.add_argument("--settings", default="none")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        batch, setting, prefix = args.child.split(",")
        child(args.model, int(batch), setting, args.image_size, prefix)
        return
    with tempfile.TemporaryDirectory() as directory:
        library = os.path.join(directory, "malloc_log.so")
        source = library.replace(".so", ".c")
        with open(source, "w") as file:
            file.write(_LOGGER)
        built = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source],
                               capture_output=True, text=True, check=False)
        if built.returncode:
            raise SystemExit(f"error: the allocation logger did not compile "
                             f"({built.stderr.strip()[:200]}); install a C compiler (cc)")
        columns = ["peak RSS", "live", "heap live", "footprint", "footprint, both",
                   "largest heap block",
                   "smallest mapped", "blocks"]
        print(f"{args.model}: MiB, the second step (footprint, both: the two steps)")
        print("| micro-batch | setting | " + " | ".join(columns) + " |")
        print("|---:|---|" + "---:|" * len(columns))
        here = os.path.dirname(os.path.abspath(__file__))
        for batch in (int(b) for b in args.batches.split(",")):
            for setting in args.settings.split(","):
                prefix = os.path.join(directory, f"{batch}-{setting}")
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--model", args.model,
                     "--image-size", str(args.image_size), "--child",
                     f"{batch},{setting},{prefix}"],
                    env=dict(os.environ, LD_PRELOAD=library,
                             PYTHONPATH=os.pathsep.join(
                                 [here] + os.environ.get("PYTHONPATH", "").split(os.pathsep))),
                    capture_output=True, text=True, check=False)
                if done.returncode:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    raise SystemExit(f"error: micro-batch {batch} ({setting}) failed: {last}")
                row = dict(summary(prefix),
                           **{"peak RSS": json.loads(done.stdout.splitlines()[-1])["peak"]
                              / MIB})
                print(f"| {batch} | {setting} | " + " | ".join(
                    row[c] if isinstance(row[c], str) else f"{row[c]:.0f}" if row[c] >= 10
                    else f"{row[c]:.2f}" for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
