"""What a segmentation loss's forward and backward (or a metric update) hold, measured by
TensorFlow's allocator on a CPU, against the planner's "loss and metrics" count.

    python benchmarks/loss_peaks.py
    python benchmarks/loss_peaks.py --image-size 360,480 --classes 12 --batch 2

Each case runs the loss on a batch of softmax (or sigmoid) outputs and its targets, and its
gradient with respect to the outputs, in one `tf.function` (a metric: its update). With
`TF_CPU_ALLOCATOR_USE_BFC=true` TensorFlow's CPU allocator counts the bytes its tensors hold,
so the peak above the outputs and targets already in memory, plus those two, is what the loss
holds in a training step. Beside it: the planner's count for one sample with the output held
(`tfmem.memory.loss_trace`, before it subtracts the output the activations count), both in
tensors of the output's size.
"""

from __future__ import annotations

import argparse
import os

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow starts
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402

import tfmem  # noqa: E402
from tfmem.memory import loss_trace  # noqa: E402


def cases(classes: int) -> dict:
    """name -> (loss or metric, multi-label targets)."""
    return {
        "cross-entropy, ignore 255": (
            keras.losses.SparseCategoricalCrossentropy(ignore_class=255), False),
        "cross-entropy": (keras.losses.SparseCategoricalCrossentropy(), False),
        "dice": (tfmem.DiceLoss(classes, ignore_class=255), False),
        "cross-entropy+dice": (tfmem.DiceLoss(classes, ignore_class=255, cross_entropy=True),
                               False),
        "binary cross-entropy (multi-label)": (keras.losses.BinaryCrossentropy(), True),
        "cross-entropy+dice (multi-label)": (
            tfmem.DiceLoss(classes, multi_label=True, cross_entropy=True), True),
        "MeanIoU update": (keras.metrics.MeanIoU(classes, ignore_class=255,
                                                 sparse_y_pred=False), False),
        "MultiLabelIoU update": (tfmem.MultiLabelIoU(classes), True),
    }


def measured(item, multi_label: bool, batch: int, height: int, width: int,
             classes: int) -> float:
    """Bytes per sample held at the peak, the outputs and targets included."""
    import tensorflow as tf

    outputs = tf.nn.softmax(tf.random.normal((batch, height, width, classes)))
    targets = (tf.cast(tf.random.uniform((batch, height, width, classes)) > 0.5, tf.float32)
               if multi_label else
               tf.random.uniform((batch, height, width), 0, classes, tf.int32))
    if isinstance(item, keras.metrics.Metric):
        def step(outputs, targets):
            return item.stateless_update_state([v.value for v in item.variables], targets,
                                               outputs)
    else:
        def step(outputs, targets):
            with tf.GradientTape() as tape:
                tape.watch(outputs)
                loss = item(targets, outputs)
            return tape.gradient(loss, outputs)
    step = tf.function(step)
    step.get_concrete_function(outputs, targets)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(outputs, targets)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    held = outputs.shape.num_elements() * 4 + targets.shape.num_elements() * 4
    return (peak - before + held) / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", default="256,256", help="height,width")
    parser.add_argument("--classes", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    height, width = (int(v) for v in args.image_size.split(","))
    output = height * width * args.classes * 4
    symbolic = keras.KerasTensor((None, height, width, args.classes))
    print(f"{args.batch} × {height}×{width}×{args.classes} float32 outputs; in tensors of the "
          f"output's size ({output / 2**20:.2f} MiB a sample)\n")
    print("| loss or metric | measured | planned | planned / measured |")
    print("|---|---:|---:|---:|")
    for name, (item, multi_label) in cases(args.classes).items():
        real = measured(item, multi_label, args.batch, height, width, args.classes)
        if isinstance(item, keras.metrics.Metric):
            counted = loss_trace.loss_bytes([symbolic], None, lambda t, p: keras.ops.sum(p),
                                            [item], 0).per_sample
        else:
            counted = loss_trace.loss_bytes([symbolic], None, item, [], 0).per_sample
        print(f"| {name} | {real / output:.2f} | {counted / output:.2f} | "
              f"{counted / real:.2f} |")


if __name__ == "__main__":
    main()
