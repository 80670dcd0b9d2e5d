"""Memory: the plan of a run before it starts, and the measurements that calibrate it.

`guard` is the one path every training run takes: plan → check → choose k → warn. `planner`
adds params + grads + optimizer slots + batch × (data + activations) for the frozen
`plan_settings` and a budget (`tfmem.runtime.budget`), keeps it under 80% of the device and
picks micro-batch × k (`memory_plan` holds the result, `levers` what fits when nothing does,
`plan_report` prints it); `saved_tensors` reads what the backward
pass keeps per sample (`layer_rules` for Keras's layers, `gradient_trace` for everything
else); `optimizer_state` sizes optimizer slots; `probe` and `probe_jax` measure real steps.
"""

from tfmem._exports import lazy_exports

# `probe` is not among them: `tfmem.memory.probe` is the module (use `tfmem.probe`).
__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "MemoryPlan": "tfmem.memory.planner",
    "MemoryPlanError": "tfmem.memory.planner",
    "plan": "tfmem.memory.planner",
    "describe_split": "tfmem.memory.plan_report",
})
