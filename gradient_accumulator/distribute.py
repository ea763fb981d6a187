"""Distribution helpers: how the accumulated gradient crosses replicas once per update."""

import contextlib
import threading
import weakref

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    OPTIMIZER_ALL_REDUCE_METHOD,
    in_multi_worker_mode,
    strategy_supports_no_merge_call,
    sublayers,
)

_patch_lock = threading.Lock()
_patch_depth = {}


def _identity(grads_and_vars):
    return grads_and_vars


def _optimizer_chain(optimizer):
    """The optimizer and every optimizer it wraps (LossScaleOptimizer, ...)."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Within, ``optimizer.apply`` takes its gradients as already all-reduced.

    Keras's TensorFlow optimizer sums gradients across replicas inside
    ``apply``, *after* clipping them: under a strategy, ``clipnorm`` and
    ``global_clipnorm`` clip each replica's share instead of the gradient.
    The accumulation engine all-reduces the group's gradient itself (once per
    update, weight sums included) and hands every replica the global mean, so
    clipping and everything else in ``apply`` sees what it sees on one device.
    Keras has no public switch for its all-reduce; this replaces the private
    ``_all_reduce_sum_gradients`` on the instances (the optimizer and any
    optimizer it wraps) for the duration of the trace. Replicas of one
    process trace in threads of their own, so entries are counted: the patch
    stays until the last one leaves.
    """
    chain = _optimizer_chain(optimizer)
    with _patch_lock:
        for opt in chain:
            if _patch_depth.get(id(opt), 0) == 0:
                vars(opt)[OPTIMIZER_ALL_REDUCE_METHOD] = _identity
            _patch_depth[id(opt)] = _patch_depth.get(id(opt), 0) + 1
    try:
        yield
    finally:
        with _patch_lock:
            for opt in chain:
                _patch_depth[id(opt)] -= 1
                if _patch_depth[id(opt)] == 0:
                    del _patch_depth[id(opt)]
                    vars(opt).pop(OPTIMIZER_ALL_REDUCE_METHOD, None)


def supports_collectives_in_conditionals():
    """Whether the current strategy allows all-reduce inside a replica-context cond.

    True with no strategy. Under MirroredStrategy and
    MultiWorkerMirroredStrategy, True only while tracing an XLA-compiled step
    whose devices are all GPUs; False otherwise (CPUs, or no XLA), where
    their collectives go through ``merge_call``. False for other strategies
    (e.g. OneDeviceStrategy). This is the test Keras's own
    LossScaleOptimizer makes; TensorFlow exposes it only under
    ``tf.__internal__`` (``strategy_supports_no_merge_call``).
    """
    return strategy_supports_no_merge_call()


def is_multi_worker(strategy):
    """Whether ``strategy`` spans several workers (Keras's own test, verbatim).

    Keras reduces a train step's logs differently in that case, and wrongly
    for scalars; see :func:`logs_for_keras`.
    """
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and in_multi_worker_mode(strategy)
    )


def logs_for_keras(logs, strategy):
    """Makes a train step's scalar logs survive Keras's multi-worker reduction.

    Across workers Keras averages each log with ``strategy.reduce("MEAN", v,
    axis=0)``, which fails on scalars, so plain Keras ``fit`` cannot run under
    MultiWorkerMirroredStrategy (keras-team/keras issue 20585). Giving each
    scalar a leading axis of length one makes that reduction the mean over
    replicas, a scalar again.
    """
    if not is_multi_worker(strategy):
        return logs
    return {
        name: ops.expand_dims(value, 0) if len(ops.shape(value)) == 0 else value
        for name, value in logs.items()
    }


class CountingCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Counts the batched cross-replica reductions that actually run.

    A diagnostic for ``tf.distribute.MirroredStrategy(devices,
    cross_device_ops=CountingCrossDeviceOps())``: every
    ``batch_reduce_to``/``all_reduce`` of the strategy (gradients included)
    passes through it, and the counters are variables incremented by the
    reduction itself, so they count reductions that executed, not the ones
    traced (a reduction inside a conditional that did not run is not counted).

    Attributes:
        reductions: int64 variable, batched reductions run so far.
        bytes: int64 variable, bytes of one replica's values summed over them.
    """

    def __init__(self):
        super().__init__()
        with tf.init_scope():
            self.reductions = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        size = 0
        for value, _ in value_destination_pairs:
            first = value.values[0] if hasattr(value, "values") else value
            size += first.shape.num_elements() * first.dtype.size
        with tf.control_dependencies([self.reductions.assign_add(1), self.bytes.assign_add(size)]):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


# model -> (its averaged variables' ids, the traced averaging function).
_AVERAGE_FUNCTIONS = weakref.WeakKeyDictionary()


def _averaged_batchnorms(model):
    """The BatchNormalization layers whose replicas' copies can differ.

    Built layers of ``model`` (at any depth) that normalise each replica's
    shard on their own and update their copies at every training call:
    Keras's ``BatchNormalization`` and ``AccumBatchNormalization`` with
    ``accum_steps=1``, unless ``synchronized=True``. An
    ``AccumBatchNormalization`` with ``accum_steps > 1`` is left out: it merges
    every replica's statistics at each update, so its copies are equal.
    """
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
    means (``synchronized=True``, or ``AccumBatchNormalization`` with
    ``accum_steps > 1``, which merges its replicas' statistics exactly at
    every update, give the global statistics).

    Layers whose copies are equal anyway are left alone: synchronized ones,
    and ``AccumBatchNormalization`` with ``accum_steps > 1``.
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
            means = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, [ops.convert_to_tensor(v) for v in variables]
            )
            for variable, mean in zip(variables, means):
                variable.assign(mean)

        # Traced once per model (and set of layers), not at every call.
        cached = (key, tf.function(lambda: strategy.run(average_in_replica)))
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
