"""fit_resumable: a run killed with SIGKILL mid-epoch resumes and ends with the same weights."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.training import run_directory

# A deterministic little training program, its killed runs in real child processes killed with
# SIGKILL (what a notebook disconnect or a preempted VM does). RUN is NAME:KILL_AT, each from the
# start of the program's model, its backups in DIRECTORY/NAME and its outcome in
# DIRECTORY/NAME.npz(.json). First each run with a KILL_AT trains in a child forked from this
# process (which has imported TensorFlow but run no op: the child's starts fresh); the program
# prints `killed {NAME: exit status, -signal if killed}` and waits for a line on stdin (the
# caller's go, after damaging copies of what the kills left). Then this process trains the runs
# without a kill one after the other. Before each run it writes "run NAME" to stderr ("run NAME
# killed" for a killed one), and one run's error does not stop the next.
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras, numpy as np, tensorflow as tf
    import tfmem

    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def make_dataset(epoch):
        # The epoch's order depends only on the epoch number.
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(96, seed=100 + epoch, reshuffle_each_iteration=False).batch(8))

    class Kill(keras.callbacks.Callback):
        def __init__(self, kill_at):
            super().__init__()
            self.kill_at, self.updates = kill_at, 0

        def on_train_batch_end(self, batch, logs=None):
            self.updates += 1
            if self.updates == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def train(backup_dir, out_path, kill_at):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs))
        model = tfmem.AccumModel(inputs, outputs, accumulation_steps=2)
        model.compile(keras.optimizers.Adam(0.05), "mse")
        history = tfmem.fit_resumable(model, make_dataset, epochs=3, steps_per_epoch=12,
                                      backup_dir=backup_dir, save_every_steps=5,
                                      callbacks=[Kill(kill_at)], verbose=0)
        np.savez(out_path, *model.get_weights())
        with open(out_path + ".json", "w") as f:
            json.dump({"history": history, "iterations": int(model.optimizer.iterations)}, f)

    def run(name, kill_at):
        print(f"run {name}" + (" killed" if kill_at else ""), file=sys.stderr, flush=True)
        path = os.path.join(sys.argv[1], name)
        try:
            train(path, path + ".npz", kill_at)
        except Exception:
            traceback.print_exc()
            return False
        return True

    runs = [(name, int(kill_at)) for name, kill_at in map(lambda r: r.split(":"), sys.argv[2:])]
    statuses = {}
    for name, kill_at in runs:
        if kill_at:
            pid = os.fork()
            if pid == 0:
                run(name, kill_at)
                os._exit(3)  # it ended without the kill
            _, status = os.waitpid(pid, 0)
            statuses[name] = (-os.WTERMSIG(status) if os.WIFSIGNALED(status)
                              else os.WEXITSTATUS(status))
    print("killed " + json.dumps(statuses), flush=True)
    sys.stdin.readline()
    failed = [name for name, kill_at in runs if not kill_at and not run(name, 0)]
    sys.exit(1 if failed else 0)
    """
)


