"""Metrics: image-quality metrics (MAE, MSE, PSNR, SSIM) on the data's declared range."""
