"""What this machine has, read without starting any device: TPU signals, GPUs, workers, CPU.

`detect()` decides from a `Hardware` record; reading it is kept apart so that tests (and users
with an unusual machine) can hand `detect()` a record instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Mapping

from tfmem.runtime import devices
from tfmem.runtime import tpu
from tfmem.runtime.cluster import workers_in_tf_config


@dataclasses.dataclass(frozen=True)
class GPU:
    """One visible GPU: its name, CUDA compute capability and total memory in bytes (or None)."""

    name: str
    compute_capability: tuple[int, int] | None = None
    memory: int | None = None


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What `detect()` decides from; `inspect_hardware()` reads it, tests may build one by hand.

    Attributes:
        tpu_signals: why a TPU seems attached (`tpu.signals()`); empty if none.
        tpu_names: TPU names to connect to, in order (`tpu.names_to_try()`).
        tpu_accelerator_type: e.g. "v3-8" (`tpu.accelerator_type()`), or None.
        gpus: the GPUs TensorFlow sees.
        num_workers: chief + worker tasks in `TF_CONFIG` (1 without it).
    """

    tpu_signals: tuple[str, ...] = ()
    tpu_names: tuple[str, ...] = ("local",)
    tpu_accelerator_type: str | None = None
    gpus: tuple[GPU, ...] = ()
    num_workers: int = 1


def inspect_hardware(environ: Mapping[str, str] | None = None) -> Hardware:
    """Reads the machine without initialising any device (safe before multi-worker set-up).

    Example:
        >>> inspect_hardware().gpus
        ()
    """
    environ = os.environ if environ is None else environ
    return Hardware(
        tpu_signals=tpu.signals(environ),
        tpu_names=tpu.names_to_try(environ),
        tpu_accelerator_type=tpu.accelerator_type(environ),
        gpus=_visible_gpus(),
        num_workers=workers_in_tf_config(environ.get("TF_CONFIG")),
    )


def _visible_gpus() -> tuple[GPU, ...]:
    # get_visible_devices / get_device_details do not initialise the runtime, so this stays
    # safe before MultiWorkerMirroredStrategy must be created.
    from tfmem._tf import tf  # TensorFlow only where GPUs are asked about (JAX runs without)

    visible = tf.config.get_visible_devices("GPU")
    if not visible:
        return ()
    totals = _nvidia_smi_totals()
    gpus = []
    for device in visible:
        details = tf.config.experimental.get_device_details(device)
        name = details.get("device_name", device.name)
        memory = totals.get(name)
        if memory is None:
            try:
                memory = devices.lookup(name).memory_per_replica
            except ValueError:
                memory = None
        gpus.append(GPU(name, details.get("compute_capability"), memory))
    return tuple(gpus)


def _nvidia_smi_totals() -> dict[str, int]:
    """GPU name → total bytes, from `nvidia-smi` (only names whose cards all agree)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_nvidia_smi(output)


def parse_nvidia_smi(output: str) -> dict[str, int]:
    """`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` → name: bytes.

    Example:
        >>> parse_nvidia_smi("Tesla T4, 15360\n")
        {'Tesla T4': 16106127360}
    """
    seen: dict[str, set[int]] = {}
    for line in output.strip().splitlines():
        name, _, mib = line.rpartition(",")
        if mib.strip().isdigit():
            seen.setdefault(name.strip(), set()).add(int(mib) * 2**20)
    # nvidia-smi and CUDA may order cards differently, so match by name, not by index.
    return {name: totals.pop() for name, totals in seen.items() if len(totals) == 1}
