"""Runs several command lines of one program in one process, as the program's own process runs
each: `python cli_commands.py COMMANDS.json` with `[[program, argv], ...]`, where `program` is a
script's path (an absl program ending in `tfmem.cli.run(main)`) or `-m module`. Prints one JSON
line: each command's exit status and what it wrote to stderr. One process per absl program: two
programs' flags would clash in one."""

import contextlib
import importlib.util
import io
import json
import runpy
import sys

from absl import flags

from tfmem import cli


def _run(program: str, argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            if program.startswith("-m "):
                sys.argv = [program[3:], *argv]
                runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
            else:
                flags.FLAGS.unparse_flags()
                cli.run(_script(program).main, [program, *argv])
            status = 0
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, stderr.getvalue()


_SCRIPTS = {}


def _script(path: str):
    if path not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"script_{len(_SCRIPTS)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[path] = module
    return _SCRIPTS[path]


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        commands = json.load(file)
    print(json.dumps([_run(program, argv) for program, argv in commands]))
