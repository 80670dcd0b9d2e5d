"""AccumModel under a real two-process MultiWorkerMirroredStrategy on localhost.

Two worker processes (tests/training/accumulation_worker.py), started once for both cases,
train on the same global batches; the reference is a single-device plain Keras model in this
process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfmem  # noqa: F401  (the reference below runs in this process)

WORKER = Path(__file__).with_name("accumulation_worker.py")


def _two_workers(ports, *arguments):
    """Runs `accumulation_worker.py` with `arguments` as two workers of one cluster."""
    workers = [f"localhost:{port}" for port in ports]
    processes = []
    for index in range(2):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        )
        env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parents[2]), env.get("PYTHONPATH", "")])
        processes.append(subprocess.Popen(
            [sys.executable, str(WORKER), *arguments],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=240)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(l[-3000:] for l in logs)


GLOBAL_BATCH, NUM_UPDATES, K = 16, 3, 2


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, free_ports):
    """One cluster of two workers for both cases: the data and initial weights of the first
    (its reference model, untrained), and what worker 0 wrote for each."""
    directory = tmp_path_factory.mktemp("workers")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * NUM_UPDATES, 6)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * NUM_UPDATES, 3)).astype("float32")
    sw = rng.uniform(0.0, 2.0, size=(GLOBAL_BATCH * NUM_UPDATES,)).astype("float32")
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    reference = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    initial = reference.get_weights()
    data = directory / "data.npz"
    np.savez(data, x=x, y=y, sw=sw, global_batch=GLOBAL_BATCH,
             **{f"w{i}": w for i, w in enumerate(initial)})
    output, synchronized = directory / "out.npz", directory / "synchronized.npz"
    _two_workers(free_ports(2), str(data), str(output), str(K), str(synchronized))
    return {"reference": reference, "data": (x, y, sw), "accumulation": np.load(output),
            "synchronized": np.load(synchronized)}


def test_two_workers_match_one_device_with_one_all_reduce_per_update(two_workers):
    reference, (x, y, sw) = two_workers["reference"], two_workers["data"]
    reference.compile("adam", "mse")
    history = reference.fit(
        x, y, sample_weight=sw, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0
    ).history
    results = two_workers["accumulation"]
    for name in ("plain", "accum"):
        assert results[f"{name}_iterations"] == NUM_UPDATES
        for i, expected in enumerate(reference.get_weights()):
            np.testing.assert_allclose(results[f"{name}_w{i}"], expected, rtol=1e-5, atol=1e-6)
    # The logged loss is the global-batch loss, averaged over both workers.
    np.testing.assert_allclose(results["accum_loss"], history["loss"], rtol=1e-5)
    # As many gradient all-reduces as a plain Keras step, none inside the micro-batch loop.
    plain_total, plain_in_loop = results["plain_all_reduces"]
    accum_total, accum_in_loop = results["accum_all_reduces"]
    assert plain_total >= 1 and accum_total == plain_total
    assert accum_in_loop == 0


def test_a_synchronized_batch_norm_across_two_workers_steps_on_its_micro_batches(two_workers):
    # Rematerialized too. Each worker takes 8 rows of a batch of 16 and micro-batches of 4:
    # micro-batch 0 normalizes rows 0-3 and 8-11 together, as one device's micro-batch of
    # those 8 rows does (tests/training/test_accumulation.py: the same on two CPUs of one
    # process).
    from tests.training import remat_cases

    x, y = remat_cases.data()
    rows = remat_cases.by_replica_micro_batches(len(x))
    one_device = remat_cases.normalized(False)
    one_device.fit(x[rows], y[rows], batch_size=16, shuffle=False, verbose=0)
    results = two_workers["synchronized"]
    assert int(results["segments"]) == 1
    expected = one_device.get_weights()
    differences = remat_cases._differences(
        expected, [results[f"arr_{i}"] for i in range(len(expected))])
    # The all-reduce's variance is E[x²] - E[x]²: a difference of rounding.
    assert max(differences) <= 1e-5, differences
