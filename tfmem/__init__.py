"""tfmem: train big Keras models without running out of memory.

The public API is re-exported here explicitly; everything else is private.
"""

from tfmem._version import __version__

__all__ = ["__version__"]  # each section below adds its names with `__all__ += [...]`
from tfmem import _tf  # noqa: F401  (fails early, naming the extra to install)

# -- data: streaming TFRecord pipeline --

# -- accumulation: AccumModel --
from tfmem.accumulation import AccumModel

__all__ += ["AccumModel"]

# -- distribute / precision: Runtime --
from tfmem.distribute import Runtime, detect
from tfmem.precision import policy_for, set_policy
from tfmem.report import describe

__all__ += ["Runtime", "detect", "describe", "policy_for", "set_policy"]

# -- resume: training that survives a killed process --
from tfmem.resume import fit_resumable

__all__ += ["fit_resumable"]

# -- planner / probe: memory plan and guard --

# -- models / metrics --
