"""Training: `AccumModel`, its per-backend train steps, and training that survives a kill.

`accumulation` holds `AccumModel` and the TensorFlow step; `accumulation_jax` the same step
for `KERAS_BACKEND=jax`; `resume` runs `fit` so a killed process resumes where it stopped,
from verified resume points; `run_directory` locks a run's directory and records its
settings; `progress` reports a whole run's progress and its time left.
"""
