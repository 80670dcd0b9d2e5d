"""`XLA_FLAGS` for the JAX processes the tests start.

XLA's CPU fusions emitted by its older emitters (`--xla_cpu_use_fusion_emitters=false`): the
same HLO passes and buffers (the memory analyses the tests assert on), about half the compile
time of the tests' tiny models. Only for JAX processes: TensorFlow's `jit_compile` rounds
differently with it, which the TensorFlow tests' references would see.
"""

import os

FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"


def jax_xla_flags(*extra: str) -> str:
    """This process's `XLA_FLAGS` (tests/conftest.py's), the fast-compile flag and `extra`."""
    return " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), FAST_COMPILE, *extra]))
