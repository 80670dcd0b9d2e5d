"""A subpackage's public names, imported from their modules on first use.

A subpackage's `__init__` lists its public names and the module each lives in; importing the
subpackage imports none of them (PEP 562 `__getattr__`), so a module never waits on a sibling
package's re-exports, and the TFRecord names ask for TensorFlow only when used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str | tuple[str, str]]
                 ) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`(__all__, __getattr__, __dir__)` for `package` re-exporting `exports`.

    Args:
        package: the subpackage's `__name__`.
        exports: public name -> the module that defines it, or `(module, name there)`.
    """
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = exports[name], name
        if isinstance(module, tuple):
            module, attribute = module
        value = getattr(importlib.import_module(module), attribute)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return list(exports), __getattr__, __dir__
