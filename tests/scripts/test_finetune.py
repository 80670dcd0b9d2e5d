"""scripts/finetune.py as users run it: the demo end to end, dry runs, resume after kill -9, errors."""

import importlib.util
import json
import os
import re
import pathlib
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from absl import flags

import tfmem

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "finetune.py"


def _finetune(*args, timeout=600, backend="tensorflow"):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, KERAS_BACKEND=backend))


def test_demo_trains_clearly_above_chance_and_writes_its_outputs(tmp_path):
    result = _finetune("--output", str(tmp_path), "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["model"] == "small-cnn" and metrics["num_classes"] == 4
    # 4 balanced classes: chance is 0.25; the demo must be learnable in 2 short epochs.
    assert metrics["validation"]["accuracy"] > 0.6
    assert f"validation accuracy {metrics['validation']['accuracy']:.3f}" in result.stdout
    assert metrics["global_batch_size"] == (metrics["micro_batch_size"]
                                            * metrics["accumulation_steps"]
                                            * metrics["num_replicas"])
    assert len(metrics["history"]["loss"]) == 2
    assert "total (peak per replica)" in result.stdout  # the memory plan was printed
    # TensorBoard event files, the resume point at the end, and a reloadable model.
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    state = json.loads((tmp_path / "backup" / "state.json").read_text())
    assert (state["epoch"], state["step"]) == (2, 0)
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(reloaded, tfmem.AccumModel)
    assert reloaded.count_params() == metrics["num_parameters"]


def test_demo_trains_on_the_jax_backend(tmp_path):
    # Today's TPU VMs train Keras on JAX; the same script, tf.data feeding it, KERAS_BACKEND=jax.
    result = _finetune("--output", str(tmp_path), "--epochs", "2", backend="jax")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras               3" in result.stdout and "(backend jax)" in result.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["validation"]["accuracy"] > 0.6
    assert len(metrics["history"]["loss"]) == 2


def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    common = ["--epochs", "2", "--global-batch-size", "32", "--accumulation-steps", "2",
              "--save-every-steps", "4", "--deterministic"]
    straight = _finetune("--output", str(tmp_path / "straight"), *common)
    assert straight.returncode == 0, straight.stderr[-3000:]

    output = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--output", str(output), *common],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    state_path = output / "backup" / "state.json"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and process.poll() is None:
        # Kill as soon as a mid-epoch resume point exists, as a notebook disconnect would.
        if state_path.exists() and json.loads(state_path.read_text())["step"] > 0:
            os.kill(process.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    assert process.wait(timeout=60) == -signal.SIGKILL
    killed_at = json.loads(state_path.read_text())
    assert killed_at["step"] > 0 and not (output / "metrics.json").exists()

    resumed = _finetune("--output", str(output), *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {output / 'backup'}: epoch {killed_at['epoch'] + 1}" in resumed.stdout
    expected = keras.models.load_model(tmp_path / "straight" / "model.keras")
    actual = keras.models.load_model(output / "model.keras")
    for want, got in zip(expected.get_weights(), actual.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert int(actual.optimizer.iterations) == int(expected.optimizer.iterations) == 2 * 64


@pytest.fixture(scope="module")
def finetune_main():
    """The script's `main`, run in this process with parsed flags (no TensorFlow re-import)."""
    spec = importlib.util.spec_from_file_location("finetune_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(*args):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["finetune.py", *tfmem.cli.underscore_flags(args)])
        return module.main([])

    yield run
    flags.FLAGS.unparse_flags()


def test_dry_run_prints_parameters_and_plan_and_trains_nothing(finetune_main, tmp_path, capsys):
    finetune_main("--model", "efficientnetv2-b0", "--image-size", "64", "--dry-run",
                  "--device", "t4", "--global-batch-size", "256", "--output", str(tmp_path))
    out = capsys.readouterr().out
    reference = keras.applications.EfficientNetV2B0(include_top=False, weights=None,
                                                    input_shape=(64, 64, 3))
    # Backbone + a 4-class Dense head on its 1280 pooled features.
    expected = reference.count_params() + 1280 * 4 + 4
    assert f"efficientnetv2-b0: {expected:,} parameters" in out
    assert "budget 12.00 GiB = 80% of 15.00 GiB" in out
    assert "global batch 256 = micro-batch" in out
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "backup").exists()
    assert not (tmp_path / "demo-data").exists()  # a dry run writes no data


@pytest.mark.parametrize("args, message", [
    (["--model", "efficientnet-b9"], r"Unknown model 'efficientnet-b9'.*Valid names: .*efficientnetv2-xl"),
    (["--model", "small-cnn", "--image-size", "16"], r"at least 32×32 pixels"),
    (["--model", "tiramisu"], r"tiramisu is a segmentation model"),
    (["--accumulation-steps", "3", "--dry-run"],
     r"must be divisible by replicas × accumulation_steps \(1 × 3 = 3\)\. Try 63 or 66"),
    (["--accumulation-steps", "many"], r"must be 'auto' or a positive int, got 'many'"),
    (["--device", "t4"], r"only goes with --dry-run"),
])
def test_bad_input_gets_a_message_with_the_fix(finetune_main, tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        finetune_main("--output", str(tmp_path), *args)


def test_data_path_without_records_is_named(finetune_main, tmp_path):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no tfmem manifest\.json.*--num-classes"):
        finetune_main("--output", str(tmp_path), "--data", str(empty))
    with pytest.raises(ValueError, match=r"Found no TFRecord files in the directory"):
        finetune_main("--output", str(tmp_path), "--data", str(empty), "--num-classes", "3",
                      "--num-examples", "100", "--model", "small-cnn", "--image-size", "32")


def test_over_budget_plan_is_refused_with_a_setting_that_fits(finetune_main, tmp_path):
    with pytest.raises(tfmem.MemoryPlanError) as error:
        finetune_main("--model", "efficientnetv2-b0", "--image-size", "224", "--dry-run",
                      "--device", "t4", "--global-batch-size", "1024",
                      "--accumulation-steps", "1", "--output", str(tmp_path))
    text = str(error.value)
    assert re.search(r"global batch 1024 \(micro-batch 1024 × 1 step\(s\) × 1 replica\(s\)\) "
                     r"needs [\d.]+ GiB per replica on t4", text), text
    assert re.search(r"micro-batch \d+ × \d+ steps fits in [\d.]+ GiB", text), text
