"""Running tfmem's absl-flag scripts: hyphenated flags, and one line per error.

absl names flags with underscores; people (and our docs) write command-line options with
hyphens. `run(main)` rewrites `--some-flag[=value]` to `--some_flag[=value]` before parsing,
so both spellings reach the same flag. Every error ends the program with one line on stderr,
`error: <what happened>; <how to fix>`, and exit status 2 when the command line is wrong
(a flag's value, a combination of flags, a run directory made with other settings, a plan
over the memory budget) or 1 when the run fails (data, disk, another process); `--debug`
prints the traceback too. A warning is one line too, `warning: <what>`; those of other
libraries (Keras, TensorFlow) are shown when the program ends without an error, and with
`--debug` as they come.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence

from absl import app, flags

USAGE = 2
FAILURE = 1


class UsageError(ValueError):
    """The command line is wrong (exit status 2)."""


class Stopped(BaseException):
    """The program was asked to stop by a signal (SIGTERM): it ends with status 128 + that
    signal's number, as a program killed by it would, after one line saying so."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    del frame
    raise Stopped(signum)


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


def one_line(error: BaseException) -> str:
    """The message of `error` on one line, without TensorFlow's graph decorations."""
    text = getattr(error, "message", None) or str(error)
    marked = re.search(r"tfmem: (.*?)\]?\s*(\n|$)", text)  # a check inside a tf.data pipeline
    if marked and "{{" in text:
        text = marked.group(1)
    else:
        text = re.sub(r"\{\{[^}]*\}\}|\[\[.*?\]\]", "", text, flags=re.S)
        if type(error).__name__ == "MemoryPlanError":  # its breakdown table follows line 1
            text = text.split("\n")[0]
    text = " ".join(text.split())
    if type(error).__name__ == "ResourceExhaustedError":
        text += ("; the step needs more memory than the device has: lower --global-batch-size "
                 "or raise --accumulation-steps (scripts/plan.py shows what fits)")
    return text.removeprefix("tfmem: ") or type(error).__name__


def is_usage_error(error: BaseException) -> bool:
    """Errors that mean "change the command": flags, settings, a plan that does not fit."""
    return isinstance(error, (UsageError, flags.Error)) or type(error).__name__ in (
        "MemoryPlanError", "RunConfigError")


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Inside: a `ValueError` or `TypeError` comes from the flags' values, so it is a
    `UsageError` (exit status 2)."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, TypeError) as error:
        raise UsageError(one_line(error)) from error


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside: a warning prints as one line, `warning: <message>` (no source file and line)."""
    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = shown


def image_size(text, flag: str = "--image-size") -> tuple[int, int]:
    """`"224"` (or `224`) → `(224, 224)`, `"360,480"` (or `(360, 480)`) → `(360, 480)`
    (height, width); a `UsageError` naming `flag` otherwise."""
    if isinstance(text, (tuple, list)):
        text = ",".join(str(part) for part in text)
    parts = [part.strip() for part in str(text).split(",")]
    if len(parts) in (1, 2) and all(part.isdigit() and int(part) > 0 for part in parts):
        height, width = (int(part) for part in parts * (3 - len(parts)))
        return height, width
    raise UsageError(f"{flag} {text!r} is not a size: pass one number for square images "
                     f"({flag} 224) or height,width ({flag} 360,480)")


def image_size_text(size: tuple[int, int]) -> str:
    """`image_size`'s input for `(height, width)`: `"224"` for a square, else `"360,480"`."""
    height, width = size
    return str(height) if height == width else f"{height},{width}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _from_tfmem(category: type[Warning], filename: str) -> bool:
    """Whether a warning is tfmem's own (its class, or raised in its code): a line written for
    the user, shown as it comes."""
    return (category.__module__.split(".")[0] == "tfmem"
            or os.path.abspath(filename).startswith(_PACKAGE))


@contextlib.contextmanager
def held_warnings(hold: bool = True) -> Iterator[list[str]]:
    """Inside: the warnings of other libraries (Keras, TensorFlow, Python) are held, and shown
    when the block ends without an error, so that an error's one line is all that stderr
    holds then; tfmem's own warnings are shown as they come. `hold=False` (`--debug`): every
    warning is shown as it comes.

    Yields the held warnings as the lines they print as (what a failed run may pass on).
    """
    held: list[tuple] = []
    lines: list[str] = []
    with warnings.catch_warnings():  # restores the filters and `showwarning` on the way out
        show = warnings.showwarning

        def hold_or_show(message, category, filename, lineno, file=None, line=None):
            if not hold or _from_tfmem(category, filename):
                show(message, category, filename, lineno, file, line)
            else:
                held.append((message, category, filename, lineno))
                lines.append(warnings.formatwarning(message, category, filename, lineno))

        warnings.showwarning = hold_or_show
        try:
            yield lines
        except SystemExit as stop:
            if stop.code:  # an exit with an error status: as an error
                raise
            ended = stop
        else:
            ended = None
    for message, category, filename, lineno in held:
        warnings.showwarning(message, category, filename, lineno)
    if ended is not None:
        raise ended


def fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


def run(main: Callable[[list[str]], object], argv: Sequence[str] | None = None, *,
        when_stopped: str = "") -> None:
    """Parses the flags and runs `main`, turning any error into one line and an exit status.

    Hyphenated flag names are accepted; a positional argument is an error (a flag needs its
    `--name`); `--debug` shows the traceback of an error. SIGTERM and Ctrl-C end it with a
    line too (SIGTERM with status 143, as its default action would), `when_stopped` its end
    (e.g. how to resume).
    """
    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, "On an error, print its traceback too.")
    app.define_help_flags()
    argv = underscore_flags(sys.argv if argv is None else argv)
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as error:  # absl names the flag as defined: --global_batch_size=0
        text = re.sub(r"--(\w+)", lambda m: "--" + m.group(1).replace("_", "-"),
                      one_line(error))
        fail(f"{text}; see --helpshort for the flags", USAGE)
    if len(rest) > 1:
        fail(f"unexpected argument {rest[1]!r}: every option is a flag with its name, e.g. "
             f"--model={rest[1]}; see --helpshort for the flags", USAGE)
    after = f"; {when_stopped}" if when_stopped else ""
    handled = threading.current_thread() is threading.main_thread()
    if handled:  # raised where the program is, so that its `finally` blocks run
        shown = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        with one_line_warnings(), held_warnings(hold=not flags.FLAGS.debug):
            status = main(rest)
    except SystemExit:
        raise
    except Stopped as stop:
        fail(f"stopped by {stop}{after}", 128 + stop.signum)
    except KeyboardInterrupt:
        fail(f"interrupted{after}", FAILURE)
    except BaseException as error:  # every failure ends as one line (and its traceback)
        if flags.FLAGS.debug:
            traceback.print_exc()
        fail(one_line(error), USAGE if is_usage_error(error) else FAILURE)
    finally:
        if handled:
            signal.signal(signal.SIGTERM, shown)
    sys.exit(status or 0)
