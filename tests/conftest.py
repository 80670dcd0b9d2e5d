"""Test-session set-up shared by every test module.

The CPU is split into two logical devices *before* TensorFlow initialises its
runtime, so that `tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])` can run real
multi-replica code on a machine without accelerators. Single-device code is not
affected: it places everything on CPU:0 as usual.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's CPU code generation without LLVM's optimisations of the machine code: the same XLA
# programs and buffers (a step's memory analysis is the same), rounding that may differ in the
# last bits (alike for a model and its reference), and a fraction of the compile time. The
# tests' models are tiny: they compile far more than they run. Every process the tests start
# (JAX programs, TensorFlow's jit_compile, notebooks' kernels) inherits it.
XLA_COMPILE_FLAG = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), XLA_COMPILE_FLAG]))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tfmem  # noqa: E402, F401  (first: it imports TensorFlow with its banner set aside)
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 2

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
)


import collections  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# Each test file's seconds when last recorded (`--record-file-seconds` rewrites those it runs).
FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", action="store_true",
                     help=f"write the seconds of each test file run (setup, call and teardown "
                          f"of its tests) into {FILE_SECONDS.name}, which orders the files of "
                          f"later runs")


def _recorded_seconds() -> dict:
    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}


def pytest_collection_modifyitems(items):
    """The test files longest first, a file not yet recorded before them all, each file's
    tests in their own order: pytest-xdist hands the files to its workers in this order
    (setup.cfg: `--no-loadscope-reorder`), so no long file starts when the other worker is
    nearly done."""
    seconds = _recorded_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))


_file_seconds = collections.Counter()


def pytest_runtest_logreport(report):
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    # Under pytest-xdist the controller receives every worker's reports and writes the file.
    if session.config.getoption("record_file_seconds") and not hasattr(session.config,
                                                                        "workerinput"):
        seconds = _recorded_seconds() | {path: round(total, 1)
                                         for path, total in _file_seconds.items()}
        FILE_SECONDS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


@pytest.fixture(autouse=True)
def _op_determinism_does_not_leak():
    """A test that turns on TensorFlow's op determinism (as `finetune.py --deterministic` does
    in-process) turns it off again: with it on, Keras's `compile` silently drops
    `jit_compile=True`, which would change what later tests run."""
    from tensorflow.python.framework import config

    was_on = config.is_op_determinism_enabled()
    yield
    if config.is_op_determinism_enabled() and not was_on:
        config.disable_op_determinism()


@pytest.fixture(scope="session")
def free_ports():
    """`free_ports(n)`: n localhost ports free right now, for multi-worker `TF_CONFIG`s."""

    def ports(count: int) -> list[int]:
        sockets = [socket.socket() for _ in range(count)]
        for sock in sockets:
            sock.bind(("localhost", 0))
        numbers = [sock.getsockname()[1] for sock in sockets]
        for sock in sockets:
            sock.close()
        return numbers

    return ports


@pytest.fixture(scope="session")
def two_cpu_strategy():
    """One `MirroredStrategy` over the two logical CPUs, shared by every test that needs one.

    Several MirroredStrategy objects in one process hand out colliding collective instance
    keys ("Shape mismatch in the collective instance 100"), so tests share this one instead
    of building their own.
    """
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.fixture
def constant_inputs():
    """`constant_inputs(dataset, op)`: the constant arguments, in order, of the `op` node
    nearest the output on the dataset's main chain (tf.data's own record of what that
    transformation was built with).
    """

    def inputs(dataset: tf.data.Dataset, op: str) -> list:
        graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
        nodes = {node.name: node for node in graph.node}
        node = next(node for node in graph.node if node.op == "_Retval")  # the output
        while node.op != op:  # down the main chain: a dataset's first input is its input
            node = nodes[node.input[0]]
        return [tf.make_ndarray(nodes[name].attr["value"].tensor).item() for name in node.input
                if nodes[name].op == "Const"]

    return inputs


@pytest.fixture
def warnings_on_stderr():
    """Warnings printed to stderr as a program outside pytest prints them (pytest records
    them instead), each time they are raised."""
    import warnings

    def to_stderr(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = to_stderr
        yield
