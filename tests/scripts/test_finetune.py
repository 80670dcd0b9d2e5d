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
import tensorflow as tf
from absl import flags

import tfmem
from tests.jax_flags import jax_xla_flags
from tfmem._sizes import format_bytes
from tfmem.finetune import task_loss
from tfmem.memory.memory_plan import Term

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "finetune.py"


def _finetune(*args, timeout=600, backend="tensorflow", cwd=ROOT, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, KERAS_BACKEND=backend,
                                   PYTHONPATH=os.pathsep.join(
                                       [str(ROOT), *os.environ.get("PYTHONPATH", "").split(
                                           os.pathsep)]).rstrip(os.pathsep), **env))


def _newest_point(backup):
    """The record of the newest resume point in a backup directory, or None."""
    records = sorted(backup.glob("backup-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return json.loads(records[-1].read_text()) if records else None


def _error_line(stderr):
    """The one `error:` line of a failed run; nothing of a traceback around it."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr[-3000:]
    return errors[0]


def test_demo_trains_clearly_above_chance_and_writes_its_outputs(tmp_path, finetune_cli,
                                                                 monkeypatch):
    # No --output: the run goes to runs/<model> under the working directory.
    result = _finetune("--epochs", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = tmp_path / "runs" / "small-cnn"
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["model"] == "small-cnn" and metrics["num_classes"] == 4
    # 4 balanced classes: chance is 0.25; the demo must be learnable in 2 short epochs.
    assert metrics["validation"]["accuracy"] > 0.6
    assert (f"validation accuracy {metrics['validation']['accuracy']:.3f} after 2 epochs "
            "(chance 0.250)") in result.stdout
    assert metrics["global_batch_size"] == (metrics["micro_batch_size"]
                                            * metrics["accumulation_steps"]
                                            * metrics["num_replicas"])
    assert len(metrics["history"]["loss"]) == 2
    assert "total (peak per replica)" in result.stdout  # the memory plan was printed
    # Each thing said once: the parameters and the split head the plan's table.
    split = tfmem.describe_split(64, metrics["micro_batch_size"], metrics["accumulation_steps"],
                                 metrics["num_replicas"])
    assert result.stdout.count(split) == 1
    assert result.stdout.count(f"{metrics['num_parameters']:,} parameters") == 1
    assert f"small-cnn: {metrics['num_parameters']:,} parameters, Adam" in result.stdout
    # TensorFlow's import banner (oneDNN, absl) is set aside; nothing else is on stderr.
    assert "oneDNN" not in result.stderr and "InitializeLog" not in result.stderr
    # Progress (not a terminal here): an estimate of the run, then one line per epoch.
    batch = "global batch 64"
    assert re.search(r"estimate: the run's 64 updates take about \d+(m\d\ds|s) on this "
                     r"machine at [\d,]+ images/s", result.stdout), result.stdout
    for epoch in (1, 2):
        found = re.search(rf"epoch {epoch}/2: accuracy [\d.]+, loss [\d.]+, val_accuracy "
                          rf"([\d.]+).*; 32 updates in \d+s, {batch}, [\d,]+ images/s, \d+s "
                          r"left for the run", result.stdout)
        assert found, result.stdout
        # Not chance after the first epoch: BatchNorm's moving statistics follow the training.
        assert float(found.group(1)) > 0.6, result.stdout
    # It says what it trains, on what; the environment in one line; a summary at the end.
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"environment: tfmem \S+, keras \S+ \(backend tensorflow\), cpu \(.*\), "
                        r"[\d.]+ GiB of host RAM available \(--verbose: the whole table\)",
                        lines[0]), lines[0]
    assert lines[1] == (
        "finetune: the demo trains small-cnn for 2 epochs on tfmem's built-in shapes data: "
        "2,048 32×32 images of 4 classes (disk, square, triangle, plus), 512 held out to "
        "validate")
    assert lines[-1] == (
        "finetune: done. The trained model: runs/small-cnn/model.keras; its results: "
        "runs/small-cnn/metrics.json; its training curves: tensorboard --logdir "
        "runs/small-cnn/logs")
    # TensorBoard event files, the resume point at the end, and a reloadable model.
    assert list((output / "logs").rglob("events.out.tfevents.*"))
    state = _newest_point(output / "backup")
    assert (state["epoch"], state["step"]) == (2, 0)
    reloaded = keras.models.load_model(output / "model.keras")
    assert isinstance(reloaded, tfmem.AccumModel)
    assert reloaded.count_params() == metrics["num_parameters"]
    run = json.loads((output / "run.json").read_text())
    assert run["config"]["model"] == "small-cnn" and run["config"]["learning_rate"] == 1e-3
    assert run["complete"]["epochs"] == 2

    # Started again (in this process, training here too: no memory limit), the finished run
    # is left as it is, run.json untouched, in one line. (A training process decides it the
    # same way: it runs the same code.)
    written = {name: (output / name).read_bytes() for name in ("metrics.json", "model.keras")}
    recorded = (output / "run.json").stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    status, out, stderr = finetune_cli("--epochs", "2", "--memory-limit", "none")
    assert status == 0, stderr[-3000:]
    assert out == (
        "finetune: the run in runs/small-cnn is complete (2 epochs); its results are "
        "runs/small-cnn/metrics.json and runs/small-cnn/model.keras. Nothing was changed: use "
        "a new --output for another run, or more --epochs to train this one further.\n")
    assert {name: (output / name).read_bytes() for name in written} == written
    assert (output / "run.json").stat().st_mtime_ns == recorded
    # Another experiment in the same directory stops, naming what differs (checked in this
    # process: without a memory limit there is no training process to start).
    status, _, stderr = finetune_cli("--optimizer", "rmsprop", "--learning-rate", "0.01",
                                     "--seed", "7", "--memory-limit", "none")
    assert status == 2
    assert _error_line(stderr) == (
        "error: runs/small-cnn holds a run with other settings (learning_rate 0.001 → 0.01, "
        "optimizer 'adam' → 'rmsprop', seed 0 → 7); start it with its own settings to resume "
        "it, use a new --output for a new run, or pass --overwrite to discard it and start "
        "again")
    assert {name: (output / name).read_bytes() for name in written} == written


def test_an_error_on_the_jax_backend_is_one_line_without_tensorflows_banner(tmp_path):
    # TensorFlow is imported after Keras there (by the data pipeline); its native libraries
    # print their notices at any TF_CPP_MIN_LOG_LEVEL below 2.
    result = _finetune("--device", "t4", "--output", str(tmp_path), timeout=300,
                       backend="jax", TF_CPP_MIN_LOG_LEVEL="0")
    assert result.returncode == 2
    assert result.stderr == ("error: --device t4 plans for another machine; it only goes with "
                             "--dry-run (training always runs on the detected runtime)\n")


def _unet_dry_run_on_jax(device: str, tmp_path, *flags):
    """A dry run on JAX for `device` of a U-Net on masks (its IoU metric traced on JAX too)."""
    return _finetune("--dry-run", "--device", device, "--model", "unet", "--task",
                     "segmentation", "--num-classes", "3", "--image-size", "64",
                     "--global-batch-size", "32", "--output", str(tmp_path), *flags,
                     timeout=300, backend="jax", JAX_PLATFORMS="cpu", XLA_FLAGS=jax_xla_flags())


def _compiled_figure(stdout: str):
    """The plan table's `compiled step (XLA)` line's MiB (a match), or None."""
    return re.search(r"compiled step \(XLA\) +([\d.]+) MiB +arguments \+ outputs", stdout)


def test_a_dry_run_on_jax_for_a_tpu_checks_the_split_with_xla_tpus_own_figure(tmp_path):
    # Compiled here ahead of time where the TPU compiler (libtpu) is installed, for a model
    # built for its shapes in the plan's precision; where it is not, the plan alone, saying
    # what the compiled figure needs. A U-Net on masks: its IoU metric traced on JAX too.
    result = _unet_dry_run_on_jax("tpu-v5e-8", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("unet: 1,945,555 parameters, Adam, mixed_bfloat16 on tpu-v5e-8, global batch 32 "
            "= micro-batch 4 × 1 accumulation step × 8 replicas") in result.stdout
    assert "warning:" not in result.stdout + result.stderr  # none of JAX's from the plan
    compiled = _compiled_figure(result.stdout)
    if importlib.util.find_spec("libtpu") is None:
        import jax

        assert compiled is None
        assert ("finetune: the plan alone: XLA's own figure of this step needs the TPU "
                "compiler, libtpu, to compile for a TPU on this machine: pip install "
                f'"jax[tpu]=={jax.__version__}" (it pins the libtpu of this JAX)'
                ) in result.stdout
    else:
        assert compiled and 0 < float(compiled.group(1)) < 1024, result.stdout
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    # --nocompile: the plan alone, without a word of the compile.
    alone = _unet_dry_run_on_jax("tpu-v5e-8", tmp_path, "--nocompile")
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert not [line for line in alone.stdout.splitlines() if line.startswith((
        "finetune: compiling", "finetune: the plan alone", "  compiled step (XLA)"))]
    assert [line for line in alone.stdout.splitlines() if "total (peak per replica)" in line
            ] == [line for line in result.stdout.splitlines()
                  if "total (peak per replica)" in line]


def test_a_dry_run_on_jax_for_a_gpu_checks_the_split_with_xla_gpus_own_figure(tmp_path):
    # Compiled here ahead of time, without a GPU, where JAX's CUDA plugin is installed; where
    # it is not, the plan alone, saying what the compiled figure needs.
    result = _unet_dry_run_on_jax("t4", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("unet: 1,945,555 parameters, Adam, mixed_float16 on t4, global batch 32 = "
            "micro-batch 32 × 1 accumulation step × 1 replica") in result.stdout
    compiled = _compiled_figure(result.stdout)
    from tfmem.memory import probe_jax

    if not probe_jax._installed("jax_plugins.xla_cuda12"):
        import jax

        assert compiled is None
        assert ("finetune: the plan alone: XLA's own figure of this step needs JAX's CUDA "
                "plugin to compile for a GPU on this machine (no GPU or driver needed): pip "
                f'install "jax[cuda12]=={jax.__version__}"') in result.stdout
    else:
        assert compiled and 0 < float(compiled.group(1)) < 2048, result.stdout
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path, finetune_cli,
                                                                   written_sets):
    # 512 demo records: 16 updates, a resume point every 2.
    common = ["--data", written_sets["demo512"], "--epochs", "1", "--global-batch-size", "32",
              "--accumulation-steps", "2", "--save-every-steps", "2", "--deterministic"]
    # The run it must equal, made in this process (no memory limit: no training process).
    status, _, stderr = finetune_cli("--output", str(tmp_path / "straight"), *common,
                                     "--memory-limit", "none")
    assert status == 0, stderr[-3000:]

    output = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--output", str(output), *common],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and process.poll() is None:
        if (output / "backup").is_dir() and not (output / "backup" / "busy-checked").exists():
            # While it trains, a second run on the same --output is refused.
            status, _, stderr = finetune_cli("--output", str(output), *common)
            assert (status, stderr) == (1, f"error: another process (pid {process.pid}) is "
                                           f"running in {output}; wait for it to end, or use "
                                           "another --output\n")
            (output / "backup" / "busy-checked").touch()
        # Kill as soon as a mid-epoch resume point exists, as a notebook disconnect would.
        point = (output / "backup").is_dir() and _newest_point(output / "backup")
        if point and point["step"] > 0:
            os.kill(process.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert (output / "backup" / "busy-checked").exists()
    killed_at = _newest_point(output / "backup")
    assert killed_at["step"] > 0 and not (output / "metrics.json").exists()

    # The killed run's lock is gone; started again, in this process, training here too (a
    # training process that resumes from a resume point: the memory-limit test below).
    status, out, stderr = finetune_cli("--output", str(output), *common, "--memory-limit",
                                       "none")
    assert status == 0, stderr[-3000:]
    assert f"Resuming from {output / 'backup'}: epoch {killed_at['epoch'] + 1}" in out
    expected = keras.models.load_model(tmp_path / "straight" / "model.keras")
    actual = keras.models.load_model(output / "model.keras")
    for want, got in zip(expected.get_weights(), actual.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(actual.optimizer.iterations) == int(expected.optimizer.iterations) == 16


@pytest.fixture(scope="module")
def efficientnet_backbone_parameters():
    """Parameters of Keras's own EfficientNetV2-B0 backbone at 64×64, the reference."""
    return keras.applications.EfficientNetV2B0(include_top=False, weights=None,
                                               input_shape=(64, 64, 3)).count_params()


def test_dry_run_prints_parameters_and_plan_and_trains_nothing(finetune_main, tmp_path, capsys,
                                                               efficientnet_backbone_parameters):
    finetune_main("--model", "efficientnetv2-b0", "--image-size", "64", "--dry-run",
                  "--device", "t4", "--global-batch-size", "256", "--output", str(tmp_path))
    out = capsys.readouterr().out
    # Backbone + a 4-class Dense head on its 1280 pooled features.
    expected = efficientnet_backbone_parameters + 1280 * 4 + 4
    assert f"efficientnetv2-b0: {expected:,} parameters" in out
    assert "budget 12.00 GiB = 80% of 15.00 GiB" in out
    assert "global batch 256 = micro-batch" in out
    assert os.listdir(tmp_path) == []  # a dry run writes nothing: no data, no run directory


def test_an_over_budget_dry_run_prints_the_plan_then_refuses_naming_the_flags(finetune_cli,
                                                                            tmp_path):
    status, out, stderr = finetune_cli(
        "--model", "efficientnetv2-b0", "--image-size", "224", "--dry-run", "--device", "t4",
        "--global-batch-size", "1024", "--accumulation-steps", "1", "--output", str(tmp_path))
    assert status == 2
    table = [line for line in out.splitlines() if line.startswith("efficientnetv2-b0: ")]
    assert table and table[0].endswith("global batch 1024 = micro-batch 1024 × 1 accumulation "
                                       "step × 1 replica")
    total = next(line for line in out.splitlines() if "total (peak per replica)" in line)
    needed = re.search(r"\)\s+([\d.]+ [GM]iB)", total).group(1).split()  # what the refusal names
    error = _error_line(stderr)
    assert error.startswith("error: global batch 1024 = micro-batch 1024 × 1 accumulation step "
                            f"× 1 replica needs {' '.join(needed)} per replica on t4")
    assert re.search(r"fits in [\d.]+ [GM]iB \(--accumulation-steps \d+\)\. Pass "
                     r"`--allow-over-budget` to run anyway\.$", error), error
    assert "allow_over_budget" not in error and os.listdir(tmp_path) == []


def test_a_dry_run_plans_the_rematerialized_layers(finetune_main, tmp_path, capsys):
    finetune_main("--dry-run", "--device", "t4", "--rematerialize", "block1_conv, block2_conv",
                  "--output", str(tmp_path))
    notes = [line for line in capsys.readouterr().out.splitlines() if "rematerialized" in line]
    assert len(notes) == 1 and notes[0].strip().startswith(
        "note: rematerialized, recomputed in the backward pass one at a time")
    assert "block1_conv " in notes[0] and "block2_conv " in notes[0]


def test_a_dry_run_of_a_segmentation_network_plans_auto_rematerialization(finetune_main,
                                                                         tmp_path, capsys):
    # FC-DenseNet-56: the smallest of the family (its planner walks fewer calls than 103's).
    finetune_main("--model", "tiramisu-56", "--image-size", "224", "--dry-run", "--device",
                  "t4", "--precision", "float32", "--rematerialize", "auto",
                  "--output", str(tmp_path))
    out = capsys.readouterr().out
    assert ("tiramisu-56 is a segmentation network: its last feature maps are averaged into a "
            "4-class classifier") in out
    note = next(line.strip() for line in out.splitlines() if "rematerialize auto" in line)
    # 64 = 16 × 4 is the target; without rematerialization only a smaller micro-batch fits.
    assert re.fullmatch(r"note: rematerialize auto: micro-batch [1248] × \d+ without it; with "
                        r"\d+ of \d+ segments recomputed, micro-batch 16 × 4 at ≈ \+\d+% "
                        r"compute", note), note


@pytest.mark.parametrize("data", [None, "{missing}/train-*.tfrec", "gs://a-bucket/train-*.tfrec"])
def test_a_dry_run_for_another_device_plans_without_the_data(finetune_main, tmp_path, capsys,
                                                            data,
                                                            efficientnet_backbone_parameters):
    # The data lives on the machine planned for (a TPU VM, a bucket), not on this one.
    data_flags = [] if data is None else ["--data", data.format(missing=tmp_path / "absent")]
    finetune_main("--model", "efficientnetv2-b0", "--image-size", "64", "--dry-run", "--device",
                  "tpu-v3-8", "--num-classes", "104", "--num-examples", "12753",
                  "--global-batch-size", "64", "--output", str(tmp_path / "run"), *data_flags)
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("finetune: ")]
    if data is None:
        assert said == ["finetune: no data given: a dry run plans for --num-classes 104; "
                        "training needs --data"]
    else:
        assert said == [f"finetune: data not checked: a dry run plans from --num-classes 104 "
                        f"and --num-examples 12753 without reading {data_flags[1]}; training "
                        "checks it before it starts"]
    header = next(line for line in out.splitlines() if line.startswith("efficientnetv2-b0: "))
    # A 104-class head on the backbone's 1280 features, bfloat16 on the TPU's 8 replicas.
    parameters = efficientnet_backbone_parameters + 1280 * 104 + 104
    assert header == (f"efficientnetv2-b0: {parameters:,} "
                      "parameters, Adam, mixed_bfloat16 on tpu-v3-8, global batch 64 = "
                      "micro-batch 8 × 1 accumulation step × 8 replicas")
    assert "environment" not in out  # this machine's table: not the machine planned for
    assert not (tmp_path / "run").exists()


def test_training_still_checks_the_data(finetune_cli, tmp_path):
    status, _, stderr = finetune_cli("--data", str(tmp_path / "absent" / "train-*.tfrec"),
                                     "--num-classes", "104", "--num-examples", "12753",
                                     "--output", str(tmp_path / "run"))
    assert status == 2
    assert re.fullmatch(r"error: .*Found no files matching the pattern .*absent.*\n", stderr)


def _foreign(path, labels, broken=()):
    """Kaggle-layout records (image, class, id): 32x32 shapes of the demo set, these labels;
    the records at `broken` hold a truncated PNG."""
    images = [image for image, _ in tfmem.demo_examples(len(labels), image_size=32)]
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index, (image, label) in enumerate(zip(images, labels)):
            data = tf.io.encode_png(image).numpy()
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[data[:80] if index in broken else data])),
                "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"%d" % index])),
            }
            writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def written_sets(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sets")
    demo = tfmem.make_demo_dataset(directory / "demo", num_examples=64, image_size=32)
    demo512 = tfmem.make_demo_dataset(directory / "demo512", num_examples=512, image_size=32)
    masks = tfmem.make_demo_dataset(directory / "masks", num_examples=8, image_size=32,
                                    task="segmentation")
    return {
        "demo": demo.directory,
        "masks": masks.directory,
        "demo512": demo512.directory,
        "labels": _foreign(directory / "labels.tfrec", [0, 1, 2, 3] * 16),
        "broken": _foreign(directory / "broken.tfrec", [0, 1, 2, 3] * 16, broken=(5,)),
    }


@pytest.mark.parametrize("args, message", [
    (["--learning-rate", "nan"], r"flag --learning-rate=nan: the learning rate must be a finite "
                                 r"number > 0, e\.g\. --learning-rate=1e-3; see --helpshort"),
    (["--learning-rate=-1"], r"flag --learning-rate=-1.0: the learning rate must be"),
    (["--save-every-steps", "0"], r"flag --save-every-steps=0: 0 is not a positive integer"),
    (["--num-examples", "0"], r"flag --num-examples=0: 0 is not a positive integer"),
    (["--accumulation-steps", "many"], r"--accumulation-steps must be 'auto' or a positive int"),
    (["resnet50"], r"unexpected argument 'resnet50': every option is a flag with its name, "
                   r"e\.g\. --model=resnet50"),
    (["--validation-data", "/data/val"], r"--validation-data goes with your own --data; the "
                                         r"demo brings its own classes, examples and held-out"),
    (["--num-classes", "104"], r"--num-classes goes with your own --data; the demo brings"),
    (["--num-examples", "500", "--dry-run"], r"--num-examples without --data plans for data "
                                             r"that is elsewhere; pass its --num-classes too"),
    (["--model", "efficientnet-b9"], r"Unknown model 'efficientnet-b9'.*Valid names: "
                                     r".*efficientnetv2-xl"),
    (["--model", "small-cnn", "--image-size", "16"], r"at least 32×32 pixels"),
    (["--model", "tiramisu", "--weights", "{demo}/manifest.json"],
     r"--weights: tiramisu is a segmentation network, trained here as a classifier of its "
     r"pooled last features from scratch; leave --weights out, or pass --task segmentation"),
    (["--model", "small-cnn", "--task", "segmentation"],
     r"--task segmentation \(--task\) predicts a class per pixel, and --model small-cnn is an "
     r"image classifier \(one label per image\); pass a segmentation network as --model "
     r"\(.*unet\), or --task classification on data with labels"),
    (["--data", "{masks}"], r"--task segmentation \(the task of --data .*masks\) predicts a "
                           r"class per pixel, and --model small-cnn is an image classifier"),
    (["--model", "unet", "--data", "{demo}", "--task", "segmentation"],
     r"--task segmentation, but .*demo is a classification set \(its records hold a label "
     r"per image, says its manifest\); leave --task out"),
    (["--accumulation-steps", "3", "--dry-run"],
     r"must be divisible by replicas × accumulation_steps \(1 × 3 = 3\)\. Try 63 or 66"),
    (["--device", "t4"], r"--device t4 plans for another machine; it only goes with --dry-run"),
    (["--nocompile", "--dry-run"], r"--nocompile leaves out the compile of a dry run for "
                                   r"another --device; it only goes with --dry-run --device"),
    (["--rematerialize", "block1_conv,nope", "--dry-run"],
     r"rematerialize: 'nope' is not a layer of '[^']+'; its layers: .*block1_conv"),
    (["--rematerialize", "avg_pool:small_cnn", "--dry-run"],
     r"rematerialize: \('avg_pool', 'small_cnn'\): 'avg_pool' runs after 'small_cnn'; give "
     r"the pair in the order the model runs them"),
    (["--rematerialize", "avg_pool:small_cnn:head", "--dry-run"],
     r"rematerialize: 'avg_pool:small_cnn:head' is neither a layer name nor a first:last "
     r"pair of layer names; write e\.g\. conv_4:add_4"),
    (["--model", "efficientnetv2-b0", "--image-size", "224", "--dry-run", "--device", "t4",
      "--global-batch-size", "1024", "--accumulation-steps", "1"],
     r"global batch 1024 = micro-batch 1024 × 1 accumulation step × 1 replica needs [\d.]+ "
     r"GiB per replica on t4, .*; micro-batch \d+ × \d+ accumulation steps fits in [\d.]+ "
     r"GiB"),
    (["--data", "{demo}", "--num-classes", "3"], r"--num-classes 3, but the manifest of "
                                                  r".*demo says 4; leave --num-classes out"),
    (["--data", "{labels}"], r"'.*labels.tfrec' has no tfmem manifest.json, so its classes "
                             r"are unknown; pass --num-classes"),
    (["--data", "{labels}", "--num-classes", "4", "--num-examples", "65"],
     r"--num-examples 65 is more than the 64 records of .*labels.tfrec; pass --num-examples "
     r"64 or fewer"),
    (["--data", "{labels}/nothing-here", "--num-classes", "4"],
     r"Found no files matching the pattern '.*nothing-here'"),
])
def test_bad_input_is_one_line_with_the_fix_and_status_2(finetune_cli, written_sets, tmp_path,
                                                         args, message):
    args = [arg.format(**written_sets) for arg in args]
    status, _, stderr = finetune_cli("--output", str(tmp_path / "run"), *args)
    assert status == 2, stderr
    assert re.fullmatch(rf"error: .*{message}.*\n", stderr, flags=re.S), stderr
    assert stderr.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "1000000000"],
     r"--global-batch-size 1000000000 is larger than the 2048 training examples of the demo "
     r"set; use at most 2048"),
    (["--data", "{labels}", "--num-classes", "4", "--global-batch-size", "65"],
     r"--global-batch-size 65 is larger than the 64 training examples of .*labels\.tfrec; use "
     r"at most 64"),
    (["--image-size", "100000"],
     r"--image-size 100000: images of 100000×100000 = 10,000,000,000 pixels are above the "
     r"limit of 67,108,864 per image \(--max-image-pixels\); use a smaller --image-size "
     r"\(small-cnn is made for 32\), or raise --max-image-pixels"),
    (["--image-size", "100", "--max-image-pixels", "9999"],
     r"--image-size 100: images of 100×100 = 10,000 pixels are above the limit of 9,999 .*"),
    (["--data", "{text}", "--num-classes", "3"],
     r"--data .*text: 3 of the 3 file\(s\) of '.*text' are not TFRecord files: a\.txt, b\.csv, "
     r"c\.tfrec hold bytes but no complete record\. Expected TFRecord files of "
     r"tf\.train\.Example: a directory written by `tfmem\.write_image_tfrecords` "
     r"\(scripts/make_tfrecords\.py\), or a glob of the shards alone, .*"),
])
def test_sizes_and_data_are_checked_before_anything_is_written(finetune_cli, written_sets,
                                                               tmp_path, args, message):
    text = tmp_path / "text"
    text.mkdir()
    for name, content in (("a.txt", "some notes\n"), ("b.csv", "x,y\n1,2\n"),
                          ("c.tfrec", "not a record, only text\n")):
        (text / name).write_text(content)
    args = [arg.format(text=text, **written_sets) for arg in args]
    status, _, stderr = finetune_cli("--output", str(tmp_path / "run"), *args)
    assert status == 2, stderr
    assert re.fullmatch(rf"error: {message}\n", stderr), stderr
    assert not (tmp_path / "run").exists()  # no run directory, no run.json, no demo data


