"""TensorFlow's own C++ log lines on stderr ("I0000 ...", "E0000 ...", absl's preamble, the CPU
feature notice): printed by TensorFlow whatever the script does, so tests of a script's one-line
errors set them aside and check every other line."""

import re

NATIVE_LOG_LINE = r"WARNING: All log messages before absl|[IWE]\d{4} |To enable the"


def without_native_logs(stderr: str, also: str | None = None) -> list[str]:
    """The lines of `stderr` that are not TensorFlow's log lines (nor match `also`)."""
    pattern = NATIVE_LOG_LINE if also is None else f"{also}|{NATIVE_LOG_LINE}"
    return [line for line in stderr.splitlines(keepends=True) if not re.match(pattern, line)]
