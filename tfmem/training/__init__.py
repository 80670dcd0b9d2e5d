"""Training: `AccumModel`, its per-backend train steps, and training that survives a kill.

`accumulation` holds `AccumModel`; `accumulation_tf` and `accumulation_jax` its train step on
each backend (`accumulation_math`: the arithmetic and loop state both share;
`micro_batches`: what both say about cutting a batch by rows; `placement`: where
the micro-batch loop runs under XLA, in the compiled step or on the host; `sparse_gradients`:
TensorFlow's gradients that are rows, kept as rows over a window); `resume` runs `fit`
so a killed process resumes where it stopped, from verified resume points; `run_directory`
locks a run's directory and records its settings; `progress` reports a whole run's progress
and its time left; `segmentation_losses` the per-image Dice losses.
"""

from tfmem._exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "AccumModel": "tfmem.training.accumulation",
    "DiceLoss": "tfmem.training.segmentation_losses",
    "fit_resumable": "tfmem.training.resume",
    "TrainingDivergedError": "tfmem.training.resume",
    "RunProgress": "tfmem.training.progress",
})