def test_a_failure_while_training_is_one_line_with_status_1(finetune_cli, written_sets,
                                                            tmp_path):
    # A label outside the classes: named by record and file before any loss sees it (trained
    # in this process; the broken image below fails in a training process of its own).
    status, _, stderr = finetune_cli(
        "--data", written_sets["labels"], "--num-classes", "3", "--global-batch-size", "16",
        "--epochs", "1", "--output", str(tmp_path / "labels"), "--memory-limit", "none")
    assert status == 1
    assert re.fullmatch(rf"error: record \d+ of {written_sets['labels']}: its label \(`class`\) "
                        r"is 3, not a class index in \[0, 3\); check num_classes "
                        r"\(`--num-classes`\) .*\n", stderr), stderr
    # A broken image: named; --debug adds the traceback above the same line.
    status, _, stderr = finetune_cli(
        "--data", written_sets["broken"], "--num-classes", "4", "--global-batch-size", "16",
        "--epochs", "1", "--output", str(tmp_path / "broken"), "--debug")
    assert status == 1 and stderr.startswith("Traceback (most recent call last)")
    assert stderr.splitlines()[-1] == (
        f"error: record 5 of {written_sets['broken']}: it cannot be decoded (a damaged or "
        "truncated image, or not a tf.train.Example); pass skip_corrupt=True (`--skip-corrupt`) "
        "to skip such records, or write the set again")


