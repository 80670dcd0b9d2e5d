"""Runtime detection, batch arithmetic, the TPU diagnosis and the environment report.

Strategies are real: the default strategy on the CPU, `MirroredStrategy` on the two logical CPUs
of conftest.py, and a two-process `MultiWorkerMirroredStrategy` on localhost.
"""

import configparser
import dataclasses
import importlib
import json
import os
import pathlib
import runpy
import subprocess
import sys
import textwrap
import types

import keras
import pytest
import tensorflow as tf

import tfmem
from tfmem.runtime import devices
from tfmem.runtime import distribute
from tfmem.runtime import report
from tfmem.runtime import tpu
from tfmem.runtime.cluster import workers_in_tf_config
from tfmem.runtime.runtime import Runtime, UnavailableDeviceError
from tfmem.runtime.hardware import (
    GPU, Hardware, inspect_hardware, parse_nvidia_smi,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
GIB = 2**30

# The exact text TensorFlow 2.21 (tensorflow-cpu) raises from initialize_tpu_system on a machine
# where it has no TPU kernels: a TPU VM with plain TensorFlow, or this CPU box.
TPU_INIT_ERROR = (
    "TPUs not found in the cluster. Failed in initialization: No OpKernel was registered to "
    "support Op 'ConfigureDistributedTPU' used by {{node ConfigureDistributedTPU}} with these "
    'attrs: [enable_whole_mesh_compilations=false, tpu_cancellation_closes_chips=2, '
    'is_global_init=false, embedding_config="", tpu_embedding_config="", '
    "compilation_failure_closes_chips=false]\nRegistered devices: [CPU]\nRegistered kernels:\n"
    "  <no registered kernels>\n\n\t [[ConfigureDistributedTPU]] [Op:__inference__tpu_init_fn_4]"
)
# What the no-argument TPUClusterResolver() raises on a TPU VM (tensorflow/python/tpu/client).
NO_TPU_NAME_ERROR = "Please provide a TPU Name to connect to."


def _cpu_model_name():
    with open("/proc/cpuinfo") as cpuinfo:
        return next(line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line)


def _rows(text):
    """`describe()`'s "  name   value" lines as a dict."""
    pairs = (line.strip().split("  ", 1) for line in text.splitlines()[1:])
    return {name.strip(): value.strip() for name, value in pairs}


def _replica_sum(strategy, per_replica_fn):
    return float(strategy.reduce("SUM", strategy.run(per_replica_fn), axis=None))


# ---------------------------------------------------------------- batch arithmetic


@pytest.fixture
def eight_replicas():
    # A plain record of 8 replicas (a TPU v3-8's count) for arithmetic; no strategy needed.
    return Runtime(kind="tpu", strategy=None, num_replicas=8)


def test_global_batch_is_per_replica_times_replicas_times_steps(eight_replicas):
    assert eight_replicas.global_batch_size(16) == 128
    assert eight_replicas.global_batch_size(16, accumulation_steps=4) == 512
    assert eight_replicas.split_global_batch(96, accumulation_steps=3) == 4
    assert eight_replicas.split_global_batch(8) == 1
    for micro_batch in range(1, 9):
        for steps in range(1, 6):
            total = eight_replicas.global_batch_size(micro_batch, steps)
            assert eight_replicas.split_global_batch(total, steps) == micro_batch


def test_split_error_names_the_nearest_sizes_that_divide(eight_replicas):
    with pytest.raises(ValueError) as error:
        eight_replicas.split_global_batch(100, accumulation_steps=3)
    assert str(error.value) == (
        "`global_batch_size` (100) must be divisible by replicas × accumulation_steps "
        "(8 × 3 = 24). Try 96 or 120."
    )
    with pytest.raises(ValueError, match=r"\(8 × 1 = 8\)\. Try 8\.$"):
        eight_replicas.split_global_batch(5)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda r: r.global_batch_size(0), ValueError, "`per_replica_batch` must be at least 1"),
        (lambda r: r.global_batch_size(16.0), TypeError, "`per_replica_batch` must be an int, got"),
        (lambda r: r.global_batch_size(16, True), TypeError, "`accumulation_steps` must be an int"),
        (lambda r: r.split_global_batch(64, 0), ValueError, "`accumulation_steps` must be at"),
        (lambda r: Runtime("TPU", None, 8), ValueError, "`kind` must be one of"),
        (lambda r: Runtime("cpu", None, 0), ValueError, "`num_replicas` must be at least 1"),
    ],
)
def test_bad_arguments_say_what_was_expected(eight_replicas, call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(eight_replicas)


# ---------------------------------------------------------------- real strategies on this CPU


def _between_readings(make):
    """`make()`, and this process's room on the host (`host_memory_for_process`) read just
    before and after it: other processes come and go meanwhile."""
    before = devices.host_memory_for_process()
    made = make()
    after = devices.host_memory_for_process()
    return made, min(before, after), max(before, after)


def test_detect_on_a_cpu_machine_uses_the_default_strategy():
    runtime, low, high = _between_readings(tfmem.detect)
    assert runtime.kind == "cpu"
    assert runtime.strategy is tf.distribute.get_strategy()
    assert (runtime.num_replicas, runtime.num_workers) == (1, 1)
    assert runtime.device_name == _cpu_model_name()
    assert runtime.compute_capability is None and runtime.notes == ()
    # The host's available RAM and what this process holds: between the two readings.
    assert 0.95 * low <= runtime.memory_per_replica <= 1.05 * high
    assert tfmem.detect(prefer="cpu").kind == "cpu"
    with runtime.scope():
        variable = tf.Variable(2.0)
    assert float(variable * 3) == 6.0


def test_mirrored_strategy_on_two_logical_cpus_is_described_and_splits_the_batch(
        two_cpu_strategy):
    strategy = two_cpu_strategy
    runtime, low, high = _between_readings(lambda: Runtime.from_strategy(strategy))
    assert (runtime.kind, runtime.num_replicas, runtime.num_workers) == ("cpu", 2, 1)
    # Two replicas in one process share the host's RAM.
    assert 0.95 * low / 2 <= runtime.memory_per_replica <= 1.05 * high / 2

    # A real all-reduce over the two replicas: 1 + 2.
    replica_id = lambda: tf.distribute.get_replica_context().replica_id_in_sync_group  # noqa: E731
    assert _replica_sum(strategy, lambda: tf.cast(replica_id(), tf.float32) + 1.0) == 3.0

    # The per-replica batch the strategy actually feeds equals split_global_batch().
    global_batch = runtime.global_batch_size(5, accumulation_steps=1)
    assert global_batch == 10
    dataset = tf.data.Dataset.range(40).batch(global_batch)
    first = next(iter(strategy.experimental_distribute_dataset(dataset)))
    shapes = [int(tensor.shape[0]) for tensor in strategy.experimental_local_results(first)]
    assert shapes == [runtime.split_global_batch(global_batch)] * 2 == [5, 5]
    with runtime.scope():
        assert tf.distribute.get_strategy() is strategy


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import tensorflow as tf
    import tfmem

    runtime = tfmem.detect()  # first thing: MultiWorkerMirroredStrategy must come first
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    @tf.function
    def all_reduce():
        context = tf.distribute.get_replica_context()
        return context.all_reduce("sum", tf.constant(float(task + 1)))

    total = runtime.strategy.experimental_local_results(runtime.strategy.run(all_reduce))
    print("RESULT " + json.dumps({
        "kind": runtime.kind,
        "multi_worker": isinstance(runtime.strategy, tf.distribute.MultiWorkerMirroredStrategy),
        "num_workers": runtime.num_workers,
        "num_replicas": runtime.num_replicas,
        "sum": [float(t) for t in total],
        "global_batch": runtime.global_batch_size(4, accumulation_steps=2),
        "same_strategy_again": tfmem.detect().strategy is runtime.strategy,
    }), flush=True)
    """
)


def test_two_process_multi_worker_on_localhost(tmp_path, free_ports):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    workers = [f"localhost:{port}" for port in free_ports(2)]
    processes = []
    for index in range(2):
        environment = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            TF_CPP_MIN_LOG_LEVEL="2",
            KERAS_BACKEND="tensorflow",
            TF_CONFIG=json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            ),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=environment, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=180)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
        line = next(line for line in output.splitlines() if line.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        assert result == {
            "kind": "cpu",
            "multi_worker": True,
            "num_workers": 2,
            "num_replicas": 2,
            "sum": [3.0],  # worker 0 gives 1, worker 1 gives 2
            "global_batch": 16,  # 4 per replica × 2 replicas × 2 steps
            "same_strategy_again": True,
        }


def test_multi_worker_after_an_op_says_to_call_detect_first(monkeypatch):
    float(tf.constant(1.0) + 1.0)  # the runtime is started, as in a program that ran ops
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                    "task": {"type": "worker", "index": 0}}),
    )
    expected = r"TF_CONFIG names 2 workers.*Call tfmem.detect\(\) first"
    with pytest.raises(RuntimeError, match=expected):
        tfmem.detect()


# ---------------------------------------------------------------- decisions without hardware


@pytest.mark.parametrize(
    "prefer, num_gpus, num_workers, expected",
    [
        (None, 0, 1, ("cpu", "default")),
        (None, 1, 1, ("gpu", "default")),
        (None, 4, 1, ("gpu", "mirrored")),
        (None, 0, 2, ("cpu", "multi_worker")),
        (None, 2, 3, ("gpu", "multi_worker")),
        ("cpu", 4, 1, ("cpu", "cpu_only")),
        ("cpu", 0, 1, ("cpu", "default")),
        ("cpu", 2, 2, ("cpu", "multi_worker")),
        ("gpu", 1, 1, ("gpu", "default")),
        ("gpu", 2, 1, ("gpu", "mirrored")),
    ],
)
def test_choose_layout(prefer, num_gpus, num_workers, expected):
    hardware = Hardware(gpus=(GPU("Tesla T4", (7, 5), 15360 * 2**20),) * num_gpus,
                        num_workers=num_workers)
    assert distribute.choose_layout(prefer, hardware) == expected


def test_prefer_gpu_without_a_gpu_is_an_error_not_a_silent_cpu_run():
    expected = r"prefer='gpu'\) found no GPU.*pip install -e '\.\[tensorflow\]'"
    with pytest.raises(UnavailableDeviceError, match=expected):
        tfmem.detect(prefer="gpu")
    expected = r"`prefer` must be None, 'tpu', 'gpu' or 'cpu', got 'TPU'"
    with pytest.raises(ValueError, match=expected):
        tfmem.detect(prefer="TPU")


def test_tf_config_worker_count():
    config = {"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"], "evaluator": ["d:1"]},
              "task": {"type": "worker", "index": 0}}
    assert workers_in_tf_config(json.dumps(config)) == 3
    assert workers_in_tf_config(None) == 1
    with pytest.raises(ValueError, match=r"TF_CONFIG is not a JSON object.*unset TF_CONFIG"):
        workers_in_tf_config("{worker: a}")


class TestTPUDecisionWithoutHardware:
    """Hardware-free decision testing of the TPU branch.

    There is no TPU here. The tests feed `detect()` the *real* exceptions TensorFlow raises on
    TPU machines (the same types and messages; where possible raised by TensorFlow itself on
    this CPU box, where `initialize_tpu_system` fails exactly as on a TPU VM with plain
    TensorFlow) and a `Hardware` record saying a TPU is attached; they assert the user-facing
    message and the fallback. A successful TPU connection cannot be produced without a TPU.
    """

    def test_real_tensorflow_error_with_a_tpu_attached_warns_and_falls_back_to_cpu(self):
        hardware = Hardware(tpu_signals=("/dev/accel0 exists", "TPU_ACCELERATOR_TYPE=v3-8"),
                            tpu_accelerator_type="v3-8")
        with pytest.warns(RuntimeWarning) as caught:
            runtime = tfmem.detect(hardware=hardware)  # default connect: real TensorFlow calls
        message = str(caught[0].message)
        assert message.startswith(
            "A TPU seems attached (/dev/accel0 exists; TPU_ACCELERATOR_TYPE=v3-8), "
            "but TensorFlow cannot use it.\nTensorFlow, connecting to tpu='local': NotFoundError: "
            "TPUs not found in the cluster. Failed in initialization: No OpKernel was registered "
            "to support Op 'ConfigureDistributedTPU'"
        )
        assert f"this TensorFlow (tensorflow-cpu {tf.__version__}) has no TPU kernels" in message
        assert "pip install 'tensorflow-tpu==2.20.*' -f https://storage.googleapis.com/" in message
        assert "set KERAS_BACKEND=jax" in message
        assert "Traceback" not in message
        assert (runtime.kind, runtime.num_replicas) == ("cpu", 1)
        assert runtime.notes[0].startswith("A TPU is attached but TensorFlow cannot use it "
                                           "(TPUs not found in the cluster.")

    def test_prefer_tpu_without_a_tpu_raises_with_the_real_error(self):
        with pytest.raises(UnavailableDeviceError) as error:
            tfmem.detect(prefer="tpu", hardware=Hardware())
        message = str(error.value)
        assert message.startswith("detect(prefer='tpu') found no usable TPU: no /dev/accel*")
        assert "No OpKernel was registered to support Op 'ConfigureDistributedTPU'" in message
        assert "Choose a TPU runtime" in message

    def test_every_name_is_tried_in_order_and_each_failure_reported(self):
        attempts = []

        def connect(name):
            attempts.append(name)
            if name == "local":
                raise tf.errors.NotFoundError(None, None, TPU_INIT_ERROR)
            raise ValueError(NO_TPU_NAME_ERROR)

        hardware = Hardware(tpu_signals=("COLAB_TPU_ADDR=10.0.0.2:8470",),
                            tpu_names=tpu.names_to_try({"COLAB_TPU_ADDR": "10.0.0.2:8470"}))
        with pytest.raises(UnavailableDeviceError) as error:
            tfmem.detect(prefer="tpu", hardware=hardware, connect_tpu=connect)
        assert attempts == ["local", "grpc://10.0.0.2:8470"]
        lines = str(error.value).splitlines()
        assert lines[1].startswith("TensorFlow, connecting to tpu='local': NotFoundError: TPUs not")
        assert lines[2] == (
            "TensorFlow, connecting to tpu='grpc://10.0.0.2:8470': ValueError: " + NO_TPU_NAME_ERROR
        )
        assert lines[3].startswith("Why: this TensorFlow (")
        assert lines[4].startswith("Why: no TPU name was given") and "tpu='local'" in lines[4]

    def test_busy_tpu_is_explained(self):
        # libtpu's message when another process has the chips open.
        def connect(name):
            raise RuntimeError(
                "TPU initialization failed: open(/dev/accel0): Device or resource busy"
            )

        with pytest.warns(RuntimeWarning, match=r"(?s)another process holds the TPU.*Restart"):
            runtime = tfmem.detect(hardware=Hardware(tpu_signals=("/dev/accel0 exists",)),
                                   connect_tpu=connect)
        assert runtime.kind == "cpu"

    def test_unexpected_errors_are_not_swallowed(self):
        def connect(name):
            raise KeyError("a bug, not a missing TPU")

        with pytest.raises(KeyError):
            tfmem.detect(hardware=Hardware(tpu_signals=("/dev/accel0 exists",)),
                         connect_tpu=connect)

    def test_no_signal_means_no_connection_attempt(self):
        def connect(name):
            raise AssertionError("must not try a TPU on a machine without TPU signals")

        assert tfmem.detect(hardware=Hardware(), connect_tpu=connect).kind == "cpu"

    def test_connected_strategy_is_described_as_a_tpu_runtime(self, two_cpu_strategy):
        # Wiring only: a real two-replica strategy stands in for the TPUStrategy that
        # connect() returns on a TPU; kind, memory and name come from the TPU branch.
        stand_in = two_cpu_strategy
        attempts = []

        def connect(name):
            attempts.append(name)
            if name == "local":
                raise tf.errors.NotFoundError(None, None, TPU_INIT_ERROR)
            return stand_in

        hardware = Hardware(tpu_signals=("TPU_NAME=my-tpu",), tpu_names=("local", "my-tpu"),
                            tpu_accelerator_type="v3-8")
        runtime = tfmem.detect(hardware=hardware, connect_tpu=connect)
        assert attempts == ["local", "my-tpu"]
        assert (runtime.kind, runtime.num_replicas, runtime.device_name) == ("tpu", 2, "TPU v3-8")
        assert runtime.memory_per_replica == 16 * GIB
        assert tfmem.policy_for(runtime) == "mixed_bfloat16"


def test_tpu_signals_from_device_files_and_environment(tmp_path):
    (tmp_path / "accel0").touch()
    (tmp_path / "accel1").touch()
    (tmp_path / "accel").mkdir()  # the generic Linux accel subsystem's directory: not a TPU
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # VFIO's control file exists on many hosts
    (tmp_path / "vfio" / "0").touch()
    (tmp_path / "vfio" / "1").touch()
    environ = {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "HOME": "/root"}
    assert tpu.signals(environ, dev_dir=str(tmp_path)) == (
        f"{tmp_path}/accel0 exists",
        f"{tmp_path}/accel1 exists",
        f"2 VFIO device group(s) in {tmp_path}/vfio (0, 1)",
        "TPU_ACCELERATOR_TYPE=v5litepod-8",
    )
    assert tpu.signals({}, dev_dir=str(tmp_path / "missing")) == ()
    assert tpu.memory_per_replica(tpu.accelerator_type(environ)) == 16 * GIB
    assert tpu.accelerator_type({"COLAB_TPU_ADDR": "10.0.0.2:8470"}) == "v2-8"
    assert tpu.names_to_try({"TPU_NAME": "my-tpu", "COLAB_TPU_ADDR": "1.2.3.4:8470"}) == (
        "local", "my-tpu", "grpc://1.2.3.4:8470")
    assert inspect_hardware({}).tpu_signals == tpu.signals({})


def test_nvidia_smi_totals_are_matched_by_name():
    # nvidia-smi's output on a machine with two different V100s and two A100s.
    output = (
        "Tesla V100-SXM2-16GB, 16160\nTesla V100-SXM2-32GB, 32510\n"
        "NVIDIA A100-SXM4-80GB, 81920\nNVIDIA A100-SXM4-80GB, 81920\n"
        "NVIDIA Graphics Device, [N/A]\n"
    )
    assert parse_nvidia_smi(output) == {
        "Tesla V100-SXM2-16GB": 16160 * 2**20,
        "Tesla V100-SXM2-32GB": 32510 * 2**20,
        "NVIDIA A100-SXM4-80GB": 80 * GIB,
    }
    # Cards of one name that disagree cannot be told apart by name (nvidia-smi and CUDA may
    # order them differently): the name is left out, so the table is used instead.
    assert parse_nvidia_smi("Tesla T4, 15360\nTesla T4, 15100\n") == {}


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs an NVIDIA GPU")
def test_gpu_memory_is_read_from_the_device():  # pragma: no cover - no GPU in CI
    runtime = tfmem.detect()
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert runtime.kind == "gpu"
    assert runtime.memory_per_replica == int(smi[0]) * 2**20


# ---------------------------------------------------------------- the backend choice


def test_the_backend_picks_detect_and_the_train_step_once_at_import():
    from tfmem.training import accumulation_tf

    assert tfmem.detect is distribute.detect
    assert issubclass(tfmem.AccumModel, accumulation_tf.AccumTrainer)
    program = textwrap.dedent(
        """
        import tfmem
        from tfmem.runtime import distribute_jax
        from tfmem.training import accumulation_jax
        assert tfmem.detect is distribute_jax.detect
        assert issubclass(tfmem.AccumModel, accumulation_jax.AccumTrainer)
        print(tfmem.detect().kind, tfmem.detect().num_replicas)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["cpu", "1"]


def test_an_unsupported_backend_is_refused_at_import_with_the_fix():
    result = subprocess.run(
        [sys.executable, "-c", "import tfmem"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO), KERAS_BACKEND="numpy", TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert result.returncode == 1
    assert "KERAS_BACKEND is 'numpy'" in result.stderr
    assert "KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax" in result.stderr


# ---------------------------------------------------------------- describe() and tfmem-env


def test_describe_prints_the_runtime_and_versions(two_cpu_strategy):
    import platform

    runtime = Runtime.from_strategy(two_cpu_strategy)
    runtime = dataclasses.replace(runtime, notes=("fell back from a TPU",))
    rows = _rows(tfmem.describe(runtime))
    assert rows["device kind"] == "cpu" and rows["replicas"] == "2" and rows["workers"] == "1"
    assert rows["memory per replica"].endswith(f"({runtime.memory_per_replica} bytes)")
    assert rows["strategy"].endswith(".MirroredStrategy")
    assert rows["precision policy"].startswith("float32 (recommended)")
    assert rows["tfmem"] == tfmem.__version__
    assert rows["keras"] == f"{keras.__version__} (backend tensorflow)"
    assert f"tensorflow-cpu {tf.__version__}" in rows["tensorflow"]
    assert rows["python"].startswith(platform.python_version())
    assert rows["note"] == "fell back from a TPU"
    assert len(tfmem.describe(runtime).splitlines()) <= 25  # one screen


def test_env_report_script_runs_as_a_program(monkeypatch, capsys):
    # As `python scripts/env_report.py --prefer cpu` runs it (as __main__), in this process:
    # what it reports is this process's TensorFlow, as a new one's would be.
    script = REPO / "scripts" / "env_report.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--prefer", "cpu"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err[-3000:]
    lines = out.splitlines()
    assert lines[0] == f"tfmem {tfmem.__version__} environment"
    rows = _rows(out)
    assert rows["device kind"] == "cpu" and rows["replicas"] == "1"
    memory_bytes = int(rows["memory per replica"].split("(")[1].split()[0])
    assert memory_bytes == pytest.approx(devices.host_available_memory(), rel=0.2)
    assert f"tensorflow-cpu {tf.__version__}" in rows["tensorflow"]


def test_console_script_entry_point(capsys):
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    entry = config["options.entry_points"]["console_scripts"].strip()
    name, target = (part.strip() for part in entry.split("="))
    module, function = target.split(":")
    assert name == "tfmem-env"
    main = getattr(importlib.import_module(module), function)
    assert main is report.main

    assert main(["--prefer", "gpu"]) == 1  # no GPU here: the message, not a traceback
    assert "error: detect(prefer='gpu') found no GPU" in capsys.readouterr().err
    assert main(["--prefer", "cpu"]) == 0
    assert "device kind" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["/job:localhost/replica:0/task:0/device:GPU:1", "/gpu:1",
                                  "/job:worker/replica:0/task:1/device:CPU:0", "CPU:0",
                                  "/device:TPU:3"])
def test_a_device_name_reads_as_tensorflow_reads_it(name):
    from tfmem.runtime.runtime import _device_type

    assert _device_type(name) == tf.DeviceSpec.from_string(name).device_type
