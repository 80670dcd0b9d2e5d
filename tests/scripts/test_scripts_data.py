"""The data scripts, run as a user runs them: real subprocesses, outputs checked."""

import os
import re
import subprocess
import sys

import numpy as np
import tensorflow as tf

import tfmem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_make_tfrecords_writes_a_folder_and_inspects_the_result(tmp_path):
    rng = np.random.default_rng(0)
    for index in range(12):
        path = tmp_path / "photos" / ("cats", "dogs", "owls")[index % 3] / f"{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
        path.write_bytes(tf.io.encode_png(image).numpy())
    (tmp_path / "photos" / "owls" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    result = _run("scripts/make_tfrecords.py", f"--source={tmp_path / 'photos'}",
                  f"--output={tmp_path / 'out'}", "--shard_size_mb=0.003", "--skip_unreadable")
    manifest = tfmem.read_manifest(tmp_path / "out")
    assert manifest.num_examples == 12 and manifest.class_names == ("cats", "dogs", "owls")
    assert manifest.skipped == ("owls/broken.jpg",)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"wrote 12 examples in {len(manifest.shards)} shards, "
        rf"{manifest.num_bytes / 1e6:.1f} MB, in \d+\.\d s to {tmp_path / 'out'}, "
        r"skipped 1 unreadable file\(s\)", summary), summary
    assert "12/13" in result.stderr  # the progress bar's last state: 12 of 13 files written

    inspected = _run("scripts/make_tfrecords.py", f"--inspect={tmp_path / 'out' / '*.tfrecord'}")
    assert f"{len(manifest.shards)} file(s)" in inspected.stdout
    assert "'image': bytes[1] (png image" in inspected.stdout
    assert "'label': int64[1]" in inspected.stdout
    assert "'image' decodes to an image of shape (16, 16, 3)" in inspected.stdout
    assert "Manifest: 12 examples, 3 classes" in inspected.stdout
