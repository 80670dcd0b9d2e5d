"""TensorFlow's import banner, set aside: the lines its native libraries print on every import.

TensorFlow 2.21 prints absl's "before InitializeLog" notice and the oneDNN notice to the
process's stderr (file descriptor 2) once per native library it loads, so twice per import, and
`TF_CPP_MIN_LOG_LEVEL` does not silence them. While tfmem imports Keras (and with it
TensorFlow), descriptor 2 goes to a temporary file; afterwards every line but those notices is
written back, so an import error or any other message still shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

_BANNER = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ (port|cpu_feature_guard)\.cc:\d+\] "
    r"|To enable the following instructions: ")


@contextlib.contextmanager
def set_aside():
    """Runs the body with TensorFlow's banner lines removed from what it prints on stderr."""
    if "tensorflow" in sys.modules:  # imported already: its banner is out
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no descriptor 2 to borrow
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _BANNER.match(line))
            if kept:
                os.write(2, kept.encode())
