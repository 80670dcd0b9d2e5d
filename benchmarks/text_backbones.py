"""keras-hub's text backbones planned against TensorFlow's allocator, on a CPU. Tables, not a test.

    python benchmarks/text_backbones.py                      # BERT and GPT-2, none and full
    python benchmarks/text_backbones.py --models bert --sequence-length 256 --batches 4,16
    python benchmarks/text_backbones.py --models gpt2 --metrics sparse_categorical_accuracy

keras-hub's `BertBackbone` and `GPT2Backbone` take token ids of any length (their inputs are
`(None,)`); here they are called on fixed-length `keras.Input((L,))`s, as a fine-tuning model
is, with random weights: BERT's pooled output into a 2-class head, GPT-2's sequence into a
next-token head over the vocabulary (sparse cross-entropy, padding masks with random
lengths). For each model, without rematerialization and with `rematerialize="full"`, each in
a child with TensorFlow's own allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`: the tensors live at
the step's peak, without the process heap's caching), an `AccumModel` (k = 1, Adam, float32)
runs a traced step and then one measured step at each of `--batches`; the growth of the peak
between the two micro-batches, per sample, is set beside the plan's (`tfmem.plan` with the
run's loss: the terms that grow with the micro-batch), and the measured and planned savings
of `"full"` beside each other.

Needs keras-hub (`pip install --no-deps keras-hub`: its own dependencies would add
TensorFlow's full wheel, through tensorflow-text, beside `tensorflow-cpu`; the backbones
need neither).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

MIB = 2**20


def build(name: str, length: int, layers: int, hidden: int, vocabulary: int):
    """The backbone in a fine-tuning model on fixed-length inputs, and its loss."""
    import keras
    import keras_hub

    shapes = dict(vocabulary_size=vocabulary, num_layers=layers, num_heads=hidden // 64,
                  hidden_dim=hidden, intermediate_dim=4 * hidden, max_sequence_length=length)
    ids = keras.Input((length,), dtype="int32", name="token_ids")
    mask = keras.Input((length,), dtype="int32", name="padding_mask")
    if name == "bert":
        segments = keras.Input((length,), dtype="int32", name="segment_ids")
        outputs = keras_hub.models.BertBackbone(**shapes)(
            {"token_ids": ids, "segment_ids": segments, "padding_mask": mask})
        head = keras.layers.Dense(2, name="head")(outputs["pooled_output"])
        return keras.Model([ids, segments, mask], head, name="bert"), "classes"
    outputs = keras_hub.models.GPT2Backbone(**shapes)({"token_ids": ids, "padding_mask": mask})
    head = keras.layers.Dense(vocabulary, name="head")(outputs)
    return keras.Model([ids, mask], head, name="gpt2"), "tokens"


def batch(model, targets: str, size: int, length: int, vocabulary: int):
    rng = np.random.default_rng(0)
    lengths = rng.integers(length // 4, length + 1, (size, 1))
    mask = (np.arange(length)[None] < lengths).astype("int32")
    ids = rng.integers(1, vocabulary, (size, length)).astype("int32") * mask
    x = [ids, np.zeros_like(ids), mask] if len(model.inputs) == 3 else [ids, mask]
    y = (rng.integers(0, 2, (size,)) if targets == "classes"
         else np.roll(ids, -1, axis=1)).astype("int32")
    return x, y


def child(args) -> None:
    """Prints, as JSON, the allocator's growth per sample and the plan's, for one setting."""
    import keras
    import tensorflow as tf

    import tfmem

    setting = None if args.setting == "none" else args.setting
    small, large = args.batch_sizes
    peaks, plans = [], []
    for size in (small, large):
        keras.utils.set_random_seed(0)
        model, targets = build(args.model, args.sequence_length, args.layers, args.hidden,
                                 args.vocabulary)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        accum = tfmem.AccumModel.wrap(model, accumulation_steps=1, rematerialize=setting)
        accum.compile(keras.optimizers.Adam(1e-4), loss,
                      metrics=[name for name in args.metrics.split(",") if name])
        x, y = batch(model, targets, size, args.sequence_length, args.vocabulary)
        accum.train_on_batch(x, y)  # traced
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        accum.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
        plan = tfmem.plan(accum, global_batch_size=size, loss=loss,
                          memory_budget=64 * 2**30, precision="float32")
        plans.append(plan.peak_bytes(size, 1))
    print(json.dumps(dict(measured=(peaks[1] - peaks[0]) / (large - small),
                          planned=(plans[1] - plans[0]) / (large - small),
                          parameters=model.count_params())))


def measured(args, model: str, setting: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", "--models", model,
               "--setting", setting, "--batches", args.batches, "--sequence-length",
               str(args.sequence_length), "--layers", str(args.layers), "--hidden",
               str(args.hidden), "--vocabulary", str(args.vocabulary), "--metrics", args.metrics]
    done = subprocess.run(command, env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
                                            TF_CPP_MIN_LOG_LEVEL="2"),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: {model} with {setting} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 64")
    parser.add_argument("--vocabulary", type=int, default=2048,
                        help="token ids, and GPT-2's next-token classes")
    parser.add_argument("--batches", default="4,16", help="two micro-batches, small,large")
    parser.add_argument("--metrics", default="",
                        help="Keras metric names, comma-separated (planned as compiled)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = tuple(int(b) for b in args.batches.split(","))
    if args.child:
        args.model = args.models
        child(args)
        return 0
    print(f"sequence length {args.sequence_length}, {args.layers} layers of {args.hidden}, "
          f"vocabulary {args.vocabulary}, micro-batches {args.batches}"
          + (f", metrics {args.metrics}" if args.metrics else "")
          + "; MiB per sample, TensorFlow's allocator on a CPU\n")
    print("| model | rematerialize | measured | planned | planned / measured |")
    print("|---|---|---:|---:|---:|")
    for model in args.models.split(","):
        rows = {setting: measured(args, model, setting) for setting in ("none", "full")}
        for setting, found in rows.items():
            print(f"| {model} | {setting} | {found['measured'] / MIB:.2f} | "
                  f"{found['planned'] / MIB:.2f} | {found['planned'] / found['measured']:.2f} |")
        saving = [rows["none"][key] / rows["full"][key] for key in ("measured", "planned")]
        print(f"| {model} | saving of full (none / full) | {saving[0]:.2f}× | {saving[1]:.2f}× "
              f"| {saving[1] / saving[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