def test_validation_runs_a_micro_batch_at_a_time(finetune_cli, written_sets, tmp_path):
    # Not the global batch at once: its forward pass would hold 4 times the micro-batch's.
    status, out, stderr = finetune_cli(
        "--data", written_sets["demo"], "--validation-data", written_sets["demo"],
        "--global-batch-size", "32", "--accumulation-steps", "4", "--epochs", "1",
        "--memory-limit", "none", "--output", str(tmp_path))
    assert status == 0, stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["micro_batch_size"], metrics["num_replicas"]) == (8, 1)
    assert metrics["validation"]["batch_size"] == 8


def test_skip_corrupt_trains_on_and_names_what_it_skipped(finetune_cli, written_sets, tmp_path):
    output = tmp_path / "run"  # trained in this process: no memory limit, no training process
    status, out, err = finetune_cli(
        "--data", written_sets["broken"], "--num-classes", "4", "--global-batch-size", "16",
        "--epochs", "2", "--output", str(output), "--skip-corrupt", "--memory-limit", "none")
    assert status == 0, err
    assert f"tfmem: skipped record 5 of {written_sets['broken']}: it cannot be decoded" in err
    summary = (f"skipped 1 record(s) in 1 shard(s):\n  {written_sets['broken']}: record 5: it "
               "cannot be decoded (a damaged or truncated image, or not a tf.train.Example)")
    assert out.rstrip().endswith(summary)
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["skipped"] == summary
    # Every epoch is still 64 // 16 = 4 updates: a skipped record does not shorten it.
    assert _newest_point(output / "backup")["epoch"] == 2
    assert int(keras.models.load_model(output / "model.keras").optimizer.iterations) == 8


