"""AccumBatchNormalization(synchronized=True) under MirroredStrategy (2 logical CPUs).

Run: ``python -m tests.scripts.mirrored_synchronized_bn``. Three runs, each
layer with momentum 0 (the moving statistics are the last update's):

1. ``plain_fit``: a plain ``keras.Model`` fitted for 2 steps of 8 rows (4 per
   replica), against Keras's ``BatchNormalization(synchronized=True)``:
   ``trainable_max_abs_diff`` between the two models' trainable weights, and
   the moving statistics of the last step, which accumulates 2 steps (all
   16 rows);
2. ``model_fit``: inside ``GradientAccumulateModel(accum_steps=2)``: one group
   of two micro-batches, the same 16 rows;
3. ``unequal_shards``: the layer alone on shards of 5 + 2 rows, then 0 + 9,
   with a large mean (1e3).

Prints one results line (see ``tests/scripts/__init__.py``) with every
replica's copy of each moving statistic, ``[[mean per replica], [variance per
replica]]``, and numpy's float64 ``[mean, variance]`` of the rows
(``numpy``, ``numpy_large``).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator.layers import AccumBatchNormalization
from tests.scripts import print_results, split_cpu


def numpy_stats(data):
    data = data.astype("float64")
    return [data.mean(0).tolist(), data.var(0).tolist()]


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-2.0, 1.0, (8, 3)), rng.normal(3.0, 2.0, (8, 3))]).astype(
        "float32"
    )
    y = rng.normal(size=(16, 1)).astype("float32")
    x_large = rng.normal(1e3, 1.0, (16, 3)).astype("float32")
    results = {"numpy": numpy_stats(x), "numpy_large": numpy_stats(x_large)}

    def build(bn, model_cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            inputs = keras.Input((3,))
            outputs = keras.layers.Dense(1)(bn(inputs))
            model = model_cls(inputs=inputs, outputs=outputs, **kwargs)
            model.compile(optimizer="sgd", loss="mse")
        return model

    def state(layer):
        # Every replica's copy, to check that they agree.
        return [
            [v.numpy().tolist() for v in strategy.experimental_local_results(w.value)]
            for w in (layer.moving_mean, layer.moving_variance)
        ]

    # 1. Plain fit: Keras's synchronized BN's forward and backward pass.
    plain = build(keras.layers.BatchNormalization(momentum=0.0, synchronized=True))
    accum = build(AccumBatchNormalization(2, momentum=0.0, synchronized=True))
    for model in (plain, accum):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    results["trainable_max_abs_diff"] = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(plain.trainable_weights, accum.trainable_weights)
    )
    results["plain_fit"] = state(accum.layers[1])

    # 2. Inside GradientAccumulateModel: one group of two micro-batches.
    model = build(
        AccumBatchNormalization(2, momentum=0.0, synchronized=True),
        GradientAccumulateModel,
        accum_steps=2,
    )
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    results["model_fit"] = state(model.layers[1])

    # 3. Unequal and empty shards (5 + 2 rows, then 0 + 9), large mean.
    with strategy.scope():
        layer = AccumBatchNormalization(2, momentum=0.0, synchronized=True)
        layer.build((None, 3))
    shards = [(x_large[:5], x_large[5:7]), (x_large[7:7], x_large[7:16])]

    @tf.function
    def step(values):
        strategy.run(lambda v: layer(v, training=True), args=(values,))

    for pair in shards:
        step(
            strategy.experimental_distribute_values_from_function(
                lambda ctx, pair=pair: tf.constant(pair[ctx.replica_id_in_sync_group])
            )
        )
    results["unequal_shards"] = state(layer)
    print_results(results)


if __name__ == "__main__":
    main()
