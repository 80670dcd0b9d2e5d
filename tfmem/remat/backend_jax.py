"""Rematerialization on JAX: `jax.checkpoint` over a stateless call of the layer.

Keras's `keras.remat` lets BatchNormalization's state update escape `jax.checkpoint`
(`UnexpectedTracerError`). Here the layer's variables go in and its updated state comes out
as values, so the recomputation sees the forward pass's state, and the updates are assigned
once, after it.
"""

from __future__ import annotations

import jax

from tfmem import _keras_internals as internals
from tfmem.remat import scope
from tfmem.remat.variables import layers_within

# XLA's CPU scheduler runs each recomputation where it saves no memory (only time).
SAVES_ON_CPU = False


def rematerialized_call(layer, original):
    """The `call` of `layer` that `jax.checkpoint` runs again in the backward pass.

    `layer` is a layer, or a graph segment's `SegmentVariables` (its layers' variables)."""

    def call(*args, **kwargs):
        if internals.any_symbolic(args, kwargs) or not scope.is_training_call():
            return original(*args, **kwargs)
        variables = list(layer.trainable_variables) + list(layer.non_trainable_variables)
        values = [variable.value for variable in variables]
        owners = layers_within(layer)
        added: list = []  # the layer that added each loss, in the order they were added

        def pure(values, args):  # kwargs (training, mask) stay Python values
            with internals.stateless_scope(list(zip(variables, values)),
                                           collect_losses=True) as scope:
                outputs = original(*args, **kwargs)
            updated = [scope.get_current_value(variable) for variable in variables]
            added[:] = [_owner(loss, owners) for loss in scope.losses]
            return outputs, [new if new is not None else old
                             for new, old in zip(updated, values)], list(scope.losses)

        outputs, updated, losses = jax.checkpoint(pure)(values, args)
        for variable, old, new in zip(variables, values, updated):
            if new is not old:
                variable.assign(new)
        # The losses the layers added (activity regularizers, `add_loss`) are values of the
        # checkpoint: added again, by the same layers, where the call runs.
        for owner, loss in zip(added, losses):
            owner.add_loss(loss)
        return outputs

    return call


def weights_first(call):
    """`call` as it is: XLA orders the step's gradients itself (`backend_tf.weights_first`)."""
    return call


def _owner(loss, owners):
    """The layer of `owners` that added `loss` inside the checkpoint (and forgets it there)."""
    for owner in owners:
        ids = internals.loss_ids(owner)
        if id(loss) in ids:
            ids.discard(id(loss))
            return owner
    return owners[0]
