"""The time of a train step under two checkouts of tfmem, side by side in one run, on a CPU.

    python benchmarks/checkout_step_time.py --before f0833cc^1                # GPT-2, "full"
    python benchmarks/checkout_step_time.py --before HEAD~3 --models bert --settings none,full

keras-hub's BERT or GPT-2 (as `benchmarks/text_backbones.py` builds them: fixed-length inputs,
random weights, padding masks, GPT-2 with its next-token head) trained as an `AccumModel`
(k = 1, Adam, float32, TensorFlow) with each of `--settings` (`none`, `full`, `auto`). Each
setting of each checkout runs in a fresh process that imports tfmem from that checkout (the
working tree for `--after`'s default, a detached `git worktree` of `--before`, removed at the
end) and times `--steps` calls of `train_on_batch` on one micro-batch after two untimed ones.
The processes take turns, checkout by checkout, `--rounds` times; the table gives the median
seconds per step of each, and after / before. The model and its data come from this file's
checkout in both, so only tfmem differs.

Needs keras-hub (`pip install --no-deps keras-hub`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(args) -> None:
    """Prints, as JSON, the seconds of each timed step of one setting."""
    import keras

    import tfmem

    sys.path.insert(0, HERE)
    import text_backbones

    keras.utils.set_random_seed(0)
    model, targets = text_backbones.build(args.models, args.sequence_length, args.layers,
                                          args.hidden, args.vocabulary)
    setting = None if args.setting == "none" else args.setting
    accum = tfmem.AccumModel.wrap(model, accumulation_steps=1, rematerialize=setting)
    accum.compile(keras.optimizers.Adam(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = text_backbones.batch(model, targets, args.batch, args.sequence_length,
                                args.vocabulary)
    for _ in range(2):  # traced, then once more
        accum.train_on_batch(x, y)
    seconds = []
    for _ in range(args.steps):
        began = time.perf_counter()
        accum.train_on_batch(x, y)
        seconds.append(time.perf_counter() - began)
    print(json.dumps({"tfmem": os.path.dirname(os.path.dirname(tfmem.__file__)),
                      "seconds": seconds}))


def timed(args, checkout: str, setting: str) -> list[float]:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--setting", setting,
               "--models", args.models, "--batch", str(args.batch), "--steps", str(args.steps),
               "--sequence-length", str(args.sequence_length), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--vocabulary", str(args.vocabulary)]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=False,
                          env=dict(os.environ, PYTHONPATH=checkout, TF_CPP_MIN_LOG_LEVEL="2"))
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: {setting} under {checkout} failed: {last}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.realpath(result["tfmem"]) != os.path.realpath(checkout):
        raise SystemExit(f"error: the child imported tfmem from {result['tfmem']}, not "
                         f"{checkout}; run from a checkout installed in editable mode or not "
                         "at all")
    return result["seconds"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before",
                        help="the commit (or any git revision) timed as before (required)")
    parser.add_argument("--models", default="gpt2", choices=("bert", "gpt2"))
    parser.add_argument("--settings", default="full", help="comma-separated: none, full, auto")
    parser.add_argument("--batch", type=int, default=16, help="the micro-batch timed")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per checkout and setting")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 64")
    parser.add_argument("--vocabulary", type=int, default=8192)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if not args.before:
        parser.error("--before is required: the revision to time against, e.g. --before HEAD~1")
    settings = args.settings.split(",")
    if not set(settings) <= {"none", "full", "auto"}:
        parser.error(f"--settings {args.settings}: each must be none, full or auto")
    revision = subprocess.run(["git", "rev-parse", "--verify", "--short", args.before],
                              cwd=ROOT, capture_output=True, text=True, check=False)
    if revision.returncode:
        print(f"error: --before {args.before} is no revision of this repository; name a "
              "commit, e.g. --before HEAD~1", file=sys.stderr)
        return 2
    before = revision.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="tfmem-before-") as folder:
        worktree = os.path.join(folder, "tfmem")
        subprocess.run(["git", "worktree", "add", "--detach", worktree, before], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            times = {(checkout, setting): [] for checkout in ("before", "after")
                     for setting in settings}
            for round_ in range(args.rounds):
                for setting in settings:
                    for checkout, path in (("before", worktree), ("after", ROOT)):
                        times[checkout, setting] += timed(args, path, setting)
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT,
                           check=False, capture_output=True)
    print(f"{args.models}, {args.vocabulary} ids, {args.sequence_length} tokens, micro-batch "
          f"{args.batch}: seconds per step (median of {args.rounds} × {args.steps}), before = "
          f"{before}, after = the working tree\n")
    print("| setting | before | after | after / before |")
    print("|---|---:|---:|---:|")
    for setting in settings:
        old = statistics.median(times["before", setting])
        new = statistics.median(times["after", setting])
        print(f"| {setting} | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
