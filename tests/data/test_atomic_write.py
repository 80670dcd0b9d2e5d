"""Replacing a set (`overwrite=True`) killed with SIGKILL at any moment leaves one complete set."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tfmem

# Writes the "new" set over the old one in DIRECTORY and kills itself (SIGKILL: no cleanup
# runs) at POINT, for each DIRECTORY POINT pair of its arguments: each in a child process forked
# from this one, which imports tfmem once and runs no TensorFlow op itself (the child's
# TensorFlow starts fresh). Prints {point: the child's exit status, -signal if killed}.
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tfmem
    from tfmem.data import manifest as manifest_lib

    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)

    def replace(directory, point):
        rng = np.random.default_rng(1)
        images = rng.integers(0, 256, size=(12, 6, 5, 3), dtype=np.uint8)
        progress = None
        if point.startswith("example-"):
            number = int(point.removeprefix("example-"))
            progress = lambda done, num_bytes, total: die() if done == number else None
        write_manifest = manifest_lib.write_manifest
        if point == "before-manifest":
            manifest_lib.write_manifest = die
        if point == "after-manifest":
            manifest_lib.write_manifest = lambda manifest: (write_manifest(manifest), die())
        tfmem.write_image_tfrecords((images, np.arange(12) % 3), directory,
                                    shard_size_mb=0.0008, shuffle=False, overwrite=True,
                                    progress=progress)

    statuses = {}
    for directory, point in zip(sys.argv[1::2], sys.argv[2::2]):
        pid = os.fork()
        if pid == 0:
            try:
                replace(directory, point)
            except BaseException:
                traceback.print_exc()
            os._exit(3)  # it ended without the kill
        _, status = os.waitpid(pid, 0)
        statuses[point] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                           else os.WEXITSTATUS(status))
    print(json.dumps(statuses))
    """
)


def _images(seed):
    return np.random.default_rng(seed).integers(0, 256, size=(12, 6, 5, 3), dtype=np.uint8)


def _read(directory):
    dataset = tfmem.image_dataset(str(directory), image_size=(6, 5), batch_size=12,
                                  training=False, num_parallel_reads=1)
    (images, _), = [tuple(t.numpy() for t in batch) for batch in dataset]
    return images


# Inside the third shard (a hidden temporary file), two new shards complete under their names;
# every new shard complete, the manifest not yet switched; switched, the old shards not yet
# removed.
SURVIVORS = {"example-8": "old", "before-manifest": "old", "after-manifest": "new"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """For each point: an old set, replaced by a process killed at that point. `{point:
    (directory, the old set's manifest, exit status)}`, and the program's stderr."""
    sets = {}
    for point in SURVIVORS:
        directory = tmp_path_factory.mktemp(point) / "set"
        sets[point] = directory, tfmem.write_image_tfrecords(
            (_images(0), np.arange(12) % 3), directory, shard_size_mb=0.0008, shuffle=False)
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM,
         *(part for point, (directory, _) in sets.items() for part in (directory, point))],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    statuses = json.loads(result.stdout.splitlines()[-1])
    return {point: (*sets[point], statuses[point]) for point in SURVIVORS}, result.stderr


@pytest.mark.parametrize("point", list(SURVIVORS))
def test_replacement_killed_at_any_point_leaves_one_complete_set(killed, point):
    (directory, old, status), stderr = killed[0][point], killed[1]
    assert status == -signal.SIGKILL, stderr[-2000:]
    # The kill left files of both sets in the directory...
    listed = set(os.listdir(directory)) - {"manifest.json"}
    assert listed - {shard.name for shard in old.shards}, listed
    # ...and the manifest names one of them whole: exactly the old pixels or the new ones.
    expected = _images(0) if SURVIVORS[point] == "old" else _images(1)
    np.testing.assert_array_equal(_read(directory), expected)

    # The next write replaces it and removes every other file.
    new = tfmem.write_image_tfrecords((_images(2), np.arange(12) % 3), directory,
                                      shard_size_mb=0.0008, shuffle=False, overwrite=True)
    assert sorted(os.listdir(directory)) == sorted(
        ["manifest.json", *(shard.name for shard in new.shards)])
    np.testing.assert_array_equal(_read(directory), _images(2))