def test_overwrite_discards_the_run_and_starts_again(finetune_cli, written_sets, tmp_path):
    common = ["--data", written_sets["demo"], "--global-batch-size", "32", "--epochs", "1",
              "--output", str(tmp_path), "--memory-limit", "none"]  # in this process
    (tmp_path / "notes.txt").write_text("the user's")  # beside the run: never the run's
    assert finetune_cli(*common)[0] == 0
    # run.json lists what the run writes: all that --overwrite may remove.
    written = json.loads((tmp_path / "run.json").read_text())["written"]
    assert written == sorted(tfmem.finetune.WRITES) and "notes.txt" not in written
    status, _, err = finetune_cli(*common, "--learning-rate", "0.01")
    assert status == 2 and "learning_rate 0.001 → 0.01" in err
    status, out, err = finetune_cli(*common, "--learning-rate", "0.01", "--overwrite")
    assert status == 0, err
    assert "is complete" not in out and "Resuming" not in out
    assert json.loads((tmp_path / "run.json").read_text())["config"]["learning_rate"] == 0.01
    assert json.loads((tmp_path / "metrics.json").read_text())["history"]["loss"]
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def test_the_run_is_one_library_call_with_the_flags_as_its_settings(finetune_main, tmp_path,
                                                                   capsys):
    from tfmem import finetune

    finetune_main("--dry-run", "--output", str(tmp_path / "script"))
    by_script = capsys.readouterr().out
    assert finetune.run(finetune.FinetuneConfig(dry_run=True,
                                                output=str(tmp_path / "call"))) == {}
    by_call = capsys.readouterr().out

    def plan_lines(out):  # the plan's table, but the budget: this host's free RAM, read live
        table = out[out.index("small-cnn: "):].splitlines()
        return [line for line in table if "total (peak per replica)" not in line]

    assert plan_lines(by_call) == plan_lines(by_script)
    assert "total (peak per replica)" in by_call and "environment" in by_call
    # Every flag of the script is a field of the settings, with the same default.
    script_flags = re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', SCRIPT.read_text())
    fields = finetune.FinetuneConfig.__dataclass_fields__
    assert sorted(script_flags) == sorted(fields)
    assert all(str(flags.FLAGS[name].default) == str(fields[name].default) for name in fields)
    with pytest.raises(tfmem.cli.UsageError, match="--device t4 plans for another machine"):
        finetune.run(finetune.FinetuneConfig(device="t4"))
    with pytest.raises(tfmem.cli.UsageError, match="learning rate must be a finite number"):
        finetune.FinetuneConfig(learning_rate=float("nan"))


