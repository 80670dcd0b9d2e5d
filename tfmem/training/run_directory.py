"""A run directory knows its run: one process at a time, and the settings it was started with.

`lock(directory)` holds an `fcntl.flock` on `directory/.lock` for as long as a run uses the
directory; the kernel drops it when the process ends, however it ends, so a killed run leaves
no stale lock. `check_config` records the run's settings in `run.json` the first time and,
on every later start, names each setting that differs instead of resuming a different run.
`run.json` also lists the names the run writes in the directory (`written`): tfmem deletes or
replaces nothing else there (`not_written`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: runs there are not locked
    fcntl = None

LOCK_FILE = ".lock"
CONFIG_FILE = "run.json"
WRITTEN = "written"  # the key of run.json that lists what the run writes in its directory


class RunDirectoryBusyError(RuntimeError):
    """Another live process holds the run directory."""


class RunConfigError(ValueError):
    """The run directory holds a run started with other settings.

    Attributes:
        differences: `{setting: (recorded value, value now)}`.
    """

    def __init__(self, message: str, differences: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.differences = differences


@contextlib.contextmanager
def lock(directory: str | os.PathLike, what: str = "directory") -> Iterator[None]:
    """Holds `directory` for this process; raises `RunDirectoryBusyError` if another has it.

    Args:
        directory: created if needed.
        what: how the error names the directory to the user (e.g. "--output").
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    if fcntl is None:
        yield
        return
    path = os.path.join(directory, LOCK_FILE)
    with open(path, "a+") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            raise RunDirectoryBusyError(
                f"another process (pid {holder}) is running in {directory}; wait for it to "
                f"end, or use another {what}") from None
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        try:
            yield
        finally:
            file.seek(0)
            file.truncate()
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)


def _same(recorded: Any, now: Any) -> bool:
    if isinstance(recorded, float) and isinstance(now, (int, float)):
        return math.isclose(recorded, now, rel_tol=1e-12, abs_tol=0.0)
    return recorded == now


def _normalised(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as JSON gives it back (tuples become lists), so that comparisons hold."""
    return json.loads(json.dumps(dict(config)))


def read_config(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The recorded `run.json` of `directory`, or None when there is none."""
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        try:
            return json.load(file)
        except json.JSONDecodeError:
            raise ValueError(f"{path} is damaged (not valid JSON); delete it, and the run's "
                             "resume point, to start the run again") from None


def is_run_record(recorded: Any) -> bool:
    """Whether a parsed `run.json` is one a tfmem run wrote (a user's file of that name is not)."""
    return isinstance(recorded, dict) and isinstance(recorded.get("config"), dict)


def not_written(directory: str | os.PathLike, names: Sequence[str]) -> list[str]:
    """Of `names`, those present in `directory` that no tfmem run wrote there.

    A name is the run's when the directory's `run.json` is a tfmem run's and lists it under
    `written` (a `run.json` without that list, of an earlier tfmem, owns every one of
    `names`). Without such a `run.json`, every present name is someone else's.
    """
    directory = os.fspath(directory)
    present = [name for name in names if os.path.lexists(os.path.join(directory, name))]
    if not present:
        return []
    recorded = read_config(directory)  # a damaged one stops here, naming it
    if not is_run_record(recorded):
        return present
    owned = {CONFIG_FILE, *recorded.get(WRITTEN, names)}
    return [name for name in present if name not in owned]


def written(directory: str | os.PathLike, names: Sequence[str]) -> list[str]:
    """Of `names`, those present in `directory` that a tfmem run wrote there (its `run.json`
    lists them): the only ones tfmem may delete or replace."""
    foreign = set(not_written(directory, names))
    directory = os.fspath(directory)
    return [name for name in names
            if os.path.lexists(os.path.join(directory, name)) and name not in foreign]


def check_writable(directory: str | os.PathLike, names: Sequence[str], *, what: str,
                   overwrite: str | None = None) -> None:
    """Before anything is written: `directory` is one (or can be made), can be written, and
    holds none of `names` unless a tfmem run wrote it there (`not_written`).

    Args:
        directory: the run directory.
        names: what the run writes in it.
        what: how the errors name the directory to the user (e.g. "--output").
        overwrite: the switch by which the user asked to discard the run there, if they
            did (e.g. "--overwrite"); the error says it does not discard these either.

    Raises:
        ValueError: a file is in the way, the directory cannot be written, or it holds
            files of `names` that no run wrote (all named; nothing is changed).
    """
    directory = os.fspath(directory)
    existing = os.path.abspath(directory)
    while not os.path.lexists(existing):  # the directory the run's directory is made in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "" if existing == os.path.abspath(directory) else f": {existing}"
        raise ValueError(f"{what} {directory}{where} is a file, not a directory; pass a "
                         "directory (it is made if it does not exist)")
    try:  # a read-only file system or directory, whoever runs this (root included)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{what} {directory}: cannot write in {existing} "
                         f"({error.strerror or error}); pass as {what} a directory you "
                         "can write to") from None
    foreign = not_written(directory, names) if os.path.isdir(directory) else []
    if foreign:
        also = f", {overwrite} included" if overwrite else ""
        raise ValueError(
            f"{what} {directory} holds {', '.join(foreign)}, which no tfmem run wrote there "
            f"(no run.json of a run lists them), and tfmem deletes or replaces only what its "
            f"runs wrote{also}; nothing was changed: use another {what}, or move them away")