def _start(directory, *runs):
    """Starts PROGRAM for `runs`, each `(name, kill_at)`; its stderr goes to DIRECTORY/stderr."""
    with open(directory / "stderr", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", PROGRAM, str(directory),
             *(f"{name}:{kill_at}" for name, kill_at in runs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _stderr_of_each_run(text):
    stderr = {}
    for part in ("\n" + text).split("\nrun ")[1:]:
        name, _, text = part.partition("\n")
        stderr[name] = text
    return stderr


def _points(directory):
    """`{generation: record}` of the resume points in a backup directory."""
    return {int(name.split("-")[1].split(".")[0]): json.loads((directory / name).read_text())
            for name in os.listdir(directory) if name.endswith(".json") and
            name.startswith("backup-")}


DAMAGES = {"truncated weights": "truncated", "empty record": "empty"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process: its child killed at update 18 of 36 (epoch 2, step 6) leaves a newest
    resume point at epoch 2, step 5 (4), the one before it at the end of epoch 1 (3). Copies of
    that backup directory are damaged (`DAMAGES`); then the process runs the program without a
    kill, resumes the killed run, then each damaged copy. The directory, the kill's exit status,
    the points and files it left, and each run's stderr."""
    directory = tmp_path_factory.mktemp("runs")
    process = _start(directory, ("resumed", 18), ("straight", 0), ("resumed", 0),
                     *((name, 0) for name in DAMAGES.values()))
    timer = threading.Timer(300, process.kill)  # a run that hangs ends the program
    timer.start()
    try:
        line = process.stdout.readline()
        assert line.startswith("killed "), (directory / "stderr").read_text()[-3000:]
        left = {"status": json.loads(line[len("killed "):])["resumed"],
                "points": _points(directory / "resumed"), "files": sorted(os.listdir(directory))}
        for name in DAMAGES.values():
            shutil.copytree(directory / "resumed", directory / name)
        (directory / "empty" / "backup-4.json").write_text("")
        weights = directory / "truncated" / "backup-4.weights.h5"
        weights.write_bytes(weights.read_bytes()[:-100])
        process.communicate("go\n", timeout=300)
    finally:
        timer.cancel()
        if process.poll() is None:
            process.kill()
    text = (directory / "stderr").read_text()
    left["stderr"] = text[-3000:]
    stderr = _stderr_of_each_run(text)
    assert sorted(stderr) == sorted(["resumed killed", "straight", "resumed",
                                     *DAMAGES.values()]), text[-3000:]
    return directory, left, stderr


@pytest.fixture(scope="module")
def straight(runs):
    """The weights and summary of the program run without a kill."""
    directory = runs[0]
    assert (directory / "straight.npz").exists(), runs[1]["stderr"]
    return np.load(directory / "straight.npz"), json.loads(
        (directory / "straight.npz.json").read_text())


def _assert_same_run(directory, name, straight):
    expected, expected_summary = straight
    actual = np.load(directory / f"{name}.npz")
    for key in expected.files:
        np.testing.assert_array_equal(actual[key], expected[key])
    summary = json.loads((directory / f"{name}.npz.json").read_text())
    # 3 epochs × 12 updates, counted once each although the run was cut in two.
    assert summary["iterations"] == expected_summary["iterations"] == 36
    # One loss per epoch; the resumed epoch's is the mean over its updates after the restart.
    assert len(summary["history"]["loss"]) == 3
    assert summary["history"]["loss"][-1] == expected_summary["history"]["loss"][-1]


def test_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(runs, straight):
    directory, killed, stderr = runs
    assert killed["status"] == -signal.SIGKILL
    newest = killed["points"][max(killed["points"])]
    assert (newest["epoch"], newest["step"]) == (1, 5)
    assert "resumed.npz" not in killed["files"]

    assert "Traceback" not in stderr["resumed"], stderr["resumed"][-2000:]
    assert "tfmem: warning" not in stderr["resumed"]
    _assert_same_run(directory, "resumed", straight)
    # The newest point and the one before it are kept. Saves: the start (generation 0, the
    # point a step that runs out of memory goes back to), epoch 1 at steps 5, 10 and its end
    # (1-3), epoch 2 at step 5 (4), killed; resumed: epoch 2 at step 10 and its end (5, 6),
    # epoch 3 at steps 5, 10 and its end (7-9).
    assert sorted(os.listdir(directory / "resumed")) == [
        ".lock", "backup-8.json", "backup-8.weights.h5", "backup-9.json",
        "backup-9.weights.h5"]


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_point_falls_back_to_the_one_before(runs, straight, damage):
    # The killed run's newest point (4: epoch 2, step 5), damaged in a copy of its directory.
    directory, _, stderr = runs
    name = DAMAGES[damage]
    reason = {"truncated weights": "backup-4.weights.h5 has",
              "empty record": "backup-4.json is damaged (JSONDecodeError"}[damage]
    assert "Traceback" not in stderr[name], stderr[name][-2000:]
    warning = [line for line in stderr[name].splitlines() if "tfmem: warning" in line]
    assert len(warning) == 1 and reason in warning[0], stderr[name][-2000:]
    assert warning[0].endswith("resuming from the one before it (epoch 2, step 0)")
    _assert_same_run(directory, name, straight)


def _small_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(epoch):
    x = np.arange(16, dtype="float32").reshape(8, 2)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)


def test_no_usable_point_is_one_line_naming_the_damage(tmp_path):
    model = _small_model()
    tfmem.fit_resumable(model, _data, epochs=2, steps_per_epoch=2, backup_dir=tmp_path,
                        verbose=0)
    (tmp_path / "backup-1.json").write_text("{")
    (tmp_path / "backup-0.weights.h5").write_bytes(b"")
    with pytest.raises(ValueError) as error:
        tfmem.fit_resumable(_small_model(), _data, epochs=2, steps_per_epoch=2,
                            backup_dir=tmp_path, verbose=0)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"no usable resume point in {tmp_path}: backup-1.json is "
                              "damaged (JSONDecodeError")
    assert "backup-0.weights.h5 has 0 bytes, backup-0.json says" in message
    assert message.endswith(f"delete {tmp_path} to start the run again from its beginning")


def test_a_point_of_another_model_is_refused_not_loaded(tmp_path):
    tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=2, backup_dir=tmp_path,
                        verbose=0)
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    other.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"the resume point .*backup-0.weights.h5 does not fit "
                                         r"this model .*it belongs to another run"):
        tfmem.fit_resumable(other, _data, epochs=1, steps_per_epoch=2, backup_dir=tmp_path,
                            verbose=0)


