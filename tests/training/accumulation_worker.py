"""One worker of the two-process MultiWorkerMirroredStrategy test.

Started by `tests/test_accumulation_multiworker.py` with `TF_CONFIG` set. Trains
an `AccumModel` with `fit` and, as the reference, a plain Keras model with its
own `train_step` run through `strategy.run` (Keras 3.15's `fit` cannot run a
plain model under multi-worker: tensorflow/tensorflow#72388). Worker 0 writes
both models' weights and the all-reduce ops of each step to OUTPUT.

Given SYNCHRONIZED.npz, it then trains `remat_cases.normalized`'s model (synchronized
BatchNormalization, rematerialized) on `remat_cases.data()` under the same strategy, and
worker 0 writes its weights there.

Usage: python accumulation_worker.py DATA.npz OUTPUT.npz ACCUMULATION_STEPS [SYNCHRONIZED.npz]
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import json  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402


def _build(cls, initial, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)
    model.set_weights(initial)
    model.compile("adam", "mse")
    return model


def _all_reduces(concrete_function):
    """CollectiveReduce ops of a traced step: (total, inside while-loop bodies)."""
    graph_def = concrete_function.graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node) + [n for f in library.values() for n in f.node_def]
    bodies = {n.attr["body"].func.name for n in nodes if n.op in ("While", "StatelessWhile")}

    def count(node_list):
        return sum(node.op.startswith("CollectiveReduce") for node in node_list)

    return count(nodes), sum(count(library[name].node_def) for name in bodies)


def main(strategy, data_path, output_path, accumulation_steps):
    data = np.load(data_path)
    initial = [data[f"w{i}"] for i in range(4)]
    # Every worker reads the whole dataset; tf.distribute rebatches each global
    # batch and gives each worker its own rows (auto-shard by DATA).
    dataset = tf.data.Dataset.from_tensor_slices((data["x"], data["y"], data["sw"]))
    dataset = dataset.batch(int(data["global_batch"]), drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        plain = _build(keras.Model, initial)
        accum = _build(tfmem.AccumModel, initial, accumulation_steps=accumulation_steps)
    history = accum.fit(dataset, verbose=0).history

    steps = {}  # traced as Keras traces its steps: without AutoGraph
    for name, model in (("plain", plain), ("accum", accum)):
        steps[name] = tf.function(lambda batch, m=model: strategy.run(m.train_step, args=(batch,)),
                                  autograph=False)
    for batch in strategy.experimental_distribute_dataset(dataset):
        steps["plain"](batch)
    spec = strategy.experimental_distribute_dataset(dataset).element_spec
    results = {"accum_loss": np.array(history["loss"])}
    for name, model in (("plain", plain), ("accum", accum)):
        results.update({f"{name}_w{i}": w for i, w in enumerate(model.get_weights())})
        results[f"{name}_iterations"] = model.optimizer.iterations.numpy()
        results[f"{name}_all_reduces"] = np.array(
            _all_reduces(steps[name].get_concrete_function(spec))
        )
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        np.savez(output_path, **results)


def synchronized(strategy, output_path):
    from tests.training import remat_cases

    x, y = remat_cases.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        accum = remat_cases.normalized(True, "full")
    accum.fit(dataset.with_options(options), verbose=0)
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        np.savez(output_path, *accum.get_weights(),
                 segments=len(accum.rematerialized_segments))


if __name__ == "__main__":
    # One strategy per process: a second one would hand out colliding collective keys.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    main(strategy, sys.argv[1], sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) > 4:
        synchronized(strategy, sys.argv[4])
