"""Rematerialization: activations recomputed in the backward pass instead of kept.

Owns the setting's type (`spec.RematSpec`), a graph's facts and where it is cut (`graph`,
`segments`, `plan`), the one graph the planner walks and `AccumModel` runs (`flat_graph`), the
runners (`runner`, per-thread `scope`) and each backend's half (`backend_tf`, `backend_jax`,
chosen in `runner`). It imports neither the planner (`tfmem.memory`) nor `AccumModel`
(`tfmem.training`): both call it.
"""
