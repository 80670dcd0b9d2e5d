"""Replacing a set (`overwrite=True`) killed with SIGKILL at any moment leaves one complete set."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tfmem

# Writes the "new" set over the old one and kills itself (SIGKILL: no cleanup runs) at a point.
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tfmem
    from tfmem.data import manifest as manifest_lib

    directory, point = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(12, 6, 5, 3), dtype=np.uint8)

    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)

    progress = None
    if point.startswith("example-"):
        number = int(point.removeprefix("example-"))
        progress = lambda done, num_bytes, total: die() if done == number else None
    write_manifest = manifest_lib.write_manifest
    if point == "before-manifest":
        manifest_lib.write_manifest = die
    if point == "after-manifest":
        manifest_lib.write_manifest = lambda manifest: (write_manifest(manifest), die())
    tfmem.write_image_tfrecords((images, np.arange(12) % 3), directory, shard_size_mb=0.0008,
                                shuffle=False, overwrite=True, progress=progress)
    """
)


def _images(seed):
    return np.random.default_rng(seed).integers(0, 256, size=(12, 6, 5, 3), dtype=np.uint8)


def _read(directory):
    dataset = tfmem.image_dataset(str(directory), image_size=(6, 5), batch_size=12,
                                  training=False, num_parallel_reads=1)
    (images, _), = [tuple(t.numpy() for t in batch) for batch in dataset]
    return images


@pytest.mark.parametrize("point, survivor", [
    ("example-8", "old"),          # inside the third shard (a hidden temporary file), two
                                   # new shards complete under their names
    ("before-manifest", "old"),    # every new shard complete, the manifest not yet switched
    ("after-manifest", "new"),     # switched, the old shards not yet removed
])
def test_replacement_killed_at_any_point_leaves_one_complete_set(tmp_path, point, survivor):
    directory = tmp_path / "set"
    old = tfmem.write_image_tfrecords((_images(0), np.arange(12) % 3), directory,
                                      shard_size_mb=0.0008, shuffle=False)
    killed = subprocess.run([sys.executable, "-c", PROGRAM, str(directory), point],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # The kill left files of both sets in the directory...
    listed = set(os.listdir(directory)) - {"manifest.json"}
    assert listed - {shard.name for shard in old.shards}, listed
    # ...and the manifest names one of them whole: exactly the old pixels or the new ones.
    expected = _images(0) if survivor == "old" else _images(1)
    np.testing.assert_array_equal(_read(directory), expected)

    # The next write replaces it and removes every other file.
    new = tfmem.write_image_tfrecords((_images(2), np.arange(12) % 3), directory,
                                      shard_size_mb=0.0008, shuffle=False, overwrite=True)
    assert sorted(os.listdir(directory)) == sorted(
        ["manifest.json", *(shard.name for shard in new.shards)])
    np.testing.assert_array_equal(_read(directory), _images(2))
