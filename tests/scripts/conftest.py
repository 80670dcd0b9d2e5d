"""Fixtures of the script tests: scripts/finetune.py run in the test's process."""

import importlib.util
import pathlib

import pytest
from absl import flags

import tfmem
from native_logs import without_native_logs

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"


@pytest.fixture(scope="session")
def finetune_module():
    """The script as a module, loaded once per process (absl defines its flags once)."""
    spec = importlib.util.spec_from_file_location("finetune_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    flags.FLAGS.unparse_flags()


@pytest.fixture()
def finetune_main(finetune_module):
    """The script's `main`, run in this process with parsed flags (no TensorFlow re-import)."""

    def run(*args):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["finetune.py", *tfmem.cli.underscore_flags(args)])
        return finetune_module.main([])

    return run


@pytest.fixture()
def finetune_cli(finetune_module, capfd):
    """The script as its command line runs it (`cli.run`), in this process: returns the exit
    status, stdout and stderr (the file descriptors': what TensorFlow prints is in them)."""

    def run(*args):
        flags.FLAGS.unparse_flags()
        capfd.readouterr()
        with pytest.raises(SystemExit) as exit_:
            tfmem.cli.run(finetune_module.main, ["finetune.py", *args])
        out, err = capfd.readouterr()
        # In this process TensorFlow's log lines can come from whatever ran before (a tf.data
        # thread of an earlier test); they are not the script's, whose own lines are checked.
        return exit_.value.code, out, "".join(without_native_logs(err))

    return run

