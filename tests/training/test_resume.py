"""fit_resumable: a run killed with SIGKILL mid-epoch resumes and ends with the same weights."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem

# A deterministic little training program, run as a real child process so it can be killed
# with SIGKILL (what a notebook disconnect or a preempted VM does).
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras, numpy as np, tensorflow as tf
    import tfmem

    backup_dir, out_path, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def make_dataset(epoch):
        # The epoch's order depends only on the epoch number.
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(96, seed=100 + epoch, reshuffle_each_iteration=False).batch(8))

    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs))
    model = tfmem.AccumModel(inputs, outputs, accumulation_steps=2)
    model.compile(keras.optimizers.Adam(0.05), "mse")

    class Kill(keras.callbacks.Callback):
        updates = 0
        def on_train_batch_end(self, batch, logs=None):
            Kill.updates += 1
            if Kill.updates == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    history = tfmem.fit_resumable(model, make_dataset, epochs=3, steps_per_epoch=12,
                                  backup_dir=backup_dir, save_every_steps=5,
                                  callbacks=[Kill()], verbose=0)
    np.savez(out_path, *model.get_weights())
    with open(out_path + ".json", "w") as f:
        json.dump({"history": history, "iterations": int(model.optimizer.iterations)}, f)
    """
)


def _run(tmp_path, name, kill_at):
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / name), str(tmp_path / f"{name}.npz"),
         str(kill_at)],
        capture_output=True, text=True, timeout=300,
    )
    return result


def test_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path):
    straight = _run(tmp_path, "straight", kill_at=0)
    assert straight.returncode == 0, straight.stderr[-2000:]

    # Killed at update 18 of 36: epoch 2, step 6; the last backup is epoch 2, step 5.
    killed = _run(tmp_path, "resumed", kill_at=18)
    assert killed.returncode == -signal.SIGKILL
    state = json.loads((tmp_path / "resumed" / "state.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 5)
    assert not (tmp_path / "resumed.npz").exists()

    resumed = _run(tmp_path, "resumed", kill_at=0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = np.load(tmp_path / "straight.npz")
    actual = np.load(tmp_path / "resumed.npz")
    for key in expected.files:
        np.testing.assert_array_equal(actual[key], expected[key])
    summary = json.loads((tmp_path / "resumed.npz.json").read_text())
    # 3 epochs × 12 updates, counted once each although the run was cut in two.
    assert summary["iterations"] == 36
    assert len(summary["history"]["loss"]) == 3
    # Only the latest weights file is kept beside state.json. Saves: epoch 1 at steps 5, 10
    # and its end (generations 0-2), epoch 2 at step 5 (3), killed; resumed: epoch 2 at step
    # 10 and its end (4, 5), epoch 3 at steps 5, 10 and its end (6-8).
    assert sorted(os.listdir(tmp_path / "resumed")) == ["backup-8.weights.h5", "state.json"]


def test_finished_run_started_again_trains_nothing(tmp_path):
    x = np.arange(16, dtype="float32").reshape(8, 2)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    make = lambda epoch: tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)
    tfmem.fit_resumable(model, make, epochs=2, steps_per_epoch=2, backup_dir=tmp_path, verbose=0)
    weights = [w.copy() for w in model.get_weights()]
    history = tfmem.fit_resumable(model, make, epochs=2, steps_per_epoch=2,
                                  backup_dir=tmp_path, verbose=0)
    assert int(model.optimizer.iterations) == 4
    assert len(history["loss"]) == 2
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("name, value", [("epochs", 0), ("steps_per_epoch", 2.5),
                                         ("save_every_steps", -1)])
def test_bad_counts_are_rejected(tmp_path, name, value):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    kwargs = {"epochs": 1, "steps_per_epoch": 1, "save_every_steps": 1, name: value}
    with pytest.raises(ValueError, match=f"`{name}` must be a positive int, got {value!r}"):
        tfmem.fit_resumable(model, lambda e: None, backup_dir=tmp_path, **kwargs)
