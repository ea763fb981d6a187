"""Distribution helpers: how the accumulated gradient crosses replicas once per update."""

import contextlib
import threading

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


def average_batchnorm_statistics(model):
    """Averages every BatchNormalization layer's moving statistics across replicas.

    Without ``synchronized=True``, a BatchNormalization layer (Keras's or
    ``AccumBatchNormalization``) under ``tf.distribute`` normalises each
    replica's shard with that shard's statistics, and each replica updates its
    own copy of ``moving_mean``/``moving_variance`` from them: the copies
    drift apart, and evaluation, ``predict`` and checkpoints read the first
    replica's. Call this before evaluating or saving to replace every copy by
    the mean over replicas, in one batched all-reduce. The averaged mean is the
    moving mean of the global batches when shards are equal; the averaged
    variance misses the spread between replicas' means (use
    ``synchronized=True`` for the global statistics, exactly).

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
    layers = [
        layer
        for layer in sublayers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.built
    ]
    variables = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
    if not variables or strategy.num_replicas_in_sync == 1:
        return 0

    def average_in_replica():
        means = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.MEAN, [ops.convert_to_tensor(v) for v in variables]
        )
        for variable, mean in zip(variables, means):
            variable.assign(mean)

    tf.function(lambda: strategy.run(average_in_replica))()
    return len(layers)
