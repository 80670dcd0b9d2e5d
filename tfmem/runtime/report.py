"""`describe()` and the `tfmem-env` command: the one screen to paste into a bug report.

    $ tfmem-env              # or: python scripts/env_report.py, python -m tfmem.runtime.report
    $ tfmem-env --prefer cpu
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback
from importlib import metadata

from tfmem._sizes import format_bytes  # the one wording of sizes
from tfmem.runtime import devices
from tfmem.runtime import precision
from tfmem._version import __version__
from tfmem import backend
from tfmem.runtime.current import detect
from tfmem.runtime import tpu
from tfmem.runtime.runtime import Runtime, UnavailableDeviceError


def describe(runtime: Runtime | None = None) -> str:
    """A one-screen description of the runtime and the installed versions.

    Args:
        runtime: from `tfmem.detect()`; detected here when None.

    Example:
        >>> print(tfmem.describe())
        tfmem 0.1.0 environment
          device kind          cpu
          ...
    """
    import keras

    runtime = detect() if runtime is None else runtime
    memory = (
        f"{format_bytes(runtime.memory_per_replica)} ({runtime.memory_per_replica} bytes)"
        if runtime.memory_per_replica is not None
        else "unknown (pass a device name to the planner)"
    )
    capability = (
        ".".join(map(str, runtime.compute_capability)) if runtime.compute_capability else "-"
    )
    rows = [
        ("device kind", runtime.kind),
        ("device", runtime.device_name),
        ("replicas", str(runtime.num_replicas)),
        ("workers", str(runtime.num_workers)),
        ("memory per replica", memory),
        ("compute capability", capability),
        ("strategy", _strategy_name(runtime.strategy)),
        ("precision policy", f"{precision.policy_for(runtime)} (recommended); "
         f"{keras.mixed_precision.global_policy().name} (set now)"),
        ("TPU signals", "; ".join(tpu.signals()) or "none"),
        ("host RAM available", format_bytes(devices.host_available_memory())),
        ("CPU cores", str(os.cpu_count())),
        ("tfmem", __version__),
        ("keras", f"{keras.__version__} (backend {backend.NAME})"),
        ("tensorflow", _versions("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tf-nightly")),
        ("jax", _versions("jax", "jaxlib", "libtpu")),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
    ]
    rows += [("note", note) for note in runtime.notes]
    width = max(len(name) for name, _ in rows)
    return "\n".join(
        [f"tfmem {__version__} environment"]
        + [f"  {name:<{width}}  {value}" for name, value in rows]
    )


def summary(runtime: Runtime | None = None) -> str:
    """`describe()` in one line: the device, the RAM available, the versions that matter.

    Example:
        >>> print(tfmem.runtime.report.summary())  # doctest: +SKIP
        environment: tfmem 0.1.0, keras 3.15.1 (backend tensorflow), cpu (AMD EPYC) × 1, ...
    """
    import keras

    runtime = detect() if runtime is None else runtime
    replicas = f" × {runtime.num_replicas}" if runtime.num_replicas != 1 else ""
    notes = "".join(f"; {note}" for note in runtime.notes)
    return (f"environment: tfmem {__version__}, keras {keras.__version__} (backend "
            f"{backend.NAME}), {runtime.kind} ({runtime.device_name}){replicas}, "
            f"{format_bytes(devices.host_available_memory())} of host RAM available"
            f"{notes}")


def _strategy_name(strategy) -> str:
    """The public name of a strategy's class: `tf.distribute.MirroredStrategy`, ..."""
    if strategy is None:
        return "none"
    cls = type(strategy)
    if cls.__name__ == "_DefaultDistributionStrategy":
        return "none (TensorFlow's default: one device)"
    if cls.__name__ == "OneDevice":
        return "none (Keras's default on JAX: one device)"
    for package, public in (("tensorflow", "tf.distribute"), ("keras", "keras.distribution")):
        if cls.__module__.split(".")[0] == package:
            return f"{public}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _versions(*distributions: str) -> str:
    found = []
    for distribution in distributions:
        try:
            found.append(f"{distribution} {metadata.version(distribution)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "not installed"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        print(f"error: {message}; see tfmem-env --help", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tfmem-env`: prints `describe(detect(prefer))`.

    Errors are one line on stderr, `error: <what>; <how to fix>`: exit status 2 for a wrong
    option, 1 when the device cannot be used; `--debug` prints the traceback too.
    """
    parser = _Parser(prog="tfmem-env", description="Print the device, replicas, memory and "
                     "versions.")
    parser.add_argument("--prefer", choices=["tpu", "gpu", "cpu"], default=None,
                        help="force a device kind, as tfmem.detect(prefer=...)")
    parser.add_argument("--debug", action="store_true", help="on an error, print its traceback")
    args = parser.parse_args(argv)
    try:
        print(describe(detect(prefer=args.prefer)))
    except Exception as error:  # every failure ends as one line (and its traceback)
        if args.debug:
            traceback.print_exc()
        text = " ".join(str(error).split()) or type(error).__name__
        if not isinstance(error, UnavailableDeviceError):
            text = f"{type(error).__name__}: {text}"
        print(f"error: {text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
