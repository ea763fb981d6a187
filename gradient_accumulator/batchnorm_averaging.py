"""Averaging the replicas' copies of BatchNormalization statistics under a strategy."""

import weakref

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import sublayers

# model -> (its averaged variables' ids, the traced averaging function).
_AVERAGE_FUNCTIONS = weakref.WeakKeyDictionary()


def _averaged_batchnorms(model):
    """The layers :func:`average_batchnorm_statistics` averages (built, at any depth)."""
    return [
        layer
        for layer in sublayers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.built
        and not getattr(layer, "synchronized", False)
        and getattr(layer, "accum_steps", 1) == 1
    ]


def average_batchnorm_statistics(model):
    """Makes every replica's copy of BatchNormalization statistics their average.

    Without ``synchronized=True``, Keras's ``BatchNormalization`` under
    ``tf.distribute`` normalises each replica's shard with that shard's
    statistics and updates the replica's own copy of
    ``moving_mean``/``moving_variance`` from them: the copies drift apart, and
    evaluation, ``predict`` and checkpoints read the first replica's. This
    replaces every copy by the mean over replicas, in one batched all-reduce.
    The averaged mean is the moving mean of the global batches when shards
    are equal; the averaged variance misses the spread between replicas'
    means. Layers whose copies are equal anyway, with the global statistics,
    are left alone: synchronized ones, and ``AccumBatchNormalization`` with
    ``accum_steps > 1`` (it merges its replicas' statistics exactly at every update).

    ``GradientAccumulateModel.fit`` calls this by itself (see
    :class:`AverageBatchNormStatistics`); call it in a custom loop before
    evaluating or saving.

    Args:
        model: A Keras model created under the strategy's scope. Layers of
            nested models are included.

    Returns:
        Integer, the number of layers averaged (0 without a strategy).
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a Keras model created under the strategy's scope. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    strategy = model.distribute_strategy
    layers = _averaged_batchnorms(model)
    variables = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
    if not variables or strategy.num_replicas_in_sync == 1:
        return 0
    key = tuple(id(v) for v in variables)
    cached = _AVERAGE_FUNCTIONS.get(model)
    if cached is None or cached[0] != key:

        def average_in_replica():
            # Copies of the reads: MultiWorkerMirroredStrategy cannot all-reduce
            # a variable's read itself ("destinations can not be empty", TF 2.21).
            values = [tf.identity(ops.convert_to_tensor(v)) for v in variables]
            means = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, values
            )
            for variable, mean in zip(variables, means):
                variable.assign(mean)

        # Traced once per model (and set of layers), not at every call.
        cached = (key, tf.function(lambda: strategy.run(average_in_replica), autograph=False))
        _AVERAGE_FUNCTIONS[model] = cached
    cached[1]()
    return len(layers)


class AverageBatchNormStatistics(keras.callbacks.Callback):
    """Averages the replicas' copies of BatchNormalization statistics whenever they are read.

    Calls :func:`average_batchnorm_statistics` before every evaluation
    (validation during ``fit`` included), at the end of every epoch and at
    the end of training, so that validation, ``ModelCheckpoint``,
    ``BackupAndRestore``, ``evaluate`` and ``predict`` see one set of
    statistics instead of the first replica's. Put it first in ``callbacks``
    so that it runs before the callbacks that save.

    ``GradientAccumulateModel.fit`` adds it by itself under a strategy with
    several replicas (``average_batchnorm_statistics=False`` turns that
    off); use it with a plain ``keras.Model``. Without a strategy it does
    nothing.

    Example:

    >>> import keras
    >>> from gradient_accumulator import AverageBatchNormStatistics
    >>> callback = AverageBatchNormStatistics()
    >>> isinstance(callback, keras.callbacks.Callback)
    True
    """

    def on_test_begin(self, logs=None):
        average_batchnorm_statistics(self.model)

    def on_epoch_end(self, epoch, logs=None):
        average_batchnorm_statistics(self.model)

    def on_train_end(self, logs=None):
        average_batchnorm_statistics(self.model)
