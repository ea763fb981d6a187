"""Distribution helpers: how the accumulated gradient crosses replicas once per update.

Keras 3's built-in accumulation puts ``optimizer.apply`` (which all-reduces
gradients and calls ``merge_call``) inside a conditional in *replica*
context, which MirroredStrategy forbids. Here, wherever collectives need
``merge_call`` (MirroredStrategy and MultiWorkerMirroredStrategy, unless the
step is XLA-compiled and every device is a GPU; see
:func:`supports_collectives_in_conditionals`), the apply-or-skip conditional
runs in *cross-replica* context, reduces the sums there and re-enters the
replicas for the update, the pattern of Keras's own ``LossScaleOptimizer``
(:func:`sum_across_replicas_if`). Where collectives may sit in a
replica-context conditional (no strategy; either strategy in an XLA-compiled
step on GPUs only), the conditional stays in the replica. Either way the
sums are replica-local (``synchronization="on_read"``): a micro-step that
does not update communicates nothing, and an update makes one batched
all-reduce of the sums, after which the optimizer is told not to reduce
again (:func:`gradients_already_reduced`), so that clipping sees the global
gradient.
"""

import contextlib
import threading

import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    in_multi_worker_mode,
    optimizer_chain,
    replace_optimizer_all_reduce,
    strategy_supports_no_merge_call,
)

# Their import path before `batchnorm_averaging` existed (docs/api.rst), kept.
from gradient_accumulator.batchnorm_averaging import (  # noqa: F401
    AverageBatchNormStatistics,
    average_batchnorm_statistics,
)

_patch_lock = threading.Lock()
_patch_depth = {}