def test_finished_run_started_again_trains_nothing(tmp_path):
    model = _small_model()
    tfmem.fit_resumable(model, _data, epochs=2, steps_per_epoch=2, backup_dir=tmp_path, verbose=0)
    weights = [w.copy() for w in model.get_weights()]
    history = tfmem.fit_resumable(model, _data, epochs=2, steps_per_epoch=2,
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


@pytest.fixture()
def tiny_disk(tmp_path):
    """A 192 KiB tmpfs: a real file system that fills up (needs root to mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_a_clear_error_that_keeps_the_last_point(tiny_disk):
    backup = tiny_disk / "backup"
    model = _small_model()
    tfmem.fit_resumable(model, _data, epochs=1, steps_per_epoch=2, backup_dir=backup, verbose=0)
    kept = {name: (backup / name).read_bytes() for name in os.listdir(backup)}
    weights = [w.copy() for w in model.get_weights()]
    # Someone else fills the disk: the next point does not fit.
    free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
    (tiny_disk / "filler").write_bytes(b"\0" * (free - 4096))
    with pytest.raises(OSError) as error:
        tfmem.fit_resumable(model, _data, epochs=2, steps_per_epoch=2, backup_dir=backup,
                            verbose=0)
    assert error.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"no space to save a resume point in {backup} \([\d.]+ MB free, a "
                        r"resume point needs about [\d.]+ MB\); the resume point of epoch 2, "
                        r"step 0 is intact; free some space and start again",
                        error.value.strerror), error.value.strerror
    assert {name: (backup / name).read_bytes() for name in os.listdir(backup)} == kept
    # Space freed: the run resumes from the point it kept and finishes.
    (tiny_disk / "filler").unlink()
    resumed = _small_model()
    tfmem.fit_resumable(resumed, _data, epochs=1, steps_per_epoch=2, backup_dir=backup,
                        verbose=0)
    for before, after in zip(weights, resumed.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_a_write_that_fails_for_space_leaves_no_partial_file(tiny_disk):
    # 40 small layers: 972 bytes of variables, but a 120 KB weights file (HDF5 metadata), so
    # the first point's estimate passes and HDF5's own write fails on the full disk. The
    # error is the same one line, and neither a temporary nor a half-written file is left.
    backup = tiny_disk / "backup"
    backup.mkdir()
    free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
    (tiny_disk / "filler").write_bytes(b"\0" * (free - 80 * 1024))
    model = keras.Sequential([keras.Input((2,))] + [keras.layers.Dense(2) for _ in range(40)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.ones((8, 2), "float32")
    data = lambda epoch: tf.data.Dataset.from_tensor_slices((x, x)).batch(4)
    with pytest.raises(OSError) as error:
        tfmem.fit_resumable(model, data, epochs=1, steps_per_epoch=2, backup_dir=backup,
                            verbose=0)
    assert error.value.errno == errno.ENOSPC, error.value
    # HDF5's own failure (errno 28 inside its message), not the estimate's.
    assert error.value.strerror.startswith(f"no space to save a resume point in {backup} (No "
                                           "space left on device); ")
    assert error.value.strerror.endswith("no resume point was written yet; free some space and "
                                         "start again")
    assert os.listdir(backup) == [".lock"]


def test_one_process_at_a_time_and_a_killed_one_leaves_no_lock(tmp_path):
    # A real second process holds the directory: this one refuses, naming its pid.
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import importlib.util, sys, time
            spec = importlib.util.spec_from_file_location(
                "run_directory", {run_directory.__file__!r})
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            with module.lock({str(tmp_path)!r}):
                print("locked", flush=True)
                time.sleep(600)
            """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(run_directory.RunDirectoryBusyError,
                           match=rf"another process \(pid {holder.pid}\) is running in "
                                 rf"{tmp_path}; wait for it to end, or use another backup_dir"):
            tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=2,
                                backup_dir=tmp_path, verbose=0)
    finally:
        holder.kill()  # SIGKILL: the holder gets no chance to unlock
        holder.wait()
    history = tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=2,
                                  backup_dir=tmp_path, verbose=0)
    assert len(history["loss"]) == 1


