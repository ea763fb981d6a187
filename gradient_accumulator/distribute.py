"""Distribution helpers: how the accumulated gradient crosses replicas once per update."""

import contextlib


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
    optimizer it wraps) for the duration of the trace. Enter it in
    cross-replica context, around ``call_for_each_replica``: replicas trace in
    threads of their own and must not patch concurrently.
    """
    chain = _optimizer_chain(optimizer)
    for opt in chain:
        vars(opt)["_all_reduce_sum_gradients"] = _identity
    try:
        yield
    finally:
        for opt in chain:
            vars(opt).pop("_all_reduce_sum_gradients", None)
