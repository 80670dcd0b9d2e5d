"""The `rematerialize` setting as one type, parsed once from any form it is given in.

`RematSpec.parse` takes what `AccumModel(rematerialize=...)` and `tfmem.plan` accept: None,
"full", "auto", a list of layer names and `(first, last)` pairs of layer names, segments chosen
already (`Ranges`, or their saved config); `RematSpec.from_flag` the command line's
`--rematerialize` string. Callers ask the spec, never the form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Ranges:
    """Segments chosen already (by a plan: "auto", or what `finetune.py` trains with):
    `(path, ((start, stop), ...))` pairs, as `tfmem.remat.plan` describes."""

    ranges: tuple


_HOW = ('`rematerialize` must be None, "full", "auto", or a list of layer names and '
        "(first, last) layer pairs, got {value!r}; e.g. rematerialize=['block_3', "
        "('conv_4', 'add_4')] (model.summary() lists the names)")


@dataclasses.dataclass(frozen=True)
class RematSpec:
    """What is recomputed in the backward pass instead of kept.

    Attributes:
        mode: None (nothing), "full", "auto", "layers" (`layers`) or "chosen" (`chosen`).
        layers: layer names and `(first, last)` pairs of layer names, as given.
        chosen: segments chosen already, `Ranges.ranges`.
    """

    mode: str | None = None
    layers: tuple = ()
    chosen: tuple = ()

    @classmethod
    def parse(cls, value) -> RematSpec:
        """The spec of any accepted Python form (a spec is returned as it is).

        Raises:
            ValueError: a form that is none of them (saying which are).
        """
        if isinstance(value, RematSpec):
            return value
        if value is None:
            return cls()
        if isinstance(value, Ranges):
            return cls("chosen", chosen=_spans(value.ranges))
        if isinstance(value, str) and value in ("full", "auto"):
            return cls(value)
        if isinstance(value, dict) and set(value) == {"segments"}:  # a saved `config()`
            return cls("chosen", chosen=_spans(value["segments"]))
        items = ([_item(entry) for entry in value]
                 if isinstance(value, Sequence) and not isinstance(value, str) else [])
        if not items or None in items:
            raise ValueError(_HOW.format(value=value))
        return cls("layers", layers=tuple(items))

    @classmethod
    def from_flag(cls, flag: str | None) -> RematSpec:
        """`--rematerialize full`, `auto`, `none`, or `down0_dense, conv_4:add_4` (a layer
        name, or `first:last` for a range); an empty flag is nothing."""
        text = (flag or "").strip()
        if text in ("full", "auto"):
            return cls(text)
        if text.lower() == "none":
            return cls()
        items = []
        for entry in text.split(","):
            entry = entry.strip()
            if ":" in entry:
                pair = tuple(part.strip() for part in entry.split(":"))
                if len(pair) != 2 or not all(pair):
                    raise ValueError(
                        f"rematerialize: {entry!r} is neither a layer name nor a first:last "
                        "pair of layer names; write e.g. conv_4:add_4 (model.summary() lists "
                        "the names)")
                items.append(pair)
            elif entry:
                items.append(entry)
        return cls.parse(items) if items else cls()

    def __bool__(self) -> bool:
        return self.mode is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The plain layer names (each rematerialized as a whole layer)."""
        return tuple(item for item in self.layers if isinstance(item, str))

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The `(first, last)` pairs (each rematerialized as one segment)."""
        return tuple(item for item in self.layers if not isinstance(item, str))

    @property
    def cuts_segments(self) -> bool:
        """Whether it cuts a graph into segments ("full", "auto", pairs, chosen ones)."""
        return self.mode in ("full", "auto", "chosen") or bool(self.pairs)

    @property
    def value(self):
        """The Python form: None, "full", "auto", a tuple (pairs as tuples), or `Ranges`."""
        if self.mode == "layers":
            return self.layers
        if self.mode == "chosen":
            return Ranges(self.chosen)
        return self.mode

    def config(self):
        """As JSON (what `parse` reads back): the string, a list (pairs as lists), or
        `{"segments": ...}`."""
        if self.mode == "chosen":
            return {"segments": [[path, [list(span) for span in spans]]
                                 for path, spans in self.chosen]}
        if self.mode == "layers":
            return [item if isinstance(item, str) else list(item) for item in self.layers]
        return self.mode

    def __repr__(self) -> str:
        return repr(self.value)


def _spans(ranges) -> tuple:
    return tuple((path, tuple(tuple(span) for span in spans)) for path, spans in ranges)


def _item(entry):
    """A layer name or a `(first, last)` pair as a tuple; None for anything else."""
    if isinstance(entry, str) and entry:
        return entry
    if (isinstance(entry, (list, tuple)) and len(entry) == 2
            and all(isinstance(name, str) and name for name in entry)):
        return tuple(entry)
    return None
