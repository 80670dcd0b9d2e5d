"""Measured peak memory of a few real training steps, and a plan calibrated on it.

`planner.plan` counts tensors; this module runs the model. For each of 2–3 micro-batch sizes a
fresh child process builds the model, runs a few `fit` steps on synthetic data and reports its
peak memory (CPU: the peak resident set `VmHWM`; GPU: TensorFlow's allocator peak). A straight
line `fixed + per_sample × b` through those points replaces the estimate's fixed and
per-sample terms (`MemoryPlan.measured`), and the calibrated plan chooses the micro-batch again.

Probing must never take the host down, so:

- it starts from the estimate: only micro-batch sizes whose *estimated* peak stays under half
  the budget are run (the estimate is within ~20%, so these are far from the edge);
- each child gets a hard limit: a watchdog in the parent reads the child's resident set
  every 20 ms and kills it on reaching the limit (the budget), and the child caps its own
  data segment with `RLIMIT_DATA` so that a single huge allocation is refused by the kernel
  before it touches a page (TensorFlow reserves ~1.4× more address space than it touches, so
  the cap is twice the remaining budget: a backstop that never stops a run the watchdog
  allows);
- on GPU the child caps TensorFlow's allocator at the budget (a logical device with
  `memory_limit`), so an oversize step raises `ResourceExhaustedError` in the child.

Children are separate processes because a process's peak resident set never goes down, and
so that a stopped probe leaves nothing behind in the caller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from tfmem.runtime import memory_cap
from tfmem.runtime.memory_cap import MemoryWatch
from tfmem.memory import planner
from tfmem.memory.memory_plan import MeasuredLine, MemoryPlan
from tfmem._sizes import format_bytes

# Fraction of the budget the *estimated* peak of a probe run may reach. The estimate is
# within ~20% (benchmarks/planner_accuracy.py), so half the budget keeps every probe run
# well away from the limit while still measuring a slope over a useful range of batches.
_PROBE_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Peak memory of one probe child.

    Attributes:
        micro_batch_size: the batch each training step ran.
        peak_bytes: peak memory of the child (total resident set on CPU, allocator peak on GPU);
            for a stopped child, the highest value seen before it was stopped.
        baseline_bytes: resident set after importing TensorFlow, before building the model
            (CPU), or 0 (GPU).
        stopped: True when the memory limit stopped the child (or the run failed).
        reason: why it was stopped, empty otherwise.
    """

    micro_batch_size: int
    peak_bytes: int
    baseline_bytes: int
    stopped: bool
    reason: str = ""


