"""Runtime: what the machine has and how to train on it.

`devices` is the table of known accelerators; `hardware` and `tpu` read what is attached
without starting a device; `distribute` (TensorFlow) and `distribute_jax` turn that into a
`Runtime` (replicas, memory per replica, scope); `precision` picks the dtype policy (and the dtype sums are kept in);
`report` prints the environment for a bug report (`tfmem-env`); `heap` fixes glibc's mmap
threshold, so that a CPU step's freed tensors leave the resident set.
"""

from tfmem._exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "Runtime": "tfmem.runtime.runtime",
    "detect": "tfmem.runtime.current",  # the backend's own half (distribute or distribute_jax)
    "policy_for": "tfmem.runtime.precision",
    "set_policy": "tfmem.runtime.precision",
    "describe": "tfmem.runtime.report",
    "fix_mmap_threshold": "tfmem.runtime.heap",
})
