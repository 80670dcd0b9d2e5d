"""Keras's own gradient accumulation and AccumModel against one whole-batch step, masked losses.

    python benchmarks/loss_normalisation.py

For the masked cases of tests/training/loss_cases.py — a per-pixel loss with
`ignore_class=255` (valid pixels per micro-batch 3, 0, 30, 32) and tokens through
`Embedding(mask_zero=True)` into a per-token loss (valid tokens 2, 11, 10, 11) — one SGD step of
a global batch of 8 as 4 micro-batches of 2: `keras.Model` with
`SGD(gradient_accumulation_steps=4)` fed the micro-batches, and `AccumModel(accumulation_steps=4)`
fed the global batch, each against `keras.Model` on the whole batch from the same weights. On
TensorFlow and on JAX, each in a process of its own (CPU, a few seconds each). Prints
max |Δ − Δ_whole| / max |Δ_whole| over all weights, as a markdown table.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = {"ignore_class": "per-pixel `ignore_class`, micro-batches with 3, 0, 30, 32 valid pixels",
         "mask_zero": "`Embedding(mask_zero=True)` tokens, 2, 11, 10, 11 valid tokens"}
BACKENDS = ("tensorflow", "jax")


def _measure() -> dict:
    """This process's backend: the relative distances per case, Keras's own and AccumModel's."""
    sys.path.insert(0, str(ROOT))
    from tests.training import loss_cases

    return {name: {"keras": loss_cases.run(name, keras_accumulation=True)["update"],
                   "accum": loss_cases.run(name)["update"]} for name in CASES}


def main() -> None:
    if len(sys.argv) > 1:  # the child: one backend
        print("RESULTS " + json.dumps(_measure()))
        return
    results = {}
    for backend in BACKENDS:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
                   JAX_PLATFORMS="cpu")
        run = subprocess.run([sys.executable, __file__, "--child"], env=env, text=True,
                             capture_output=True, check=False)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULTS ")]
        if run.returncode or not lines:
            raise SystemExit(f"error: the {backend} run failed:\n{run.stderr[-3000:]}")
        results[backend] = json.loads(lines[-1][len("RESULTS "):])
    print("| case | Keras's own, TensorFlow | Keras's own, JAX | AccumModel, TensorFlow "
          "| AccumModel, JAX |")
    print("|---|---:|---:|---:|---:|")
    for name, label in CASES.items():
        cells = [f"{results[b][name][who]:.0%}" if results[b][name][who] >= 0.005
                 else f"{results[b][name][who]:.0e}" for who in ("keras", "accum")
                 for b in BACKENDS]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
