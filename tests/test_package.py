"""The package installs and imports as the README says, and fails helpfully without TensorFlow."""

import subprocess
import sys
import textwrap

import pytest

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
    assert "`pip install -e '.[cpu]'` in a checkout of tfmem" in result.stdout
    assert "`pip install -e '.[tensorflow]'`" in result.stdout
    assert "No module named 'tensorflow'" in result.stdout


def test_each_subpackage_exports_the_public_names_it_holds():
    import importlib
    import importlib.util

    # Every public name of tfmem lives in one subpackage; `import tfmem.<sub> as m; m.name`
    # reaches the same object as `tfmem.name`.
    holders = {}
    for name in sorted(set(tfmem.__all__) | set(tfmem._TENSORFLOW_NAMES)):
        value = getattr(tfmem, name)
        module = tfmem._TENSORFLOW_NAMES.get(name) or getattr(value, "__module__", "")
        module = module[0] if isinstance(module, tuple) else module
        parts = module.split(".")
        # tfmem.<subpackage>.<module>, unless the name is a module there too (tfmem.memory.probe)
        if (len(parts) > 2 and parts[0] == "tfmem"
                and importlib.util.find_spec(f"{'.'.join(parts[:2])}.{name}") is None):
            holders[name] = ".".join(parts[:2])
    assert {"psnr", "AccumModel", "plan", "Runtime", "image_dataset"} <= set(holders)
    for name, package in holders.items():
        subpackage = importlib.import_module(package)
        assert name in subpackage.__all__, (package, name)
        assert getattr(subpackage, name) is getattr(tfmem, name), (package, name)
        assert name in dir(subpackage)


def test_a_subpackage_name_works_as_the_top_level_one():
    import numpy as np

    import tfmem.metrics as tm

    clean = np.zeros((1, 8, 8, 1), "float32")
    noisy = clean + np.float32(0.1)
    # MSE 0.01 on a range of 1: PSNR = 10 log10(1 / 0.01) = 20 dB.
    np.testing.assert_allclose(np.asarray(tm.psnr(clean, noisy, data_range=(0, 1))), [20.0],
                               rtol=1e-5)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        tm.nonexistent  # noqa: B018


def test_every_extra_a_message_names_exists():
    import configparser
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    extras = set(config["options.extras_require"])
    sources = [*(root / "tfmem").rglob("*.py"), *(root / "scripts").glob("*.py")]
    named = set()
    for path in sources:
        text = path.read_text()
        named |= set(re.findall(r"install_command\(['\"](\w+)['\"]\)", text))
        named |= set(re.findall(r"'\.\[(\w+)\]'", text))
        assert "tfmem[" not in text, f"{path} names an extra as if tfmem were on an index"
    assert {"cpu", "tensorflow", "plot"} <= named <= extras
