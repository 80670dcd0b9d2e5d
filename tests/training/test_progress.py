"""RunProgress: a run's progress, resumed epochs included, as a terminal and a log show it."""

import io
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.training.progress import format_duration


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (95, "1m35s"),
                                           (3599, "59m59s"), (7260, "2h01m"), (-3, "0s")])
def test_durations_read_as_people_write_them(seconds, text):
    assert format_duration(seconds) == text


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(epoch):
    x = np.arange(32, dtype="float32").reshape(16, 2) / 32
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(2)


class _Stream(io.StringIO):
    def __init__(self, terminal):
        super().__init__()
        self.terminal = terminal

    def isatty(self):
        return self.terminal


def _fit(tmp_path, stream, epochs=2):
    progress = tfmem.RunProgress(epochs=epochs, steps_per_epoch=8, global_batch_size=2,
                                 micro_batch_size=1, accumulation_steps=2, stream=stream,
                                 estimate_after=3)
    tfmem.fit_resumable(_model(), _data, epochs=epochs, steps_per_epoch=8, backup_dir=tmp_path,
                        callbacks=[progress], verbose=0)
    return stream.getvalue()


def test_a_log_gets_an_estimate_then_one_line_per_epoch(tmp_path):
    lines = _fit(tmp_path, _Stream(terminal=False)).splitlines()
    assert len(lines) == 3 and "\r" not in "".join(lines)
    assert re.fullmatch(r"estimate: the run's 16 updates take about \d+s on this machine at "
                        r"[\d,]+ images/s \(\d+s from now\)", lines[0]), lines[0]
    for epoch, line in enumerate(lines[1:], start=1):
        assert re.fullmatch(rf"epoch {epoch}/2: loss [\d.]+; 8 updates in \d+s, global batch 2 = "
                            r"micro-batch 1 × 2 accumulation steps × 1 replica, [\d,]+ images/s, "
                            r"\d+s left for the run", line), line


def test_a_terminal_gets_a_live_line_and_a_resumed_run_counts_from_where_it_was(tmp_path):
    _fit(tmp_path, _Stream(terminal=False), epochs=1)  # epoch 1 done: the run resumes at 8
    text = _fit(tmp_path, _Stream(terminal=True), epochs=2)
    frames = [frame for frame in text.split("\r\x1b[2K") if frame]
    bars = [frame for frame in frames if frame.startswith("epoch 2/2 [")]
    assert bars, text
    for frame in bars:  # every redraw names the epoch's step, the batch and the run's time
        assert re.fullmatch(r"epoch 2/2 \[[#.]{20}\] [1-8]/8, loss [\d.]+, global batch 2 = "
                            r"micro-batch 1 × 2 accumulation steps × 1 replica, "
                            r"([\d,]+ images/s, \d+s left for the run|measuring speed)",
                            frame), frame
    # 8 updates left of 16 when the run restarted: the estimate is for the whole run.
    assert any(re.match(r"estimate: the run's 16 updates take about", f) for f in frames)
    assert frames[-1].startswith("epoch 2/2: loss ") and frames[-1].endswith("\n")
