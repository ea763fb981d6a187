"""Plain Keras ``fit`` and this library's under MultiWorkerMirroredStrategy.

Run on every worker of a cluster described by ``TF_CONFIG``:
``python -m tests.scripts.keras_fit_multi_worker`` (``tests.helpers.run_workers``
starts two on loopback). The same linear model, created in the strategy's
scope, trains on 32 samples at the global batch 8 (4 per worker):

- ``keras``: plain Keras ``fit`` (``SGD(0.1)``), ``keras_builtin``: with
  ``gradient_accumulation_steps=2``: the outcome, ``"trained"`` or the error
  (``Type: message``; keras-team/keras issue 20585: Keras reduces the first
  batch, a nested structure of per-replica values, to build the model);
- ``library``: ``GradientAccumulateModel(accum_steps=2)`` with ``SGD(0.1)``.

Each that trains reports ``updates`` and ``diff``: the max |weight difference|
from plain Keras on one device (no strategy) at the batch 8, or, for the
accumulating runs, at the batch 16. Prints one results line (see
``tests/scripts/__init__.py``).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import max_abs_diff
from tests.scripts import print_results


def build(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return cls(inputs=inputs, outputs=keras.layers.Dense(1)(inputs), **kwargs)


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x[:, :1]
    references = {}
    for batch_size in (8, 16):
        references[batch_size] = build()
        references[batch_size].compile(keras.optimizers.SGD(0.1), "mse")
        references[batch_size].fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)

    def outcome(model, reference):
        try:
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        except Exception as error:  # noqa: BLE001 - Keras's outcome is the finding
            return {"outcome": f"{type(error).__name__}: {error}"}
        return {
            "outcome": "trained",
            "updates": int(model.optimizer.iterations.numpy()),
            "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        }

    with strategy.scope():
        keras_plain = build()
        keras_plain.compile(keras.optimizers.SGD(0.1), "mse")
        keras_builtin = build()
        keras_builtin.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "mse")
        library = build(GradientAccumulateModel, accum_steps=2)
        library.compile(keras.optimizers.SGD(0.1), "mse")
    print_results(
        {
            "replicas": strategy.num_replicas_in_sync,
            "keras": outcome(keras_plain, references[8]),
            "keras_builtin": outcome(keras_builtin, references[16]),
            "library": outcome(library, references[16]),
        }
    )


if __name__ == "__main__":
    main()
