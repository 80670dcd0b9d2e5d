"""Memory and time of the two fine-tuning modes: frozen backbone vs all layers.

    PYTHONPATH=. python benchmarks/finetune_modes.py [--model efficientnetv2-b0]
        [--image-size 96] [--batch-size 8] [--steps 3]

Each case runs `fit` for a few Adam steps on random pixels in its own process (so one
case's memory never counts against another) and reports the peak RSS above the
process's RSS after building the model, plus the trainable parameters and the
parameter-proportional state Adam adds (gradients + 2 slots, float32).
Expect the full mode to need more: gradients and optimizer slots exist for every
trainable parameter, and the backbone's activations must be kept for backprop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(model_name: str, image_size: int, batch_size: int, steps: int,
             freeze: bool) -> dict:
    """Runs in a child process: build, fit `steps` steps, measure."""
    import keras
    import numpy as np

    from tfmem import models

    model = models.build(model_name, num_classes=10, image_size=image_size,
                         freeze_backbone=freeze)
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch_size * steps, image_size, image_size, 3))
    labels = rng.integers(0, 10, batch_size * steps)
    baseline = _current_rss_bytes()
    model.fit(images[:batch_size], labels[:batch_size], batch_size=batch_size, verbose=0)
    start = time.perf_counter()
    model.fit(images, labels, batch_size=batch_size, epochs=1, verbose=0)
    seconds_per_step = (time.perf_counter() - start) / steps
    return {"trainable": trainable, "peak_above_model_gb": (_peak_rss_bytes() - baseline) / 1e9,
            "seconds_per_step": seconds_per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnetv2-b0")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--case", choices=["frozen", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        result = run_case(args.model, args.image_size, args.batch_size, args.steps,
                          freeze=args.case == "frozen")
        print("RESULT " + json.dumps(result))
        return

    results = {}
    for case in ("frozen", "full"):
        output = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--image-size",
             str(args.image_size), "--batch-size", str(args.batch_size), "--steps",
             str(args.steps), "--case", case],
            check=True, capture_output=True, text=True).stdout
        results[case] = json.loads(output.split("RESULT ", 1)[1])
    print(f"{args.model}, {args.image_size}x{args.image_size}, batch {args.batch_size}, "
          f"Adam, fp32, {args.steps} steps after a warm-up step")
    print("| mode | trainable params | grads + Adam slots | peak RSS above model | s/step |")
    print("|---|---:|---:|---:|---:|")
    for case, result in results.items():
        state_gb = result["trainable"] * 4 * 3 / 1e9
        print(f"| {case} | {result['trainable']:,} | {state_gb:.3f} GB | "
              f"{result['peak_above_model_gb']:.2f} GB | {result['seconds_per_step']:.2f} |")
    frozen, full = results["frozen"], results["full"]
    print(f"| full / frozen | {full['trainable'] / frozen['trainable']:.0f}x | | "
          f"{full['peak_above_model_gb'] / max(frozen['peak_above_model_gb'], 1e-9):.1f}x | "
          f"{full['seconds_per_step'] / frozen['seconds_per_step']:.1f}x |")


if __name__ == "__main__":
    main()
