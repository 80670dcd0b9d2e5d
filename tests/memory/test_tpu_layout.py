"""XLA:TPU's tiles (`tfmem.memory.tpu_layout`) against the sizes of XLA:TPU's own buffer
assignment, and a plan whose padding is a step function of the micro-batch."""

import dataclasses
import math

import pytest

from tfmem.memory import tpu_layout
from tfmem.memory.memory_plan import MemoryPlan, Term, choose

MIB = 2**20


@pytest.mark.parametrize("shape, itemsize, allocated", [
    # Buffers of train steps XLA:TPU compiled (libtpu 0.0.42, TPU v5e), from their
    # buffer assignment: 24 channels on the lanes at micro-batch 8 ({3,0,2,1:T(8,128)})...
    ((8, 64, 64, 24), 4, 16 * MIB),
    ((8, 192, 192, 24), 2, 72 * MIB),
    # ... the batch on the lanes from 32 ({0,3,2,1:T(8,128)(2,1)}: 25165824 bytes) ...
    ((32, 64, 64, 24), 2, 24 * MIB),
    # ... and nothing padded where either fills them.
    ((1024, 32, 32, 32), 4, 128 * MIB),
    ((256, 32, 32, 128), 4, 128 * MIB),
])
def test_a_tensor_takes_what_xla_tpus_buffer_assignment_gives_it(shape, itemsize, allocated):
    assert tpu_layout.padded_elements(shape, itemsize) * itemsize == allocated


def test_the_padding_of_kept_tensors_is_counted_at_each_micro_batch():
    # One map of 16×16×24 float32 a sample: at micro-batch 8 the channels pad 24 → 128, at
    # 64 the batch pads 64 → 128 (the smaller of the two), at 128 nothing.
    sample = 16 * 16 * 24 * 4
    tensors = ((((16, 16, 24), 4), sample),)
    assert tpu_layout.padding_bytes(tensors, 8) == 8 * sample * (128 - 24) // 24
    assert tpu_layout.padding_bytes(tensors, 64) == 64 * sample
    assert tpu_layout.padding_bytes(tensors, 128) == 0


def _tpu_plan(**changes) -> MemoryPlan:
    fields = dict(
        model_name="m", num_parameters=1, num_trainable_parameters=1, optimizer="SGD",
        precision="float32", device="tpu-v5e-1", device_kind="tpu", num_replicas=1,
        memory_per_replica=2**30, safety=1.0, global_batch_size=256, parameter_bytes=0,
        gradient_bytes=0, optimizer_bytes=0, accumulation_bytes=0, mixed_precision_bytes=0,
        runtime_bytes=0, input_bytes_per_sample=0, activation_bytes_per_sample=4 * 24 * 1024,
        workspace_bytes_per_sample=24 * 1024, input_batches_in_flight=1,
        lane_tensors=((((16, 16, 24), 4), 4 * 24 * 1024),))
    return MemoryPlan(**{**fields, **changes})


def test_a_tpu_plan_shows_the_padding_and_chooses_by_it():
    plan = _tpu_plan()
    rows = plan.breakdown(8, 32)
    # The workspace (gradient maps of the same tensors) pads in the same proportion.
    assert rows[Term.LANE_PADDING] == 8 * 5 * 24 * 1024 * (128 - 24) // 24
    assert Term.LANE_PADDING not in dataclasses.replace(plan, lane_tensors=()).breakdown(8, 32)
    # Not a line: per sample, micro-batch 8 holds more than 128 does.
    assert plan.peak_bytes(8, 1) / 8 > plan.peak_bytes(128, 1) / 128
    # The largest plain step and the chosen split are those of trying every size.
    for budget in (2 * MIB, 20 * MIB, 50 * MIB, 300 * MIB):
        limited = dataclasses.replace(plan, memory_per_replica=budget)
        fitting = [b for b in range(1, 4096) if limited.peak_bytes(b, 1) <= budget]
        assert limited.max_micro_batch == max(fitting, default=0)
        chosen = choose(limited)
        dividing = [b for b in range(1, 257) if 256 % b == 0
                    and limited.peak_bytes(b, 256 // b) <= budget]
        assert chosen.micro_batch_size == max(dividing, default=0)
    assert math.isclose(plan.peak_bytes(128, 1), 128 * 5 * 24 * 1024)
