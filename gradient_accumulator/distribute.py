"""Distribution helpers: how the accumulated gradient crosses replicas once per update."""

import contextlib
import threading

import tensorflow as tf
from keras import ops

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
                vars(opt)["_all_reduce_sum_gradients"] = _identity
            _patch_depth[id(opt)] = _patch_depth.get(id(opt), 0) + 1
    try:
        yield
    finally:
        with _patch_lock:
            for opt in chain:
                _patch_depth[id(opt)] -= 1
                if _patch_depth[id(opt)] == 0:
                    del _patch_depth[id(opt)]
                    vars(opt).pop("_all_reduce_sum_gradients", None)


def supports_collectives_in_conditionals():
    """Whether the current strategy allows all-reduce inside a replica-context cond.

    True with no strategy and for MultiWorkerMirroredStrategy, whose
    collectives need no ``merge_call``; False for MirroredStrategy. This is
    the test Keras's own LossScaleOptimizer makes; TensorFlow exposes it only
    under ``tf.__internal__``.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def is_multi_worker(strategy):
    """Whether ``strategy`` spans several workers (Keras's own test, verbatim).

    Keras reduces a train step's logs differently in that case, and wrongly
    for scalars; see :func:`logs_for_keras`.
    """
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


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
