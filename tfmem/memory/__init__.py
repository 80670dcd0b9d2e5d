"""Memory: the plan of a run before it starts, and the measurements that calibrate it.

`planner` adds params + grads + optimizer slots + batch × (data + activations), keeps it
under 80% of the device and picks micro-batch × k; `plan_report` formats it; `saved_tensors`
reads what the backward pass keeps per sample; `optimizer_state` sizes each optimizer's
slots; `probe` and `probe_jax` measure real steps.
"""
