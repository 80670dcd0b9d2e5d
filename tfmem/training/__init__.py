"""Training: `AccumModel`, its per-backend train steps, and training that survives a kill.

`accumulation` holds `AccumModel`; `accumulation_tf` and `accumulation_jax` its train step on
each backend; `placement` decides where the micro-batch loop runs under XLA (in the compiled
step, or on the host); `resume` runs `fit` so a killed process resumes where it stopped.
"""
