"""average_batchnorm_statistics under MirroredStrategy (2 logical CPUs).

Run: ``python -m tests.scripts.mirrored_unsynchronized_bn``. Keras's
``BatchNormalization`` (not synchronized: each replica's copy follows its own
shard, at every micro-step) trains with momentum 0 inside a
``GradientAccumulateModel(average_batchnorm_statistics=False)`` on shards
whose means differ (replica 0 gets the first half of every global micro-batch
of 8, replica 1 the second half, shifted by 5); then
``average_batchnorm_statistics`` averages the replicas' moving means. Prints
one results line (see ``tests/scripts/__init__.py``): ``layers`` (averaged),
``before_gap`` / ``after_gap`` (max |difference| between the replicas' moving
means), ``after_vs_mean`` (from the mean of the two copies) and ``vs_global``
(from the mean of the last global micro-batch, samples 56-63).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator.distribute import average_batchnorm_statistics
from tests.scripts import print_results, split_cpu


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    x[np.arange(64) % 8 >= 4] += 5.0
    y = rng.normal(size=(64, 1)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        normalized = keras.layers.BatchNormalization(momentum=0.0, name="bn")(inputs)
        model = GradientAccumulateModel(
            accum_steps=2,
            average_batchnorm_statistics=False,
            inputs=inputs,
            outputs=keras.layers.Dense(1)(normalized),
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    bn = model.get_layer("bn")

    def copies():
        return [v.numpy() for v in strategy.experimental_local_results(bn.moving_mean.value)]

    per_replica = copies()
    averaged = average_batchnorm_statistics(model)
    after = copies()
    print_results(
        {
            "layers": averaged,
            "before_gap": float(np.abs(per_replica[0] - per_replica[1]).max()),
            "after_gap": float(np.abs(after[0] - after[1]).max()),
            "after_vs_mean": float(np.abs(after[0] - (per_replica[0] + per_replica[1]) / 2).max()),
            # Momentum 0 keeps only the last micro-step's statistics: each
            # copy its shard's of samples 56-63, their average the whole's.
            "vs_global": float(np.abs(after[0] - x[56:].mean(axis=0)).max()),
        }
    )


if __name__ == "__main__":
    main()