def test_learning_rate_data_and_settings_are_checked(tmp_path):
    for rate in (float("nan"), -1.0, float("inf")):
        model = _small_model()
        model.optimizer.learning_rate = rate
        with pytest.raises(ValueError, match=rf"the optimizer's learning rate is {rate}; pass a "
                                             r"finite learning rate >= 0"):
            tfmem.fit_resumable(model, _data, epochs=1, steps_per_epoch=2,
                                backup_dir=tmp_path / "lr", verbose=0)
    # 8 examples in batches of 4 give 2 updates, not 3.
    with pytest.raises(ValueError, match=r"the data of epoch 1 ran out after 2 of 3 updates: "
                                         r"steps_per_epoch .* is more than the data gives"):
        tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=3,
                            backup_dir=tmp_path / "short", verbose=0)
    config = {"learning_rate": 0.01, "global_batch_size": 4, "optimizer": "sgd"}
    tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=2,
                        backup_dir=tmp_path / "run", verbose=0, run_config=config)
    with pytest.raises(ValueError, match=r"holds a run with other settings \(learning_rate 0.01 "
                                         r"→ 0.1, optimizer 'sgd' → 'adam'\); use another "
                                         r"backup_dir, or delete .*run to start this run"):
        tfmem.fit_resumable(_small_model(), _data, epochs=2, steps_per_epoch=2,
                            backup_dir=tmp_path / "run", verbose=0,
                            run_config=config | {"learning_rate": 0.1, "optimizer": "adam"})
    # A record without anything of its run (a first start that stopped before its first
    # resume point) is replaced, not compared: there is nothing to mix.
    fresh = tmp_path / "fresh"
    run_directory.check_config(fresh, {"seed": 1}, holds_run=False, how_to_fix="-")
    assert run_directory.check_config(fresh, {"seed": 2}, holds_run=False,
                                      how_to_fix="-")["config"] == {"seed": 2}
    with pytest.raises(run_directory.RunConfigError, match=r"other settings \(seed 2 → 3\); -"):
        run_directory.check_config(fresh, {"seed": 3}, holds_run=True, how_to_fix="-")


def _sgd_step(weights, x, y, rate):
    """One SGD update of a Dense(1) on the mean squared error, in float32 (NumPy)."""
    kernel, bias = (np.asarray(w, "float32") for w in weights)
    error = x @ kernel + bias - y
    loss = np.mean(error**2, dtype="float32")
    kernel = kernel - np.float32(rate) * (2 / len(x)) * (x.T @ error)
    bias = bias - np.float32(rate) * (2 / len(x)) * error.sum(axis=0)
    return [kernel, bias], loss


