"""micro_batch_size="auto" under MirroredStrategy (2 logical CPUs): the replicas switch together.

Run: ``python -m tests.scripts.mirrored_auto_micro_batch``. Prints one results
line (see ``tests/scripts/__init__.py``), per case (``every``: every replica
runs out of memory above 4 rows; ``one``: only replica 1 does):

- ``diff``: max |weight difference| from plain Keras at the global batch (32)
  on one device, after two epochs of 87 samples (the last batch, 23, split 12
  and 11 between the replicas); ``moved``: how far the reference moved;
- ``changes``: the micro-batch changes ``[update, old, new]`` (global);
- ``iterations`` and ``logged``: the updates, and ``micro_batch_size`` in ``History``;
- ``coupled``: the same for an in-batch softmax loss with
  ``coupled_loss="global"`` (every replica out of memory above 4 rows), against
  plain Keras at 32 on one device (SGD).

The replicas' shards differ: each batch's second half (replica 1's) is three
times the first's.
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import OutOfMemoryAbove, make_regression_data, max_abs_diff
from tests.scripts import REPLICAS, print_results, split_cpu

BATCH = 32


def in_batch_softmax(y_true, y_pred):
    """Each sample's query against every sample's key of the batch: the samples coupled."""
    queries, keys = y_pred[:, :2], y_pred[:, 2:]
    logits = tf.matmul(queries, keys, transpose_b=True)
    labels = tf.range(tf.shape(logits)[0])
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def build(cls=keras.Model, oom=None, outputs=1, loss="mse", optimizer=None, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    if oom is not None:
        hidden = oom(hidden)
    model = cls(inputs=inputs, outputs=keras.layers.Dense(outputs)(hidden), **kwargs)
    optimizer = optimizer or keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss=loss, metrics=["mae"])
    return model


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    x, y = make_regression_data(87, seed=5)
    halves = (np.arange(len(x)) % BATCH) >= BATCH // 2
    x[halves] *= 3.0
    reference = build()
    initial = reference.get_weights()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    results = {"moved": max_abs_diff(reference.get_weights(), initial)}
    for case, replica in (("every", None), ("one", 1)):
        with strategy.scope():
            model = build(
                GradientAccumulateModel,
                oom=OutOfMemoryAbove(4, replica=replica),
                micro_batch_size="auto",
            )
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        results[case] = {
            "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
            "changes": [[c.update, c.old, c.new] for c in model.micro_batch_changes],
            "iterations": int(model.optimizer.iterations.numpy()),
            "logged": history.history["micro_batch_size"],
        }
    # SGD: the keys' bias has a gradient of exactly 0 in exact arithmetic (a
    # shift of every key leaves the softmax as it was), which Adam would
    # turn into steps of about its learning rate from float32 noise.
    coupled = {"outputs": 4, "loss": in_batch_softmax}
    reference = build(**coupled, optimizer=keras.optimizers.SGD(0.1))
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = build(
            GradientAccumulateModel,
            oom=OutOfMemoryAbove(4),
            micro_batch_size="auto",
            coupled_loss="global",
            optimizer=keras.optimizers.SGD(0.1),
            **coupled,
        )
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    results["coupled"] = {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "changes": [[c.update, c.old, c.new] for c in model.micro_batch_changes],
        "iterations": int(model.optimizer.iterations.numpy()),
        "logged": history.history["micro_batch_size"],
    }
    print_results(results)


if __name__ == "__main__":
    main()
