"""The package installs and imports as the README says, and fails helpfully without TensorFlow."""

import subprocess
import sys
import textwrap

import tfmem


def test_version_is_the_packaged_version():
    from importlib import metadata

    assert tfmem.__version__ == metadata.version("tfmem")


def test_import_without_tensorflow_names_the_extra_to_install():
    # A meta-path finder that refuses `tensorflow`, as if no TensorFlow were installed.
    program = textwrap.dedent(
        """
        import sys

        class NoTensorFlow:
            def find_spec(self, name, path=None, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, NoTensorFlow())
        try:
            import tfmem
        except ImportError as error:
            print(error)
            sys.exit(3)
        sys.exit(0)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    assert "tfmem[cpu]" in result.stdout
    assert "tfmem[tensorflow]" in result.stdout
    assert "No module named 'tensorflow'" in result.stdout
