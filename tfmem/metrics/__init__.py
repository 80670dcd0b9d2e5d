"""Metrics: image-quality metrics (MAE, MSE, PSNR, SSIM) on the data's declared range; the
IoU of multi-label masks (MultiLabelIoU)."""

from tfmem._exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    name: "tfmem.metrics.image"
    for name in ("MAE", "MSE", "PSNR", "SSIM", "mae", "mse", "psnr", "ssim")} | {
    "MultiLabelIoU": "tfmem.metrics.segmentation"})
