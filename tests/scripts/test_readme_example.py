"""The README's Python example, taken from README.md and run as a user runs it, then once
more in the same folder after it finished."""

import os
import re
import subprocess
import sys

import keras
import numpy as np

import tfmem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = re.compile(r"training accuracy (\d\.\d{3}) after 2 epochs; model saved to "
                    r"runs/shapes/model.keras")


def _example() -> str:
    with open(os.path.join(ROOT, "README.md")) as file:
        readme = file.read()
    section = readme.split("## One example, end to end", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(folder):
    return subprocess.run([sys.executable, "example.py"], cwd=folder, env=dict(
        os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True,
        timeout=240)


def test_the_readme_example_runs_and_runs_again_when_done(tmp_path):
    # (That fit_resumable resumes after a kill -9: tests/training/test_resume.py, and
    # scripts/finetune.py's in tests/scripts/test_finetune.py.)
    (tmp_path / "example.py").write_text(_example())
    first = _run(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    accuracy = float(RESULT.search(first.stdout).group(1))
    assert accuracy > 0.9  # four classes: chance is 0.25
    manifest = tmp_path / "data" / "shapes" / "manifest.json"
    written = manifest.stat().st_mtime_ns

    again = _run(tmp_path)  # the same folder: the data and the finished run are reused
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from runs/shapes/backup" in again.stdout and "Epoch" not in again.stdout
    assert float(RESULT.search(again.stdout).group(1)) == accuracy  # the history it kept
    assert manifest.stat().st_mtime_ns == written
    model = keras.saving.load_model(tmp_path / "runs" / "shapes" / "model.keras")
    assert isinstance(model, tfmem.AccumModel)
    images = np.stack([image for image, _ in tfmem.demo_examples(8, image_size=32)])
    assert model.predict(images, verbose=0).shape == (8, 4)


def test_getting_started_shows_the_readme_example():
    with open(os.path.join(ROOT, "docs", "getting-started.md")) as file:
        page = file.read()
    assert f"```python\n{_example()}```" in page


def test_the_readme_is_one_screen_and_its_results_are_the_linked_pages():
    with open(os.path.join(ROOT, "README.md")) as file:
        readme = file.read()
    assert len(readme.splitlines()) <= 100
    assert "pip install tfmem" not in readme  # it installs from the repository
    results = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in results.splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 5
    for row in rows:
        _, result, details = [cell.strip() for cell in row.strip("|").split("|")]
        page = re.search(r"\]\((docs/[\w-]+\.md)#[\w-]+\)", details).group(1)
        with open(os.path.join(ROOT, page)) as file:
            text = file.read()
        for number in re.findall(r"\d+\.\d+|\d{3,}", result):  # each measured number
            assert number in text, f"README's {number!r} is not in {page}: {row}"
