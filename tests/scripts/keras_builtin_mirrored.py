"""Keras's built-in accumulation and this library's, under MirroredStrategy (2 logical CPUs).

Run: ``python -m tests.scripts.keras_builtin_mirrored``. The same linear
model, created in the strategy's scope, trains on 64 samples at the global
micro-batch 16 (8 per replica), 4 micro-steps per update:

- ``builtin``: Keras's ``SGD(0.1, gradient_accumulation_steps=4)``: the
  outcome, ``"trained"`` or the error (``Type: message``; keras-team/keras
  issue 20582: ``merge_call`` inside the update's conditional);
- ``library``: ``GradientAccumulateModel(accum_steps=4)`` with ``SGD(0.1)``.

Each that trains reports ``updates`` and ``diff``, the max |weight
difference| from plain Keras on one device at the batch 64. Prints one
results line (see ``tests/scripts/__init__.py``).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import max_abs_diff
from tests.scripts import print_results, split_cpu


def build(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return cls(inputs=inputs, outputs=keras.layers.Dense(1)(inputs), **kwargs)


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x[:, :1]
    reference = build()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=64, shuffle=False, verbose=0)

    def outcome(model):
        try:
            model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        except Exception as error:  # noqa: BLE001 - Keras's outcome is the finding
            return {"outcome": f"{type(error).__name__}: {error}"}
        return {
            "outcome": "trained",
            "updates": int(model.optimizer.iterations.numpy()),
            "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        }

    with strategy.scope():
        builtin = build()
        builtin.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
        library = build(GradientAccumulateModel, accum_steps=4)
        library.compile(keras.optimizers.SGD(0.1), "mse")
    print_results(
        {
            "replicas": strategy.num_replicas_in_sync,
            "builtin": outcome(builtin),
            "library": outcome(library),
        }
    )


if __name__ == "__main__":
    main()
