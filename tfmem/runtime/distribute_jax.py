"""`tfmem.detect()` on the Keras JAX backend: JAX's devices, one `DataParallel` over them.

On today's Colab/Kaggle TPU VMs TensorFlow cannot drive the TPU (`tensorflow-tpu` stops at
2.20), but Keras 3 on JAX can. `tfmem.detect` is `detect()` here when
`keras.backend.backend() == "jax"`; it returns the same `Runtime`, so the global-batch
arithmetic and everything downstream (planner, AccumModel, scripts) do not change:

- devices: `jax.devices()` — TPU, else GPU, else CPU (JAX's own order), or the kind asked for;
  all global devices, so a multi-host TPU pod slice counts every chip;
- strategy: a `keras.distribution.DataParallel` over them, installed with
  `keras.distribution.set_distribution` (Keras then shards each global batch over the devices,
  replicates the variables, and XLA inserts the gradient all-reduce); `runtime.scope()` is its
  scope;
- memory per replica: the device's own `bytes_limit` — what JAX's allocator may use, which on
  a GPU is by default 75% of the card (`XLA_PYTHON_CLIENT_MEM_FRACTION`), less than the
  TensorFlow path's `nvidia-smi` total, because that is all a JAX process can get — else the
  `tfmem.runtime.devices` table entry for its `device_kind`; on CPU the host's available RAM divided
  by this process's CPU devices, since forced host devices
  (`--xla_force_host_platform_device_count`) share one RAM.
"""

from __future__ import annotations

import logging

import jax
import keras

from tfmem.memory import probe_jax
from tfmem.runtime import devices as devices_lib
from tfmem.runtime.runtime import KINDS, Runtime, UnavailableDeviceError


def detect(prefer: str | None = None) -> Runtime:
    """Finds JAX's accelerators, installs data parallelism over them, returns a `Runtime`.

    Args:
        prefer: `"tpu"`, `"gpu"` or `"cpu"` to use that kind of device; `None` takes JAX's
            default backend (TPU, then GPU, then CPU).

    Returns:
        A `Runtime` whose `strategy` is the installed `keras.distribution.DataParallel`.

    Raises:
        ValueError: `prefer` is not one of the kinds.
        tfmem.runtime.UnavailableDeviceError: no device of the preferred kind is present.

    Example:
        >>> import os; os.environ["KERAS_BACKEND"] = "jax"  # before importing keras
        >>> import tfmem
        >>> runtime = tfmem.detect()  # on a TPU v3-8: kind="tpu", num_replicas=8
        >>> runtime.global_batch_size(16, accumulation_steps=4)  # 16 × 8 × 4 = 512
    """
    if prefer not in (None, *KINDS):
        raise ValueError(f"`prefer` must be None, 'tpu', 'gpu' or 'cpu', got {prefer!r}.")
    try:
        found = jax.devices(prefer)
    except RuntimeError as error:
        raise UnavailableDeviceError(
            f"detect(prefer={prefer!r}) on the JAX backend found no {prefer} device: {error}. "
            f"JAX can use: {_available_kinds()}. Install JAX for the device "
            "(`pip install 'jax[tpu]'` on a TPU VM, `pip install 'jax[cuda12]'` for NVIDIA "
            "GPUs), or call detect() without `prefer`."
        ) from None
    distribution = keras.distribution.DataParallel(devices=found)
    keras.distribution.set_distribution(distribution)
    runtime = _describe(found, distribution, num_replicas=len(found))
    logging.info(
        "tfmem: JAX backend, %d × %s (%s), DataParallel installed.",
        runtime.num_replicas,
        runtime.device_name,
        runtime.kind,
    )
    return runtime


def current_runtime(model=None) -> Runtime:
    """The `Runtime` of the installed `keras.distribution` (or of JAX's default device).

    What `AccumModel.fit` plans memory with on the JAX backend, where no `tf.distribute`
    strategy exists (`model` is accepted for the same signature as the TensorFlow side's
    and not needed: the distribution is global). Installs nothing.

    Example:
        >>> tfmem.runtime.distribute_jax.current_runtime().num_replicas  # 8 after detect() on a v3-8
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return _describe(jax.devices()[:1], None, num_replicas=1)
    mesh = distribution.device_mesh
    found = list(mesh.backend_mesh.devices.flat)
    batch_shards = int(mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)])
    return _describe(found, distribution, num_replicas=batch_shards)


def _describe(found: list[jax.Device], distribution, num_replicas: int) -> Runtime:
    kind = found[0].platform
    if kind not in KINDS:  # e.g. a plugin platform ("METAL"): treat as a GPU
        kind = "gpu"
    return Runtime(
        kind=kind,
        strategy=distribution,
        num_replicas=num_replicas,
        num_workers=jax.process_count(),
        memory_per_replica=_memory_per_device(found),
        device_name=devices_lib.cpu_name() if kind == "cpu" else found[0].device_kind,
        compute_capability=_compute_capability(found[0]),
    )


def _memory_per_device(found: list[jax.Device]) -> int | None:
    device = found[0]
    if device.platform == "cpu":
        num_local_cpus = sum(1 for d in found if d.process_index == jax.process_index())
        return devices_lib.host_memory_for_process() // num_local_cpus
    limit = probe_jax.device_memory_stats(device).get("bytes_limit")
    if limit:
        return int(limit)
    try:
        return devices_lib.lookup(device.device_kind).memory_per_replica
    except ValueError:
        logging.warning(
            "tfmem: %r reports no memory limit and is not in tfmem.runtime.devices.ACCELERATORS; "
            "memory_per_replica is unknown (None). Pass the device to the planner by name.",
            device.device_kind,
        )
        return None


def _compute_capability(device: jax.Device) -> tuple[int, int] | None:
    """CUDA devices report e.g. "8.0"; TPUs, CPUs and ROCm GPUs report none."""
    value = getattr(device, "compute_capability", None)
    try:
        major, minor = str(value).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _available_kinds() -> str:
    kinds = []
    for kind in KINDS:
        try:
            jax.devices(kind)
        except RuntimeError:
            continue
        kinds.append(kind)
    return ", ".join(kinds)
