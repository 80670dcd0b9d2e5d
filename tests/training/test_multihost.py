"""JAX past one process: 2 real processes on localhost (gloo collectives), 2 CPU devices each.

The commands are those of docs/multi-host.md ("Try it on one machine"): each process gets
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, and `tfmem.detect()` starts JAX's
distributed runtime. The reference is one process training a plain `keras.Model` on the same
global batches.
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import tfmem
from tests.jax_flags import jax_xla_flags
from tfmem.runtime import distribute_jax

PROGRAM = os.path.join(os.path.dirname(__file__), "multihost_run.py")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    return dict(env, TF_CPP_MIN_LOG_LEVEL="3", **extra,
                XLA_FLAGS=jax_xla_flags())


def _start(tmp_path, name, mode, *args):
    """Starts the 2 processes; returns them with their output files."""
    port = _free_port()
    started = []
    for rank in range(2):
        out = tmp_path / f"{name}-{rank}.json"
        env = _env(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(rank))
        started.append((subprocess.Popen(
            [sys.executable, PROGRAM, mode, str(out), *map(str, args)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out))
    return started


def _finish(started, timeout=300):
    results = []
    for process, out in started:
        stdout, stderr = process.communicate(timeout=timeout)
        results.append((process.returncode, stdout + stderr, out))
    return results


def _demo_set(directory, shard_size_mb):
    shards = tfmem.make_demo_dataset(directory, num_examples=48, image_size=16,
                                     shard_size_mb=shard_size_mb).shards
    return directory, [shard.num_examples for shard in shards]


@pytest.fixture(scope="module")
def image_sets(tmp_path_factory):
    """Two image sets of the same 48 images: one shard (fewer than the processes), and 8
    shards (each process's 4 hold the epoch's 3 steps × 8 rows)."""
    directory = tmp_path_factory.mktemp("sets")
    one, counts = _demo_set(directory / "one", shard_size_mb=1)
    assert counts == [48]
    eight, counts = _demo_set(directory / "eight", shard_size_mb=0.005)
    assert counts == [6] * 8
    return {"one": one, "eight": eight}


@pytest.fixture(scope="module")
def plain(tmp_path_factory, image_sets):
    """One process, one device, plain `fit`: the weights on the arrays after 1 epoch and after
    2, and the weights and batches on the one-shard image set after 2."""
    out = tmp_path_factory.mktemp("plain") / "plain.json"
    result = subprocess.run([sys.executable, PROGRAM, "plain", str(out),
                             "--images", str(image_sets["one"])],
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(out.read_text())
    by_epoch = outcome["arrays"]["weights_by_epoch"]
    assert len(by_epoch) == 2
    return dict({epochs: {"weights": weights} for epochs, weights in enumerate(by_epoch, start=1)},
                images=outcome["images"])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, image_sets):
    """Two processes that train an AccumModel on arrays, read the 8-shard set, train on the
    one-shard set, then start a resumable run in which process 1 kills itself after 4 updates
    (process 0 is stopped then, as a scheduler tears the job down); what each wrote before,
    the exit statuses and the backup directory."""
    directory = tmp_path_factory.mktemp("two")
    backup = directory / "backup"
    started = _start(directory, "run", "accum", "--read", image_sets["eight"],
                     "--images", image_sets["one"], "--backup", backup, "--kill-at", 4)
    try:
        started[1][0].wait(timeout=300)
    finally:
        for process, _ in started:
            if process.poll() is None:
                process.kill()
    results = _finish(started)
    for _, output, out in results:
        assert out.exists(), output[-3000:]
    return [(output, json.loads(out.read_text())) for _, output, out in results], {
        "statuses": [status for status, _, _ in results], "backup": backup}


def _images_of(shards, directory, manifest):
    """The SHA-1 of each image of `shards` (linked into `directory`, one reader for them all),
    decoded as the training reader decodes them."""
    directory.mkdir()
    for shard in shards:
        (directory / shard.name).symlink_to(shard)
    read = tfmem.image_dataset(str(directory / "*"), schema=manifest.schema,
                               num_classes=manifest.num_classes, image_size=(16, 16),
                               batch_size=64, training=False)
    return {hashlib.sha1(image.tobytes()).hexdigest() for batch, _ in read
            for image in batch.numpy()}


def test_two_processes_train_on_image_dataset_as_one(two_processes, plain):
    # One shard, fewer than the processes: each reads every record and keeps its rows, so the
    # global batches are exactly those of one process.
    reference = plain["images"]
    parts = []
    for output, outcome in two_processes[0]:
        outcome = outcome["images"]
        _assert_close(outcome, reference)
        assert outcome["planned"] == [16, 2, 2]  # 8 rows here × 2 processes = 2 × 2 × 4
        assert outcome["unseeded"].startswith(
            "with 2 processes, each keeps its rows of the same global batches, so every "
            "process must shuffle alike: pass the same `seed` in every process")
        parts.append(outcome["batches"])
    assert all(len(batch) == 8 for part in parts for batch in part)  # 16 ÷ 2 processes
    assert [a + b for a, b in zip(*parts, strict=True)] == reference["batches"]


def test_with_enough_shards_each_process_reads_only_its_own(two_processes, image_sets,
                                                           tmp_path):
    data = image_sets["eight"]
    parts = [outcome["read"] for _, outcome in two_processes[0]]
    assert [len(part) for part in parts] == [3, 3]  # the same steps in each process
    assert all(len(batch) == 8 for part in parts for batch in part)
    # No image twice, all 48 read, and each process read the images of its own shards.
    seen = [image for part in parts for batch in part for image in batch]
    assert len(set(seen)) == len(seen) == 48
    manifest = tfmem.read_manifest(data)
    shards = [data / shard.name for shard in manifest.shards]
    for index, part in enumerate(parts):
        assert {image for batch in part for image in batch} == _images_of(
            shards[index::2], tmp_path / str(index), manifest)


def _assert_close(actual, expected):
    for a, b in zip(actual["weights"], expected["weights"], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_two_processes_train_as_one_big_batch(two_processes, plain):
    for rank, (output, outcome) in enumerate(two_processes[0]):
        assert (f"tfmem: starting JAX's distributed runtime (process {rank} of 2, coordinator "
                "localhost:") in output
        assert outcome["process"] == [2, rank]
        assert outcome["replicas"] == [4, 2]  # global and local
        assert outcome["arrays"]["iterations"] == 3
        _assert_close(outcome["arrays"], plain[1])


def test_a_killed_process_and_a_restart_resume_every_process_from_one_point(tmp_path,
                                                                             two_processes,
                                                                             plain):
    # Process 1 killed itself after 4 updates of the resumable run, and process 0 was stopped.
    killed = two_processes[1]
    assert killed["statuses"][1] == -signal.SIGKILL
    backup = killed["backup"]
    points = sorted(name for name in os.listdir(backup) if name.endswith(".json"))
    assert points and all(name.startswith("backup-") for name in points)

    results = _finish(_start(tmp_path, "run", "resumable", "--backup", backup))
    positions = set()
    for status, output, out in results:
        assert status == 0, output[-3000:]
        resumed = [line for line in output.splitlines() if line.startswith("Resuming from")]
        assert len(resumed) == 1, output[-3000:]
        positions.add(resumed[0])
        outcome = json.loads(out.read_text())["resumed"]
        assert outcome["iterations"] == 6
        _assert_close(outcome, plain[2])
    assert len(positions) == 1  # one resume point, read by both


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4",
      "JAX_PROCESS_ID": "3"},
     {"coordinator_address": "10.0.0.2:1234", "num_processes": 4, "process_id": 3}),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, {"coordinator_address": "h:1"}),  # SLURM, MPI: JAX
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1,t1k-w-2,t1k-w-3"}, {}),  # a v4-32 pod slice
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # one TPU VM
])
def test_what_the_environment_asks_for(environ, expected):
    assert distribute_jax.process_settings(environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS is not set"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "1"}, "JAX_NUM_PROCESSES is not set"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID=2 must be from 0 to JAX_NUM_PROCESSES - 1 = 1"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "must be whole numbers"),
])
def test_a_partial_or_wrong_environment_is_one_error(environ, message):
    with pytest.raises(ValueError, match=message):
        distribute_jax.process_settings(environ)


def test_without_process_zero_the_others_stop_at_the_time_limit(tmp_path):
    env = _env(JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID="1")
    program = ("import os; os.environ['KERAS_BACKEND'] = 'jax'\n"
               "import tfmem\n"
               "tfmem.detect(timeout=2)\n")
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "RuntimeError: process 1: the coordinator localhost:")
    assert "did not answer within 2 s" in result.stderr
