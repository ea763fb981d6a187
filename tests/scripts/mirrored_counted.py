"""Cross-replica reductions counted as they run, under MirroredStrategy (2 logical CPUs).

Run: ``python -m tests.scripts.mirrored_counted``. The strategy's reductions
go through ``benchmarks._counting.CountingCrossDeviceOps``. Each
configuration trains one traced epoch, then a counted one: 64 samples at the
global micro-batch 16 (8 per replica), 4 micro-steps:

- ``plain_keras``: plain Keras at the micro-batch (4 steps);
- ``once_per_update``: ``GradientAccumulateModel(accum_steps=4)``;
- ``every_micro_step``: the same with ``reduce_every_micro_step=True``;
- ``sparse_once_per_update``: the Embedding model of ``tests.helpers``
  (sparse gradients) with ``accum_steps=4``: the update all-reduces the dense
  sum of the whole table.

Prints one results line (see ``tests/scripts/__init__.py``): per
configuration ``reductions`` and ``bytes`` (one replica's values) of the
counted epoch, ``updates`` in it, ``diff`` from plain Keras on one device at
the batch 64 after both epochs, and ``params`` (trainable parameters) of the
dense and the Embedding model.
"""

import keras
import numpy as np
import tensorflow as tf

from benchmarks._counting import CountingCrossDeviceOps
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import (
    build_dense,
    build_embedding,
    make_regression_data,
    make_token_data,
    max_abs_diff,
    train_big_batches,
)
from tests.scripts import print_results, split_cpu

CONFIGURATIONS = {
    "plain_keras": (build_dense, None),
    "once_per_update": (build_dense, {"accum_steps": 4}),
    "every_micro_step": (build_dense, {"accum_steps": 4, "reduce_every_micro_step": True}),
    "sparse_once_per_update": (build_embedding, {"accum_steps": 4}),
}


def adam():
    return keras.optimizers.Adam(0.01)


def parameters(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def main():
    devices = split_cpu(2)
    counter = CountingCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=counter)
    data = {
        build_dense: make_regression_data(num_samples=64),
        build_embedding: make_token_data(64, shard_size=8),
    }
    # The Embedding model's reference has its gradients densified, as the
    # wrapper hands Adam the dense sum (see tests.helpers.train_big_batches).
    references = {
        build: train_big_batches(
            build, adam, *xy, batch_size=64, epochs=2, densify=build is build_embedding
        )[0]
        for build, xy in data.items()
    }

    def counted():
        return int(counter.reductions.numpy()), int(counter.bytes.numpy())

    results = {}
    for name, (build, kwargs) in CONFIGURATIONS.items():
        x, y = data[build]
        with strategy.scope():
            model = build() if kwargs is None else build(GradientAccumulateModel, **kwargs)
            model.compile(adam(), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # traces
        before = counted()
        updates = int(model.optimizer.iterations.numpy())
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        after = counted()
        results[name] = {
            "reductions": after[0] - before[0],
            "bytes": after[1] - before[1],
            "updates": int(model.optimizer.iterations.numpy()) - updates,
            "diff": max_abs_diff(references[build].get_weights(), model.get_weights()),
        }
    params = {build.__name__: parameters(reference) for build, reference in references.items()}
    print_results({"params": params, "results": results})


if __name__ == "__main__":
    main()
