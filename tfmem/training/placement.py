"""Where `AccumModel` runs its micro-batch loop under XLA: inside the compiled step, or on the host.

XLA:CPU runs the gradient convolutions of a loop body (a JAX `scan`, TensorFlow's `while` under
`jit_compile=True`) tens of times slower than the same convolutions outside a loop: inside a
body it cannot choose the operands' layouts, and falls back to a generic convolution
(jax-ml/jax#12868). There the loop runs on the host instead, over one compiled micro-step that
adds into donated accumulators: the same arithmetic, one micro-batch of activations alive,
full speed. On GPUs and TPUs the loop stays inside the compiled step (docs/jax.md has the
measurements per platform).
"""

from __future__ import annotations

# Platforms (JAX's `Device.platform` names: "cpu", "gpu", "tpu") whose micro-batch loop runs
# on the host. Any other platform, including one tfmem does not know, keeps the in-graph loop.
HOST_LOOP_PLATFORMS = ("cpu",)


def loop_on_host(platform: str) -> bool:
    """Whether the micro-batch loop of a compiled step on `platform` runs on the host.

    Args:
        platform: "cpu", "gpu", "tpu" (JAX's `Device.platform`), or another plugin's name.

    Example:
        >>> loop_on_host("cpu"), loop_on_host("tpu")
        (True, False)
    """
    return platform.lower() in HOST_LOOP_PLATFORMS
