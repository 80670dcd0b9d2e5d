"""The first training step on TensorFlow: how often it is traced, its time, the memory kept.

    python benchmarks/first_step.py --model tiramisu-103 --image-size 224
    python benchmarks/first_step.py --model tiramisu-103 --image-size 224 --rematerialize full
    python benchmarks/first_step.py --model efficientnetv2-s --image-size 384 --rounds 1

For one model of the registry, a plain `keras.Model` and the same model as an `AccumModel`
(k = 1; with `--rematerialize`, that setting), each in fresh processes that take turns
(`--rounds` each), trained the same way: Adam, mean squared error, the mean absolute error as
a metric, one `fit` epoch of `--steps` steps at batch `--batch` on random images, no
distribution strategy. Printed per model, medians over the rounds:

- how many times the step function was traced (the graphs of it still alive after `fit`);
- the seconds of the first step (tracing, graph optimization and one step), and of each
  later step;
- the resident set after `fit`, above the process's after importing TensorFlow;
- the bytes glibc's heap has in use then (`mallinfo2`): the graphs and Python objects kept
  for the run, without the pool TensorFlow keeps the tensors in.

Processes differ from one another in the time of a step by more than the two kinds do:
`--one-process keras-first` (or `accum-first`) fits both models in one process, an epoch each
in turn, and prints the median of their later steps over `--rounds` epochs after the first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_in_use() -> int | None:
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().uordblks)


def _resident() -> int:
    from tfmem.runtime.devices import resident_bytes

    resident = resident_bytes()
    if resident is None:
        raise SystemExit("error: this system has no /proc/self/statm; run on Linux")
    return resident


def _model_and_data(args, kind: str):
    """The model of `kind` ("keras" or "accum"), compiled, and its `--steps` batches."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmem
    from tfmem import models

    keras.utils.set_random_seed(0)
    base = models.build(args.model, num_classes=4, image_size=args.image_size)
    if kind == "accum":
        model = tfmem.AccumModel.wrap(base, accumulation_steps=1,
                                      rematerialize=args.rematerialize)
    else:
        model = base
    model.compile(keras.optimizers.Adam(1e-4), "mse", metrics=["mae"])
    shape = (args.batch * args.steps, args.image_size, args.image_size, 3)
    x = np.random.default_rng(0).uniform(0, 1, shape).astype("float32")
    y = np.zeros((len(x),) + tuple(model.output_shape[1:]), "float32")
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)


def _fit_epoch(model, kind: str, data) -> tuple[float, list[float]]:
    """One `fit` epoch: its start and the end of each of its steps (`time.perf_counter`)."""
    import keras

    ends: list[float] = []

    class Times(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    extra = {"check_memory": False} if kind == "accum" else {}
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=[Times()], **extra)
    return start, ends


def child(args) -> None:
    """In a fresh process: one model, one kind; prints its measurements as one JSON line."""
    import gc

    import numpy as np
    from tensorflow.python.framework import ops

    baseline = _resident()
    model, data = _model_and_data(args, args.child)
    start, ends = _fit_epoch(model, args.child, data)
    gc.collect()
    traces = sum(1 for o in gc.get_objects()
                 if isinstance(o, ops.Graph) and getattr(o, "name", "") == "one_step_on_data")
    later = np.diff(ends)
    print(json.dumps(dict(
        traces=traces, first=ends[0] - start,
        later=float(np.median(later)) if len(later) else None,
        resident=_resident() - baseline, heap=_heap_in_use())))


def one_process(args) -> None:
    """Both kinds in this one process, a `fit` epoch each in turn, `--rounds` + 1 times (the
    first traces): the median of their later steps, apart from the spread between processes."""
    import numpy as np

    kinds = ("keras", "accum") if args.one_process == "keras-first" else ("accum", "keras")
    built = {kind: _model_and_data(args, kind) for kind in kinds}
    later: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds + 1):
        for kind in kinds:
            model, data = built[kind]
            _, ends = _fit_epoch(model, kind, data)
            if round_:
                later[kind].extend(np.diff(ends))
    print(f"{args.model} at {args.image_size} px, batch {args.batch}, one process, "
          f"{args.rounds} timed epochs of {args.steps} steps each, in turn ({', '.join(kinds)})")
    for kind in kinds:
        print(f"{kind}: later steps, median {np.median(later[kind]):.3f} s")


def _run(args, kind: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", kind,
               "--model", args.model, "--image-size", str(args.image_size),
               "--batch", str(args.batch), "--steps", str(args.steps)]
    if args.rematerialize:
        command += ["--rematerialize", args.rematerialize]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: the {kind} process failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiramisu-56", help="a model of tfmem.models")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="samples per step")
    parser.add_argument("--steps", type=int, default=3, help="steps in the epoch (≥ 2)")
    parser.add_argument("--rematerialize", default=None,
                        help="the AccumModel's setting (full, auto or layer names)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per kind")
    parser.add_argument("--one-process", choices=("keras-first", "accum-first"),
                        help="both kinds in one process, in turn: later steps only")
    parser.add_argument("--child", choices=("keras", "accum"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.batch < 1 or args.rounds < 1:
        parser.error("--steps must be at least 2, --batch and --rounds at least 1")
    if args.child:
        return child(args)
    if args.one_process:
        return one_process(args)

    import numpy as np

    kinds = {"keras": "`keras.Model`",
             "accum": f"`AccumModel`{', ' + args.rematerialize if args.rematerialize else ''}"}
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(_run(args, kind))
    print(f"{args.model} at {args.image_size} px, batch {args.batch}, {args.steps} steps, "
          f"medians of {args.rounds} processes each; {os.cpu_count()} CPU cores")
    print("| model | traces of the step | first step, s | later steps, s | "
          "resident set after fit, MiB | heap in use after fit, MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, name in kinds.items():
        runs = results[kind]

        def median(key):
            values = [run[key] for run in runs if run[key] is not None]
            return float(np.median(values)) if values else None

        heap = median("heap")
        print(f"| {name} | {median('traces'):.0f} | {median('first'):.1f} | "
              f"{median('later'):.3f} | {median('resident') / MIB:.0f} | "
              f"{'—' if heap is None else format(heap / MIB, '.0f')} |")


if __name__ == "__main__":
    main()
