"""Running tfmem's absl-flag scripts: `--global-batch-size` and `--global_batch_size` both work.

absl names flags with underscores; people (and our docs) write command-line options with
hyphens. `run(main)` rewrites `--some-flag[=value]` to `--some_flag[=value]` before absl parses
the command line, so both spellings reach the same flag.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from absl import app


def underscore_flags(argv: Sequence[str]) -> list[str]:
    """`["prog", "--dry-run", "--data=a-b"]` → `["prog", "--dry_run", "--data=a-b"]`.

    Only the flag's name changes; values (after `=` or in the next argument) are kept, and
    everything after a bare `--` is left alone.
    """
    rewritten, passthrough = [], False
    for argument in argv:
        if passthrough or not argument.startswith("--") or argument == "--":
            passthrough = passthrough or argument == "--"
            rewritten.append(argument)
            continue
        name, equals, value = argument[2:].partition("=")
        rewritten.append("--" + name.replace("-", "_") + equals + value)
    return rewritten


def run(main: Callable[[list[str]], object]) -> None:
    """`absl.app.run(main)` on the command line with hyphenated flag names accepted."""
    app.run(main, argv=underscore_flags(sys.argv))
