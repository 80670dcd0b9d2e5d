"""tfmem: train big Keras models without running out of memory.

The public API is re-exported here explicitly; everything else is private.
"""

from tfmem._version import __version__

__all__ = ["__version__"]  # each section below adds its names with `__all__ += [...]`
from tfmem import _tf  # noqa: F401  (fails early, naming the extra to install)

# -- data: streaming TFRecord pipeline --
from tfmem.data.reader import (auto_shard_policy, count_records, image_dataset,
                               inspect_tfrecords)
from tfmem.data.demo import CLASS_NAMES as DEMO_CLASS_NAMES
from tfmem.data.demo import demo_examples, make_demo_dataset
from tfmem.data.manifest import Manifest, Shard, read_manifest
from tfmem.data.schema import Schema, detect_schema
from tfmem.data.tfds_data import tfds_image_dataset
from tfmem.data.tfrecords import write_image_tfrecords
from tfmem.data.options import ReaderOptions
from tfmem.data.integrity import SkippedRecords

__all__ += [
    "auto_shard_policy", "count_records", "image_dataset", "inspect_tfrecords",
    "DEMO_CLASS_NAMES", "demo_examples",
    "make_demo_dataset", "Manifest", "Shard", "read_manifest", "Schema", "detect_schema",
    "write_image_tfrecords", "tfds_image_dataset", "ReaderOptions", "SkippedRecords",
]

# -- accumulation: AccumModel --
from tfmem.training.accumulation import AccumModel

__all__ += ["AccumModel"]

# -- distribute / precision: Runtime --
from tfmem.backend import detect
from tfmem.runtime.runtime import Runtime
from tfmem.runtime.precision import policy_for, set_policy
from tfmem.runtime.report import describe

__all__ += ["Runtime", "detect", "describe", "policy_for", "set_policy"]

# -- resume: training that survives a killed process --
from tfmem.training.progress import RunProgress
from tfmem.training.resume import fit_resumable

__all__ += ["fit_resumable", "RunProgress"]

# -- planner / probe: memory plan and guard --
from tfmem.memory.planner import MemoryPlan, MemoryPlanError, plan
from tfmem.memory.probe import probe

__all__ += ["MemoryPlan", "MemoryPlanError", "plan", "probe"]

# -- models / metrics --
from tfmem import models
from tfmem.metrics.image import MAE, MSE, PSNR, SSIM, mae, mse, psnr, ssim

__all__ += ["models", "MAE", "MSE", "PSNR", "SSIM", "mae", "mse", "psnr", "ssim"]
