"""The notebooks in colab/ run top to bottom on CPU (tiny settings), so they can't rot."""

import os
import pathlib
import re

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

import tfmem

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _execute(name: str, tmp_path: pathlib.Path, monkeypatch, **parameters
             ) -> nbformat.NotebookNode:
    """Runs colab/<name> in a fresh kernel with `parameters` overriding its parameters cell."""
    notebook = nbformat.read(ROOT / "colab" / name, as_version=4)
    cell = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += "\n" + "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    # The kernel inherits this environment: this checkout's tfmem, quiet TensorFlow logs.
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return notebook


def _text(notebook) -> str:
    return "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.get("outputs", []))


def test_finetune_notebook_trains_the_demo_above_chance(tmp_path, monkeypatch):
    # On its default backend, TensorFlow: the same calls on JAX (detect, plan, AccumModel.wrap,
    # image_dataset, fit_resumable) train on masks in tests/scripts/test_finetune.py's
    # test_multi_label_masks_from_an_rle_csv_train_with_dice_on_jax.
    notebook = _execute("finetune_tpu.ipynb", tmp_path, monkeypatch,
                        OUTPUT=str(tmp_path / "run"), EPOCHS=1)
    text = _text(notebook)
    assert "2048 training images, 4 classes" in text
    accuracy = float(re.search(r"validation accuracy ([\d.]+) \(chance 0\.250\)", text).group(1))
    assert accuracy > 0.6  # chance is 0.25: 32 updates on the demo learn it well above
    assert "total (peak per replica)" in text
    assert re.search(r"global batch 64 = micro-batch \d+ × \d+ accumulation steps? × 1 replica\n",
                     text)
    assert list((tmp_path / "run" / "backup").glob("backup-*.json"))  # resume points


def test_memory_planning_notebook_tabulates_devices_and_draws_the_budget(tmp_path, monkeypatch):
    notebook = _execute("memory_planning.ipynb", tmp_path, monkeypatch, MODEL="small-cnn", IMAGE_SIZE=32,
                        GLOBAL_BATCH_SIZE=64, DEVICES=["t4", "tpu-v3-8"])
    text = _text(notebook)
    assert re.search(r"small-cnn: [\d,]+ parameters", text)
    # T4: 15360 MiB → an 80% budget of 12.0 GiB; TPU v3 core: 16 GiB → 12.8 GiB.
    assert re.search(r"t4\s+15\.0G\s+12\.0G", text)
    assert re.search(r"tpu-v3-8\s+16\.0G\s+12\.8G", text)
    assert (tmp_path / "memory_vs_micro_batch.png").stat().st_size > 10_000


def test_segmentation_notebook_trains_a_unet_above_the_all_background_iou(tmp_path,
                                                                          monkeypatch):
    # 128 updates of 8 images of 16×16: the notebook's calls, in seconds. Training reads its
    # shards in whichever order they are ready, so the result varies from run to run; it takes
    # about 128 updates for the batch norms' moving statistics (momentum 0.99) to come near the
    # data's, and the held-out IoU to stay clear of the bound below whatever the order.
    notebook = _execute("segmentation.ipynb", tmp_path, monkeypatch,
                        OUTPUT=str(tmp_path / "run"), IMAGE_SIZE=16, NUM_EXAMPLES=1024,
                        VALIDATION_EXAMPLES=64, GLOBAL_BATCH_SIZE=8, LEARNING_RATE=3e-3,
                        EPOCHS=1)
    text = _text(notebook)
    assert ("1024 training images with masks, classes background, disk, square, triangle, plus, "
            "ignore value 255") in text
    assert re.search(r"global batch 8 = micro-batch \d+ × \d+ accumulation steps? × 1 replica\n",
                     text), text
    found = re.search(r"validation mean IoU ([\d.]+) \(predicting all background: ([\d.]+)\)",
                      text)
    assert found, text
    # Predicting background everywhere, by hand: the background's IoU is its share of the
    # pixels, each shape's is 0, and Keras's MeanIoU averages the classes present.
    masks = np.stack([mask for _, mask in tfmem.demo_examples(64, 16, seed=1,
                                                               task="segmentation")])
    background = (masks == 0).mean() / len(np.unique(masks))
    assert float(found.group(2)) == pytest.approx(background, abs=5e-4)
    assert float(found.group(1)) > background + 0.25, text
    assert (tmp_path / "prediction.png").stat().st_size > 5_000
    assert any("image/png" in output.get("data", {}) for cell in notebook.cells
               if cell.cell_type == "code" for output in cell.get("outputs", []))