def measure(
    model: Any,
    *,
    micro_batch_size: int,
    input_shape: Sequence[int],
    memory_limit: int,
    optimizer: Any = "adam",
    loss: Any = "mse",
    targets: str = "zeros",
    precision: str = "float32",
    num_steps: int = 2,
    device: str = "cpu",
    timeout: float = 900.0,
) -> Measurement:
    """Runs `num_steps` training steps of `model` in a child process and returns its peak.

    Args:
        model: a `keras.Model` (saved to a temporary `.keras` file that the child loads) or a
            zero-argument callable that builds it (pickled by reference: a module-level function).
        micro_batch_size: the batch size of each step.
        input_shape: shape of one sample, e.g. `(64, 64, 3)`.
        memory_limit: bytes; the child is stopped before its memory passes this.
        optimizer: a Keras optimizer name or instance (its config is sent to the child).
        loss: a Keras loss name or instance (its config is sent to the child).
        targets: `"zeros"`: zeros shaped like the model's output; `"class_indices"`: random
            int32 class indices below the output's last axis, shaped like the output without
            it (the targets of a sparse categorical loss, e.g. a segmentation's masks).
        precision: Keras dtype policy name for the child.
        num_steps: training steps to run (the first one traces the graph).
        device: `"cpu"` (resident set) or `"gpu"` (TensorFlow allocator peak on `GPU:0`).
        timeout: seconds before the child is killed and reported as stopped.

    Returns:
        A `Measurement`.

    Example:
        >>> m = measure(build_tiny_cnn, micro_batch_size=4, input_shape=(32, 32, 3),
        ...             memory_limit=3 * 2**30)  # doctest: +SKIP
    """
    import keras

    if device not in ("cpu", "gpu"):
        raise ValueError(f"`device` must be 'cpu' or 'gpu', got {device!r}.")
    if targets not in ("zeros", "class_indices"):
        raise ValueError(f"`targets` must be 'zeros' or 'class_indices', got {targets!r}.")
    with tempfile.TemporaryDirectory(prefix="tfmem-probe-") as workdir:
        if isinstance(model, keras.Model):
            source: dict[str, Any] = {"path": os.path.join(workdir, "model.keras")}
            model.save(source["path"])
        elif callable(model):
            source = {"model_fn": model}
        else:
            raise TypeError(f"`model` must be a keras.Model or a callable, got {type(model)}.")
        optimizer_config = keras.optimizers.serialize(keras.optimizers.get(optimizer))
        spec = dict(
            source,
            micro_batch_size=int(micro_batch_size),
            input_shape=tuple(int(d) for d in input_shape),
            memory_limit=int(memory_limit),
            optimizer=optimizer_config,
            loss=keras.losses.serialize(keras.losses.get(loss)),
            targets=targets,
            precision=precision,
            num_steps=int(num_steps),
            device=device,
        )
        spec_path = os.path.join(workdir, "spec.pkl")
        result_path = os.path.join(workdir, "result.json")
        with open(spec_path, "wb") as spec_file:
            pickle.dump(spec, spec_file)
        return _run_child(spec_path, result_path, spec, timeout)


class ProbeError(RuntimeError):
    """A probe run was stopped by its memory limit or failed; the message says which."""


