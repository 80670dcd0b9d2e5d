"""tfmem: train big Keras models without running out of memory.

The public API is re-exported here explicitly; everything else is private.
"""

from tfmem._version import __version__
from tfmem import _tf  # noqa: F401  (fails early, naming the extra to install)

# -- data: streaming TFRecord pipeline --

# -- accumulation: AccumModel --
from tfmem.accumulation import AccumModel  # noqa: E402

# -- distribute / precision: Runtime --

# -- planner / probe: memory plan and guard --

# -- models / metrics --

__all__ = ["__version__"]
__all__ += ["AccumModel"]  # accumulation