def test_a_diverging_run_stops_at_the_first_non_finite_loss(tmp_path):
    x = np.arange(16, dtype="float32").reshape(8, 2)
    y = x[:, :1]
    model = _small_model()
    model.optimizer.learning_rate = 1e30
    start = [w.copy() for w in model.get_weights()]
    with np.errstate(over="ignore", invalid="ignore"):
        after_one, _ = _sgd_step(start, x[:4], y[:4], 1e30)
        _, second_loss = _sgd_step(after_one, x[4:], y[4:], 1e30)
    assert np.isfinite(after_one[0]).all() and not np.isfinite(second_loss)
    with pytest.raises(tfmem.TrainingDivergedError) as error:
        tfmem.fit_resumable(model, _data, epochs=3, steps_per_epoch=2, save_every_steps=1,
                            backup_dir=tmp_path, verbose=0)
    diverged = error.value
    assert (diverged.epoch, diverged.step, diverged.resume_point) == (1, 2, (1, 1))
    np.testing.assert_equal(diverged.loss, second_loss)
    assert str(diverged) == (
        f"training diverged: the loss is {second_loss} at epoch 1, step 2, and the run stopped "
        f"there; the newest resume point in {tmp_path} (epoch 1, step 1) holds the last finite "
        "weights; lower the learning rate (or clip the gradients) and start again")
    # Nothing was saved after the first update: the newest point holds its weights.
    assert sorted(_points(tmp_path)) == [0]
    kept = _small_model()
    kept.load_weights(tmp_path / _points(tmp_path)[0]["weights"])
    for got, want in zip(kept.get_weights(), after_one):
        np.testing.assert_allclose(got, want, rtol=1e-6)

    # An update that leaves the loss finite but the weights not: no point is saved of them.
    model = _small_model()
    model.optimizer.learning_rate = 1e38
    with pytest.raises(tfmem.TrainingDivergedError,
                       match=r"^training diverged: the weights are no longer finite numbers at "
                             r"epoch 1, step 1, and the run stopped there; no resume point was "
                             r"saved;") as error:
        tfmem.fit_resumable(model, _data, epochs=1, steps_per_epoch=2, save_every_steps=1,
                            backup_dir=tmp_path / "weights", verbose=0)
    assert error.value.resume_point is None and _points(tmp_path / "weights") == {}


def test_a_restart_with_fewer_epochs_than_trained_is_refused(tmp_path):
    tfmem.fit_resumable(_small_model(), _data, epochs=2, steps_per_epoch=2,
                        backup_dir=tmp_path, verbose=0)
    model = _small_model()
    with pytest.raises(ValueError, match=rf"^`epochs` is 1, but the run in {tmp_path} has "
                                         r"trained 2 epochs already; pass epochs=2 or more to "
                                         r"go on with it, or another backup_dir for a new run$"):
        tfmem.fit_resumable(model, _data, epochs=1, steps_per_epoch=2, backup_dir=tmp_path,
                            verbose=0)
    assert int(model.optimizer.iterations) == 4  # the point's, and no update after it


def test_a_backup_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(ValueError, match=rf"^backup_dir {tmp_path / 'taken'} is a file, not a "
                                         r"directory; pass a directory \(it is made if it does "
                                         r"not exist\)$"):
        tfmem.fit_resumable(_small_model(), _data, epochs=1, steps_per_epoch=2,
                            backup_dir=tmp_path / "taken", verbose=0)
    assert (tmp_path / "taken").read_text() == "x"


def test_arrays_and_a_py_dataset_resume_to_the_uninterrupted_weights():
    # The case the JAX backend runs without TensorFlow (tests/test_without_tensorflow.py), here
    # on TensorFlow: interrupted at update 9 of 12, resumed from update 8.
    from tests.training.jax_cases.without_tensorflow_cases import resume_differences

    assert resume_differences() == {"arrays": pytest.approx(0, abs=1e-6),
                                    "PyDataset": pytest.approx(0, abs=1e-6)}


def test_what_make_dataset_returns_is_checked(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    with pytest.raises(TypeError, match=r"`make_dataset` returned a list; return a "
                                        r"tf\.data\.Dataset, a keras\.utils\.PyDataset, or a "
                                        r"tuple \(x, y\)"):
        tfmem.fit_resumable(model, lambda epoch: [np.zeros((8, 2))], epochs=1,
                            steps_per_epoch=2, backup_dir=tmp_path / "b")
