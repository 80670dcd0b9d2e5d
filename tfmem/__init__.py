"""tfmem: train big Keras models without running out of memory.

The public API is re-exported here explicitly; everything else is private.
"""

from tfmem._version import __version__
from tfmem import _tf  # noqa: F401  (fails early, naming the extra to install)

# -- data: streaming TFRecord pipeline --

# -- accumulation: AccumModel --

# -- distribute / precision: Runtime --

# -- planner / probe: memory plan and guard --
from tfmem.planner import MemoryPlan, MemoryPlanError, plan  # noqa: E402
from tfmem.probe import probe  # noqa: E402

_PLANNER_API = ["MemoryPlan", "MemoryPlanError", "plan", "probe"]

# -- models / metrics --

__all__ = ["__version__"]
__all__ += _PLANNER_API