def _command(finetune_cli, backend, *args):
    """The command's exit status, stdout and stderr: run in this process on its backend (the
    training processes it starts are its own), in a process of its own on the other."""
    if backend == keras.backend.backend():
        return finetune_cli(*args)
    result = _finetune(*args, backend=backend)
    return result.returncode, result.stdout, result.stderr


# At 128 px the small CNN holds about 1.8 GiB at micro-batch 64 and 1.1 GiB at 16 on
# TensorFlow: under this limit the first process is stopped, and the run goes on with a smaller
# micro-batch. The supervisor is the same code on both backends; a JAX training process that
# runs out of memory and goes on with a smaller micro-batch is tested in
# tests/training/test_out_of_memory.py and tests/test_without_tensorflow.py.
@pytest.mark.parametrize("backend, limit", [("tensorflow", 1.45)])
def test_a_run_over_its_memory_limit_resumes_with_a_smaller_micro_batch(tmp_path, backend,
                                                                        limit, finetune_cli):
    data = _foreign(tmp_path / "train.tfrec", [0, 1, 2, 3] * 32)  # 128 records: 2 updates
    # No resume point before the end: the watch samples every 20 ms and may miss the first
    # step's peak on a loaded machine; so it resumes from the start. (That the run then ends
    # with the weights of a run at the smaller micro-batch from its start, AccumModel and
    # resuming being exact: tests/training/test_out_of_memory.py and test_resume.py.)
    common = ["--data", data, "--num-classes", "4", "--image-size", "128", "--epochs", "1",
              "--global-batch-size", "64", "--deterministic", "--optimizer", "sgd",
              "--save-every-steps", "8"]
    # Another process on the machine, holding 64 MiB all along.
    bystander = subprocess.Popen([sys.executable, "-c", "import sys, time\nheld = bytearray("
                                  "64 * 2**20)\ntime.sleep(600)"])
    status, out, stderr = _command(finetune_cli, backend, *common, "--accumulation-steps", "1",
                                   "--memory-limit", f"{limit}GiB",
                                   "--output", str(tmp_path / "limited"))
    assert bystander.poll() is None  # untouched by the limit
    bystander.kill()
    assert status == 0, stderr[-3000:]
    assert out.count("environment: ") == 1  # once per run, not once per training process
    metrics = json.loads((tmp_path / "limited" / "metrics.json").read_text())
    recoveries = metrics["memory_recoveries"]
    assert recoveries and recoveries[0]["micro_batch_size"] == 64
    first = recoveries[0]
    assert re.search(
        rf"finetune: memory limit {limit:.2f} GiB reached at micro-batch 64 × 1 accumulation step "
        rf"\([\d.]+ GiB held\); resuming from the last resume point with micro-batch 32 × 2 "
        r"accumulation steps, the same global batch 64", out), out
    assert first["held_bytes"] >= first["limit_bytes"] == int(limit * 2**30)
    k = metrics["accumulation_steps"]
    assert (metrics["micro_batch_size"] * k, metrics["global_batch_size"]) == (64, 64)
    assert k == recoveries[-1]["to_accumulation_steps"] >= 2
    actual = keras.models.load_model(tmp_path / "limited" / "model.keras")
    assert int(actual.optimizer.iterations) == 2  # every update of the epoch, none twice


def test_a_memory_limit_below_the_framework_stops_with_one_line(finetune_cli, tmp_path):
    status, _, stderr = finetune_cli("--memory-limit", "200MB", "--epochs", "1",
                                     "--output", str(tmp_path / "run"))
    assert status == 2
    assert re.fullmatch(r"error: the training process reached --memory-limit 190\.7 MiB before "
                        r"its first step \(stopped by the memory limit: .*\): the framework and "
                        r"the model alone need more; raise --memory-limit .*\n", stderr), stderr
    status, _, stderr = finetune_cli("--memory-limit", "lots", "--output", str(tmp_path / "x"))
    assert (status, stderr) == (2, "error: --memory-limit lots: 'lots' is not a size; write a "
                                   "positive number of bytes with a unit, e.g. 3GB, 2.5GiB or "
                                   "800MB, or auto or none\n")


def test_a_memory_limit_below_the_planned_model_state_stops_before_training(tmp_path,
                                                                          finetune_cli):
    # DenseNet-121's plan holds more than 1.6 GB before any batch (the framework's runtime for
    # its ~600 variables, weights, gradients, Adam's slots), while the training process is
    # still under it when it plans: it stops then, not after halving the micro-batch 7 times.
    data = _foreign(tmp_path / "train.tfrec", [0, 1, 2, 3] * 16)
    start = time.monotonic()
    status, out, stderr = finetune_cli(
        "--model", "densenet121", "--image-size", "64", "--global-batch-size", "64",
        "--accumulation-steps", "1", "--memory-limit", "1.6GB", "--epochs", "1", "--data",
        data, "--num-classes", "4", "--output", str(tmp_path / "run"))
    seconds = time.monotonic() - start
    assert status == 2
    found = re.fullmatch(
        r"error: --memory-limit 1\.49 GiB is below what the framework and the model's state "
        r"need before any batch \(([\d.]+) GiB as planned\), so no micro-batch can fit; the "
        r"smallest limit that could work is about ([\d.]+) GiB \(the plan at micro-batch 1\): "
        r"raise --memory-limit, or pass --memory-limit none", _error_line(stderr))
    assert found, stderr[-2000:]
    assert 1.49 < float(found.group(1)) <= float(found.group(2))
    assert "reached" not in out and out.count("environment: ") == 1
    assert seconds < 120  # one training process, stopped after its plan
    assert not (tmp_path / "run" / "backup").exists()


