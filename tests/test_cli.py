"""The scripts' shared plumbing: other libraries' warnings wait for the program's outcome;
image sizes as the flags spell them."""

import re
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


@pytest.mark.parametrize("text, size", [("224", (224, 224)), ("360,480", (360, 480)),
                                        (" 360 , 480", (360, 480))])
def test_an_image_size_is_read_and_spelled_back_as_the_flag_takes_it(text, size):
    assert cli.image_size(text) == size
    assert cli.image_size(list(size)) == size  # as JSON gives it back
    assert cli.image_size_text(size) == text.replace(" ", "")
    assert cli.image_size(cli.image_size_text(size)) == size


@pytest.mark.parametrize("text", ["0", "224,", "1,2,3", "a,b", "-5"])
def test_a_size_that_is_none_names_the_flag(text):
    with pytest.raises(cli.UsageError, match=rf"^--size '{re.escape(text)}' is not a size: "
                       r"pass one number for square images \(--size 224\)"):
        cli.image_size(text, flag="--size")