def probe(
    model: Any,
    plan_settings: planner.PlanSettings | None = None,
    *,
    loss: str = "mse",
    micro_batch_sizes: Sequence[int] | None = None,
    num_steps: int = 2,
    timeout: float = 900.0,
    **arguments: Any,
) -> MemoryPlan:
    """Measures `model`'s peak at 2–3 micro-batch sizes and returns a calibrated plan.

    Takes what `tfmem.plan` takes (a `PlanSettings`, or its arguments: `global_batch_size`,
    `optimizer`, `precision`, `runtime`/`memory_budget`/`device`, ...) for the estimate it
    starts from, plus the probe's own. The measured line `fixed + per_sample × b` replaces the
    estimate's terms (`plan.measured`); accumulation buffers and the input of a k-times larger
    batch, which a plain step does not have, are still added from the formulas.

    Args:
        model: a built functional `keras.Model` (saved to a temporary file for the children).
        plan_settings: the settings of the estimate (`tfmem.memory.planner.settings`).
        loss: the loss the probe runs train with.
        micro_batch_sizes: sizes to run; default: up to three sizes (¼, ½ and all of the
            largest one whose *estimated* peak stays under half the budget, capped at the
            per-replica batch).
        num_steps: training steps per size (the first traces the graph).
        timeout: seconds per child.
        **arguments: the arguments of `tfmem.memory.planner.settings`, instead of
            `plan_settings`.

    Returns:
        A `MemoryPlan` with `measured` set and micro-batch × k chosen on the measured line.

    Raises:
        ProbeError: a run was stopped by its limit or failed (the plan's estimate was far off,
            or the model does not train); no run is left behind.
        ValueError: the estimate leaves no room to probe under half the budget, or the
            device is not this machine's.

    Example:
        >>> calibrated = tfmem.probe(model, global_batch_size=64, memory_budget=8 * 2**30)
        >>> calibrated.measured.per_sample_bytes, calibrated.micro_batch_size  # doctest: +SKIP
    """
    if plan_settings is None:
        plan_settings = planner.settings(**arguments)
    estimate = planner.plan(model, plan_settings)
    kind = estimate.device_kind
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"`probe` measures this machine's CPU or GPU, not a {kind}: plan for "
                         "the TPU with `tfmem.plan`, or probe on a GPU/CPU host.")
    if kind == "gpu":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            raise ValueError(f"The plan is for a GPU ({estimate.device}) but this machine has "
                             "none: probe on the GPU machine, or plan with `tfmem.plan` alone.")
    ceiling = _PROBE_FRACTION * estimate.budget_bytes
    if micro_batch_sizes is None:
        micro_batch_sizes = default_sizes(estimate)
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    too_big = [b for b in sizes if b < 1 or estimate.peak_bytes(b, 1) > ceiling]
    if len(sizes) < 2 or too_big:
        raise ValueError(
            f"Probing needs two micro-batch sizes whose estimated peak stays under half the "
            f"budget ({format_bytes(ceiling)}); got {sizes} (over: {too_big}). "
            f"The estimate at micro-batch 1 is {format_bytes(estimate.peak_bytes(1, 1))}"
            ": give a larger `memory_budget`, or a smaller model or image size."
        )
    results = []
    for size in sizes:
        result = measure(model, micro_batch_size=size, input_shape=model.input_shape[1:],
                         memory_limit=estimate.budget_bytes, optimizer=plan_settings.optimizer,
                         loss=loss, precision=plan_settings.precision, num_steps=num_steps,
                         device=kind, timeout=timeout)
        if result.stopped:
            raise ProbeError(f"The probe run at micro-batch {size} did not finish: "
                             f"{result.reason}. Nothing else was run.")
        results.append(result)
    # The line is fit on each run's growth above its own baseline (the resident set after
    # importing TensorFlow moves by tens of MiB between processes on a loaded machine), then
    # lifted by the runs' median baseline.
    growths = [r.peak_bytes - r.baseline_bytes for r in results]
    slope, intercept = np.polyfit(sizes, growths, 1)
    intercept += float(np.median([r.baseline_bytes for r in results]))
    if slope <= 0:
        raise ProbeError(
            f"Measured peaks {[r.peak_bytes for r in results]} at micro-batches {sizes} do not "
            "grow with the batch: noise dominates. Probe larger `micro_batch_sizes`."
        )
    line = MeasuredLine(int(intercept), int(slope), tuple(sizes),
                                tuple(r.peak_bytes for r in results))
    return estimate.replace(measured=line)


