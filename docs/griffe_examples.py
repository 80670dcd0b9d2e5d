"""Griffe extension for the API reference: tfmem's `Example:` sections hold doctests.

Google style names the section `Example:` or `Examples:`; griffe parses only the plural as
examples (prose plus `>>>` sessions shown as Python console code) and renders the singular as
an admonition, where `>>>` reads as nested Markdown quotes. The docstrings keep their
spelling; the reference reads each `Example:` heading as `Examples:`.
"""

import re

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
