"""Throughput and peak memory of gradient accumulation on a real model, each case side by side.

Cases (each in its own process, so that its peak memory is its own; m = micro-batch, k = steps):

* plain(m): `fit` with batch m — the reference;
* keras(m×k): Keras's built-in `optimizer(gradient_accumulation_steps=k)`, batch m;
* AccumModel(m×k): `tfmem.AccumModel`, global batch m·k split into k micro-batches;
* plain(m·k): `fit` with the global batch at once;
* … xla (TensorFlow): the same with `compile(jit_compile=True)`;
* AccumModel(m×k) in-graph / host: the micro-batch loop forced inside the compiled step or
  onto the host (`tfmem.training.placement`) instead of the platform's choice.

Model: a `keras.applications` model (weights=None, 10 classes), SGD, synthetic images in
memory fed as numpy arrays. Samples/s counts the timed windows of m·k samples after one
warm-up window (compilation); peak memory is the process's `ru_maxrss`, and on a GPU/TPU
also JAX's `peak_bytes_in_use`. Rounds run every case once each, interleaved, so a shared
machine's load falls on all cases alike; the table gives the best and the median samples/s.

Run (CPU, 2 cores: about 6 minutes a round for the default cases):

    PYTHONPATH=. python benchmarks/accumulation.py --backend=jax --rounds=3
    PYTHONPATH=. python benchmarks/accumulation.py --backend=tensorflow --rounds=3
    # a GPU, JAX: XLA's memory analysis and the planner's estimate beside the measured peak
    PYTHONPATH=. python benchmarks/accumulation.py --backend=jax --model=ResNet50 \\
        --image_size=224 --cases=plain,accum_graph,accum_host,big --memory_analysis

Expected (docs/jax.md has the tables): every AccumModel case at >= 0.8× the samples/s of its
plain reference with a peak within 1.15× of it, and below half the peak of plain(m·k).
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("backend", "tensorflow", ["tensorflow", "jax"],
                  "Keras backend of every case (KERAS_BACKEND of the child processes).")
flags.DEFINE_string("model", "EfficientNetV2B0", "A keras.applications model name.")
flags.DEFINE_integer("image_size", 96, "Square input size.")
flags.DEFINE_integer("micro_batch", 32, "Micro-batch m (the batch of the plain reference).")
flags.DEFINE_integer("accumulation_steps", 8, "k: micro-batches per update.")
flags.DEFINE_integer("windows", 3, "Timed windows of m·k samples per case (after 1 warm-up).")
flags.DEFINE_integer("rounds", 1, "Interleaved runs of every case.")
flags.DEFINE_list("cases", None, "Cases to run (default: all of the backend's, see CASES).")
flags.DEFINE_bool("memory_analysis", False,
                  "JAX: also XLA's memory analysis of the compiled step and the planner's "
                  "estimate, in the first round.")
flags.DEFINE_bool("analysis_only", False,
                  "JAX: only XLA's memory analysis of each case's compiled step, side by side "
                  "as ratios (nothing trains; minutes on a CPU for ResNet50).")
flags.DEFINE_enum("precision", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                  "Keras dtype policy of every case.")
flags.DEFINE_string("case", None, "Internal: run one case in this process and print JSON.")

# key: (reference key, batch given to fit is global (m·k), AccumModel k, Keras k, XLA, loop)
CASES = {
    "plain": (None, False, False, False, None, None),
    "keras": ("plain", False, False, True, None, None),
    "accum": ("plain", True, True, False, None, None),
    "big": ("plain", True, False, False, None, None),
    "plain_xla": (None, False, False, False, True, None),
    "accum_xla": ("plain_xla", True, True, False, True, None),
    "accum_graph": ("plain", True, True, False, None, "graph"),
    "accum_host": ("plain", True, True, False, None, "host"),
}
DEFAULT_CASES = {
    "tensorflow": ["plain", "keras", "accum", "big", "plain_xla", "accum_xla"],
    "jax": ["plain", "keras", "accum", "big"],
}


def label(key: str) -> str:
    m, k = FLAGS.micro_batch, FLAGS.accumulation_steps
    _, _, _, _, xla, loop = CASES[key]
    name = {"plain": f"plain({m})", "keras": f"keras({m}x{k})", "big": f"plain({m * k})"}.get(
        key.split("_")[0], f"AccumModel({m}x{k})")
    return name + (" xla" if xla else "") + (f" {loop}" if loop == "host" else
                                            " in-graph" if loop == "graph" else "")


def run_case(key: str) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = FLAGS.backend  # before Keras is imported: it fixes the backend
    import keras
    import numpy as np

    import tfmem
    from tfmem.training import placement

    _, is_global, accumulate, keras_accumulates, xla, loop = CASES[key]
    m, k = FLAGS.micro_batch, FLAGS.accumulation_steps
    if loop == "host":
        placement.HOST_LOOP_PLATFORMS = ("cpu", "gpu", "tpu")
    elif loop == "graph":
        placement.HOST_LOOP_PLATFORMS = ()
    window = m * k
    batch_size = window if is_global else m
    keras.config.set_dtype_policy(FLAGS.precision)
    keras.utils.set_random_seed(0)
    size = FLAGS.image_size
    model = getattr(keras.applications, FLAGS.model)(
        weights=None, input_shape=(size, size, 3), classes=10)
    if accumulate:
        model = tfmem.AccumModel.wrap(model, accumulation_steps=k)
    model.compile(
        keras.optimizers.SGD(0.01, gradient_accumulation_steps=k if keras_accumulates else None),
        keras.losses.SparseCategoricalCrossentropy(),
        jit_compile=True if xla else "auto",
    )
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (window, size, size, 3)).astype("float32")
    labels = rng.integers(0, 10, (window,))
    if FLAGS.analysis_only:
        model.optimizer.build(model.trainable_variables)
        return {"xla": _xla_memory(model, (images[:batch_size], labels[:batch_size]))}
    times = []

    def on_batch_end(batch, logs):
        float(logs["loss"])  # waits for the step: JAX dispatches it asynchronously
        times.append(time.perf_counter())

    timer = keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)
    fit = dict(batch_size=batch_size, shuffle=False, verbose=0, callbacks=[timer])
    if accumulate:
        fit["check_memory"] = False  # the plan is not what is measured here
    model.fit(images, labels, epochs=FLAGS.windows + 1, **fit)
    batches_per_window = window // batch_size
    warm = times[batches_per_window - 1]  # end of the warm-up window
    result = {
        "samples_per_s": FLAGS.windows * window / (times[-1] - warm),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "updates": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }
    if FLAGS.backend == "jax":
        from tfmem.memory import probe_jax

        peak = probe_jax.peak_bytes_in_use()
        result["device_peak_gb"] = None if peak is None else peak / 1e9
        if FLAGS.memory_analysis:
            data = (images[:batch_size], labels[:batch_size])
            result["xla"] = _xla_memory(model, data)
            result["xla_peak_gb"] = result["xla"]["peak_bytes"] / 1e9
            try:
                memory_plan = tfmem.plan(model, global_batch_size=batch_size, optimizer="sgd",
                                         runtime=tfmem.runtime.current.current_runtime(model))
            except (AttributeError, ValueError) as error:  # a model the planner cannot read
                print(f"planner: {type(error).__name__}: {error}", file=sys.stderr)
                result["plan_peak_gb"] = None
            else:
                result["plan_peak_gb"] = memory_plan.peak_bytes(
                    batch_size // (k if accumulate else 1), k if accumulate else 1) / 1e9
    return result


def _xla_memory(model, data) -> dict:
    """XLA's memory analysis of the step `fit` runs (AccumModel's: the loop its platform runs,
    or the one the case forces)."""
    from tfmem.memory import probe_jax

    import jax

    memory = (model.compiled_step_memory(data) if hasattr(model, "compiled_step_memory")
              else probe_jax.compiled_step_memory(model, data))
    return dict(memory, compiler=f"XLA:{jax.devices()[0].platform.upper()}, JAX {jax.__version__}")


def _run_child(key: str, memory_analysis: bool) -> dict:
    command = [sys.executable, os.path.abspath(__file__), f"--case={key}"] + [
        f"--{name}={FLAGS[name].value}" for name in
        ("backend", "model", "image_size", "micro_batch", "accumulation_steps", "windows",
         "precision", "analysis_only")
    ] + [f"--memory_analysis={memory_analysis}"]
    output = subprocess.run(command, capture_output=True, text=True, check=False)
    line = [l for l in output.stdout.splitlines() if l.startswith("RESULT ")]
    if output.returncode or not line:
        sys.exit(f"case {key} failed:\n{output.stdout[-2000:]}\n{output.stderr[-4000:]}")
    return json.loads(line[-1][len("RESULT "):])


def _gb(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def main(argv):
    del argv
    if FLAGS.case:
        print("RESULT " + json.dumps(run_case(FLAGS.case)))
        return
    keys = FLAGS.cases or DEFAULT_CASES[FLAGS.backend]
    unknown = [key for key in keys if key not in CASES]
    if unknown:
        sys.exit(f"error: unknown case(s) {unknown}; choose from {sorted(CASES)}")
    if FLAGS.analysis_only:
        if FLAGS.backend != "jax":
            sys.exit("error: --analysis_only reads XLA's analysis of a JAX step; pass "
                     "--backend=jax")
        _print_analysis({key: _run_child(key, False)["xla"] for key in keys})
        return
    runs = {key: [] for key in keys}
    for round_index in range(FLAGS.rounds):
        for key in keys:
            result = _run_child(key, FLAGS.memory_analysis and round_index == 0)
            print(f"round {round_index + 1} {label(key)}: {result}", file=sys.stderr, flush=True)
            runs[key].append(result)

    def summary(key):
        results = runs[key]
        speeds = [r["samples_per_s"] for r in results]
        best = dict(results[0])
        best.update(best_speed=max(speeds), median_speed=statistics.median(speeds),
                    peak_rss_gb=max(r["peak_rss_gb"] for r in results))
        devices = [r.get("device_peak_gb") for r in results if r.get("device_peak_gb")]
        best["device_peak_gb"] = max(devices) if devices else None
        return best

    table = {key: summary(key) for key in keys}
    m, k = FLAGS.micro_batch, FLAGS.accumulation_steps
    print(f"\n{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, SGD, Keras backend "
          f"{FLAGS.backend}, {FLAGS.windows} timed windows of {m * k} samples per case, "
          f"{FLAGS.rounds} interleaved round(s)\n")
    print("| case | samples/s best | median | × ref. (best / median) | peak RSS (GB) | × ref. "
          "| device peak (GB) | × ref. | updates |")
    print("|---|---|---|---|---|---|---|---|---|")
    checks = []
    for key in keys:
        row = table[key]
        reference = table.get(CASES[key][0]) or row
        speed = (row["best_speed"] / reference["best_speed"],
                 row["median_speed"] / reference["median_speed"])
        rss = row["peak_rss_gb"] / reference["peak_rss_gb"]
        device = (row["device_peak_gb"] / reference["device_peak_gb"]
                  if row["device_peak_gb"] and reference["device_peak_gb"] else None)
        print(f"| {label(key)} | {row['best_speed']:.1f} | {row['median_speed']:.1f} "
              f"| {speed[0]:.2f} / {speed[1]:.2f} | {row['peak_rss_gb']:.2f} | {rss:.2f} "
              f"| {_gb(row['device_peak_gb'])} | {_gb(device)} | {row['updates']} |")
        if key.startswith("accum") and CASES[key][0] in table:
            memory = device if device is not None else rss
            checks.append((label(key), speed[0] >= 0.8, memory <= 1.15))
    if any("xla_peak_gb" in table[key] for key in keys):
        print("\n| case | planner estimate (GB) | XLA memory analysis (GB) | measured device "
              "peak (GB) |")
        print("|---|---|---|---|")
        for key in keys:
            row = table[key]
            if "xla_peak_gb" in row:
                print(f"| {label(key)} | {_gb(row['plan_peak_gb'])} | {_gb(row['xla_peak_gb'])} "
                      f"| {_gb(row['device_peak_gb'])} |")
    analyses = {key: table[key]["xla"] for key in keys if "xla" in table[key]}
    if analyses:
        _print_analysis(analyses)
    print()
    for name, fast, small in checks:
        print(f"{name}: samples/s >= 0.8 × reference {'met' if fast else 'NOT met'}; "
              f"peak <= 1.15 × reference {'met' if small else 'NOT met'}")


def _print_analysis(analyses: dict) -> None:
    """XLA's memory analysis of each case's step, in MB and as a ratio to its reference."""
    m, k = FLAGS.micro_batch, FLAGS.accumulation_steps
    compiler = next(iter(analyses.values()))["compiler"]
    print(f"\nXLA's memory analysis of each compiled step ({compiler}): "
          f"{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, "
          f"{FLAGS.precision}, SGD, m={m}, k={k}; MB per device\n")
    print("| case | arguments | outputs − aliased | temporaries | peak | × ref. |")
    print("|---|---|---|---|---|---|")
    for key, xla in analyses.items():
        reference = analyses.get(CASES[key][0]) or xla
        print(f"| {label(key)} | {xla['argument_bytes'] / 1e6:.1f} "
              f"| {(xla['output_bytes'] - xla['alias_bytes']) / 1e6:.1f} "
              f"| {xla['temp_bytes'] / 1e6:.1f} | {xla['peak_bytes'] / 1e6:.1f} "
              f"| {xla['peak_bytes'] / reference['peak_bytes']:.2f} |")


if __name__ == "__main__":
    app.run(main)
