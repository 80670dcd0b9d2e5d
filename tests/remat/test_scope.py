"""Rematerialization's scope state is per thread (MirroredStrategy traces each replica in one)."""

import threading

from tfmem.remat import scope


def _asked_while_held(hold, ask) -> dict:
    """What `is_training_call()` says inside `hold(inside)` on one thread, and what `ask()`
    returns on another thread meanwhile."""
    entered, done = threading.Event(), threading.Event()
    seen = {}

    def inside():
        seen["holding"] = scope.is_training_call()
        entered.set()
        done.wait(30)

    holder = threading.Thread(target=hold, args=(inside,))
    holder.start()
    try:
        assert entered.wait(30)
        asker = threading.Thread(target=lambda: seen.update(asking=ask()))
        asker.start()
        asker.join(30)
    finally:
        done.set()
        holder.join(30)
    return seen


def _training_call(inside):
    """`inside()` run in a functional call given `training=True`."""
    return scope.recording_training(lambda x, training=None: inside())(1, training=True)


def _measuring(inside):
    with scope.measured_as_written():
        inside()


def test_measuring_as_written_on_one_thread_leaves_training_calls_on_another():
    seen = _asked_while_held(_measuring, lambda: _training_call(scope.is_training_call))
    assert seen == {"holding": False, "asking": True}


def test_a_training_call_on_one_thread_is_not_one_on_another():
    seen = _asked_while_held(_training_call, scope.is_training_call)
    assert seen == {"holding": True, "asking": False}