def default_sizes(estimate: MemoryPlan) -> list[int]:
    """The probe's micro-batch sizes for `estimate`: ¼, ½ and all of the largest plain step
    whose *estimated* peak stays under half the budget (capped at the per-replica batch).

    The widest span that is still safe: the per-sample slope is measured over hundreds of
    MiB, well above the allocator's noise, so it extrapolates to the budget. Empty when not
    even micro-batch 1 is estimated under half the budget (`probe` then raises).

    Example:
        >>> default_sizes(tfmem.plan(model, global_batch_size=256, memory_budget=6 * 2**30))
        [13, 27, 55]  # doctest: +SKIP
    """
    upper = estimate.largest_micro_batch(_PROBE_FRACTION * estimate.budget_bytes)
    upper = min(upper, max(estimate.per_replica_batch_size, 2))
    if upper < 1:
        return []
    return sorted({max(1, upper // 4), max(1, upper // 2), upper})


def _run_child(spec_path: str, result_path: str, spec: dict, timeout: float) -> Measurement:
    env = dict(os.environ)
    # The child must import the same tfmem and the module of a pickled `model_fn`.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU probe must not put its tensors on a GPU
    child = subprocess.Popen(
        [sys.executable, "-m", "tfmem.memory.probe", spec_path, result_path],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = MemoryWatch(child.pid, spec["memory_limit"] if spec["device"] == "cpu" else None)
    watchdog.start()
    try:
        _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        _, stderr = child.communicate()
        watchdog.reason = watchdog.reason or f"timed out after {timeout:.0f} s"
    finally:
        watchdog.stop()
    size = spec["micro_batch_size"]
    if os.path.exists(result_path) and child.returncode == 0 and not watchdog.reason:
        with open(result_path) as result_file:
            result = json.load(result_file)
        return Measurement(size, result["peak_bytes"], result["baseline_bytes"], False)
    if child.returncode is not None and child.returncode < 0:
        # TensorFlow often dies of a signal after the kernel refuses an allocation under
        # RLIMIT_DATA (it reports the OOM, or not, then aborts or segfaults).
        status = (f"killed by {signal.Signals(-child.returncode).name}; under the child's "
                  "RLIMIT_DATA this is usually a refused allocation")
    else:
        status = f"exit status {child.returncode}"
    reason = watchdog.reason or f"{_last_error_line(stderr)} ({status})"
    return Measurement(size, watchdog.highest, 0, True, reason)


def _last_error_line(stderr: str) -> str:
    """The line that says why a child failed: an out-of-memory report first, else an error."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    for markers in (("RESOURCE_EXHAUSTED", "OOM when allocating", "MemoryError", "bad_alloc"),
                    ("Error",)):
        for line in reversed(lines):
            if any(marker in line for marker in markers):
                return line[:300]
    return lines[-1][:300] if lines else ""


def _child_main(spec_path: str, result_path: str) -> None:
    """Entry point of a probe child: build, train a few steps, report the peak."""
    with open(spec_path, "rb") as spec_file:
        spec = pickle.load(spec_file)
    import numpy as np
    import tensorflow as tf

    if spec["device"] == "gpu":
        # TensorFlow's own cap: an oversize step raises ResourceExhaustedError here.
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=spec["memory_limit"] // 2**20)]
        )
    import keras

    keras.mixed_precision.set_global_policy(spec["precision"])
    status = memory_cap.status_bytes()
    baseline = status["VmRSS"]
    if spec["device"] == "cpu":
        # Kernel backstop against one huge allocation; the parent's watchdog enforces the limit.
        cap = status["VmData"] + 2 * max(spec["memory_limit"] - baseline, 0)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    if "model_fn" in spec:
        model = spec["model_fn"]()
    else:
        model = keras.models.load_model(spec["path"], compile=False)
    model.compile(optimizer=keras.optimizers.deserialize(spec["optimizer"]),
                  loss=keras.losses.get(spec["loss"]))
    size = spec["micro_batch_size"]
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (size,) + spec["input_shape"]).astype("float32")
    # A subclassed model has no `output_shape`: its symbolic call gives it.
    output = model.compute_output_spec(keras.KerasTensor((size,) + spec["input_shape"]))
    targets = _targets(spec["targets"], (size,) + tuple(output.shape[1:]), rng)
    # One batch repeated: the data costs one batch, as a streaming pipeline's current batch does.
    dataset = tf.data.Dataset.from_tensors((images, targets)).repeat(spec["num_steps"])
    if spec["device"] == "cpu" and "path" in spec:
        # Reading the saved file is a transient a real run (which builds the model) never has.
        _reset_peak_resident()
    model.fit(dataset, epochs=1, verbose=0)
    if spec["device"] == "gpu":
        peak, baseline = tf.config.experimental.get_memory_info("GPU:0")["peak"], 0
    else:
        peak = memory_cap.status_bytes()["VmHWM"]
    with open(result_path, "w") as result_file:
        json.dump({"peak_bytes": int(peak), "baseline_bytes": int(baseline)}, result_file)


def _targets(kind: str, output_shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The probe's targets for an output of `output_shape` (see `measure`'s `targets`)."""
    if kind == "class_indices":
        return rng.integers(0, output_shape[-1], output_shape[:-1]).astype("int32")
    return np.zeros(output_shape, "float32")


def _reset_peak_resident() -> None:
    """Resets `VmHWM` to the current resident set (Linux ≥ 4.0; a no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
