"""What JAX itself can say about memory: per-device allocator stats and a compiled step's plan.

Two readings the planner's probe (`tfmem/memory/probe.py`) uses on the Keras JAX backend:

- `device_memory_stats()`: the allocator counters of each local device (`bytes_in_use`,
  `peak_bytes_in_use`, `bytes_limit`, …) as `jax.Device.memory_stats()` reports them on GPUs
  and TPUs. CPU devices keep no such counters (there the probe measures process RSS instead).
- `compiled_step_memory(model, data)`: XLA's memory analysis of the model's jitted train step
  for one batch, before running it: argument, output, aliased (donated) and temporary bytes
  per device. Available on every platform, including CPU.
- `tpu_device(name)`: a TPU device of a generation of tfmem's device table, which
  `compiled_step_memory(..., device=)` compiles for ahead of time on a machine without a TPU
  (where the TPU compiler, libtpu, is installed).
- `gpu_device(name)`: the same for an NVIDIA GPU of the table, described to XLA's GPU
  compiler from the table's figures of the card (where JAX's CUDA plugin is installed; no GPU
  or driver needed).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import jax
import keras
import numpy as np
from keras import tree

from tfmem import _keras_internals as internals
from tfmem.runtime import devices


def device_memory_stats(device: jax.Device | None = None) -> dict[str, int]:
    """The allocator counters of one device, or `{}` where the platform keeps none (CPU).

    Args:
        device: a `jax.Device`; the first local device when omitted.

    Returns:
        JAX's `memory_stats()` dict, e.g. `{"bytes_in_use": …, "peak_bytes_in_use": …,
        "bytes_limit": …}` on a GPU or TPU.

    Example:
        >>> stats = device_memory_stats()
        >>> stats.get("peak_bytes_in_use")  # None on CPU
    """
    device = device if device is not None else jax.local_devices()[0]
    return dict(device.memory_stats() or {})


def peak_bytes_in_use() -> int | None:
    """The largest `peak_bytes_in_use` over this process's devices; `None` on CPU.

    JAX's counter covers the whole process lifetime (it cannot be reset), so read it in a fresh
    process that runs only the steps being measured, as `tfmem.probe` does.

    Example:
        >>> model.fit(x, y, batch_size=64, epochs=1)  # doctest: +SKIP
        >>> peak_bytes_in_use()  # bytes on the busiest GPU/TPU device
    """
    peaks = [device_memory_stats(d).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [peak for peak in peaks if peak is not None]
    return max(peaks) if peaks else None


# libtpu's name of a slice of one host of each TPU generation of tfmem's device table: a step
# is compiled for its first device.
_TPU_TOPOLOGIES = {"tpu-v2": "v2:2x2", "tpu-v3": "v3:2x2", "tpu-v4": "v4:2x2x1",
                   "tpu-v5e": "v5e:2x2", "tpu-v5p": "v5p:2x2x1", "tpu-v6e": "v6e:2x2"}
# What libtpu reads at start: this machine is no TPU host whose metadata server it would ask.
_NO_TPU_HOST = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def tpu_device(device: str) -> jax.Device:
    """A TPU device of `device`'s generation, to compile a step for ahead of time.

    On a TPU host of that generation, its first device. Elsewhere (a laptop, a GPU machine),
    a device of a TPU slice that XLA's TPU compiler describes without the hardware:
    `compiled_step_memory(model, batch, device=tpu_device("tpu-v5e-8"))` is then XLA:TPU's
    own figure of the step, per replica, on a machine that has no TPU. Nothing runs on it.
    This needs the TPU compiler, `libtpu`, at the version JAX's `tpu` extra pins; with it
    installed, JAX on a machine without a TPU says so once as it starts (set
    `JAX_PLATFORMS=cpu` to keep it quiet).

    Args:
        device: a TPU of tfmem's device table (`"tpu-v5e-8"`, `"tpu-v3-8"`) or a Cloud TPU
            type (`"v5litepod-16"`); only its generation matters.

    Raises:
        ValueError: `device` is no TPU of the table.
        ImportError: libtpu is not installed; the message gives the command that installs it.

    Example:
        >>> chip = tpu_device("tpu-v5e-8")  # doctest: +SKIP
        >>> compiled_step_memory(model, (x[:32], y[:32]), device=chip)["peak_bytes"]  # doctest: +SKIP
    """
    accelerator = _of_kind("tpu_device", device, "tpu")
    generation = accelerator.name.rsplit("-", 1)[0]
    local = [d for d in jax.devices() if d.platform == "tpu"]
    if local and _generation(local[0].device_kind) == generation:
        return local[0]  # this host's own TPU
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(f"tpu_device(device={device!r}) needs {compiler_needed('tpu')}")
    for name, value in _NO_TPU_HOST.items():
        os.environ.setdefault(name, value)
    from jax.experimental import topologies  # the TPU compiler is loaded only here

    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=_TPU_TOPOLOGIES[generation])
    return topology.devices[0]


# What XLA:GPU's compiler reads of a GPU it compiles for without one (its `GpuTargetConfig`):
# per GPU of the device table, multiprocessors, boost clock (GHz), memory bandwidth (GB/s)
# and L2 cache (MiB), NVIDIA's data sheets; per compute capability, the shared memory of a
# multiprocessor and the most one block may opt into (KiB), resident threads per
# multiprocessor, and FP32 units per multiprocessor (CUDA's programming guide).
_GPU_CARDS = {"p100": (56, 1.33, 732, 4), "t4": (40, 1.59, 320, 4),
              "v100-16gb": (80, 1.53, 900, 6), "v100-32gb": (80, 1.53, 900, 6),
              "l4": (58, 2.04, 300, 48), "a100-40gb": (108, 1.41, 1555, 40),
              "a100-80gb": (108, 1.41, 2039, 40), "h100": (132, 1.98, 3352, 50),
              "h200": (132, 1.98, 4800, 50)}
_GPU_CAPABILITIES = {(6, 0): (64, 48, 2048, 64), (7, 0): (96, 96, 2048, 64),
                     (7, 5): (64, 64, 1024, 64), (8, 0): (164, 163, 2048, 64),
                     (8, 9): (100, 99, 1536, 128), (9, 0): (228, 227, 2048, 128)}


# XLA:GPU's options for a step compiled without the card (`compiled_step_memory`), and the
# CUDA plugin's switch that skips its check of the driver at start (`gpu_device`).
_AHEAD_OF_TIME = {"xla_gpu_autotune_level": 0}
_NO_DRIVER_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def gpu_device(device: str) -> jax.Device:
    """An NVIDIA GPU of tfmem's device table, to compile a step for ahead of time.

    On a machine with that GPU, its first device. Elsewhere (a laptop, a TPU host), a device
    that XLA's GPU compiler describes from the table's figures of the card, without the
    hardware: `compiled_step_memory(model, batch, device=gpu_device("t4"))` is then
    XLA:GPU's own figure of the step on a machine that has no GPU. Nothing runs on it. This
    needs JAX's CUDA plugin and NVIDIA's libraries (`pip install "jax[cuda12]"`, a few
    gigabytes); no driver. Convolutions compile with their default algorithms (XLA:GPU
    picks among them by running them, which needs the card): set
    `XLA_FLAGS=--xla_gpu_autotune_level=0` on the GPU for the same figure there.

    Args:
        device: a GPU of tfmem's device table (`"t4"`, `"a100-80gb"`, `"h200"`).

    Raises:
        ValueError: `device` is no GPU of the table, or one JAX's CUDA plugin cannot
            compile for (compute capability below 6.0: a K80).
        ImportError: the CUDA plugin is not installed; the message gives the command.

    Example:
        >>> chip = gpu_device("t4")  # doctest: +SKIP
        >>> compiled_step_memory(model, (x[:32], y[:32]), device=chip)["peak_bytes"]  # doctest: +SKIP
    """
    accelerator = _of_kind("gpu_device", device, "gpu")
    if accelerator.name not in _GPU_CARDS:
        raise ValueError(f"gpu_device(device={device!r}): JAX's CUDA plugin compiles for "
                         "compute capability 6.0 and later; name a newer GPU, e.g. "
                         "device=\"t4\"")
    local = [d for d in jax.devices() if d.platform == "gpu"]
    for chip in local:
        try:
            if devices.lookup(chip.device_kind).name == accelerator.name:
                return chip  # this machine's own GPU
        except ValueError:  # a GPU the table does not know
            pass
    plugins = [name for name in _CUDA_PLUGINS if _installed(name)]
    if not plugins:
        raise ImportError(f"gpu_device(device={device!r}) needs {compiler_needed('gpu')}")
    from jax.experimental import topologies  # the CUDA plugin is loaded only here

    describe = functools.partial(topologies.get_topology_desc, platform="cuda",
                                 topology="1x1x1", target_config=_gpu_target(accelerator))
    try:
        return describe().devices[0]
    except NotImplementedError:  # the plugin stood down at start: no driver to check
        pass
    # Its check of the driver's CUDA version is what a machine without a GPU fails; a
    # compile reads no driver.
    checked = os.environ.get(_NO_DRIVER_CHECK)
    os.environ[_NO_DRIVER_CHECK] = "1"
    try:
        importlib.import_module(plugins[0]).initialize()
    finally:
        if checked is None:
            del os.environ[_NO_DRIVER_CHECK]
    return describe().devices[0]


def _installed(module: str) -> bool:
    """Whether `module` (of a package that may be missing itself) can be imported."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not installed
        return False


def _gpu_target(accelerator: devices.Accelerator) -> str:
    """XLA's `GpuTargetConfig` (text format) of a GPU of the table."""
    cores, clock, bandwidth, l2 = _GPU_CARDS[accelerator.name]
    major, minor = accelerator.compute_capability
    shared, opt_in, threads, fpus = _GPU_CAPABILITIES[(major, minor)]
    info = dict(threads_per_block_limit=1024, threads_per_warp=32,
                shared_memory_per_block=48 * 1024, shared_memory_per_core=shared * 1024,
                threads_per_core_limit=threads, core_count=cores, fpus_per_core=fpus,
                block_dim_limit_x=2**31 - 1, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=bandwidth * 10**9, l2_cache_size=l2 * 2**20,
                clock_rate_ghz=clock, device_memory_size=accelerator.memory_per_replica,
                shared_memory_per_block_optin=opt_in * 1024, registers_per_core_limit=65536,
                registers_per_block_limit=65536)
    fields = "".join(f"  {name}: {value}\n" for name, value in info.items())
    return (f"gpu_device_info {{\n{fields}  cuda_compute_capability {{ major: {major} "
            f"minor: {minor} }}\n}}\nplatform_name: \"CUDA\"\n"
            "dnn_version_info { major: 9 minor: 8 }\n"
            "runtime_version { major: 12 minor: 8 }\n"
            f"device_description_str: \"{accelerator.description}\"\n")


# Per kind: what a device of it is called in a message, and two of the device table to name.
_KINDS = {"tpu": ("TPU", ("tpu-v5e-8", "tpu-v3-8")), "gpu": ("GPU", ("t4", "a100-80gb"))}


def _of_kind(function: str, device: str, kind: str) -> devices.Accelerator:
    """The accelerator of the device table `device` names, refused (by `function`'s name)
    where it is none or of another kind (a TPU generation XLA:TPU does not describe too)."""
    try:
        accelerator = devices.by_name(device)
    except ValueError as error:
        raise ValueError(f"{function}(device={device!r}): {error}") from None
    known = (accelerator.name.rsplit("-", 1)[0] in _TPU_TOPOLOGIES if kind == "tpu" else True)
    if accelerator.kind != kind or not known:
        word, (first, second) = _KINDS[kind]
        raise ValueError(f"{function}(device={device!r}): {accelerator.description} is no "
                         f"{word}; name one, e.g. device=\"{first}\" or \"{second}\"")
    return accelerator


def compiler_needed(kind: str) -> str:
    """What compiling a step on this machine for a device of `kind` ("tpu", "gpu") needs,
    with the command that installs it (`tpu_device`, `gpu_device`)."""
    if kind == "gpu":
        return (f"JAX's CUDA plugin to compile for a GPU on this machine (no GPU or driver "
                f"needed): pip install \"jax[cuda12]=={jax.__version__}\"")
    return (f"the TPU compiler, libtpu, to compile for a TPU on this machine: pip install "
            f"\"jax[tpu]=={jax.__version__}\" (it pins the libtpu of this JAX)")


def _generation(device_kind: str) -> str | None:
    """The device table's TPU generation of a JAX device kind ("TPU v5 lite": "tpu-v5e")."""
    try:
        return devices.lookup(device_kind).name.rsplit("-", 1)[0]
    except ValueError:  # a TPU the table does not know yet
        return None


def compiled_step_memory(model: keras.Model, data, step=None,
                         device: jax.Device | None = None) -> dict[str, int]:
    """XLA's memory analysis of `model.train_step` compiled for one batch shaped like `data`.

    The step is lowered exactly as `fit` runs it: `jax.jit` with the state donated, and under
    a `keras.distribution` the batch sharded over its devices, so the numbers are per device.
    Nothing runs and no variable changes.

    Args:
        model: a compiled model that has been built for training (it has run `fit` or
            `train_on_batch` once, so its optimizer and metrics have their variables).
        data: one batch as `fit` sees it: `(x, y)` or `(x, y, sample_weight)`; arrays or
            `jax.ShapeDtypeStruct`s.
        step: the jitted step to compile (default: a new `jax.jit` of `model.train_step`).
            Its later calls with arguments laid out like these run the executable compiled
            here (JAX caches it in the jitted function).
        device: compile for this one device instead of where the state lives: e.g.
            `tpu_device("tpu-v5e-8")`, a TPU that XLA compiles for ahead of time on a
            machine without one (where `libtpu` is installed).

    Returns:
        `{"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
        "generated_code_bytes", "peak_bytes"}`, where `peak_bytes` = argument + output −
        alias + temp, XLA's own bound on what the step holds at once.

    Raises:
        ValueError: the model is not compiled, or its optimizer has no variables yet; or
            `device` under a `keras.distribution` (its mesh places the step).

    Example:
        >>> model.train_on_batch(x[:64], y[:64])  # doctest: +SKIP
        >>> compiled_step_memory(model, (x[:64], y[:64]))["peak_bytes"]
    """
    if not model.compiled:
        raise ValueError(
            "compiled_step_memory() needs a compiled model: call `model.compile(...)` first."
        )
    if not model.optimizer.built:
        raise ValueError(
            "The model's optimizer has no variables yet, so there is no train step to "
            "compile. Run one step first (`model.train_on_batch(x, y)` or a 1-step `fit`)."
        )
    abstract_state = tuple([abstract(value) for value in values]
                           for values in step_state(model))
    abstract_data = abstract_batch(data)
    if device is not None:
        if keras.distribution.distribution() is not None:
            raise ValueError("compiled_step_memory(): `device` places the whole step on one "
                             "device; under a keras.distribution its mesh places it, so leave "
                             "`device` out.")
        sharding = jax.sharding.SingleDeviceSharding(device)
        abstract_state, abstract_data = tree.map_structure(
            lambda value: None if value is None else jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=sharding), (abstract_state, abstract_data))
    if step is None:
        step = jax.jit(model.train_step, donate_argnums=0)
    lowered = step.lower(abstract_state, abstract_data)
    if device is None or device.platform != "gpu" or device in jax.devices():
        return memory_analysis(lowered.compile())
    # XLA:GPU without the card: convolutions and matrix products take their default
    # algorithms (choosing among them runs them); where a Triton product finds no default
    # tiling, the library's kernels instead.
    try:
        return memory_analysis(lowered.compile(compiler_options=_AHEAD_OF_TIME))
    except jax.errors.JaxRuntimeError:
        return memory_analysis(lowered.compile(
            compiler_options={**_AHEAD_OF_TIME, "xla_gpu_enable_triton_gemm": False}))


def step_state(model: keras.Model) -> tuple[list, list, list, list]:
    """The values a train step takes, as Keras's JAX trainer groups them: trainable,
    non-trainable, optimizer and metric variables. A variable never initialised (a model
    built under `tfmem.models.shapes_only`) is its shape and dtype alone, on no device yet, so
    that reading it makes no initial value."""
    def value(variable):
        if internals.is_initialized(variable):
            return variable.value
        return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype)

    return tuple([value(v) for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))


def memory_analysis(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled JAX program (`jax.jit(f).lower(...).compile()`).

    Returns:
        `{"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
        "generated_code_bytes", "peak_bytes"}` per device, `peak_bytes` = argument + output −
        alias + temp.
    """
    analysis = compiled.memory_analysis()
    sizes = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
        "generated_code_bytes": analysis.generated_code_size_in_bytes,
    }
    sizes["peak_bytes"] = (
        sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
    )
    return {name: int(value) for name, value in sizes.items()}


def abstract(value) -> jax.ShapeDtypeStruct:
    """The shape, dtype and sharding of a JAX array, to lower a program for it: an array not
    committed to its device has no sharding, as a call with it has none (so the call finds
    the program compiled for the shapes)."""
    committed = getattr(value, "committed", True)
    return jax.ShapeDtypeStruct(value.shape, value.dtype,
                                sharding=value.sharding if committed else None)


def placed(value, dtype=None) -> jax.ShapeDtypeStruct:
    """The shape, dtype (or `dtype`) and device(s) of an array (or `jax.ShapeDtypeStruct`) as
    a committed array would have them: what a program called with committed arrays is lowered
    for."""
    return jax.ShapeDtypeStruct(value.shape, dtype or value.dtype, sharding=value.sharding)


def abstract_batch(data):
    """A batch's leaves as `jax.ShapeDtypeStruct`s laid out as `fit` lays them out."""
    return tree.map_structure(_abstract_batch, data)


def _abstract_batch(value):
    """A batch leaf laid out as `fit` lays it out: sharded on the batch axis if distributed."""
    if value is None:
        return None
    shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    mesh = distribution.device_mesh.backend_mesh
    spec = jax.sharding.PartitionSpec(distribution.batch_dim_name)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

