"""detect() and AccumModel under DataParallel over 8 host devices (the shape of a TPU v3-8).

`results()` runs last in accumulation_cases.py's program, which test_accumulation_jax.py starts
with XLA_FLAGS=--xla_force_host_platform_device_count=8: detect() installs the distribution for
the rest of the process. The single-device reference runs first, before detect().
"""

import common  # noqa: F401  (fixes the backend first)
import keras
import numpy as np
import tensorflow as tf
from common import compile_model, conv_model, data, relative_difference

from tfmem.runtime import devices
from tfmem.runtime import distribute_jax
from tfmem.memory import probe_jax
from tfmem import detect
from tfmem.runtime.runtime import UnavailableDeviceError

from tests.training import loss_cases

GLOBAL_BATCH = 64
K = 2  # 64 = 8 devices × 4 samples × 2 micro-batches


def train(model, inputs, **arrays):
    compile_model(model, keras.optimizers.Adam(0.01))
    batch_size = None if isinstance(inputs, tf.data.Dataset) else GLOBAL_BATCH
    history = model.fit(inputs, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, **arrays)
    return model, history.history


def results() -> dict:
    """The numbers test_accumulation_jax asserts; installs detect()'s distribution."""
    x, y, sample_weight = data((8, 8, 3), num_samples=2 * GLOBAL_BATCH)

    # The reference: a plain keras.Model, one device, no distribution, the whole global batch.
    assert keras.distribution.distribution() is None
    reference, reference_history = train(conv_model(None), x, y=y, sample_weight=sample_weight)
    reference_devices = len(reference.trainable_variables[0].value.sharding.device_set)

    errors = {}
    for prefer in ("tpu", "accelerator"):
        try:
            detect(prefer)
        except (ValueError, UnavailableDeviceError) as error:
            errors[prefer] = [type(error).__name__, str(error)]

    available_before = devices.host_available_memory()
    runtime = detect()
    results = {
        "runtime": {
            "kind": runtime.kind,
            "num_replicas": runtime.num_replicas,
            "num_workers": runtime.num_workers,
            "memory_per_replica": runtime.memory_per_replica,
            "host_available_per_device": available_before / 8,
            "device_name": runtime.device_name,
            "global_batch_size_4_2": runtime.global_batch_size(4, accumulation_steps=K),
            "split_64_2": runtime.split_global_batch(GLOBAL_BATCH, K),
            "strategy": [cls.__name__ for cls in type(runtime.strategy).__mro__],
            "installed": keras.distribution.distribution() is runtime.strategy,
            "errors": errors,
            # What AccumModel.fit plans with: the installed distribution, as detect() reported it.
            "current_runtime": [
                distribute_jax.current_runtime().num_replicas,
                # host RAM is read again, so only about equal
                abs(distribute_jax.current_runtime().memory_per_replica / runtime.memory_per_replica - 1)
                < 0.2,
            ],
        }
    }

    with runtime.scope():
        # numpy in, as Keras feeds arrays; and a tf.data pipeline, passed to fit unchanged.
        from_arrays, arrays_history = train(conv_model(K), x, y=y, sample_weight=sample_weight)
        dataset = tf.data.Dataset.from_tensor_slices((x, y, sample_weight)).batch(GLOBAL_BATCH)
        from_dataset, dataset_history = train(conv_model(K), dataset)

    results["data_parallel"] = {
        "reference_devices": reference_devices,
        "variable_devices": len(from_arrays.trainable_variables[0].value.sharding.device_set),
        "weights_vs_reference": relative_difference(reference.get_weights(), from_arrays.get_weights()),
        "dataset_vs_arrays": relative_difference(from_arrays.get_weights(), from_dataset.get_weights()),
        "dataset_vs_reference": relative_difference(
            reference.get_weights(), from_dataset.get_weights()
        ),
        "reference_loss": reference_history["loss"][0],
        "accum_loss": arrays_history["loss"][0],
        "dataset_loss": dataset_history["loss"][0],
        "iterations": int(from_dataset.optimizer.iterations),
    }

    # The compiled step under DataParallel: AccumModel(k=4) needs less scratch memory per device
    # than a plain step on the same global batch, since only a micro-batch of activations is alive.
    batch = (x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
    memory = {}
    for name, accumulation_steps in (("plain", None), ("accum_4", 4)):
        with runtime.scope():
            model = compile_model(conv_model(accumulation_steps), keras.optimizers.Adam(0.01),
                                  metrics=())
            model.optimizer.build(model.trainable_variables)  # its state, without a step
        memory[name] = probe_jax.compiled_step_memory(model, batch)
    results["compiled_memory"] = memory
    # 64 rows over 8 replicas is 8 rows each, which 3 micro-batches cannot split evenly.
    with runtime.scope():
        model = compile_model(conv_model(3), keras.optimizers.Adam(0.01))
    try:
        model.train_on_batch(*batch)
        results["indivisible"] = None
    except ValueError as error:
        results["indivisible"] = str(error)
    # Masked losses under DataParallel: 8 copies of a loss case's rows, one per device, against a
    # keras.Model under the same distribution (the counts are those of all devices' rows).
    with runtime.scope():
        results["masked_losses"] = {name: loss_cases.run(name, repeat=8)
                                    for name in ("add_loss", "two_outputs")}
    results["peak_bytes_in_use"] = probe_jax.peak_bytes_in_use()
    return results
