"""Runtime: what the machine has and how to train on it.

`devices` is the table of known accelerators; `hardware` and `tpu` read what is attached
without starting a device; `distribute` (TensorFlow) and `distribute_jax` turn that into a
`Runtime` (replicas, memory per replica, scope); `precision` picks the dtype policy;
`report` prints the environment for a bug report (`tfmem-env`).
"""
