"""The layers and variables a rematerialized call runs with, as each backend's half reads them."""

from __future__ import annotations

import keras

from tfmem import _keras_internals as internals


class SegmentVariables:
    """The variables of a graph segment's layers, read as a layer's are."""

    def __init__(self, layers):
        names = [getattr(layer, "name", "?") for layer in layers]
        self.description = (f"the segment of layers {names[0]!r} to {names[-1]!r}"
                            if names else "an empty segment")
        self.layers = []  # the layers, and those inside them
        for layer in layers:
            if isinstance(layer, keras.layers.Layer):
                self.layers.extend([layer, *internals.flatten_layers(layer)])
        seen: set = set()
        self.trainable_variables, self.non_trainable_variables = [], []
        for layer in layers:
            for attribute in ("trainable_variables", "non_trainable_variables"):
                for variable in getattr(layer, attribute, []):
                    if id(variable) not in seen:
                        seen.add(id(variable))
                        getattr(self, attribute).append(variable)


def layers_within(segment) -> list[keras.layers.Layer]:
    """The layers a rematerialized call runs: a layer and those inside it, or a graph
    segment's (`SegmentVariables`)."""
    if isinstance(segment, SegmentVariables):
        return segment.layers
    return [segment, *internals.flatten_layers(segment)]