def test_when_micro_batch_one_reaches_the_limit_the_plan_for_it_is_the_answer(tmp_path,
                                                                             finetune_cli):
    data = _foreign(tmp_path / "train.tfrec", [0, 1, 2, 3])
    # At 1024 px one image's activations take about 0.5 GB: TensorFlow's 0.65 GB and the model
    # stay under 1 GiB, a step of micro-batch 1 does not. (The command runs in this process,
    # its training processes under the limit.) A global batch of 1: the micro-batch halving
    # before it is test_a_run_over_its_memory_limit_resumes_with_a_smaller_micro_batch's.
    status, out, stderr = finetune_cli(
        "--data", data, "--num-classes", "4", "--image-size", "1024", "--global-batch-size",
        "1", "--accumulation-steps", "1", "--epochs", "1", "--memory-limit", "1GiB",
        "--output", str(tmp_path / "run"))
    assert status == 2
    # At micro-batch 1 it tries recomputing: planned, 332 MiB of activations instead of 476,
    # but the largest call's backward workspace (512 MiB) stays, and it is not enough here.
    assert re.search(r"finetune: memory limit 1\.00 GiB reached at micro-batch 1 × 1 "
                     r"accumulation step \([\d.]+ GiB held\); resuming from the last resume "
                     r"point with --rematerialize full \(activations recomputed in the backward "
                     r"pass: the same training, more time\), micro-batch 1 × 1", out), out
    assert out.count("finetune: memory limit") == 1  # the one try left at micro-batch 1
    error = _error_line(stderr)
    assert re.fullmatch(
        r"error: micro-batch 1 × 1 accumulation steps with --rematerialize full still reached "
        r"--memory-limit 1\.00 GiB "
        r"\([\d.]+ GiB held\), and nothing smaller can be tried; the plan for that budget: "
        r"nothing fits, not even micro-batch 1, nor any change it checked: raise "
        r"--memory-limit \(scripts/plan\.py lists them\)\n",
        error + "\n"), stderr[-2000:]
    assert len(error) <= 3 * 100  # three lines of a terminal, not the changes tried one by one
    assert not (tmp_path / "run" / "metrics.json").exists()


# -- tfmem deletes or replaces only what its runs wrote; every check before any work --

def _files(directory):
    """Every file under `directory`, with its bytes."""
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_an_output_holding_files_no_run_wrote_is_refused_and_left_as_it_was(finetune_cli,
                                                                          tmp_path):
    own = tmp_path / "own"  # the user's own model where the run would write its own
    own.mkdir()
    (own / "model.keras").write_bytes(b"the user's model")
    mixed = tmp_path / "mixed"  # a folder no tfmem run made, given to --overwrite
    (mixed / "logs").mkdir(parents=True)
    (mixed / "logs" / "important.txt").write_text("notes")
    (mixed / "metrics.json").write_text('{"mine": 1}')
    record = tmp_path / "record"  # a run.json that is not a run's
    record.mkdir()
    (record / "run.json").write_text('{"experiment": "mine"}')
    before = {directory: _files(directory) for directory in (own, mixed, record)}
    for directory, extra, names in [(own, [], "model.keras"),
                                    (mixed, ["--overwrite"], "logs, metrics.json"),
                                    (record, ["--overwrite", "--memory-limit", "none"],
                                     "run.json")]:
        status, _, stderr = finetune_cli("--output", str(directory), "--epochs", "1", *extra)
        assert status == 2
        also = ", --overwrite included" if "--overwrite" in extra else ""
        assert _error_line(stderr) == (
            f"error: --output {directory} holds {names}, which no tfmem run wrote there (no "
            f"run.json of a run lists them), and tfmem deletes or replaces only what its runs "
            f"wrote{also}; nothing was changed: use another --output, or move them away")
    # Not a byte changed, nothing added (no lock, no run.json, no demo data).
    assert {directory: _files(directory) for directory in before} == before
    assert sorted(os.listdir(own)) == ["model.keras"]

    # An --output that is a file, or lies inside one.
    file = tmp_path / "notes.txt"
    file.write_text("x")
    for output, where in [(file, ""), (file / "run", f": {file}")]:
        status, _, stderr = finetune_cli("--output", str(output))
        assert (status, _error_line(stderr)) == (
            2, f"error: --output {output}{where} is a file, not a directory; pass a directory "
               "(it is made if it does not exist)")
    assert file.read_text() == "x"


@pytest.fixture()
def read_only_disk(tmp_path):
    """A real read-only file system (a tmpfs mounted read-only; needs root to mount)."""
    mount = tmp_path / "read-only"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_an_output_that_cannot_be_written_is_one_line_before_any_work(finetune_cli,
                                                                      read_only_disk):
    output = read_only_disk / "run"
    status, _, stderr = finetune_cli("--output", str(output), "--epochs", "1")
    assert (status, _error_line(stderr)) == (
        2, f"error: --output {output}: cannot write in {read_only_disk} (Read-only file "
           "system); pass as --output a directory you can write to")


def test_a_diverging_run_is_one_line_with_status_1_and_keeps_the_last_finite_point(
        finetune_cli, written_sets, tmp_path):
    # Trained in this process (no memory limit: no training process). That a training
    # process's error comes back as one line: test_a_memory_limit_below_the_planned_model_state_
    # stops_before_training; with --debug, its traceback above it: test_a_failure_while_training.
    output = tmp_path / "run"
    status, _, stderr = finetune_cli(
        "--data", written_sets["demo"], "--global-batch-size", "16", "--epochs", "2",
        "--optimizer", "sgd", "--learning-rate", "1e30", "--save-every-steps", "1",
        "--output", str(output), "--memory-limit", "none")
    assert status == 1
    # The first update makes the weights huge, the second the loss (or the weights) not finite.
    assert re.fullmatch(
        r"error: training diverged: (the loss is nan|the weights are no longer finite numbers) "
        rf"at epoch 1, step 2, and the run stopped there; the newest resume point in "
        rf"{output / 'backup'} \(epoch 1, step 1\) holds the last finite weights; no model\.keras "
        r"or metrics\.json was written; lower --learning-rate \(now 1e\+30 with sgd\) and start "
        r"again with --overwrite or a new --output", _error_line(stderr)), stderr[-2000:]
    assert not (output / "model.keras").exists() and not (output / "metrics.json").exists()
    assert "complete" not in json.loads((output / "run.json").read_text())
    point = _newest_point(output / "backup")
    assert (point["epoch"], point["step"]) == (0, 1)
    import h5py

    with h5py.File(output / "backup" / point["weights"]) as weights:
        arrays = []
        weights.visititems(lambda _, item: arrays.append(item[()])
                           if isinstance(item, h5py.Dataset) else None)
    floating = [array for array in arrays if np.issubdtype(array.dtype, np.floating)]
    assert floating and all(np.isfinite(array).all() for array in floating)