def write_config(directory: str | os.PathLike, config: Mapping[str, Any]) -> None:
    """Writes `run.json` atomically (temporary file, fsync, rename)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CONFIG_FILE)
    temporary = os.path.join(directory, f".{CONFIG_FILE}.tmp-{os.getpid()}")
    with open(temporary, "w") as file:
        json.dump(dict(config), file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def check_config(directory: str | os.PathLike, config: Mapping[str, Any], *,
                 holds_run: bool, settings: Mapping[str, Any] | None = None,
                 how_to_fix: str, writes: Sequence[str] = ()) -> dict:
    """Records `config` in `directory`, or checks it against the one recorded there.

    Args:
        directory: the run directory.
        config: the settings that define the run (JSON values); keys recorded but absent
            here, or present here but not recorded, count as differences too.
        holds_run: whether the directory holds something of the recorded run (a resume
            point, results). If not, nothing can be mixed: `config` replaces the record
            (e.g. after a first attempt that stopped before its first resume point).
        settings: further entries stored beside `config` but never compared (e.g. the
            number of epochs, which a later start may raise to train on).
        how_to_fix: the end of the error, e.g. "use a new --output, or --overwrite".
        writes: the names the run writes in `directory`, listed in a new `run.json` (tfmem
            deletes or replaces only those).

    Returns:
        The recorded `run.json` (after this call).

    Raises:
        RunConfigError: a setting differs; the message names each one, recorded → now.
        ValueError: the directory's `run.json` is not a tfmem run's (it is left as it is).
    """
    config = _normalised(config)
    found = read_config(directory)
    if found is not None and not is_run_record(found):
        raise ValueError(
            f"{os.path.join(os.fspath(directory), CONFIG_FILE)} is not the record of a tfmem "
            "run, and tfmem replaces only files a run of its own wrote; move it away, or use "
            "another directory")
    recorded = found if holds_run else None
    if recorded is None:
        record = {"config": config, **({WRITTEN: sorted(set(writes) | {CONFIG_FILE})}
                                       if writes else {}), **_normalised(settings or {})}
        write_config(directory, record)
        return record
    before = recorded.get("config", {})
    differences = {key: (before.get(key), config.get(key))
                   for key in sorted(set(before) | set(config))
                   if not _same(before.get(key), config.get(key))}
    if differences:
        listed = ", ".join(f"{key} {old!r} → {new!r}" for key, (old, new) in differences.items())
        raise RunConfigError(
            f"{os.fspath(directory)} holds a run with other settings ({listed}); {how_to_fix}",
            differences)
    if settings:
        recorded = {**recorded, **_normalised(settings)}
        write_config(directory, recorded)
    return recorded
