"""Rematerialization on TensorFlow: `tf.recompute_grad`, with the forward pass's state.

`tf.recompute_grad` runs the layer again when the gradient is taken; Keras's own `keras.remat`
lets that second run update BatchNormalization's statistics again and advance the Dropout
seeds. Here the second run reads the state the first one saw and its updates are dropped.
"""

from __future__ import annotations

import tensorflow as tf

from tfmem import _keras_internals as internals
from tfmem.training import remat


def rematerialized_call(layer, original):
    """The `call` of `layer` that `tf.recompute_grad` runs again in the backward pass."""

    def call(*args, **kwargs):
        if internals.any_symbolic(args, kwargs) or not remat.is_training_call():
            return original(*args, **kwargs)
        state = list(layer.non_trainable_variables)
        seen = [tf.identity(variable.value) for variable in state]  # before the forward pass
        flat = tf.nest.flatten(args)
        runs = []

        @tf.recompute_grad
        def run(*tensors):
            rebuilt = tf.nest.pack_sequence_as(args, list(tensors))
            if not runs:  # the forward pass: its updates are the step's
                runs.append("forward")
                return original(*rebuilt, **kwargs)
            runs.append("recomputed")
            with internals.stateless_scope(list(zip(state, seen))):
                return original(*rebuilt, **kwargs)

        return run(*flat)

    return call
