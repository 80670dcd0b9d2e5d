"""AccumModel and detect() on the Keras JAX backend, checked in their own processes.

The Keras backend is fixed when Keras is first imported, and this test session runs on
TensorFlow (tests/conftest.py), so the JAX cases are real subprocesses
(tests/jax_cases/*.py, KERAS_BACKEND=jax) that print their numbers as JSON; the tests here
assert on those numbers. One program, `accumulation_cases.py`, starts at module set-up on 8 host
devices (XLA_FLAGS), the shape of a TPU v3-8: its single-device cases first, the loss cases of
`loss_cases.py` (loss_normalisation_cases.py) among them, then `data_parallel_cases.py`'s under
a distribution over the 8 devices.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.jax_flags import jax_xla_flags
from tests.training import loss_cases

CASES = pathlib.Path(__file__).parent / "jax_cases"
ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a guard against a hung program; a loaded machine takes minutes


class _Case:
    """One case program running in the background; `results()` waits and parses its JSON."""

    def __init__(self, name: str, num_devices: int):
        env = dict(os.environ)
        env.update(
            KERAS_BACKEND="jax",
            XLA_FLAGS=jax_xla_flags(f"--xla_force_host_platform_device_count={num_devices}"),
            # tests/training too: the models the TensorFlow tests share with the cases.
            PYTHONPATH=os.pathsep.join([str(ROOT), str(CASES), str(CASES.parent),
                                        env.get("PYTHONPATH", "")]),
            TF_CPP_MIN_LOG_LEVEL="2",
            JAX_PLATFORMS="cpu",
        )
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(CASES / f"{name}.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._results = None

    def results(self) -> dict:
        if self._results is None:
            stdout, stderr = self.process.communicate(timeout=TIMEOUT_S)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
            if self.process.returncode or not lines:
                pytest.fail(
                    f"{self.name}.py exited with {self.process.returncode}:\n{stderr[-4000:]}"
                )
            self._results = json.loads(lines[-1][len("RESULTS ") :])
        return self._results

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def accumulation():
    case = _Case("accumulation_cases", num_devices=8)
    try:
        yield case.results()
    finally:
        case.stop()


@pytest.fixture(scope="module")
def data_parallel(accumulation):
    return accumulation["data_parallel"]


@pytest.fixture(scope="module")
def losses(accumulation):
    return accumulation["losses"]


@pytest.mark.parametrize(
    "case", ["dense_sgd_weighted", "dense_adam_weighted", "conv_sgd_weighted", "conv_adam"]
)
def test_micro_batches_equal_one_big_batch(accumulation, case):
    # Three global batches of 32 as 4 micro-batches of 8 vs a plain keras.Model on batches of 32.
    result = accumulation[case]
    assert result["weights"] <= 1e-5
    assert result["update"] <= 1e-4  # the change itself, not only the weights, agrees
    assert result["accum_loss"] == pytest.approx(result["plain_loss"], rel=1e-5)
    assert result["accum_accuracy"] == result["plain_accuracy"]
    assert result["accum_iterations"] == result["plain_iterations"] == 3


def test_host_loop_and_in_graph_loop_give_the_same_step(accumulation):
    # conv + BatchNorm + Dropout, Adam, 2 global batches of 32 as 4 micro-batches of 8.
    result = accumulation["placement"]
    assert result["host_loop_steps"] == 2  # on a CPU, `fit` runs the loop from the host
    assert result["graph_loop_host_steps"] == 0
    assert result["weights"] <= 1e-5
    assert result["non_trainable"] <= 1e-5  # moving statistics and dropout seeds
    assert result["host_loss"] == pytest.approx(result["graph_loss"], rel=1e-5)
    assert result["iterations"] == [2, 2]


def test_accumulating_holds_at_most_a_tenth_more_than_a_plain_step(accumulation):
    # XLA's memory analysis (compile-time arithmetic, nothing measured) of AccumModel(8 × 4)'s
    # in-graph step against plain fit at batch 8, on a conv net in mixed_bfloat16 (float32 and
    # real models: benchmarks/accumulation.py --analysis_only).
    result = accumulation["compiled_memory"]["convolutions"]
    assert result["accum"] <= 1.10 * result["plain"]


def test_accumulating_adds_only_its_sums_and_the_rest_of_the_batch(accumulation):
    # Where weights outweigh activations, in mixed_bfloat16: half-precision copies of the
    # weights kept through the micro-batch loop would add about as much again as the sums.
    result = accumulation["compiled_memory"]["dense"]
    added = result["accum"] - result["plain"]
    assert added <= result["more_batch_bytes"] + 1.25 * result["sums_bytes"]


def test_a_split_the_plan_refuses_trains_when_its_compiled_step_fits(accumulation):
    result = accumulation["guard_with_xla"]
    fixed = result["fixed"]
    assert fixed["plan_steps"] is None  # the plan refuses it
    # XLA's figure of the step with the plan's framework runtime, which the figure leaves out
    assert fixed["compiled_peak"] + result["runtime_bytes"] <= fixed["budget_bytes"]
    assert fixed["iterations"] == 1 and fixed["weights"] <= 1e-5  # the whole batch's step
    # The step the check compiles (Keras's at k = 1) is the one fit runs: no second compile.
    assert fixed["check_lowerings"] == 1 and fixed["fit_lowerings"] == 0


def test_auto_takes_the_largest_micro_batch_whose_compiled_step_fits(accumulation):
    result = accumulation["guard_with_xla"]
    auto = result["auto"]
    runtime = result["runtime_bytes"]  # the plan's framework runtime, which XLA leaves out
    peak_of_1, peak_of_4 = result["peaks"]  # the compiled peaks with k = 1 and 4
    assert peak_of_1 + runtime > auto["budget_bytes"] >= peak_of_4 + runtime
    # The plan puts the dense net above XLA's figure: its micro-batch is smaller than the
    # one XLA fits, and "auto" moves up to that one.
    assert auto["plan_steps"] > auto["accumulation_steps"] > 1
    assert (auto["compiled_peak"] + runtime <= auto["budget_bytes"]
            < auto["half_steps_peak"] + runtime)
    assert auto["iterations"] == 1 and auto["weights"] <= 1e-5  # chosen before any step
    # Each k the search compiles (a micro-step and an update) is compiled once: fit, which
    # checks again, runs the chosen k's executables.
    assert auto["check_lowerings"] >= 4 and auto["fit_lowerings"] == 0
    # A set k over the budget by XLA's figure too: refused, naming what XLA fits.
    assert result["refused"].startswith(
        "global batch 32 = micro-batch 32 × 1 accumulation step × 1 replica needs ")
    assert result["refused"].endswith(
        f"by XLA's figure (accumulation_steps={auto['accumulation_steps']}). "
        "Pass `allow_over_budget=True` to run anyway.")


def test_auto_moves_down_when_the_compiled_step_of_the_plans_split_does_not_fit(accumulation):
    result = accumulation["guard_with_xla"]["accepted"]
    runtime = result["runtime_bytes"]
    # The plan accepts micro-batch 32 (it puts two pooled convolution blocks under XLA:CPU's
    # figure); XLA does not fit it.
    assert result["plan_steps"] == 1
    assert result["planned"] <= result["budget_bytes"] < result["compiled_32"] + runtime
    # Moved before any step to a smaller micro-batch whose compiled step fits.
    assert result["accumulation_steps"] > 1
    assert result["compiled_peak"] + runtime <= result["budget_bytes"]
    assert result["iterations"] == 1 and result["weights"] <= 1e-5  # the whole batch's step
    assert "compiled step (XLA)" in result["table"]
    # The executables the check compiled are the ones fit runs.
    assert result["check_lowerings"] >= 3 and result["fit_lowerings"] == 0


def test_lr_schedule_counts_real_updates(accumulation):
    # PiecewiseConstantDecay([2], [0.1, 0.0]): iterations 0, 1, 2 at lr 0.1, then lr 0.
    result = accumulation["lr_schedule"]
    for name in ("plain", "accum"):
        changes = result[name]["changes"]
        assert all(change > 1e-3 for change in changes[:3]), changes
        assert changes[3:] == [0.0, 0.0]
        assert result[name]["iterations"] == 5
    assert result["accum"]["changes"] == pytest.approx(result["plain"]["changes"], rel=1e-4)
    assert result["weights"] <= 1e-5


def test_float16_skips_the_whole_window_and_halves_the_scale(accumulation):
    result = accumulation["float16"]
    assert result["optimizer"] == "LossScaleOptimizer"
    assert result["update"] <= 2e-3  # fp16 forward pass: looser than float32, still one step
    poisoned = result["poisoned"]
    assert poisoned["change"] == 0.0  # 3 of 4 micro-batches were finite: nothing applied
    assert poisoned["scale_after"] == poisoned["scale_before"] / 2 == 2.0**14
    assert poisoned["iterations"] == poisoned["iterations_before"]
    clean = result["clean_after"]
    assert clean["change"] > 1e-3
    assert clean["scale"] == 2.0**14
    assert clean["iterations"] == poisoned["iterations"] + 1


def test_bfloat16_matches_a_plain_step(accumulation):
    result = accumulation["bfloat16"]
    assert result["optimizer"] == "SGD"
    # bf16 has 8 mantissa bits: the plain and the accumulated step round differently.
    assert result["update"] <= 2e-2


def test_batch_norm_moving_statistics_average_the_window(accumulation):
    result = accumulation["batch_norm"]
    assert result["mean_error"] <= 1e-4
    assert result["var_error"] <= 1e-4
    # k separate momentum steps land far from the formula, so the check above discriminates.
    assert result["sequential_gap"] >= 0.1


def test_dropout_draws_a_fresh_mask_per_micro_batch(accumulation):
    seeds = accumulation["dropout_seeds"]
    assert seeds["accum_1"] == seeds["plain_2"]  # k=2: two draws in one step
    assert seeds["accum_1"] != seeds["plain_1"]


def test_indivisible_global_batch_names_the_nearest_sizes(accumulation):
    kind, message = accumulation["errors"]["indivisible_batch"]
    assert kind == "ValueError"
    assert message.startswith("`global_batch_size` (30) must be divisible by replicas × "
                              "accumulation_steps (1 × 4 = 4). Try 28 or 32. If this is the "
                              "last batch of an epoch")


def test_same_checks_as_the_tensorflow_path(accumulation):
    kind, message = accumulation["errors"]["double_accumulation"]
    assert kind == "ValueError" and "`gradient_accumulation_steps=2`" in message


def _assert_whole_batch_step(result):
    assert result["finite"]
    assert result["update"] <= 1e-5
    plain = result["plain_history"]
    assert result["history"].keys() == plain.keys()
    for name, values in result["history"].items():  # loss, per-output losses, metrics
        assert values == pytest.approx(plain[name], rel=1e-5), name


@pytest.mark.parametrize("name", ["ignore_class", "mask_zero",
                                  "sample_weight:mean_with_sample_weight", "two_outputs",
                                  "add_loss", *loss_cases.SEGMENTATION_CASES])
def test_every_counted_loss_gives_the_whole_batch_step(losses, name):
    # tests/training/loss_cases.py; every case runs on TensorFlow in test_accumulation_losses.py.
    result = losses["host_loop"][name]
    _assert_whole_batch_step(result)
    assert result["warnings"] == []


def test_masked_groups_in_the_in_graph_loop_and_under_data_parallel(losses, data_parallel):
    _assert_whole_batch_step(losses["in_graph_loop"]["two_outputs"])
    for name in ("add_loss", "two_outputs"):
        _assert_whole_batch_step(data_parallel["masked_losses"][name])  # 8 devices


def test_a_loss_returning_a_scalar_is_averaged_with_one_warning(losses):
    result = losses["host_loop"]["scalar_loss"]
    _assert_whole_batch_step(result)
    assert len(result["warnings"]) == 1 and "'_scalar_mean_square'" in result["warnings"][0]


def test_indivisible_per_replica_batch_names_the_nearest_sizes(data_parallel):
    message = data_parallel["indivisible"]
    # 8 rows per replica, 3 micro-batches: the same message as the TensorFlow path's.
    assert message.startswith("`global_batch_size` (64) must be divisible by replicas × "
                              "accumulation_steps (8 × 3 = 24). Try 48 or 72.")


def test_detect_reports_eight_replicas(data_parallel):
    runtime = data_parallel["runtime"]
    assert runtime["kind"] == "cpu"
    assert runtime["num_replicas"] == 8
    assert runtime["num_workers"] == 1
    # Keras's DataParallel (tfmem's subclass also takes datasets split by process).
    assert "DataParallel" in runtime["strategy"] and runtime["installed"]
    # 8 host devices share one RAM: each is given an eighth of what was available.
    expected = runtime["host_available_per_device"]
    assert runtime["memory_per_replica"] == pytest.approx(expected, rel=0.2)
    assert runtime["global_batch_size_4_2"] == 64
    assert runtime["split_64_2"] == 4
    assert runtime["current_runtime"] == [8, True]


def test_detect_explains_a_missing_or_unknown_device_kind(data_parallel):
    errors = data_parallel["runtime"]["errors"]
    kind, message = errors["tpu"]
    assert kind == "UnavailableDeviceError"
    assert "found no tpu device" in message and "JAX can use: cpu" in message
    assert "jax[tpu]" in message
    assert errors["accelerator"] == [
        "ValueError",
        "`prefer` must be None, 'tpu', 'gpu' or 'cpu', got 'accelerator'.",
    ]


def test_data_parallel_equals_single_device_big_batch(data_parallel):
    result = data_parallel["data_parallel"]
    assert result["reference_devices"] == 1
    assert result["variable_devices"] == 8  # really replicated over the 8 devices
    assert result["weights_vs_reference"] <= 1e-5
    assert result["accum_loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
    assert result["iterations"] == 2


def test_tf_data_pipeline_feeds_it_unchanged(data_parallel):
    result = data_parallel["data_parallel"]
    assert result["dataset_vs_arrays"] <= 1e-6
    assert result["dataset_vs_reference"] <= 1e-5
    assert result["dataset_loss"] == pytest.approx(result["reference_loss"], rel=1e-5)


def test_compiled_step_memory_shrinks_with_micro_batches(data_parallel):
    memory = data_parallel["compiled_memory"]
    plain, accum = memory["plain"], memory["accum_4"]
    assert accum["argument_bytes"] == plain["argument_bytes"]  # the same state goes in
    assert 0 < accum["temp_bytes"] < plain["temp_bytes"]
    assert accum["peak_bytes"] == (
        accum["argument_bytes"] + accum["output_bytes"] - accum["alias_bytes"] + accum["temp_bytes"]
    )
    assert data_parallel["peak_bytes_in_use"] is None  # CPU devices keep no allocator stats
