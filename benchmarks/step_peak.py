"""What a training step on TensorFlow (CPU) holds at its peak: the tensors live, largest first.

    python benchmarks/step_peak.py --model tiramisu-103 --image-size 224 --batch 2
    python benchmarks/step_peak.py --model efficientnetv2-s --image-size 384 --setting none

Traces one `train_on_batch` of an `AccumModel` (k = 1, SGD, cross-entropy, after one call that
traces it) with TensorFlow's profiler, TensorFlow's own allocator on the CPU
(`TF_CPU_ALLOCATOR_USE_BFC=true`, set here before TensorFlow starts). The allocator records
each allocation and deallocation it makes while the profiler runs (`MemoryAllocation` and
`MemoryDeallocation` events: the op, the shape, the bytes asked for, the chunk given, and the
bytes in use after it). Replaying them finds the moment the bytes in use were highest and
prints what was live then: op, shape, MiB asked for, MiB of the chunk. Allocations made before
the traced step (weights, the optimizer's slots) are in the bytes in use but not in the list.
Also the most bytes the step's own tensors asked for at once: without the chunks' rounding (a
free chunk under twice the size asked is not split), which moves the allocator's count from
run to run.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 2**20


def _events(logdir: str) -> list[tuple[int, str, dict]]:
    """`(time in ps, event name, its stats)` of the allocator's events in the trace."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit("error: the profiler wrote no trace; run on a CPU with TensorFlow")
    space = xplane_pb2.XSpace()
    with open(paths[0], "rb") as file:
        space.ParseFromString(file.read())
    events = []
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        stat_names = {key: value.name for key, value in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    value = (stat.str_value
                             or (plane.stat_metadata[stat.ref_value].name if stat.ref_value
                                 else None)
                             or stat.int64_value or stat.uint64_value)
                    stats[stat_names.get(stat.metadata_id)] = value
                events.append((line.timestamp_ns * 1000 + event.offset_ps, name, stats))
    return sorted(events, key=lambda event: event[0])


def peak(events, asked: bool = False) -> tuple[int, str, dict]:
    """(the highest bytes in use, the op that allocated then, `address → (asked, chunk, op,
    shape)` of what was live then). Bytes in use are the allocator's (its chunks, and what
    was allocated before the trace), or with `asked`, the bytes the step's tensors asked for."""
    live, highest, at, then = {}, -1, "", {}
    total = 0
    for _, name, stats in events:
        address = stats.get("addr")
        total -= live.pop(address, (0,))[0]
        if name == "MemoryAllocation":
            live[address] = (int(stats.get("requested_bytes") or 0),
                             int(stats.get("allocation_bytes") or 0),
                             stats.get("tf_op") or "?", stats.get("shape") or "")
            total += live[address][0]
        in_use = total if asked else int(stats.get("bytes_allocated") or 0)
        if in_use > highest:
            highest, at, then = in_use, stats.get("tf_op") or "?", dict(live)
    return highest, at, then


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--setting", choices=("none", "full"), default="full")
    parser.add_argument("--top", type=int, default=30, help="live tensors to list")
    parser.add_argument("--one-thread", action="store_true",
                        help="run the step's ops one at a time (Grappler's rewrites kept)")
    args = parser.parse_args()

    import tensorflow as tf

    if args.one_thread:
        tf.config.threading.set_inter_op_parallelism_threads(1)

    import dependency_optimizer

    accum = dependency_optimizer._model(args.setting, args.model, args.image_size)
    x, y = dependency_optimizer._batch(accum, args.image_size, args.batch)
    accum.train_on_batch(x, y)  # traced
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        accum.train_on_batch(x, y)
        tf.profiler.experimental.stop()
        events = _events(logdir)
    highest, at, live = peak(events)
    asked = sum(entry[0] for entry in live.values())
    most, most_at, _ = peak(events, asked=True)
    print(f"{args.model} at {args.image_size} px, micro-batch {args.batch}, rematerialize "
          f"{args.setting}: {highest / MIB:.1f} MiB in use at the allocator's peak (allocating "
          f"{at}); {len(live)} tensors of the step live there, {asked / MIB:.1f} MiB asked for. "
          f"At most {most / MIB:.1f} MiB asked for by the step's live tensors (allocating "
          f"{most_at}).")
    print("| MiB asked | MiB chunk | op | shape |\n|---:|---:|---|---|")
    for requested, chunk, op, shape in sorted(live.values(), reverse=True)[:args.top]:
        print(f"| {requested / MIB:.1f} | {chunk / MIB:.1f} | {op} | {shape} |")


if __name__ == "__main__":
    main()