def _identity(grads_and_vars):
    return grads_and_vars


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Within, ``optimizer.apply`` takes its gradients as already all-reduced.

    Keras's TensorFlow optimizer sums gradients across replicas inside ``apply``, *after*
    clipping them (``clipnorm`` would clip each replica's share). The engine all-reduces the
    group's gradient itself, once per update, and hands every replica the global mean, so
    this replaces Keras's all-reduce (``_compat.OPTIMIZER_ALL_REDUCE_METHOD``) on the
    optimizer and those it wraps while tracing. Replicas trace in threads of their own, so
    entries are counted: the patch stays until the last one leaves.
    """
    chain = optimizer_chain(optimizer)
    with _patch_lock:
        for opt in chain:
            if _patch_depth.get(id(opt), 0) == 0:
                replace_optimizer_all_reduce(opt, _identity)
            _patch_depth[id(opt)] = _patch_depth.get(id(opt), 0) + 1
    try:
        yield
    finally:
        with _patch_lock:
            for opt in chain:
                _patch_depth[id(opt)] -= 1
                if _patch_depth[id(opt)] == 0:
                    del _patch_depth[id(opt)]
                    replace_optimizer_all_reduce(opt, None)


def supports_collectives_in_conditionals():
    """Whether the current strategy allows all-reduce inside a replica-context cond.

    True with no strategy. Under MirroredStrategy and
    MultiWorkerMirroredStrategy, True only while tracing an XLA-compiled step
    whose devices are all GPUs; False otherwise (CPUs, or no XLA), where
    their collectives go through ``merge_call``. False for other strategies
    (e.g. OneDeviceStrategy). Keras's ``LossScaleOptimizer`` makes the same test.
    """
    return strategy_supports_no_merge_call()


def is_multi_worker(strategy):
    """Whether ``strategy`` spans several workers (Keras's own test, verbatim).

    Keras reduces a train step's logs differently in that case, and wrongly
    for scalars; see :func:`logs_for_keras`.
    """
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and in_multi_worker_mode(
        strategy
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


def by_replica(value):
    """``value`` (float32) in this replica's row of zeros, one row per replica.

    The sum over the replicas of these tensors holds every replica's value,
    exactly (``x + 0 = x``), and its maximum over the first axis is the
    maximum across replicas: TensorFlow's reductions have a sum and a mean but
    no maximum, and so a maximum rides in the update's one batched sum. One
    replica is the case of one row.
    """
    context = tf.distribute.get_replica_context()
    value = ops.cast(ops.convert_to_tensor(value), "float32")
    row = ops.cast(ops.convert_to_tensor(context.replica_id_in_sync_group), "int32")
    shape = (context.num_replicas_in_sync, *value.shape)
    return tf.scatter_nd(ops.reshape(row, (1, 1)), value[None], shape)


def maximum_of_rows(reduced):
    """The maximum across replicas of a sum of :func:`by_replica` tensors."""
    return ops.max(reduced, axis=0)


def all_reduce_in_replica(grads, weights, maximum):
    """Sums the dense gradients and the weights across replicas, in one batch.

    ``maximum`` flags the gradients that take the maximum across replicas
    instead (float8 state, ``engine.takes_maximum``), in the same batch (:func:`by_replica`).
    """
    present = [(g, m) for g, m in zip(grads, maximum) if g is not None]
    dense = [  # IndexedSlices densified
        by_replica(g) if m else tf.convert_to_tensor(g) for g, m in present
    ]
    reduced = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, [*dense, *weights]
    )
    weights = reduced[len(dense) :]
    reduced = iter(
        maximum_of_rows(r) if m else r for r, (_, m) in zip(reduced[: len(dense)], present)
    )
    return [None if g is None else next(reduced) for g in grads], weights


def sum_across_replicas_if(condition, values, fn):
    """If ``condition``: sums ``values`` over the replicas and runs ``fn(*sums)`` in each.

    The one place where the library communicates at an update: all of
    ``values`` cross the replicas in one batched reduction, and only when
    ``condition`` holds (a micro-step that does not update communicates
    nothing). Call it in replica context, in every replica.

    Where :func:`supports_collectives_in_conditionals`, the conditional stays in the
    replica; elsewhere it is taken in cross-replica context and re-enters the replicas
    (module docstring): ``fn`` may then call ``merge_call`` itself, as Keras optimizers do.

    A Python ``bool`` condition (a micro-step whose place in its group is
    known when it is traced, as in a function that runs a whole group) needs
    no conditional: ``True`` reduces and runs ``fn``, ``False`` does nothing.

    Args:
        condition: Boolean scalar tensor, the same in every replica, or a
            Python ``bool``.
        values: List of float tensors or replica-local variables (this
            replica's values).
        fn: Callable taking one reduced tensor per entry of ``values``.
    """
    if supports_collectives_in_conditionals():
        if condition is True:
            fn(*sum_in_replica(values))
        elif condition is not False:
            tf.cond(condition, lambda: fn(*sum_in_replica(values)), lambda: None)
    elif condition is True:
        _sum_in_cross_replica(values, fn)
    elif condition is not False:
        _sum_if_in_cross_replica(condition, values, fn)


def sum_in_replica(values):
    """``values`` summed over the replicas in one batch, in replica context (a list).

    Where :func:`supports_collectives_in_conditionals`, also inside a
    replica's conditional.
    """
    # Identities: inside a conditional, the batch must come from one graph,
    # the branch's (variables are read there; tensors may come from outside).
    sums = [tf.identity(v) for v in values]
    if sums:
        sums = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sums)
    return sums


def _reduce_then_run(strategy, values, fn):
    """Cross-replica context: ``values`` summed onto their devices in one batch, then ``fn``."""
    pairs = [(value, value) for value in values]
    sums = []
    if pairs:
        sums = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)
    strategy.extended.call_for_each_replica(fn, args=tuple(sums))


def _sum_in_cross_replica(values, fn):
    tf.distribute.get_replica_context().merge_call(
        lambda strategy, *values: _reduce_then_run(strategy, values, fn), args=tuple(values)
    )


def _sum_if_in_cross_replica(condition, values, fn):
    def decide(strategy, condition, *values):
        decision = strategy.experimental_local_results(condition)[0]
        tf.cond(decision, lambda: _reduce_then_run(strategy, values, fn), lambda: None)

    tf.distribute.get_replica_context().merge_call(decide, args=(condition, *values))
