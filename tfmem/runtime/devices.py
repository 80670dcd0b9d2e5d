"""Known accelerators and their memory per replica: the table behind `detect()` and `plan(device=...)`.

GPU figures are `nvidia-smi`'s totals; TPU figures are HBM per replica (a core on v2/v3, a
chip from v4 on); the CPU is not in the table (`host_available_memory()`). Used where the
device cannot be asked (TPUs on TensorFlow, planning for another machine).
"""

from __future__ import annotations

import dataclasses
import platform
import re

import psutil

_MIB = 1024**2
_GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One known accelerator configuration.

    Attributes:
        name: the short name used on command lines, e.g. `"v100-32gb"`, `"tpu-v3-8"`.
        kind: `"gpu"` or `"tpu"`.
        memory_per_replica: bytes of device memory one replica can use.
        num_replicas: replicas in this configuration (8 for a TPU v3-8, 1 for one GPU).
        description: what the table entry stands for, for printing.
        compute_capability: a GPU's CUDA compute capability (NVIDIA's table), None for TPUs.
        num_hosts: hosts (one process each) the replicas are spread over: 4 for a TPU v4-32.
    """

    name: str
    kind: str
    memory_per_replica: int
    num_replicas: int
    description: str
    compute_capability: tuple[int, int] | None = None
    num_hosts: int = 1


def _gpu(name: str, mib: int, capability: tuple[int, int], description: str) -> Accelerator:
    return Accelerator(name, "gpu", mib * _MIB, 1, description, capability)


def _tpu(name: str, gib_per_replica: int, num_replicas: int, description: str) -> Accelerator:
    family = name.rsplit("-", 1)[0]
    return Accelerator(name, "tpu", gib_per_replica * _GIB, num_replicas, description,
                       num_hosts=_tpu_hosts(family, num_replicas))


# Per Cloud TPU version: replicas per unit of the type's size (v2-v4 and v5p count TensorCores,
# a replica is a core on v2/v3 and a chip of 2 cores on v4/v5p; v5e/v6e count chips), replicas
# per host in a slice of several hosts, and the most replicas one host carries.
_TPU_FAMILIES: dict[str, tuple[float, int, int]] = {
    "tpu-v2": (1, 8, 8), "tpu-v3": (1, 8, 8), "tpu-v4": (0.5, 4, 4), "tpu-v5p": (0.5, 4, 4),
    "tpu-v5e": (1, 4, 8), "tpu-v6e": (1, 4, 8),
}


def _tpu_hosts(family: str, num_replicas: int) -> int:
    _, per_host, one_host = _TPU_FAMILIES[family]
    return 1 if num_replicas <= one_host else -(-num_replicas // per_host)


ACCELERATORS: dict[str, Accelerator] = {
    accelerator.name: accelerator
    for accelerator in [
        _gpu("k80", 11441, (3, 7), "NVIDIA Tesla K80 (one of its two GPUs), 12 GB"),
        _gpu("p100", 16280, (6, 0), "NVIDIA Tesla P100 16 GB (Kaggle 'GPU P100')"),
        _gpu("t4", 15360, (7, 5), "NVIDIA T4 16 GB (Colab/Kaggle 'T4')"),
        _gpu("v100-16gb", 16160, (7, 0), "NVIDIA V100 16 GB"),
        _gpu("v100-32gb", 32510, (7, 0), "NVIDIA V100 32 GB"),
        _gpu("l4", 23034, (8, 9), "NVIDIA L4 24 GB (Colab 'L4')"),
        _gpu("a100-40gb", 40960, (8, 0), "NVIDIA A100 40 GB"),
        _gpu("a100-80gb", 81920, (8, 0), "NVIDIA A100 80 GB"),
        _gpu("h100", 81559, (9, 0), "NVIDIA H100 80 GB"),
        _gpu("h200", 143771, (9, 0), "NVIDIA H200 141 GB"),
        _tpu("tpu-v2-8", 8, 8, "TPU v2-8: 8 cores × 8 GiB HBM (Colab's legacy TPU)"),
        _tpu("tpu-v3-8", 16, 8, "TPU v3-8: 8 cores × 16 GiB HBM (Kaggle 'TPU v3-8')"),
        _tpu("tpu-v4-8", 32, 4, "TPU v4-8: 4 chips × 32 GiB HBM"),
        _tpu("tpu-v4-32", 32, 16, "TPU v4-32: 16 chips × 32 GiB HBM on 4 hosts"),
        _tpu("tpu-v5e-1", 16, 1, "TPU v5e-1: 1 chip × 16 GiB HBM (Colab 'v5e-1')"),
        _tpu("tpu-v5e-8", 16, 8, "TPU v5e-8: 8 chips × 16 GiB HBM (Kaggle 'TPU v5e-8')"),
        _tpu("tpu-v5e-16", 16, 16, "TPU v5e-16: 16 chips × 16 GiB HBM on 4 hosts"),
        _tpu("tpu-v5p-8", 95, 4, "TPU v5p-8: 4 chips × 95 GiB HBM"),
        _tpu("tpu-v6e-1", 32, 1, "TPU v6e-1: 1 chip × 32 GiB HBM (Colab 'v6e-1')"),
        _tpu("tpu-v6e-8", 32, 8, "TPU v6e-8: 8 chips × 32 GiB HBM"),
    ]
}

# How the frameworks name devices (TF's `get_device_details(...)["device_name"]`, JAX's
# `device.device_kind`), matched case-insensitively, most specific pattern first.
# The GB figure in an NVIDIA name ("A100-SXM4-80GB") decides between memory variants.
_DEVICE_KIND_PATTERNS: list[tuple[str, str]] = [
    (r"a100.*80\s*gb", "a100-80gb"),
    (r"a100", "a100-40gb"),
    (r"h100", "h100"),
    (r"h200", "h200"),
    (r"v100.*32\s*gb", "v100-32gb"),
    (r"v100", "v100-16gb"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"p100", "p100"),
    (r"k80", "k80"),
    (r"tpu v2", "tpu-v2-8"),
    (r"tpu v3", "tpu-v3-8"),
    (r"tpu v4", "tpu-v4-8"),
    (r"tpu v5 lite|tpu v5e", "tpu-v5e-8"),
    (r"tpu v5p|tpu v5$", "tpu-v5p-8"),
    (r"tpu v6 lite|tpu v6e", "tpu-v6e-8"),
]


# Cloud TPU accelerator types, as TPU VMs put them in `TPU_ACCELERATOR_TYPE` ("v3-8",
# "v5litepod-8", "v6e-1"): version, an optional variant, and the TensorCore (v2-v4, v5p) or
# chip (v5e, v6e) count. Memory per replica is the same for every size of one version, so an
# unlisted size ("v5litepod-4", "tpu-v4-64") is its version's entry with its own replicas and
# hosts.
_TPU_ACCELERATOR_TYPE = re.compile(
    r"^(tpu-)?v(?P<version>[2-6])(?P<variant>litepod|lite|e|p)?-(?P<size>\d+)$"
)
_TPU_VARIANTS = {None: "", "p": "p", "e": "e", "lite": "e", "litepod": "e"}


def _from_tpu_accelerator_type(key: str) -> Accelerator | None:
    match = _TPU_ACCELERATOR_TYPE.match(key)
    if match is None:
        return None
    family = f"tpu-v{match['version']}{_TPU_VARIANTS[match['variant']]}"
    exact = f"{family}-{match['size']}"
    if exact in ACCELERATORS:
        return ACCELERATORS[exact]
    same_family = [a for a in ACCELERATORS.values() if a.name.rsplit("-", 1)[0] == family]
    if not same_family or family not in _TPU_FAMILIES:
        return None
    replicas = int(int(match["size"]) * _TPU_FAMILIES[family][0])
    if replicas < 1:
        return None
    base = same_family[0]
    hosts = _tpu_hosts(family, replicas)
    return dataclasses.replace(
        base, name=exact, num_replicas=replicas, num_hosts=hosts,
        description=f"{exact.upper().replace('TPU-', 'TPU ')}: {replicas} × "
                    f"{base.memory_per_replica // _GIB} GiB HBM"
                    + (f" on {hosts} hosts" if hosts > 1 else ""))


def by_name(name: str) -> Accelerator:
    """The table entry a person names: a key of `ACCELERATORS` or a Cloud TPU accelerator
    type (`"v3-8"`, `"v5litepod-16"`), nothing approximate (`lookup` reads the frameworks'
    device names, which vary).

    Raises:
        ValueError: any other name; the message lists the known ones.

    Example:
        >>> by_name("v100-32gb").name
        'v100-32gb'
    """
    key = str(name).strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    accelerator_type = _from_tpu_accelerator_type(key)
    if accelerator_type is not None:
        return accelerator_type
    raise ValueError(
        f"{name!r} is not a known accelerator; known names: {', '.join(ACCELERATORS)}, "
        "'cpu' (this host's RAM), or a Cloud TPU type such as v5litepod-16")


def lookup(name: str) -> Accelerator:
    """Returns the table entry for a command-line name or a framework's device name.

    Args:
        name: a key of `ACCELERATORS` (`"t4"`, `"tpu-v3-8"`, …), a device name as TensorFlow
            or JAX report it (`"Tesla T4"`, `"NVIDIA A100-SXM4-80GB"`, `"TPU v3"`), or a Cloud
            TPU accelerator type as in `TPU_ACCELERATOR_TYPE` (`"v3-8"`, `"v5litepod-8"`).

    Raises:
        ValueError: the name matches no known accelerator; the message lists the valid names.

    Example:
        >>> lookup("v100-32gb").memory_per_replica / 2**30
        31.748046875
    """
    key = name.strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    accelerator_type = _from_tpu_accelerator_type(key)
    if accelerator_type is not None:
        return accelerator_type
    for pattern, table_name in _DEVICE_KIND_PATTERNS:
        if re.search(pattern, key):
            return ACCELERATORS[table_name]
    raise ValueError(
        f"Unknown accelerator {name!r}. Known names: {', '.join(ACCELERATORS)} "
        "(or 'cpu' for this host's RAM where a device is asked for)."
    )


def resident_bytes(pid: int | str = "self") -> int | None:
    """Resident set of a process in bytes (psutil, on Linux, macOS and Windows); None when the
    process is gone or cannot be read.

    Example:
        >>> resident_bytes() > 0   # this process
        True
    """
    try:
        return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss
    except (psutil.Error, OSError, ValueError):
        return None


def host_available_memory() -> int:
    """Bytes of RAM available to a new process on this host, without swapping (psutil's
    `available`: Linux `MemAvailable`, and what macOS and Windows count as free to use)."""
    return int(psutil.virtual_memory().available)


def host_memory_for_process() -> int:
    """Bytes this process may grow to on this host: what it holds now plus what is available.

    The memory of a CPU "device": a plan counts the whole process (the framework's import
    included), and the part of it already resident is not in `host_available_memory()`.
    """
    return host_available_memory() + (resident_bytes() or 0)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo), or what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"
