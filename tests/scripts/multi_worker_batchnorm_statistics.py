"""BatchNormalization statistics across two workers (MultiWorkerMirroredStrategy).

Run as a cluster: ``tests.helpers.run_workers("multi_worker_batchnorm_statistics")``
(one CPU replica per worker, ``TF_CONFIG`` set by the helper). Worker 0's
shard of every global micro-batch is four rows of -5, worker 1's four rows of
+5 (``momentum=0``, 2 micro-steps a group), so the global accumulated batch has
mean 0 and variance 25. Prints one results line (see
``tests/scripts/__init__.py``): this worker's copy of ``moving_mean`` and
``moving_variance`` after ``fit`` of a ``GradientAccumulateModel`` holding an
``AccumBatchNormalization`` (``fit``), and of the layer on its own in a custom
loop (``on_its_own``).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from tests.scripts import print_results


def _shards(strategy):
    """Each worker's own rows: -5 on worker 0, +5 on worker 1.

    Each worker reads its own dataset (no auto-sharding) of global batches of
    8, of which its one replica takes 4: its own value.
    """
    value = -5.0 if strategy.cluster_resolver.task_id == 0 else 5.0
    x = np.full((32, 3), value, "float32")
    y = np.zeros((32, 1), "float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).with_options(options)


def _statistics(layer):
    return {
        "moving_mean": np.asarray(layer.moving_mean.numpy()).tolist(),
        "moving_variance": np.asarray(layer.moving_variance.numpy()).tolist(),
    }


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        layer = AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")
        model = GradientAccumulateModel(
            accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(1)(layer(inputs))
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(_shards(strategy), epochs=1, verbose=0)
    results = {"replicas": strategy.num_replicas_in_sync, "fit": _statistics(layer)}

    with strategy.scope():
        alone = AccumBatchNormalization(accum_steps=2, momentum=0.0)
        alone.build((None, 3))

    @tf.function
    def step(batch):
        strategy.run(lambda x, y: alone(x, training=True), args=batch)

    for batch in strategy.experimental_distribute_dataset(_shards(strategy)):
        step(batch)
    results["on_its_own"] = _statistics(alone)
    print_results(results)


if __name__ == "__main__":
    main()
