"""TPU detection for TensorFlow: is one attached, can TensorFlow use it, and if not, why.

A TPU counts as attached when a device node (`/dev/accel<N>`, numbered `/dev/vfio/<N>`) or a
TPU environment variable says so; an installed `libtpu` does not. Plain TensorFlow has no TPU
kernels, so the messages here name the way on (the JAX backend). See docs/runtime.md.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING

from tfmem.runtime import devices

if TYPE_CHECKING:  # TensorFlow is imported only to connect: signals and messages need none
    import tensorflow as tf

_SIGNAL_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "COLAB_TPU_ADDR")


def _connect_errors() -> tuple[type[Exception], ...]:
    """What TensorFlow raises while connecting to / initialising a TPU; anything else is a bug
    that should surface as-is."""
    from tfmem._tf import tf  # TensorFlow only where a TPU is asked about (JAX runs without)

    return (tf.errors.OpError, ValueError, RuntimeError, ImportError)

_INSTALL_TENSORFLOW_TPU = (
    "pip uninstall -y tensorflow tensorflow-cpu && pip install 'tensorflow-tpu==2.20.*' "
    "-f https://storage.googleapis.com/libtpu-tf-releases/index.html"
)


def signals(environ: Mapping[str, str] | None = None, dev_dir: str = "/dev") -> tuple[str, ...]:
    """Why a TPU seems attached to this machine, one reason per entry; empty if none.

    Example:
        >>> signals({"TPU_ACCELERATOR_TYPE": "v3-8"}, dev_dir="/nonexistent")
        ('TPU_ACCELERATOR_TYPE=v3-8',)
    """
    environ = os.environ if environ is None else environ
    found = [f"{path} exists" for path in sorted(glob.glob(os.path.join(dev_dir, "accel[0-9]*")))]
    vfio = os.path.join(dev_dir, "vfio")
    groups = sorted(name for name in _listdir(vfio) if name.isdigit())
    if groups:
        found.append(f"{len(groups)} VFIO device group(s) in {vfio} ({', '.join(groups[:8])})")
    found += [f"{name}={environ[name]}" for name in _SIGNAL_VARIABLES if environ.get(name)]
    return tuple(found)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # no such directory, or not readable: no VFIO devices for us
        return []


def names_to_try(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """TPU names for `TPUClusterResolver(tpu=...)`, in order: local first, then the environment's.

    "local" is the TPU VM case (Kaggle, Colab since 2024, Cloud TPU VMs): the no-argument
    resolver raises "Please provide a TPU Name to connect to" there.

    Example:
        >>> names_to_try({"COLAB_TPU_ADDR": "10.0.0.2:8470"})
        ('local', 'grpc://10.0.0.2:8470')
    """
    environ = os.environ if environ is None else environ
    names = ["local"]
    if environ.get("TPU_NAME") and environ["TPU_NAME"] != "local":
        names.append(environ["TPU_NAME"])
    if environ.get("COLAB_TPU_ADDR"):
        names.append(f"grpc://{environ['COLAB_TPU_ADDR']}")
    return tuple(names)


def accelerator_type(environ: Mapping[str, str] | None = None) -> str | None:
    """The Cloud TPU accelerator type ("v3-8", "v5litepod-8"), or None where unknown."""
    environ = os.environ if environ is None else environ
    if environ.get("TPU_ACCELERATOR_TYPE"):
        return environ["TPU_ACCELERATOR_TYPE"].strip().lower()
    if environ.get("COLAB_TPU_ADDR"):
        return "v2-8"  # Colab's legacy TPU node was only ever a v2-8.
    return None


def memory_per_replica(accelerator: str | None) -> int | None:
    """HBM bytes per replica from `tfmem.runtime.devices` (TensorFlow cannot report TPU memory)."""
    if accelerator is None:
        return None
    try:
        return devices.lookup(accelerator).memory_per_replica
    except ValueError:
        return None


_connected: dict[str, tf.distribute.Strategy] = {}


def connect(name: str) -> tf.distribute.Strategy:
    """Connects to the TPU `name`, initialises it and returns a `TPUStrategy` (once per name).

    Initialising a TPU twice discards the variables on it, so a second call returns the
    strategy of the first.
    """
    from tfmem._tf import tf  # TensorFlow only where a TPU is asked about (JAX runs without)

    if name not in _connected:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        _connected[name] = tf.distribute.TPUStrategy(resolver)
    return _connected[name]


def connect_first(
    names: Iterable[str], connect_fn: Callable[[str], tf.distribute.Strategy]
) -> tuple[tf.distribute.Strategy | None, list[tuple[str, Exception]]]:
    """Tries each name in turn; returns the first strategy (or None) and the errors on the way."""
    failures: list[tuple[str, Exception]] = []
    errors = _connect_errors()
    for name in names:
        try:
            return connect_fn(name), failures
        except errors as error:
            failures.append((name, error))
    return None, failures


def unavailable_message(
    tpu_signals: tuple[str, ...], failures: list[tuple[str, Exception]]
) -> str:
    """What went wrong with the TPU, why, and what to install: never a bare traceback."""
    if tpu_signals:
        lines = [f"A TPU seems attached ({'; '.join(tpu_signals)}), but TensorFlow cannot use it."]
    else:
        lines = [
            "detect(prefer='tpu') found no usable TPU: no /dev/accel* or /dev/vfio/<N> device "
            f"and none of {', '.join(_SIGNAL_VARIABLES)} in the environment."
        ]
    lines += [
        f"TensorFlow, connecting to tpu={name!r}: {type(error).__name__}: {_first_line(error)}"
        for name, error in failures
    ]
    lines += _diagnoses(failures)
    if tpu_signals:
        lines += [
            "Fix it in one of two ways, then restart the runtime:",
            f"  1. TensorFlow with TPU support (its last release is 2.20, with its own libtpu): "
            f"{_INSTALL_TENSORFLOW_TPU}",
            "  2. the Keras JAX backend: pip install -U 'jax[tpu]', and set KERAS_BACKEND=jax "
            "before importing keras or tfmem.",
            "Or train on the CPU on purpose: tfmem.detect(prefer='cpu').",
        ]
    else:
        lines.append(
            "Choose a TPU runtime (Colab: Runtime > Change runtime type > TPU; Kaggle: "
            "Settings > Accelerator > TPU), or call tfmem.detect() without `prefer`."
        )
    return "\n".join(lines)


def short_note(failures: list[tuple[str, Exception]]) -> str:
    """One line for `Runtime.notes` when training fell back from an unusable TPU."""
    reason = _first_line(failures[0][1])[:160] if failures else "no connection attempt"
    return (
        f"A TPU is attached but TensorFlow cannot use it ({reason}); fell back. Install "
        "tensorflow-tpu==2.20.* or use KERAS_BACKEND=jax."
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:400] if text else repr(error)


def _diagnoses(failures: list[tuple[str, Exception]]) -> list[str]:
    text = " ".join(str(error) for _, error in failures)
    found = []
    if "ConfigureDistributedTPU" in text or "TPUs not found in the cluster" in text:
        found.append(
            f"Why: this TensorFlow ({_installed_tensorflow()}) has no TPU kernels; only the "
            "`tensorflow-tpu` package has them, and it stops at 2.20."
            + _libtpu_remark()
        )
    if "Please provide a TPU Name to connect to" in text:
        found.append(
            "Why: no TPU name was given and the environment names none (TPU_NAME). On a TPU VM "
            "the TPU is local: TPUClusterResolver(tpu='local') is the call that works there."
        )
    if "busy" in text.lower() or "already in use" in text.lower():
        found.append(
            "Why: another process holds the TPU (an earlier notebook kernel, or JAX in this "
            "process); only one process can open it. Restart the runtime."
        )
    return found


def _installed_tensorflow() -> str:
    for distribution in ("tensorflow-tpu", "tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    from tfmem._tf import tf  # TensorFlow only if installed (JAX runs without)

    return f"tensorflow {tf.__version__}"


def _libtpu_remark() -> str:
    for distribution in ("libtpu", "libtpu-nightly"):
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        return f" ({distribution} {version} is installed: JAX can use it, TensorFlow cannot.)"
    return ""
