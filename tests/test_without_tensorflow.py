"""tfmem on `KERAS_BACKEND=jax` in a second environment that has JAX and Keras but no TensorFlow.

The environment is a virtual environment with tfmem's `install_requires` and its `jax` extra
(pinned to the versions of this one, so pip's cache serves them), made once and kept under the
user's cache directory. The program (tests/training/jax_cases/without_tensorflow_cases.py) runs
there on this checkout; its numbers are compared with the same computations here, on the
TensorFlow backend.
"""

import configparser
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import subprocess
import sys
from importlib import metadata

import pytest

from tests.jax_flags import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "training" / "jax_cases"
sys.path.insert(0, str(CASES))
import without_tensorflow_cases  # noqa: E402

# What pip prints when it cannot reach an index: the only failure that skips rather than fails.
_OFFLINE = ("Could not find a version", "No matching distribution", "NewConnectionError",
            "Temporary failure in name resolution", "Network is unreachable")


def _requirements() -> list[str]:
    """`install_requires` + the `jax` extra from setup.cfg, pinned to the versions installed here."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    names = config["options"]["install_requires"].split() + \
        config["options.extras_require"]["jax"].split() + ["jaxlib"]
    pinned = []
    for requirement in names:
        name = requirement.split(">")[0].split("=")[0].split("[")[0]
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(requirement)
    return pinned


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "tfmem-tests"


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def python():
    """The Python of a virtual environment without TensorFlow (made on first use)."""
    requirements = _requirements()
    key = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()[:12]
    venv = _cache_dir() / f"no-tensorflow-{key}"
    executable = venv / "bin" / "python"
    with _locked(venv.with_suffix(".lock")):
        if not (venv / "ready").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                           capture_output=True, timeout=300)
            pip = subprocess.run(
                [str(executable), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                 *requirements],
                capture_output=True, text=True, timeout=900,
            )
            if pip.returncode:
                if any(text in pip.stderr for text in _OFFLINE):
                    pytest.skip(f"cannot install {requirements} from a package index: "
                                f"{pip.stderr.strip().splitlines()[-1]}")
                pytest.fail(f"pip install {requirements} failed:\n{pip.stderr[-3000:]}")
            (venv / "ready").write_text("\n".join(requirements))
    return executable


def _run(python, *args, timeout=300):
    env = {key: value for key, value in os.environ.items() if not key.startswith("XLA_")}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=FAST_COMPILE)
    return subprocess.run([str(python), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(ROOT))


@pytest.fixture(scope="module")
def completed(python):
    """The program's run: its exit status, output and error output."""
    return _run(python, str(CASES / "without_tensorflow_cases.py"))


@pytest.fixture(scope="module")
def results(completed):
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULTS ")]
    if completed.returncode or not lines:
        pytest.fail(f"the program exited with {completed.returncode}:\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def test_the_environment_has_no_tensorflow_and_tfmem_imports_none(results):
    assert results["tensorflow_installed"] is False
    assert results["tensorflow_imported"] is False


def test_accum_model_equals_a_plain_model_without_tensorflow(results):
    # Two global batches of 32 as 4 micro-batches of 8 vs a plain keras.Model on batches of 32.
    assert results["accumulation_difference"] <= 1e-5


def test_arrays_and_a_py_dataset_resume_without_tensorflow(results):
    # Interrupted at update 9 of 12 and resumed from update 8: the uninterrupted weights.
    assert results["resume_difference"] == {"arrays": pytest.approx(0, abs=1e-6),
                                            "PyDataset": pytest.approx(0, abs=1e-6)}


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="caps the address space (RLIMIT_AS) as Linux enforces it")
def test_out_of_memory_recovery_on_a_py_dataset_without_tensorflow(results, completed):
    # Micro-batch 64 needs ~1.6 GB of activations and their gradients; 700 MB are allowed
    # (the program's last run, under a cap of the address space it maps then plus 700 MB):
    # the run goes on with a smaller micro-batch, every update once. (That it then ends with
    # the weights of a run that used it from the start is compared on JAX in
    # tests/training/test_out_of_memory.py; what is new here is the PyDataset, without TF.)
    recovered = results["out_of_memory"]
    first = recovered["recoveries"][0]
    assert (first["micro_batch_size"], first["to_micro_batch_size"]) == (64, 32)
    assert "ran out of memory at micro-batch 64 × 1" in completed.stderr
    k = recovered["accumulation_steps"]
    assert k == recovered["recoveries"][-1]["to_accumulation_steps"] >= 2
    assert recovered["iterations"] == 2


def test_detect_and_describe_without_tensorflow(results):
    assert results["runtime"] == ["cpu", 1]
    assert results["describe_tensorflow"] == "not installed"


def test_metrics_without_tensorflow(results):
    assert results["psnr"] == pytest.approx(28.1308, abs=1e-4)  # 10·log10(255² / 10²)
    assert results["ssim_identical"] == pytest.approx(1.0, abs=1e-6)
    in_range, out_of_range = results["psnr_jit"]
    assert in_range == pytest.approx(28.1308, abs=1e-4) and out_of_range != out_of_range  # NaN


def test_plan_without_tensorflow_equals_the_tensorflow_plan(results):
    import tfmem

    reference = tfmem.plan(without_tensorflow_cases.plan_model(),
                           **without_tensorflow_cases.PLAN_ARGUMENTS)
    expected = {key: value for key, value in dataclasses.asdict(reference).items()
                if isinstance(value, int)}
    # Known layers are sized by the same rules on both backends; the custom layer and the
    # loss are traced by each backend's autodiff (TensorFlow's gradient graph, JAX's vjp
    # residuals).
    traced = {"activation_bytes_per_sample", "workspace_bytes_per_sample",
              "loss_bytes_per_sample"}
    assert {k: v for k, v in results["plan"].items() if k not in traced} == \
        {k: v for k, v in expected.items() if k not in traced}
    # A plan for a CPU on JAX counts what XLA:CPU keeps besides: the convolution's relu its
    # pre-activation next to its output (14 × 14 × 8 floats, `tfmem.memory.xla_rules`).
    assert results["plan"]["activation_bytes_per_sample"] == pytest.approx(
        expected["activation_bytes_per_sample"] + 14 * 14 * 8 * 4, rel=0.25)
    # The logits' gradient and one temporary at least: 3 float32 a sample each.
    assert results["plan"]["loss_bytes_per_sample"] >= 2 * 3 * 4
    assert results["plan_notes"] == ["measured by tracing their backward pass: GatedDense"]


def test_the_tfrecord_pipeline_names_the_extra_to_install(results):
    for name in ("image_dataset", "write_image_tfrecords"):
        message = results["errors"][name]
        assert "pip install -e '.[cpu]'" in message and "No module named 'tensorflow'" in message


def test_tfmem_env_runs_without_tensorflow(results, completed):
    status, output = results["tfmem_env"]  # `python -m tfmem.runtime.report`, in the program
    assert status == 0, completed.stderr[-2000:]
    assert "device kind" in output and "backend jax" in output
