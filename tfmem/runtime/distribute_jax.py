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
  scope. One device of the default kind in one process is Keras's own single-device path
  instead (`OneDevice`, no distribution installed): a `DataParallel` over one device makes JAX
  compile the train step again at every epoch;
- memory per replica: the device's own `bytes_limit` — what JAX's allocator may use, which on
  a GPU is by default 75% of the card (`XLA_PYTHON_CLIENT_MEM_FRACTION`), less than the
  TensorFlow path's `nvidia-smi` total, because that is all a JAX process can get — else the
  `tfmem.runtime.devices` table entry for its `device_kind`; on CPU the host's available RAM divided
  by this process's CPU devices, since forced host devices
  (`--xla_force_host_platform_device_count`) share one RAM;
- processes: when the environment asks for several (`JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or a multi-host TPU pod slice), `detect()` starts
  JAX's distributed runtime first (`jax.distributed.initialize`), with a time limit; the mesh
  then spans every process's devices (docs/multi-host.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping

import jax
import keras

from tfmem.runtime import devices as devices_lib
from tfmem.runtime.runtime import KINDS, Runtime, UnavailableDeviceError


# What asks for several processes: JAX's own variable for the coordinator, and two more that
# tfmem reads for the count and the rank (JAX finds those itself on SLURM, Open MPI, GKE, and
# Cloud TPU pod slices, whose hosts are in TPU_WORKER_HOSTNAMES).
COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
TPU_HOSTS = "TPU_WORKER_HOSTNAMES"


def process_settings(environ: Mapping[str, str]) -> dict | None:
    """The `jax.distributed.initialize` arguments the environment asks for; None: one process.

    Raises:
        ValueError: a count or rank that is not a number, a rank outside the count, or a
            count and rank without the coordinator's address.
    """
    address = environ.get(COORDINATOR, "").strip()
    count, rank = environ.get(NUM_PROCESSES, "").strip(), environ.get(PROCESS_ID, "").strip()
    if count or rank:
        missing = [name for name, value in ((COORDINATOR, address), (NUM_PROCESSES, count),
                                            (PROCESS_ID, rank)) if not value]
        if missing:
            raise ValueError(
                f"several JAX processes need {COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} "
                f"together; {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                "set: set it in every process (process 0's host:port as the address)")
        try:
            num_processes, process_id = int(count), int(rank)
        except ValueError:
            raise ValueError(f"{NUM_PROCESSES}={count!r} and {PROCESS_ID}={rank!r} must be "
                             "whole numbers") from None
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"{PROCESS_ID}={process_id} must be from 0 to "
                             f"{NUM_PROCESSES} - 1 = {num_processes - 1}")
        if num_processes == 1:
            return None
        return {"coordinator_address": address, "num_processes": num_processes,
                "process_id": process_id}
    if address:  # the count and rank come from the cluster (SLURM, Open MPI, ...)
        return {"coordinator_address": address}
    if len([host for host in environ.get(TPU_HOSTS, "").split(",") if host.strip()]) > 1:
        return {}  # a TPU pod slice: JAX finds the coordinator, count and rank itself
    return None


def _start_processes(timeout: float) -> None:
    """Starts JAX's distributed runtime when the environment asks for it and it is not on."""
    if jax.distributed.is_initialized():
        return
    settings = process_settings(os.environ)
    if settings is None:
        return
    rank = settings.get("process_id")
    address = settings.get("coordinator_address")
    if rank and address:  # process 0 serves the coordinator; the others first wait for it
        _wait_for(address, timeout, rank)
    print(f"tfmem: starting JAX's distributed runtime (process "
          f"{'?' if rank is None else rank} of {settings.get('num_processes', '?')}, "
          f"coordinator {address or 'found by JAX'}); every process must start within "
          f"{timeout:g} s", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(**settings, initialization_timeout=int(timeout))
    except RuntimeError as error:
        if "before" in str(error):
            raise RuntimeError(
                "JAX's distributed runtime must start before any JAX computation: call "
                "tfmem.detect() first, before building a model or creating arrays") from None
        raise


def _wait_for(address: str, timeout: float, rank: int) -> None:
    """Waits until the coordinator at `address` accepts connections, at most `timeout` s."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"process {rank}: the coordinator {address} did not answer within "
                    f"{timeout:g} s ({error.strerror or error}); start process 0 "
                    f"({PROCESS_ID}=0) with the same {COORDINATOR}, on the host that address "
                    "names") from None
            time.sleep(0.5)


class OneDevice:
    """The strategy of a runtime of one JAX device in one process: no `keras.distribution` is
    installed, and Keras places everything on JAX's default device, as it does by itself."""

    def __init__(self, device: jax.Device):
        self.device = device

    def scope(self):
        """Nothing to enter: variables go to JAX's default device, which is `device`."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"OneDevice({self.device})"


class ProcessDataParallel(keras.distribution.DataParallel):
    """Keras's `DataParallel`, which also takes a dataset already split by process as it is.

    With several processes Keras gives each process its rows of every global batch, so every
    process reads all the data. A dataset whose tf.data auto-shard policy is OFF (as
    `tfmem.image_dataset` makes them under this distribution) already holds this process's
    part, batched by `global batch ÷ processes`: it is used as it is, as `tf.distribute` uses
    such a dataset.
    """

    def distribute_dataset(self, dataset):
        if split_by_process(dataset):
            return dataset
        return super().distribute_dataset(dataset)


def _splits_by_process() -> bool:
    """Several processes, under the distribution that takes datasets split by process."""
    return jax.process_count() > 1 and isinstance(keras.distribution.distribution(),
                                                  ProcessDataParallel)


def split_by_process(dataset) -> bool:
    """Whether `dataset` holds only this process's part of each global batch."""
    if not _splits_by_process():
        return False
    options = getattr(dataset, "options", None)
    tf = sys.modules.get("tensorflow")
    if options is None or tf is None:
        return False
    policy = options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


def process_split() -> tuple[int, int] | None:
    """`(processes, index)` when a dataset made now may hold only this process's part."""
    return (jax.process_count(), jax.process_index()) if _splits_by_process() else None


class Processes:
    """This process among those of the run (JAX's distributed runtime): what `fit_resumable`
    needs to let one of them write and all of them read the same resume point."""

    @property
    def index(self) -> int:
        return jax.process_index()

    @property
    def count(self) -> int:
        return jax.process_count()

    def barrier(self, name: str) -> None:
        """Returns when every process has reached the barrier of this name."""
        if self.count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every process's `values`, by process index."""
        if self.count == 1:
            return [list(values)]
        import numpy as np
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(
            np.asarray(values, dtype=np.int32))).reshape(self.count, -1).tolist()

    def global_batch(self, batch_size: int, dataset) -> int:
        """The global batch of a dataset's batches of `batch_size` rows."""
        return batch_size * self.count if split_by_process(dataset) else batch_size


processes = Processes()


def detect(prefer: str | None = None, *, timeout: float = 300) -> Runtime:
    """Finds JAX's accelerators, installs data parallelism over them, returns a `Runtime`.

    With several processes (hosts), the environment says so (`JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or a TPU pod slice's own) and `detect()` starts
    JAX's distributed runtime before anything else; or call `jax.distributed.initialize`
    yourself before `detect()`.

    Args:
        prefer: `"tpu"`, `"gpu"` or `"cpu"` to use that kind of device; `None` takes JAX's
            default backend (TPU, then GPU, then CPU).
        timeout: seconds every process has to start, with several processes.

    Returns:
        A `Runtime` whose `strategy` is the installed `keras.distribution.DataParallel`, or,
        for one device of JAX's default kind in one process, `OneDevice` (nothing installed:
        Keras's single-device path, where the train step compiles once for the run).

    Raises:
        ValueError: `prefer` is not one of the kinds; the processes' variables are partial or
            not numbers.
        tfmem.runtime.UnavailableDeviceError: no device of the preferred kind is present.
        RuntimeError: the coordinator did not answer in time; JAX had already computed
            before `detect()` started its distributed runtime.

    Example:
        >>> import os; os.environ["KERAS_BACKEND"] = "jax"  # before importing keras
        >>> import tfmem
        >>> runtime = tfmem.detect()  # on a TPU v3-8: kind="tpu", num_replicas=8
        >>> runtime.global_batch_size(16, accumulation_steps=4)  # 16 × 8 × 4 = 512
    """
    if prefer not in (None, *KINDS):
        raise ValueError(f"`prefer` must be None, 'tpu', 'gpu' or 'cpu', got {prefer!r}.")
    _start_processes(timeout)
    try:
        found = jax.devices(prefer)
    except RuntimeError as error:
        raise UnavailableDeviceError(
            f"detect(prefer={prefer!r}) on the JAX backend found no {prefer} device: {error}. "
            f"JAX can use: {_available_kinds()}. Install JAX for the device "
            "(`pip install 'jax[tpu]'` on a TPU VM, `pip install 'jax[cuda12]'` for NVIDIA "
            "GPUs), or call detect() without `prefer`."
        ) from None
    if len(found) == 1 and jax.process_count() == 1 and found[0] == jax.devices()[0]:
        # One device, and the one JAX computes on anyway: Keras's own single-device path.
        # A DataParallel over one device hands a step's state back with its mesh's sharding
        # while a fresh state (the first step, metrics reset each epoch) has none, and JAX
        # compiles the train step again at every epoch.
        keras.distribution.set_distribution(None)
        strategy = OneDevice(found[0])
    else:
        strategy = ProcessDataParallel(devices=found)
        keras.distribution.set_distribution(strategy)
    runtime = _describe(found, strategy, num_replicas=len(found))
    logging.info(
        "tfmem: JAX backend, %d × %s (%s) over %d process(es), %s.",
        runtime.num_replicas,
        runtime.device_name,
        runtime.kind,
        runtime.num_workers,
        "one device" if isinstance(strategy, OneDevice) else "DataParallel installed",
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
        default = jax.devices()[0]
        return _describe([default], OneDevice(default), num_replicas=1)
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
    limit = (device.memory_stats() or {}).get("bytes_limit")  # none on a CPU
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
