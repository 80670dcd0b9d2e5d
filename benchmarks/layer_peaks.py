"""What one layer's training step holds at its peak, measured by TensorFlow's allocator on a CPU,
against what the planner counts for it.

    python benchmarks/layer_peaks.py
    python benchmarks/layer_peaks.py --layers batchnorm,relu --channels 240 --image-size 64
    python benchmarks/layer_peaks.py --layers batchnorm,swish --serial

Each case is a 1×1 convolution to `--channels` maps of `--image-size`² (so that a gradient
flows into the layer), the layer, and a pooled 4-class head, trained as an `AccumModel` (k = 1,
Adam, float32). With `TF_CPU_ALLOCATOR_USE_BFC=true` TensorFlow's CPU allocator keeps count of
the bytes its tensors hold (`tf.config.experimental.get_memory_info`), so the peak of a
training step is the live tensors', not the process's resident set (no allocator caching or
fragmentation in it). Per sample: the difference of the peaks at two micro-batches. Beside it:
the plan's activations and workspace for the same model, and the size of one `--channels` map
stack, the unit the rows are easiest to read in. With `--serial`, the step's ops run one at a
time (one inter-op thread) and its graph is not rewritten (Grappler off): the order the plan
counts in.
"""

from __future__ import annotations

import argparse
import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow starts
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmem  # noqa: E402

MIB = 2**20

LAYERS = {
    "none": lambda x: x,
    "batchnorm": lambda x: keras.layers.BatchNormalization()(x),
    "relu": lambda x: keras.ops.relu(x),
    "swish": lambda x: keras.layers.Activation("swish")(x),
    "conv3x3": lambda x: keras.layers.Conv2D(16, 3, padding="same")(x),
    "dropout": lambda x: keras.layers.Dropout(0.2)(x),
    "bn-relu-conv": lambda x: keras.layers.Conv2D(16, 3, padding="same")(
        keras.ops.relu(keras.layers.BatchNormalization()(x))),
    "grouped7x7": lambda x: keras.layers.Conv2D(x.shape[-1], 7, groups=x.shape[-1],
                                                padding="same")(x),
    "depthwise7x7": lambda x: keras.layers.DepthwiseConv2D(7, padding="same")(x),
}


def build(layer: str, channels: int, image_size: int) -> tfmem.AccumModel:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((image_size, image_size, 8))
    x = LAYERS[layer](keras.layers.Conv2D(channels, 1, name="stem")(inputs))
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(x))
    model = tfmem.AccumModel(inputs, outputs, accumulation_steps=1, check_memory=False)
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    return model


def peak_bytes(layer: str, channels: int, image_size: int, batch: int) -> int:
    import tensorflow as tf

    model = build(layer, channels, image_size)
    x = np.random.default_rng(0).uniform(size=(batch, image_size, image_size, 8))
    y = np.zeros((batch, 4), "float32")
    model.train_on_batch(x.astype("float32"), y)  # traced
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x.astype("float32"), y)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(LAYERS),
                        help=f"comma-separated, of: {', '.join(LAYERS)}")
    parser.add_argument("--channels", type=int, default=240)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batches", default="4,12", help="two micro-batches: small,large")
    parser.add_argument("--serial", action="store_true",
                        help="one op at a time, in the order of the graph as built")
    args = parser.parse_args(argv)
    if args.serial:
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    small, large = (int(b) for b in args.batches.split(","))
    unknown = [name for name in args.layers.split(",") if name not in LAYERS]
    if unknown:
        parser.error(f"unknown layer {', '.join(unknown)}; choose from {', '.join(LAYERS)}")
    stack = args.image_size**2 * args.channels * 4 / MIB
    print(f"{args.channels} maps of {args.image_size}² (one stack: {stack:.2f} MiB per sample), "
          "Adam, float32, TensorFlow's BFC allocator on the CPU"
          + (", one op at a time, Grappler off" if args.serial else ""))
    print("| layer | peak per sample, measured | activations, planned | workspace, planned | "
          "measured / planned |")
    print("|---|---:|---:|---:|---:|")
    for layer in args.layers.split(","):
        peaks = [peak_bytes(layer, args.channels, args.image_size, b) for b in (small, large)]
        measured = (peaks[1] - peaks[0]) / (large - small)
        plan = tfmem.plan(build(layer, args.channels, args.image_size), global_batch_size=small,
                          memory_budget=2**34)
        planned = plan.activation_bytes_per_sample + plan.workspace_bytes_per_sample
        print(f"| {layer} | {measured / MIB:.1f} MiB ({measured / MIB / stack:.1f} stacks) | "
              f"{plan.activation_bytes_per_sample / MIB:.1f} MiB | "
              f"{plan.workspace_bytes_per_sample / MIB:.1f} MiB | {measured / planned:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
