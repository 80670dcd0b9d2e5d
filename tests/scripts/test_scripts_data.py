"""The data scripts, run as a user runs them: real subprocesses (one per program, running its
command lines one after the other), outputs checked."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import types

import pytest

import numpy as np
import tensorflow as tf

import tfmem
from tests.jax_flags import jax_xla_flags
from tfmem import finetune
from tfmem._sizes import format_bytes
from tfmem.memory import plan_report
from native_logs import without_native_logs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "tests", "scripts", "cli_commands.py")


class _Programs:
    """Runs command lines as `python PROGRAM ARGS` runs them, each program's in one process of
    cli_commands.py (started on first use; a `-m` module's in whichever is running)."""

    def __init__(self, directory):
        self.directory, self.processes = directory, {}

    def __call__(self, program, *args, timeout=240):
        """The command's exit status, stdout and stderr."""
        if program.startswith("-m ") and self.processes:
            key = next(iter(self.processes))
        else:
            key = program
        if key not in self.processes:
            log = self.directory / f"{len(self.processes)}.log"
            with open(log, "w") as errors:  # native log lines, for a process that ended
                self.processes[key] = (subprocess.Popen(
                    [sys.executable, RUNNER], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=errors,
                    env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")), log)
        process, log = self.processes[key]
        process.stdin.write(json.dumps([program, list(args)]) + "\n")
        process.stdin.flush()
        timer = threading.Timer(timeout, process.kill)  # a command that hangs ends its process
        timer.start()
        try:
            answer = process.stdout.readline()
        finally:
            timer.cancel()
        assert answer, f"{program} {args}: its process ended\n{log.read_text()[-3000:]}"
        return tuple(json.loads(answer))

    def close(self):
        for process, _ in self.processes.values():
            process.stdin.close()
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    runner = _Programs(tmp_path_factory.mktemp("programs"))
    yield runner
    runner.close()


@pytest.fixture()
def run(programs):
    """`run(program, *args)`: the command's stdout and stderr, once it exited with status 0."""

    def succeeded(program, *args):
        status, stdout, stderr = programs(program, *args)
        assert status == 0, stderr[-3000:]
        return types.SimpleNamespace(stdout=stdout, stderr=stderr)

    return succeeded


def test_make_tfrecords_writes_a_folder_and_inspects_the_result(tmp_path, run):
    rng = np.random.default_rng(0)
    for index in range(12):
        path = tmp_path / "photos" / ("cats", "dogs", "owls")[index % 3] / f"{index}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
        path.write_bytes(tf.io.encode_png(image).numpy())
    (tmp_path / "photos" / "owls" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (tmp_path / "photos" / "owls" / "moved.png").symlink_to(tmp_path / "elsewhere.png")
    result = run("scripts/make_tfrecords.py", f"--source={tmp_path / 'photos'}",
                 f"--output={tmp_path / 'out'}", "--shard_size_mb=0.003", "--skip_unreadable")
    manifest = tfmem.read_manifest(tmp_path / "out")
    assert manifest.num_examples == 12 and manifest.class_names == ("cats", "dogs", "owls")
    assert manifest.skipped == ("owls/moved.png", "owls/broken.jpg")  # the link, when listed
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"wrote 12 examples in {len(manifest.shards)} shards, "
        rf"{manifest.num_bytes / 1e6:.1f} MB, in \d+\.\d s to {tmp_path / 'out'}, "
        r"skipped 2 unreadable file\(s\)", summary), summary
    assert "12/14" in result.stderr  # the progress bar's last state: 12 of 14 files written

    inspected = run("scripts/make_tfrecords.py", f"--inspect={tmp_path / 'out' / '*.tfrecord'}")
    assert f"{len(manifest.shards)} file(s)" in inspected.stdout
    assert "'image': bytes[1] (png image" in inspected.stdout
    assert "'label': int64[1]" in inspected.stdout
    assert "'image' decodes to an image of shape (16, 16, 3)" in inspected.stdout
    assert "Manifest: 12 examples, 3 classes" in inspected.stdout


def test_every_script_reports_a_bad_command_in_one_line_with_status_2(tmp_path, programs):
    """make_tfrecords.py, plan.py and tfmem-env."""
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "manifest.json").write_text("{}")
    for folder in ("ants", "cats"):
        (tmp_path / "photos" / folder).mkdir(parents=True)
    (tmp_path / "photos" / "cats" / "a.png").write_bytes(
        tf.io.encode_png(np.zeros((4, 4, 3), np.uint8)).numpy())
    for folder in ("images", "masks"):  # a segmentation pair: b.png's mask has no image
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.png").write_bytes(
            tf.io.encode_png(np.zeros((4, 6, 1), np.uint8)).numpy())
    (tmp_path / "masks" / "b.png").write_bytes((tmp_path / "masks" / "a.png").read_bytes())
    (tmp_path / "runs.csv").write_text("ImageId,EncodedPixels\na.png,20 8\n")  # 24 pixels
    commands = {
        "mask alone": (["scripts/make_tfrecords.py", f"--source={tmp_path / 'images'}",
                        f"--masks={tmp_path / 'masks'}", f"--output={tmp_path / 'seg'}"],
                       rf"error: mask '{tmp_path / 'masks' / 'b.png'}' has no image in "
                       rf"'{tmp_path / 'images'}' \(expected a file named 'b' with any "
                       r"extension; 1 mask\(s\) without one\); each mask needs its image "
                       r"under the same name"),
        "rle runs": (["scripts/make_tfrecords.py", f"--source={tmp_path / 'images'}",
                      f"--rle-csv={tmp_path / 'runs.csv'}", "--ignore-value=none",
                      f"--output={tmp_path / 'seg'}"],
                     rf"error: '{tmp_path / 'runs.csv'}', image 'a.png', class '1': its runs "
                     r"leave the image's 24 pixels \(6×4\), or have a negative start or "
                     r"length"),
        "empty class": (["scripts/make_tfrecords.py", f"--source={tmp_path / 'photos'}",
                         f"--output={tmp_path / 'out'}"],
                        rf"error: 1 class folder\(s\) of '{tmp_path / 'photos'}' hold no images: "
                        r"'ants'; each would be a class without examples\. Add images to it, "
                        r"remove it, or pass allow_empty_classes=True "
                        r"\(`--allow-empty-classes`\) to keep it as a class"),
        "plan optimizer": (["scripts/plan.py", "--model=small-cnn", "--global-batch-size=8",
                            "--image-size=32", "--optimizer=bogus"],
                           r"error: `optimizer` \(`--optimizer`\) 'bogus' is not an "
                           r"optimizer Keras knows; use one of adadelta, .*, adamw, .*, sgd, "
                           r"or pass a keras\.optimizers\.Optimizer"),
        "no folder": (["scripts/make_tfrecords.py", f"--source={tmp_path / 'nowhere'}",
                       f"--output={tmp_path / 'out'}"],
                      rf"error: Image folder '{tmp_path / 'nowhere'}' does not exist or is not "
                      r"a directory: expected root/<class_name>/<image>\.\{jpg,jpeg,png\}\."),
        "set there": (["scripts/make_tfrecords.py", "--source=demo", "--num-examples=8",
                       f"--output={tmp_path / 'set'}"],
                      rf"error: '{tmp_path / 'set'}' already holds a TFRecord set .* pass "
                      r"overwrite=True \(`--overwrite`\) to replace it\."),
        "shard size": (["scripts/make_tfrecords.py", "--source=demo", "--shard-size-mb=0",
                        f"--output={tmp_path / 'out'}"],
                       r"error: flag --shard-size-mb=0.0: --shard-size-mb must be a number > 0, "
                       r"e\.g\. --shard-size-mb=128; see --helpshort for the flags"),
        "plan model": (["scripts/plan.py", "--model=resnet5", "--global-batch-size=8"],
                       r"error: Unknown model 'resnet5'\. Did you mean .*"),
        "plan size": (["scripts/plan.py", "--model=unet", "--global-batch-size=8",
                       "--image-size=32,40"],
                      r"error: --image-size 32,40: unet needs height and width divisible by 16 "
                      r"\(it pools 16× and upsamples back\); got image_size=\(32, 40\)\. Try 32 "
                      r"or 48\."),
        "plan no size": (["scripts/plan.py", "--model=unet", "--global-batch-size=8",
                          "--image-size=wide"],
                         r"error: --image-size 'wide' is not a size: pass one number for square "
                         r"images \(--image-size 224\) or height,width \(--image-size 360,480\)"),
        "plan loss": (["scripts/plan.py", "--model=small-cnn", "--global-batch-size=8",
                       "--loss=dice"],
                      r"error: --loss dice scores masks, and small-cnn is a classification "
                      r"network; leave --loss out, or pass a segmentation --model "
                      r"\(unet, tiramisu-\*\)"),
        # Checked before the model is built (as an unknown --device is).
        "plot dir": (["scripts/plan.py", "--model=small-cnn", "--global-batch-size=8",
                      f"--plot={tmp_path}"],
                     rf"error: --plot {tmp_path} is a directory; pass a file name, e\.g\. "
                     rf"--plot {tmp_path / 'plan.png'}"),
        "tfmem-env": (["-m", "tfmem.runtime.report", "--prefer=xpu"],
                      r"error: argument --prefer: invalid choice: 'xpu' \(choose from 'tpu', "
                      r"'gpu', 'cpu'\); see tfmem-env --help"),
    }
    for name, (args, message) in commands.items():
        program, argv = (f"-m {args[1]}", args[2:]) if args[0] == "-m" else (args[0], args[1:])
        status, _, text = programs(program, *argv)
        # TensorFlow's C++ logging at import ("I0000 ...", absl's preamble) is not ours.
        lines = [line.rstrip("\n") for line in without_native_logs(text, also="<frozen runpy>")]
        assert status == 2, (name, text[-2000:])
        assert len(lines) == 1 and re.fullmatch(message, lines[0]), (name, text)
    assert not (tmp_path / "out").exists()


def test_overwrite_replaces_a_set_and_keeps_no_old_shard(tmp_path, run):
    run("scripts/make_tfrecords.py", "--source=demo", "--num-examples=8", "--image-size=8",
        f"--output={tmp_path}")
    old = tfmem.read_manifest(tmp_path)
    run("scripts/make_tfrecords.py", "--source=demo", "--num-examples=12", "--image-size=8",
        "--seed=1", "--overwrite", f"--output={tmp_path}")
    new = tfmem.read_manifest(tmp_path)
    assert new.num_examples == 12 and not {s.name for s in old.shards} & {s.name for s in
                                                                           new.shards}
    assert sorted(os.listdir(tmp_path)) == sorted(["manifest.json",
                                                   *(s.name for s in new.shards)])


def test_plan_plots_where_it_says(tmp_path, run):
    # A name without an extension: matplotlib adds ".png", and the line names that file.
    result = run("scripts/plan.py", "--model=small-cnn", "--image-size=32,48",
                 "--global-batch-size=8", f"--plot={tmp_path / 'memory'}")
    assert result.stdout.splitlines()[-1] == f"wrote {tmp_path / 'memory.png'}"
    # A non-square size, and the finetune.py command of the planned run with it.
    assert "next: python scripts/finetune.py --model small-cnn --data PATH --image-size 32,48 " \
        in result.stdout
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["memory.png"]


def test_plan_script_prints_the_plan_and_draws_it(tmp_path, run):
    png = tmp_path / "plan.png"
    result = run("scripts/plan.py", "--model", "mobilenetv2", "--global-batch-size", "48",
                 "--device", "t4", "--image-size", "32", "--num-classes", "10", "--optimizer",
                 "sgd", f"--plot={png}")
    with tfmem.models.shapes_only():  # the planner reads shapes only
        model = tfmem.models.build("mobilenetv2", num_classes=10, image_size=32)
    loss, metrics = finetune.task_loss("classification", 10)  # finetune.py's
    reference = tfmem.plan(model, global_batch_size=48, optimizer="sgd", device="t4",
                           precision="mixed_float16",  # what --precision auto means on a T4
                           loss=loss, metrics=metrics)
    total = format_bytes(reference.peak_bytes(reference.micro_batch_size))
    assert "total (peak per replica)" in result.stdout and total in result.stdout
    assert "SGD, mixed_float16" in result.stdout
    assert reference.split() in result.stdout.splitlines()[0]  # the table's header
    assert result.stdout.splitlines()[-3:] == [
        plan_report.format_choice(reference).splitlines()[0],
        "next: python scripts/finetune.py --model mobilenetv2 --data PATH --image-size 32 "
        f"--global-batch-size 48 --optimizer sgd --accumulation-steps "
        f"{reference.accumulation_steps}", f"wrote {png}"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_on_jax_for_a_tpu_checks_its_split_with_xla_tpus_own_figure(tmp_path):
    # docs/planning.md's example. Compiled here ahead of time where the TPU compiler (libtpu)
    # is installed; where it is not, the plan alone, after a line that says what the
    # compiled figure needs. Either way the lines the page shows that do not come from the
    # compile are the program's.
    page = open(os.path.join(ROOT, "docs", "planning.md"), encoding="utf-8").read()
    example = page.split("KERAS_BACKEND=jax python scripts/plan.py ", 1)[1]
    command = example.split("\n```", 1)[0].replace("\\\n", " ").split()
    shown = example.split("```\n", 2)[2].split("\n```", 1)[0].splitlines()
    paths = [ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    environment = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
                       XLA_FLAGS=jax_xla_flags(), TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=os.pathsep.join(paths).rstrip(os.pathsep))
    png = tmp_path / "plan.png"  # XLA's figure drawn beside the plan's line
    result = subprocess.run([sys.executable, "scripts/plan.py", *command, f"--plot={png}"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    compiled = re.search(r"compiled step \(XLA\) +([\d.]+) MiB +arguments \+ outputs",
                         result.stdout)
    from_the_compile = ("plan: compiling", "  compiled step (XLA)", "chosen by XLA's figure")
    if importlib.util.find_spec("libtpu") is None:
        import jax

        assert compiled is None
        assert lines[0] == ("plan: the plan alone: XLA's own figure of this step needs the "
                            "TPU compiler, libtpu, to compile for a TPU on this machine: pip "
                            f'install "jax[tpu]=={jax.__version__}" (it pins the libtpu of '
                            "this JAX)")
        assert lines[-3].startswith("chosen: one step of micro-batch 4 (no accumulation)")
        shown = [line for line in shown if not line.startswith(from_the_compile)]
    else:
        assert compiled and 0 < float(compiled.group(1)) < 1024, result.stdout
        assert lines[-3] == (f"chosen by XLA's figure of the compiled step: micro-batch 4 × "
                             f"1, {compiled.group(1)} MiB of the 12.80 GiB budget (the plan "
                             "alone: micro-batch 4 × 1)")
        # The compiled figure, to the page's 0.1 MiB, may move with the compiler's version.
        shown = [line for line in shown if not line.startswith(from_the_compile[1:])]
    assert [line for line in shown if line.strip() != "…"] == [
        line for line in lines if line in shown]
    assert lines[-2:] == [shown[-1], f"wrote {png}"]  # the command that trains it, the plot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
