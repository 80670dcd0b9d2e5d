"""`tfmem.detect()` on the Keras JAX backend: JAX's devices, one `DataParallel` over them.

On today's Colab/Kaggle TPU VMs TensorFlow cannot drive the TPU (`tensorflow-tpu` stops at
2.20), but Keras 3 on JAX can. `tfmem.distribute.detect()` hands over to `detect()` here when
`keras.backend.backend() == "jax"`; it returns the same `Runtime`, so the global-batch
arithmetic and everything downstream (planner, AccumModel, scripts) do not change:

- devices: `jax.devices()` — TPU, else GPU, else CPU (JAX's own order), or the kind asked for;
  all global devices, so a multi-host TPU pod slice counts every chip;
- strategy: a `keras.distribution.DataParallel` over them, installed with
  `keras.distribution.set_distribution` (Keras then shards each global batch over the devices,
  replicates the variables, and XLA inserts the gradient all-reduce); `runtime.scope()` is its
  scope;
- memory per replica: the device's own `bytes_limit` (what JAX's allocator may use on a GPU or
  TPU), else the `tfmem.devices` table entry for its `device_kind`; on CPU the host's available
  RAM divided by the number of CPU devices, since forced host devices
  (`--xla_force_host_platform_device_count`) share one RAM.
"""

from __future__ import annotations

import logging

import jax
import keras

from tfmem import devices as devices_lib
from tfmem import probe_jax
from tfmem.distribute import Runtime

_KINDS = ("tpu", "gpu", "cpu")


def detect(prefer: str | None = None) -> Runtime:
    """Finds JAX's accelerators, installs data parallelism over them, returns a `Runtime`.

    Args:
        prefer: `"tpu"`, `"gpu"` or `"cpu"` to use that kind of device; `None` takes JAX's
            default backend (TPU, then GPU, then CPU).

    Returns:
        A `Runtime` whose `strategy` is the installed `keras.distribution.DataParallel`.

    Raises:
        ValueError: `prefer` is not one of the kinds, or no device of that kind is present.

    Example:
        >>> import os; os.environ["KERAS_BACKEND"] = "jax"  # before importing keras
        >>> import tfmem
        >>> runtime = tfmem.detect()  # on a TPU v3-8: kind="tpu", num_replicas=8
        >>> runtime.global_batch_size(16, accumulation_steps=4)  # 16 × 8 × 4 = 512
    """
    if prefer is not None and prefer not in _KINDS:
        raise ValueError(
            f"prefer={prefer!r} is not a device kind. Expected one of {', '.join(_KINDS)} "
            "or None (JAX's default: TPU, then GPU, then CPU)."
        )
    try:
        found = jax.devices(prefer)
    except RuntimeError as error:
        raise ValueError(
            f"prefer={prefer!r}, but JAX has no {prefer} device here ({error}). "
            f"Available: {_available_kinds()}. For TPUs install `jax[tpu]`; for NVIDIA GPUs "
            "`jax[cuda12]`; or call detect() without `prefer`."
        ) from None
    kind = found[0].platform
    distribution = keras.distribution.DataParallel(devices=found)
    keras.distribution.set_distribution(distribution)
    runtime = Runtime(
        kind=kind,
        strategy=distribution,
        num_replicas=len(found),
        num_workers=jax.process_count(),
        memory_per_replica=_memory_per_device(found),
        device_name=found[0].device_kind,
    )
    logging.info(
        "tfmem: JAX backend, %d × %s (%s), DataParallel installed.",
        runtime.num_replicas,
        runtime.device_name,
        kind,
    )
    return runtime


def _memory_per_device(found: list[jax.Device]) -> int | None:
    device = found[0]
    if device.platform == "cpu":
        num_local_cpus = sum(1 for d in found if d.process_index == jax.process_index())
        return devices_lib.host_available_memory() // num_local_cpus
    limit = probe_jax.device_memory_stats(device).get("bytes_limit")
    if limit:
        return int(limit)
    try:
        return devices_lib.lookup(device.device_kind).memory_per_replica
    except ValueError:
        logging.warning(
            "tfmem: %r reports no memory limit and is not in tfmem.devices.ACCELERATORS; "
            "memory_per_replica is unknown (None). Pass the device to the planner by name.",
            device.device_kind,
        )
        return None


def _available_kinds() -> str:
    kinds = []
    for kind in _KINDS:
        try:
            jax.devices(kind)
        except RuntimeError:
            continue
        kinds.append(kind)
    return ", ".join(kinds)
