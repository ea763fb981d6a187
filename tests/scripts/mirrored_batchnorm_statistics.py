"""BatchNormalization statistics across replicas, under MirroredStrategy (2 logical CPUs).

Run: ``python -m tests.scripts.mirrored_batchnorm_statistics <folder>``
(``<folder>``: where ``ModelCheckpoint`` writes). Every case trains with
``SGD(0.0)``, so the layers' inputs are the data itself and the expected
moving statistics are numpy's, in float64, on the global accumulated batch.
Replica 0 gets the first half of every global micro-batch, replica 1 the
second half. Prints one results line (see ``tests/scripts/__init__.py``)
holding, per case, every replica's copy of ``moving_mean`` and
``moving_variance`` and the expected values:

- ``shards``: four rows of -5 on replica 0 and four of +5 on replica 1 in
  every global micro-batch of 8 (``momentum=0``, 2 micro-steps a group): the
  global group has mean 0 and variance 25. ``AccumBatchNormalization`` (and,
  for comparison, Keras's ``BatchNormalization``, whose copies follow their
  own shard) in a ``GradientAccumulateModel`` with
  ``average_batchnorm_statistics=False``.
- ``equal_shards``: normal data, ``momentum=0.9`` over five groups, the
  expected value the moving average of numpy's group statistics.
- ``unequal_shards``: sequences behind a ``Masking`` layer, replica 0's far
  more padded than replica 1's (and of another mean), so the replicas hold
  different counts.
- ``last_group``: 40 samples at a global micro-batch of 8, ``accum_steps=2``:
  the epoch ends with a group of one micro-step; ``momentum=0``.
- ``checkpoint``: the ``shards`` model's ``ModelCheckpoint`` file, loaded into
  a one-device model.
- ``validation``: the ``shards`` model with validation data: the
  ``val_loss`` of ``fit`` and the loss of a one-device model holding the
  global statistics on the same data (and whether plain Keras reports its
  own ``val_loss`` right under the strategy, which Keras < 3.8 does not).
- ``keras_bn_averaged``: Keras ``BatchNormalization`` in a
  ``GradientAccumulateModel`` (default ``average_batchnorm_statistics=True``),
  and in a plain ``keras.Model`` with ``AverageBatchNormStatistics``: copies
  equal to their average.
- ``on_its_own``: ``AccumBatchNormalization`` called in a custom loop under
  ``strategy.run`` (the layer counts its calls): the ``shards`` data.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import (
    AccumBatchNormalization,
    AverageBatchNormStatistics,
    GradientAccumulateModel,
)
from tests.scripts import print_results, split_cpu


def _copies(strategy, layer):
    return {
        name: [
            np.asarray(v.numpy()).tolist()
            for v in strategy.experimental_local_results(getattr(layer, name).value)
        ]
        for name in ("moving_mean", "moving_variance")
    }


def _stats(x, axis=0):
    x = np.asarray(x, "float64")
    return {"mean": x.mean(axis=axis).tolist(), "variance": x.var(axis=axis).tolist()}


def _shard_data(num_samples=32):
    x = np.zeros((num_samples, 3), "float32")
    x[np.arange(num_samples) % 8 < 4] = -5.0
    x[np.arange(num_samples) % 8 >= 4] = 5.0
    return x, np.zeros((num_samples, 1), "float32")


def _model(strategy, layer, cls=GradientAccumulateModel, features=(3,), **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(features)
        hidden = layer(inputs)
        if len(features) > 1:
            hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)
        model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def shards(strategy, folder):
    x, y = _shard_data()
    results = {"expected": _stats(x)}
    checkpoint = os.path.join(folder, "shards.weights.h5")
    for name, layer in [
        ("accum_bn", AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")),
        ("keras_bn", keras.layers.BatchNormalization(momentum=0.0, name="bn")),
    ]:
        model = _model(strategy, layer, accum_steps=2, average_batchnorm_statistics=False)
        callbacks = []
        if name == "accum_bn":
            callbacks = [keras.callbacks.ModelCheckpoint(checkpoint, save_weights_only=True)]
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=1,
            shuffle=False,
            verbose=0,
            validation_data=(x[:16], y[:16] + 1.0),
            callbacks=callbacks,
        )
        results[name] = _copies(strategy, layer)
        if name == "accum_bn":
            results["val_loss"] = float(history.history["val_loss"][-1])
            weights = model.get_weights()
    # One device, the same weights (replica 0's copies): the loss validation
    # must have reported, and the checkpoint's statistics.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    layer = AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")
    single = GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(1)(layer(inputs))
    )
    single.compile(keras.optimizers.SGD(0.0), "mse")
    single.set_weights(weights)
    results["one_device_val_loss"] = float(single.evaluate(x[:16], y[:16] + 1.0, verbose=0))
    results["keras_validation_is_right"] = _keras_validation_is_right(strategy, x, y + 1.0)
    single.load_weights(checkpoint)
    results["checkpoint"] = {
        "moving_mean": np.asarray(layer.moving_mean.numpy()).tolist(),
        "moving_variance": np.asarray(layer.moving_variance.numpy()).tolist(),
    }
    return results


def _keras_validation_is_right(strategy, x, y):
    """Whether plain Keras's ``val_loss`` under the strategy is one device's loss.

    Keras before 3.8 reports a wrong validation loss under MirroredStrategy
    (about the sum over replicas), with or without this library.
    """
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.0), "mse")
    history = model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, validation_data=(x[:16], y[:16])
    )
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    single = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    single.compile(keras.optimizers.SGD(0.0), "mse")
    single.set_weights(model.get_weights())
    expected = single.evaluate(x[:16], y[:16], verbose=0)
    return bool(np.isclose(history.history["val_loss"][-1], expected, rtol=1e-6))


def equal_shards(strategy):
    x = np.random.default_rng(1).normal(3.0, 2.0, (80, 3)).astype("float32")
    layer = AccumBatchNormalization(accum_steps=2, momentum=0.9, name="bn")
    model = _model(strategy, layer, accum_steps=2)
    model.fit(x, np.zeros((80, 1), "float32"), batch_size=8, shuffle=False, verbose=0)
    mean, variance = np.zeros(3), np.ones(3)
    for group in np.split(x.astype("float64"), 5):
        mean = 0.9 * mean + 0.1 * group.mean(axis=0)
        variance = 0.9 * variance + 0.1 * group.var(axis=0)
    return {
        **_copies(strategy, layer),
        "expected": {"mean": mean.tolist(), "variance": variance.tolist()},
    }


def unequal_shards(strategy):
    rng = np.random.default_rng(2)
    x = rng.normal(1.0, 1.0, (32, 6, 3)).astype("float32")
    rows = np.arange(32) % 8 < 4  # replica 0's half of each global micro-batch
    x[rows, 1:] = 0.0  # one valid time step of six
    x[~rows] += 4.0
    mask = np.any(x != 0.0, axis=-1)
    layer = AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 3))
        hidden = layer(keras.layers.Masking(0.0)(inputs))
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        model = GradientAccumulateModel(
            accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(1)(pooled)
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(x, np.zeros((32, 1), "float32"), batch_size=8, shuffle=False, verbose=0)
    last_group = x[16:][mask[16:]]  # momentum 0: the last group, unmasked steps
    counts = [int(mask[16:][rows[16:]].sum()), int(mask[16:][~rows[16:]].sum())]
    return {**_copies(strategy, layer), "expected": _stats(last_group), "counts": counts}


def last_group(strategy):
    x = np.random.default_rng(3).normal(-2.0, 3.0, (40, 3)).astype("float32")
    layer = AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")
    model = _model(strategy, layer, accum_steps=2)
    model.fit(x, np.zeros((40, 1), "float32"), batch_size=8, shuffle=False, verbose=0)
    return {
        **_copies(strategy, layer),
        "expected": _stats(x[32:]),
        "updates": int(model.optimizer.iterations.numpy()),
    }


def keras_bn_averaged(strategy):
    x, y = _shard_data()
    results = {}
    for name, cls, kwargs, callbacks in [
        ("gradient_accumulate_model", GradientAccumulateModel, {"accum_steps": 2}, []),
        ("plain_model_with_callback", keras.Model, {}, [AverageBatchNormStatistics()]),
    ]:
        layer = keras.layers.BatchNormalization(momentum=0.0, name="bn")
        model = _model(strategy, layer, cls=cls, **kwargs)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=callbacks)
        results[name] = _copies(strategy, layer)
    return results


def on_its_own(strategy):
    x, _ = _shard_data()
    with strategy.scope():
        layer = AccumBatchNormalization(accum_steps=2, momentum=0.0)
        layer.build((None, 3))
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(8)
    )

    @tf.function
    def step(batch):
        strategy.run(lambda inputs: layer(inputs, training=True), args=(batch,))

    for batch in dataset:
        step(batch)
    return {**_copies(strategy, layer), "expected": _stats(x)}


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    folder = sys.argv[1]
    print_results(
        {
            "replicas": strategy.num_replicas_in_sync,
            "shards": shards(strategy, folder),
            "equal_shards": equal_shards(strategy),
            "unequal_shards": unequal_shards(strategy),
            "last_group": last_group(strategy),
            "keras_bn_averaged": keras_bn_averaged(strategy),
            "on_its_own": on_its_own(strategy),
        }
    )


if __name__ == "__main__":
    main()
