"""Where a call runs, as rematerialization asks it: per thread, as Keras keeps its call context
(`MirroredStrategy` traces each replica in its own thread)."""

from __future__ import annotations

import contextlib
import threading

from tfmem import _keras_internals as internals

# Per thread, innermost last: `training` of the functional calls now running (JAX's trainer
# calls a model through `stateless_call`, which runs `call` without Keras's call context);
# how a graph segment's calls run; whether the planner measures layers as written.
_STATE = threading.local()


def _stack(name: str) -> list:
    stack = getattr(_STATE, name, None)
    if stack is None:
        stack = []
        setattr(_STATE, name, stack)
    return stack


@contextlib.contextmanager
def _pushed(name: str, value):
    stack = _stack(name)
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def recording_training(call):
    """A functional model's `call` that records its `training` argument for its graph runner."""

    def recording(*args, **kwargs):
        training = kwargs.get("training", args[1] if len(args) > 1 else None)
        with _pushed("graph_training",
                     training if training is not None else internals.call_training()):
            return call(*args, **kwargs)

    return recording


def segment_calls(wrap):
    """Inside, a graph segment's calls run as `wrap(node, call)(*args, **kwargs)`."""
    return _pushed("segment_calls", wrap)


def segment_call(node, call):
    """`call` of `node` as the innermost `segment_calls` runs it (as it is outside one)."""
    wraps = _stack("segment_calls")
    return wraps[-1](node, call) if wraps else call


def measured_as_written():
    """Inside, rematerialized layers run as written: the planner measures what each keeps
    inside, and counts the rematerialization itself."""
    return _pushed("as_written", True)


def is_training_call() -> bool:
    """Whether the layer call now running is a training one to rematerialize (Keras's call
    context, else the `training` of the functional call running), and not one the planner
    measures as written."""
    training = internals.call_training()
    graph_training = _stack("graph_training")
    if training is None and graph_training:
        training = graph_training[-1]
    return not _stack("as_written") and bool(training)
