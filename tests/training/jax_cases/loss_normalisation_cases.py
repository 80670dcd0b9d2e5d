"""AccumModel against keras.Model's whole-batch step for loss cases, on JAX (the cases:
tests/training/loss_cases.py); run inside accumulation_cases.py's program. The reductions whose
count does not vary are the same arithmetic on both backends and run on TensorFlow only."""

from tests.training import loss_cases
from tfmem.training import placement

HOST_LOOP = ("ignore_class", "mask_zero", "sample_weight:mean_with_sample_weight",
             "two_outputs", "add_loss", "scalar_loss")


def in_graph_loop(name):
    """The case with the micro-batch loop inside the compiled step (a GPU's or TPU's path)."""
    placement.HOST_LOOP_PLATFORMS = ()
    try:
        return loss_cases.run(name)
    finally:
        placement.HOST_LOOP_PLATFORMS = ("cpu",)


def results():
    return {
        "host_loop": {name: loss_cases.run(name)
                      for name in HOST_LOOP + loss_cases.SEGMENTATION_CASES},
        "in_graph_loop": {"two_outputs": in_graph_loop("two_outputs")},
    }
