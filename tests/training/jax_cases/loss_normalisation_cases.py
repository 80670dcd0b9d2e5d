"""AccumModel against keras.Model's whole-batch step for each loss case, on JAX: prints the
numbers test_accumulation_jax.py asserts (the cases: tests/training/loss_cases.py)."""

import common  # noqa: F401  (fixes the backend first)
from common import emit

from tests.training import loss_cases
from tfmem.training import placement


def in_graph_loop(name):
    """The case with the micro-batch loop inside the compiled step (a GPU's or TPU's path)."""
    placement.HOST_LOOP_PLATFORMS = ()
    try:
        return loss_cases.run(name)
    finally:
        placement.HOST_LOOP_PLATFORMS = ("cpu",)


emit({
    "host_loop": {name: loss_cases.run(name) for name in loss_cases.CASES},
    "in_graph_loop": {name: in_graph_loop(name) for name in ("add_loss", "two_outputs")},
    "keras_accumulation": {name: loss_cases.run(name, keras_accumulation=True)
                           for name in ("ignore_class", "mask_zero")},
})
