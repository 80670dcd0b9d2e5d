"""Subclassed models as Keras users write them (keras.io's VAE, GAN-style pairs of sub-models),
on `tfmem.AccumModel` or on `keras.Model` alike: shared by the TensorFlow tests and the JAX cases
(tests/training/jax_cases/dropin_cases.py), so both backends check the same classes.
"""

import keras
import numpy as np

import tfmem


def sub_models(seed=0):
    """A tiny encoder (6 → 4) and decoder (4 → 3) with the same weights for every `seed`."""
    init = keras.initializers.GlorotUniform
    encoder = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
        4, activation="tanh", kernel_initializer=init(seed))], name="encoder")
    decoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_initializer=init(seed + 1))], name="decoder")
    return encoder, decoder


def pair_class(base):
    """`Pair(encoder, decoder, **kwargs)` on `base`: two positional sub-models, as keras.io's
    `VAE(encoder, decoder)`, with the `get_config`/`from_config` that saving it needs."""

    class Pair(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder

        def call(self, inputs):
            return self.decoder(self.encoder(inputs))

        def get_config(self):
            return {**super().get_config(),
                    "encoder": keras.saving.serialize_keras_object(self.encoder),
                    "decoder": keras.saving.serialize_keras_object(self.decoder)}

        @classmethod
        def from_config(cls, config):
            config = dict(config)
            encoder = keras.saving.deserialize_keras_object(config.pop("encoder"))
            decoder = keras.saving.deserialize_keras_object(config.pop("decoder"))
            return cls(encoder, decoder, **config)

    return Pair


def regularised_pair_class(base):
    """`Pair` whose own `compute_loss` adds a penalty on the encoder's output (as a VAE adds
    its KL term) to the reconstruction error: compiled without a loss."""

    class RegularisedPair(pair_class(base)):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            latent = self.encoder(x)
            return (keras.ops.mean(keras.ops.square(y_pred - y))
                    + 0.1 * keras.ops.mean(keras.ops.square(latent)))

    return RegularisedPair


def regression(num=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(num, 6)).astype("float32"),
            rng.normal(size=(num, 3)).astype("float32"))


def one_update(model, x, y, **compile_kwargs) -> list:
    """The change of each weight after one SGD step on the whole batch `x` (one fit batch)."""
    before = [np.asarray(w, np.float64) for w in model.get_weights()]
    model.compile(keras.optimizers.SGD(0.1), **compile_kwargs)
    extra = dict(check_memory=False) if isinstance(model, tfmem.AccumModel) else {}
    model.fit(x, y, batch_size=len(x), shuffle=False, verbose=0, **extra)
    return [np.asarray(w, np.float64) - w0 for w, w0 in zip(model.get_weights(), before)]


def relative_difference(updates, reference) -> float:
    """The largest difference of two updates, as a share of the reference's largest entry."""
    scale = max(float(np.max(np.abs(r))) for r in reference)
    return max(float(np.max(np.abs(u - r))) for u, r in zip(updates, reference)) / scale
