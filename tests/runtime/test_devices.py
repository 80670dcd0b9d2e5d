"""The accelerator table: names, framework device names and memory figures."""

import pytest

from tfmem.runtime import devices
from tfmem.runtime.budget import budget_for
from tfmem.runtime.runtime import Runtime


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("Tesla P100-PCIE-16GB", "p100"),
        ("NVIDIA L4", "l4"),
        ("TPU v3", "tpu-v3-8"),
        ("TPU v5 lite", "tpu-v5e-8"),
        ("TPU v6 lite", "tpu-v6e-8"),
        ("tpu-v3-8", "tpu-v3-8"),
        ("V100-32GB", "v100-32gb"),
        ("NVIDIA H200", "h200"),
        # Cloud TPU accelerator types, as in TPU_ACCELERATOR_TYPE on TPU VMs.
        ("v2-8", "tpu-v2-8"),
        ("v3-8", "tpu-v3-8"),
        ("v4-8", "tpu-v4-8"),
        ("v5litepod-1", "tpu-v5e-1"),
        ("v5litepod-8", "tpu-v5e-8"),
        ("v5litepod-4", "tpu-v5e-4"),  # an unlisted size: its version's chip, its own count
        ("v4-32", "tpu-v4-32"),
        ("tpu-v4-64", "tpu-v4-64"),
        ("v5p-8", "tpu-v5p-8"),
        ("v6e-1", "tpu-v6e-1"),
        ("V6E-8", "tpu-v6e-8"),
    ],
)
def test_lookup_maps_framework_names_to_table_entries(device_name, expected):
    assert devices.lookup(device_name).name == expected


def test_memory_figures_are_per_replica_bytes():
    assert devices.lookup("t4").memory_per_replica == 15360 * 2**20
    assert devices.lookup("tpu-v3-8").memory_per_replica == 16 * 2**30
    assert devices.lookup("tpu-v3-8").num_replicas == 8
    assert devices.lookup("tpu-v2-8").memory_per_replica == 8 * 2**30
    assert devices.lookup("a100-80gb").memory_per_replica == 80 * 2**30


def test_tpu_accelerator_types_give_memory_per_replica():
    assert devices.lookup("v5litepod-4").memory_per_replica == 16 * 2**30
    assert devices.lookup("v6e-1").memory_per_replica == 32 * 2**30
    assert devices.lookup("v5p-8").memory_per_replica == 95 * 2**30
    with pytest.raises(ValueError, match="Unknown accelerator 'v9-8'"):
        devices.lookup("v9-8")


@pytest.mark.parametrize("name, replicas, hosts", [
    ("tpu-v4-8", 4, 1), ("tpu-v4-32", 16, 4), ("v4-64", 32, 8), ("v3-32", 32, 4),
    ("tpu-v5e-8", 8, 1), ("tpu-v5e-16", 16, 4), ("v5litepod-4", 4, 1), ("v5p-16", 8, 2),
    ("v6e-16", 16, 4),
])
def test_tpu_slices_know_their_chips_and_hosts(name, replicas, hosts):
    accelerator = devices.lookup(name)
    assert (accelerator.num_replicas, accelerator.num_hosts) == (replicas, hosts)
    runtime = Runtime.of_device(name)
    assert (runtime.num_replicas, runtime.num_workers, runtime.local_replicas) == (
        replicas, hosts, replicas // hosts)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown accelerator 'rtx-9090'.*v100-32gb.*tpu-v3-8"):
        devices.lookup("rtx-9090")


def test_host_available_memory_is_between_zero_and_total_ram():
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < devices.host_available_memory() <= total


@pytest.mark.parametrize("name", ["v100-64gb", "h100-unknown", "t4x", "tpu-v3"])
def test_a_name_a_person_gives_is_exact_or_refused(name):
    # The frameworks' names are matched by pattern (above); a person's name is not guessed.
    with pytest.raises(ValueError, match=rf"^'{name}' is not a known accelerator; known names: "
                                         r"k80, .*v100-16gb, v100-32gb, .*h100, h200, tpu-v2-8"):
        devices.by_name(name)
    with pytest.raises(ValueError, match=rf"^`device`: '{name}' is not a known accelerator"):
        budget_for(device=name)  # as plan(), guard() and probe() take it
    assert devices.by_name("V100-32GB").name == "v100-32gb"
    assert devices.by_name("v5litepod-16").num_replicas == 16
