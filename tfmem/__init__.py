"""tfmem: train big Keras models without running out of memory.

The public API is re-exported here explicitly; everything else is private. The TFRecord
pipeline (`tfmem.data`) needs TensorFlow, so its names are imported on first use: on
`KERAS_BACKEND=jax` tfmem imports and trains without TensorFlow, and using one of those names
without it raises an ImportError naming the extra that installs it.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

from tfmem._exports import lazy_exports
from tfmem._version import __version__

__all__ = ["__version__"]  # each section below adds its names with `__all__ += [...]`
# Imports Keras, and with it the backend: on the TensorFlow backend without TensorFlow, an
# ImportError naming the extra to install. TensorFlow's import banner is set aside.
from tfmem import _import_banner

with _import_banner.set_aside():
    from tfmem import backend

# -- data: streaming TFRecord pipeline (TensorFlow), imported on first use --
from tfmem.data import EXPORTS as _TENSORFLOW_NAMES  # imports no TensorFlow

if importlib.util.find_spec("tensorflow") is not None:
    # `from tfmem import *` takes what works here: the pipeline only where TensorFlow is.
    __all__ += list(_TENSORFLOW_NAMES)
if TYPE_CHECKING:  # the same names for type checkers and the API reference, never executed
    from tfmem.data.demo import CLASS_NAMES as DEMO_CLASS_NAMES
    from tfmem.data.demo import demo_examples, make_demo_dataset
    from tfmem.data.integrity import SkippedRecords
    from tfmem.data.manifest import Manifest, Shard, read_manifest
    from tfmem.data.options import ReaderOptions
    from tfmem.data.reader import (auto_shard_policy, count_records, image_dataset,
                                   inspect_tfrecords)
    from tfmem.data.schema import Schema, detect_schema
    from tfmem.data.tfds_data import tfds_image_dataset
    from tfmem.data.tfrecords import write_image_tfrecords

# -- accumulation: AccumModel --
from tfmem.training.accumulation import AccumModel
from tfmem.training.segmentation_losses import DiceLoss

__all__ += ["AccumModel", "DiceLoss"]

# -- distribute / precision: Runtime --
from tfmem.runtime.current import detect
from tfmem.runtime.runtime import Runtime
from tfmem.runtime.precision import policy_for, set_policy
from tfmem.runtime.report import describe
from tfmem.memory.plan_report import describe_split

__all__ += ["Runtime", "detect", "describe", "describe_split", "policy_for", "set_policy"]

# -- resume: training that survives a killed process --
from tfmem.training.progress import RunProgress
from tfmem.training.resume import TrainingDivergedError, fit_resumable

__all__ += ["fit_resumable", "RunProgress", "TrainingDivergedError"]

# -- planner / probe: memory plan and guard --
from tfmem.memory.planner import MemoryPlan, MemoryPlanError, plan
from tfmem.memory.probe import probe

__all__ += ["MemoryPlan", "MemoryPlanError", "plan", "probe"]

# -- models / metrics --
from tfmem import models
from tfmem.metrics.image import MAE, MSE, PSNR, SSIM, mae, mse, psnr, ssim
from tfmem.metrics.segmentation import MultiLabelIoU
from tfmem.models.tiling import predict_tiled

__all__ += ["models", "MAE", "MSE", "PSNR", "SSIM", "mae", "mse", "psnr", "ssim",
            "MultiLabelIoU", "predict_tiled"]


# A TFRecord-pipeline name is imported on first use (`tfmem._tf` names the extra if missing).
_, __getattr__, _ = lazy_exports(__name__, _TENSORFLOW_NAMES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TENSORFLOW_NAMES))
