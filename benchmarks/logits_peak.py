"""A next-token head, its loss and their gradient alone, against the plan. Tables, not a test.

    python benchmarks/logits_peak.py                  # 2048, 8192 and 32768 ids
    python benchmarks/logits_peak.py --vocabulary 8192 --batches 4,16

One `tf.function` on TensorFlow's own allocator on a CPU (`TF_CPU_ALLOCATOR_USE_BFC=true`, in a
child): a `Dense` head on (b, 128, 256) into (b, 128, V) logits, sparse cross-entropy from the
logits, and the gradient of the loss for the head's input and weights, as a fine-tuned GPT-2's
last call is. Its allocator peak grows per sample by what the logits hold at once; beside it
the plan's per-sample loss and backward workspace of the same head (`tfmem.plan` with the
same loss), all in tensors of the logits' size (128 × V float32 a sample).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

LENGTH, HIDDEN = 128, 256


def child(vocabulary: int, batches: tuple[int, int]) -> None:
    """Prints, as JSON, the allocator's growth per sample and the plan's terms."""
    import keras
    import tensorflow as tf

    import tfmem

    inputs = keras.Input((LENGTH, HIDDEN))
    model = keras.Model(inputs, keras.layers.Dense(vocabulary, name="head")(inputs))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = loss(y, model(x))
        return tape.gradient(value, [x] + model.trainable_weights)

    peaks = []
    for size in batches:
        x = tf.random.normal((size, LENGTH, HIDDEN))
        y = tf.random.uniform((size, LENGTH), 0, vocabulary, tf.int32)
        step(x, y)  # traced
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    plan = tfmem.plan(model, global_batch_size=1, loss=loss, memory_budget=2**40)
    logits = LENGTH * vocabulary * 4
    print(json.dumps(dict(measured=(peaks[1] - peaks[0]) / (batches[1] - batches[0]) / logits,
                          loss=plan.loss_bytes_per_sample / logits,
                          workspace=plan.workspace_bytes_per_sample / logits)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabulary", default="2048,8192,32768", help="ids, comma-separated")
    parser.add_argument("--batches", default="4,16", help="two batch sizes, small,large")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.child:
        child(int(args.vocabulary), batches)
        return 0
    print(f"{LENGTH} positions of {HIDDEN} into V ids, batches {args.batches}; tensors of the "
          "logits' size a sample, TensorFlow's allocator on a CPU\n")
    print("| ids | measured (head, loss, gradient) | planned: loss | planned: head's backward |")
    print("|---:|---:|---:|---:|")
    for vocabulary in args.vocabulary.split(","):
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--vocabulary", vocabulary,
             "--batches", args.batches],
            env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2"),
            capture_output=True, text=True, check=False)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: {vocabulary} ids failed: {last}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {vocabulary} | {found['measured']:.2f} | {found['loss']:.2f} | "
              f"{found['workspace']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