def test_weights_that_are_no_weights_file_are_one_line_naming_it(finetune_cli, tmp_path,
                                                                 warnings_on_stderr):
    text = tmp_path / "notes.weights.h5"
    text.write_text("not weights")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.save_weights(tmp_path / "whole.weights.h5")
    whole = (tmp_path / "whole.weights.h5").read_bytes()
    cut = tmp_path / "cut.weights.h5"  # a copy that stopped half-way
    cut.write_bytes(whole[:len(whole) // 2])
    folder = tmp_path / "folder"
    folder.mkdir()
    unreadable = (r"cannot be read as HDF5 \({}\): it is not a Keras weights file, or a copy "
                  r"that was cut short; copy it again \(its size should match the original's\), "
                  r"or pass another file")
    for path, message in [(text, unreadable.format("file signature not found")),
                          (cut, unreadable.format(r"truncated file: eof = \d+, .*")),
                          (folder, r"is a directory; pass the weights file in it \(a "
                                   r"`\.weights\.h5`, or Keras's `\*_notop\.h5` backbone file\)")]:
        status, _, stderr = finetune_cli("--weights", str(path), "--output",
                                         str(tmp_path / "run"))
        assert status == 2
        assert re.fullmatch(rf"error: --weights: Weights file '{path}' {message}",
                            _error_line(stderr)), stderr
    assert not (tmp_path / "run").exists()
    # Another model's weights: Keras warns about each part of small-cnn the file lacks, then
    # the load fails. The error's line is all of stderr; --debug shows the warnings too.
    other = tmp_path / "whole.weights.h5"
    status, _, stderr = finetune_cli("--weights", str(other), "--dry-run")
    assert status == 2 and "warning" not in stderr
    assert _error_line(stderr).startswith(f"error: '{other}' does not fit small-cnn")
    status, _, stderr = finetune_cli("--weights", str(other), "--dry-run", "--debug")
    assert status == 2 and re.search(r"^warning: ", stderr, re.M), stderr[-3000:]


def test_flags_checked_before_any_work_name_themselves(finetune_cli, tmp_path, monkeypatch):
    output = tmp_path / "run"
    for device in ("v100-64gb", "h100-unknown"):  # once taken for a v100-16gb and an h100
        status, _, stderr = finetune_cli("--dry-run", "--device", device)
        assert status == 2
        assert re.fullmatch(rf"error: --device: '{device}' is not a known accelerator; known "
                            r"names: k80, .*, v100-16gb, v100-32gb, .*h100, .*'cpu' \(this "
                            r"host's RAM\), or a Cloud TPU type such as v5litepod-16",
                            _error_line(stderr))
    status, _, stderr = finetune_cli("--seed", "-1", "--output", str(output))
    assert status == 2 and _error_line(stderr).startswith("error: flag --seed=-1: ")
    with pytest.raises(tfmem.cli.UsageError, match=r"--seed -1: a seed is an int from 0"):
        tfmem.finetune.FinetuneConfig(seed=-1)
    # Without TensorBoard (tfmem installed without extras), a run stops before anything is built.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    status, _, stderr = finetune_cli("--output", str(output), "--epochs", "1")
    assert (status, _error_line(stderr)) == (
        1, "error: a training run writes TensorBoard logs, and the tensorboard package is not "
           "installed; pip install tensorboard (or `pip install -e '.[cpu]'` in a checkout of "
           "tfmem, or its `tensorflow` extra, which bring it)")
    assert not output.exists()


def test_sigterm_says_how_to_resume_and_fewer_epochs_than_begun_are_refused(
        finetune_cli, written_sets, tmp_path):
    output, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    # 64 records: 4 updates an epoch; stopped long before its 8 epochs end.
    common = ["--data", written_sets["demo"], "--global-batch-size", "16",
              "--save-every-steps", "2", "--output", str(output)]
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *common, "--epochs", "8"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and process.poll() is None:
        point = (output / "backup").is_dir() and _newest_point(output / "backup")
        if point and (point["epoch"], point["step"]) > (1, 0):  # inside epoch 2 or later
            process.send_signal(signal.SIGTERM)  # as a scheduler stops a job
            break
        time.sleep(0.05)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert _error_line(stderr) == ("error: stopped by SIGTERM; start the same command again to "
                                   "resume from its last resume point")
    # The supervising process's files are gone with it; nothing of it is left in /tmp.
    assert not (output / ".attempts").exists() and not list(scratch.glob("tfmem-*"))

    # Started again with fewer epochs than it has begun: one line, nothing trained or written.
    epoch, step = (lambda p: (p["epoch"], p["step"]))(_newest_point(output / "backup"))
    before = _files(output)
    status, _, stderr = finetune_cli(*common, "--epochs", "1", "--memory-limit", "none")
    trained = f"{epoch} epoch{'s' if epoch > 1 else ''}" + (
        f" and {step} updates of epoch {epoch + 1}" if step else "")
    assert (status, _error_line(stderr)) == (
        2, f"error: --epochs 1, but the run in {output} has trained {trained} already; pass "
           f"--epochs {epoch + (step > 0)} or more to go on with it, or use a new --output (or "
           "--overwrite) to start again")
    assert _files(output) == before


@pytest.fixture(scope="module")
def segmentation_sets(tmp_path_factory):
    """The demo shapes with their masks: 128 of 32 px to train on, 32 of 40×56 held out."""
    directory = tmp_path_factory.mktemp("segmentation")
    train = tfmem.make_demo_dataset(directory / "train", num_examples=128, image_size=32,
                                    task="segmentation")
    held_out = tfmem.make_demo_dataset(directory / "validation", num_examples=32,
                                       image_size=(40, 56), seed=1, task="segmentation")
    return train, held_out


def _confusion(true, predicted, num_classes):
    """Rows: the true class, columns: the predicted one."""
    return np.bincount(true.ravel() * num_classes + predicted.ravel(),
                       minlength=num_classes**2).reshape(num_classes, num_classes)


def _iou(confusion):
    hits = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - hits
    return [h / u if u else None for h, u in zip(hits, union)]


def test_unet_trains_on_masks_above_the_all_background_baseline(finetune_cli,
                                                               segmentation_sets, tmp_path):
    train, held_out = segmentation_sets
    command = ["--model", "unet", "--task", "segmentation", "--data", train.directory,
               "--validation-data", held_out.directory, "--global-batch-size", "4",
               "--image-size", "32", "--learning-rate", "3e-3", "--memory-limit", "none",
               "--save-every-steps", "32", "--output", str(tmp_path)]  # a point: the end
    status, out, stderr = finetune_cli(*command, "--epochs", "1")
    assert status == 0, stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    validation = metrics["validation"]
    # The 32 held-out images at their own size, 40×56, and their masks: one batch.
    images, masks = next(tfmem.image_dataset(held_out.directory, image_size=(40, 56),
                                             batch_size=32, training=False).as_numpy_iterator())
    # Every pixel called background: its IoU is the background's share, the shapes' 0.
    background = _iou(_confusion(masks, np.zeros_like(masks), 5))
    baseline = np.mean([iou for iou in background if iou is not None])
    assert validation["mean_iou"] > baseline + 0.05, (validation, baseline)
    # U-Net takes multiples of 16: the held-out images are predicted by tiles of the training
    # size, a micro-batch per replica a call.
    assert validation["batch_size"] == metrics["micro_batch_size"] * metrics["num_replicas"]
    assert (validation["image_size"], validation["tile_size"]) == ([40, 56], [32, 32])
    assert (f"finetune: validation: 40×56 images by 32×32 tiles, {validation['batch_size']} a "
            "call") in out
    # Per-class IoU and pixel accuracy: the saved model's predictions, counted in NumPy.
    model = keras.models.load_model(tmp_path / "model.keras")
    predicted = np.argmax(tfmem.predict_tiled(model, images, batch_size=16), axis=-1)
    confusion = _confusion(masks, predicted, 5)
    np.testing.assert_allclose(validation["per_class_iou"], _iou(confusion), atol=1e-6)
    np.testing.assert_allclose(validation["pixel_accuracy"],
                               np.trace(confusion) / confusion.sum(), atol=1e-6)
    np.testing.assert_allclose(validation["mean_iou"], np.mean(_iou(confusion)), atol=1e-5)
    assert (f"finetune: validation mean IoU {validation['mean_iou']:.3f}, pixel accuracy "
            f"{validation['pixel_accuracy']:.3f} after 1 epoch") in out
    assert json.loads((tmp_path / "run.json").read_text())["config"]["task"] == "segmentation"

    # Started again for a second epoch: it resumes from the point at the end of the first and
    # trains the second only, the first's history kept.
    status, out, stderr = finetune_cli(*command, "--epochs", "2")
    assert status == 0, stderr[-3000:]
    assert f"Resuming from {tmp_path / 'backup'}: epoch 2" in out
    history = json.loads((tmp_path / "metrics.json").read_text())["history"]
    assert len(history["loss"]) == 2 and history["loss"][0] == metrics["history"]["loss"][0]


def test_a_dry_run_plans_the_segmentation_head_per_pixel(finetune_main, tmp_path, capsys):
    finetune_main("--model", "unet", "--task", "segmentation", "--image-size", "64",
                  "--global-batch-size", "64", "--dry-run", "--device", "t4",
                  "--rematerialize", "auto", "--output", str(tmp_path))
    out = capsys.readouterr().out
    # "auto" plans a segmentation run as a classifier's: here nothing needs recomputing.
    assert "note: rematerialize auto: not needed, micro-batch 64 fits" in out
    # The demo's 5 classes per pixel (background and the 4 shapes): U-Net's own 1×1 head.
    head = tfmem.models.build("unet", num_classes=5, image_size=64)
    assert head.output_shape == (None, 64, 64, 5)
    assert f"unet: {head.count_params():,} parameters" in out
    assert "total (peak per replica)" in out and "averaged into" not in out
    # The plan keeps the per-pixel probabilities: float32 height × width × classes a sample.
    features = tfmem.models.build("unet", num_classes=None, image_size=64, include_top=False)
    kept = [tfmem.plan(model, global_batch_size=8, device="t4", precision="float32")
            .activation_bytes_per_sample for model in (head, features)]
    assert kept[0] - kept[1] == 64 * 64 * 5 * 4
    # The run's loss (cross-entropy skipping the ignore value) and mean IoU have a row of their
    # own: the plan of the same model with them, at the run's micro-batch.
    loss, metrics = task_loss("segmentation", 5)
    planned = tfmem.plan(head, global_batch_size=64, device="t4", precision="auto", loss=loss,
                         metrics=metrics)
    row = next(line for line in out.splitlines() if "loss and metrics" in line)
    assert format_bytes(planned.breakdown()[Term.LOSS]) in row
    assert planned.loss_bytes_per_sample > 2 * 64 * 64 * 5 * 4  # the gradient, temporaries


def _runs(mask):
    """Kaggle's run-length text of a 0/1 mask: 1-based starts counted down each column."""
    pixels = np.concatenate([[0], mask.T.ravel(), [0]])
    edges = np.flatnonzero(pixels[1:] != pixels[:-1]) + 1
    starts, ends = edges[::2], edges[1::2]
    return " ".join(f"{start} {end - start}" for start, end in zip(starts, ends))


def _cloud_layout(folder, num_examples, seed):
    """The demo shapes as Kaggle's cloud layout: PNG images and an `Image_Label` CSV with a
    row per image and class, "shape" overlapping the 4 shapes' own classes."""
    (folder / "images").mkdir(parents=True)
    lines = ["Image_Label,EncodedPixels"]
    for index, (image, mask) in enumerate(tfmem.demo_examples(num_examples, 32, seed=seed,
                                                              task="segmentation")):
        name = f"{index:03d}.png"
        (folder / "images" / name).write_bytes(tf.io.encode_png(image).numpy())
        for value, label in enumerate(tfmem.DEMO_CLASS_NAMES, start=1):
            lines.append(f"{name}_{label},{_runs(mask == value)}")
        lines.append(f"{name}_shape,{_runs(mask > 0)}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    return tfmem.write_image_tfrecords((folder / "images", folder / "labels.csv"),
                                       folder / "records")


def test_multi_label_masks_from_an_rle_csv_train_with_dice_on_jax(tmp_path):
    """The script on JAX (today's TPU VMs train Keras on JAX), tf.data feeding it: the library
    calls of the colab notebooks (detect, plan, AccumModel.wrap, image_dataset,
    fit_resumable), which run there on TensorFlow (tests/scripts/test_notebooks.py)."""
    train, held_out = (_cloud_layout(tmp_path / name, count, seed)
                       for name, count, seed in (("train", 32, 0), ("validation", 16, 1)))
    assert train.schema.multi_label and train.class_names == (
        "disk", "plus", "shape", "square", "triangle")
    # Rematerialized in the segments the plan cuts (exact: it trains as well). Trained in the
    # script's process (no memory limit): the memory-limit runs below start JAX training
    # processes of their own.
    result = _finetune("--model", "unet", "--data", train.directory, "--validation-data",
                       held_out.directory, "--loss", "cross-entropy+dice", "--epochs", "2",
                       "--global-batch-size", "4", "--learning-rate", "3e-3",
                       "--rematerialize", "full", "--memory-limit", "none", "--verbose",
                       "--output", str(tmp_path / "run"), backend="jax", JAX_LOG_COMPILES="1",
                       XLA_FLAGS=jax_xla_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras               3" in result.stdout and "(backend jax)" in result.stdout
    # One device: Keras's own path, where the train step compiles once for the whole run
    # (a DataParallel over one device compiled it again at every epoch).
    assert re.search(r"strategy +none \(Keras's default on JAX: one device\)", result.stdout)
    assert result.stderr.count("Finished XLA compilation of jit(train_step)") == 1, \
        result.stderr[-3000:]
    # The split checked with XLA's figure of that compiled step before any step (which the
    # run then ran: the one compile above), shown under the plan.
    assert re.search(r"\n  compiled step \(XLA\) +[\d.]+ [MG]iB   arguments \+ outputs \+ "
                     r"temporaries − aliased; checked with the framework runtime above: "
                     r"[\d.]+ [MG]iB\n", result.stdout), result.stdout[-3000:]
    # Segments cut and recomputed all the same (the note names them only where some are);
    # planned as kept, since on a CPU XLA saves nothing by it.
    assert "note: rematerialized layers planned as kept: on JAX on a CPU" in result.stdout
    validation = json.loads((tmp_path / "run" / "metrics.json").read_text())["validation"]
    # Each class's IoU from the saved model's sigmoids at 0.5, counted in NumPy.
    images, masks = next(tfmem.image_dataset(held_out.directory, image_size=(32, 32),
                                             batch_size=16, training=False).as_numpy_iterator())
    model = keras.models.load_model(tmp_path / "run" / "model.keras")
    called = model.predict(images, verbose=0) >= 0.5
    hits = (called & (masks == 1)).sum((0, 1, 2))
    union = (called | (masks == 1)).sum((0, 1, 2))
    np.testing.assert_allclose(validation["per_class_iou"], hits / union, atol=1e-6)
    np.testing.assert_allclose(validation["pixel_accuracy"], np.mean(called == (masks == 1)),
                               atol=1e-6)
    # "shape" (every shape's pixels) is learnt first: far above calling no pixel a shape (0).
    assert validation["per_class_iou"][2] > 0.3, validation
