"""The scripts' shared plumbing: other libraries' warnings wait for the program's outcome."""

import sys
import warnings

import pytest

from tfmem import cli
from tfmem.memory.guard import UnplannedRunWarning


def test_other_libraries_warnings_show_after_success_and_not_before_an_error(
        warnings_on_stderr, capsys):
    with cli.one_line_warnings():
        with cli.held_warnings():
            warnings.warn("another library's", UserWarning)
            warnings.warn("tfmem's own", UnplannedRunWarning)
            assert capsys.readouterr().err == "warning: tfmem's own\n"  # as it comes
        assert capsys.readouterr().err == "warning: another library's\n"  # at the end
        with pytest.raises(ValueError), cli.held_warnings() as held:
            warnings.warn("before an error", UserWarning)
            raise ValueError("the error")
        assert capsys.readouterr().err == "" and held == ["warning: before an error\n"]
        with cli.held_warnings(hold=False):  # --debug: as they come
            warnings.warn("with --debug", UserWarning)
            assert capsys.readouterr().err == "warning: with --debug\n"
        with pytest.raises(SystemExit), cli.held_warnings():  # exit status 0: a success
            warnings.warn("before exit 0", UserWarning)
            sys.exit(0)
        assert capsys.readouterr().err == "warning: before exit 0\n"
