"""Runs command lines one after the other in one process, as the program's own process runs
each: `python cli_commands.py` reads one JSON `[program, argv]` a line from stdin, where
`program` is a script's path (an absl program ending in `tfmem.cli.run(main)`) or `-m module`,
and answers each with one JSON line `[exit status, stdout, stderr]` (what the command wrote to
sys.stdout and sys.stderr). At most one absl script per process: two programs' flags would
clash in one. What is written to file descriptor 1 from below Python goes to stderr, so that
the answers are the only lines on stdout."""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import sys

from absl import flags

from tfmem import cli


def _run(program: str, argv: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
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
    return status, stdout.getvalue(), stderr.getvalue()


_SCRIPTS = {}


def _script(path: str):
    if path not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"script_{len(_SCRIPTS)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[path] = module
    return _SCRIPTS[path]


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        program, argv = json.loads(line)
        answers.write(json.dumps(_run(program, argv)) + "\n")
        answers.flush()
