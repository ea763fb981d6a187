"""The gradient noise scale, from the micro-batches' gradients and their group's.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") call
``B_simple = tr(Sigma) / |G|^2`` the simple noise scale: ``G`` the true
gradient, ``Sigma`` the covariance of one sample's gradient. A batch much
smaller than it buys proportionally fewer steps as it grows; beyond it, a
bigger batch buys little. A gradient averaged over ``b`` samples has
``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, so two batch sizes give two equations.
Accumulation has both at every update: each micro-batch's gradient
(``b_i`` samples, or tokens where the loss is a mean over tokens) and the
group's mean gradient (``B = sum_i b_i``). With ``S_small`` the mean of the
micro-batches' squared norms, ``1 / b`` the mean of their ``1 / b_i`` and
``S_big`` the group's squared norm, the unbiased estimates are::

    tr(Sigma) = (S_small - S_big) / (1 / b - 1 / B)
    |G|^2     = (B * S_big - b * S_small) / (B - b)

Each is noisy; as the paper does, their exponential moving averages over
updates are divided (a ratio of averages, not an average of ratios). Under
several replicas each replica's micro-batch is a small batch and ``B`` the
global batch. ``S_small`` and ``1 / b`` may be the means over some of the
group's micro-batches only (``noise_scale_micro_batches="last"``: the last,
a sample of one, unbiased alike), ``B`` still the whole group's.
"""

import tensorflow as tf
from keras import ops

# A micro-batch's summary, summed over a group's micro-batches and replicas:
# its gradient's squared norm, 1 (a count), 1 / b_i (those three 0 where it is
# not measured), b_i.
SUMMARY_SIZE = 4


def squared_norm(grads, skip=None):
    """``sum(g ** 2)`` over ``grads`` (float32), ``None`` entries and ``skip`` ones left out.

    A ``tf.IndexedSlices`` counts as its dense tensor: rows repeated in its
    indices are summed first.
    """
    skip = skip or [False] * len(grads)
    squares = []
    for g, skipped in zip(grads, skip):
        if g is None or skipped:
            continue
        if isinstance(g, tf.IndexedSlices):
            rows, positions = tf.unique(g.indices)
            g = tf.math.unsorted_segment_sum(g.values, positions, tf.size(rows))
        # One kernel (TensorFlow's L2Loss, sum(g ** 2) / 2) rather than a
        # square, which writes a tensor of g's size, then a sum.
        squares.append(2.0 * tf.nn.l2_loss(ops.cast(g, "float32")))
    if not squares:
        return ops.zeros((), "float32")
    return ops.sum(ops.stack(squares))


def micro_batch_summary(grads_squared_norm, factor, size, measured=None):
    """One micro-batch's summary: ``[|g_i|^2, 1, 1 / b_i, b_i]`` (float32).

    Args:
        grads_squared_norm: The squared norm of the gradients as computed
            (of the weighted, scaled loss).
        factor: What those gradients are multiplied by relative to the
            micro-batch's own mean gradient ``g_i`` (its weight, the loss
            scale, one over the replicas).
        size: ``b_i``, the micro-batch's normaliser (samples, or tokens). At 0
            (all its tokens masked) the micro-batch is not measured either: its
            gradient is 0, no draw of one of size ``b_i``.
        measured: ``None`` (measured), or a boolean tensor: where false, the
            gradient was not measured and the summary is ``[0, 0, 0, b_i]``
            (its samples still count in the group's ``B``).
    """
    factor = ops.cast(factor, "float32")
    size = ops.cast(size, "float32")
    own = ops.divide_no_nan(grads_squared_norm, factor * factor)
    inverse = ops.divide_no_nan(1.0, size)
    summary = ops.stack([own, ops.ones(()), inverse])
    measured = size > 0.0 if measured is None else ops.logical_and(measured, size > 0.0)
    # A select, not a product: an overflowed norm times 0 is NaN.
    summary = ops.where(measured, summary, ops.zeros_like(summary))
    return ops.concatenate([summary, ops.expand_dims(size, 0)])


def estimates(sums, big_squared_norm):
    """``(trace, signal, valid)`` of one update from its summed summaries.

    ``trace`` estimates ``tr(Sigma)``, ``signal`` ``|G|^2``; ``valid`` is
    false where there is no estimate: no micro-batch of the group was
    measured, the group's batch is not bigger than its micro-batches (one
    micro-batch on one replica), or a gradient was not finite (an
    overflowed loss scale, whose update is skipped).
    """
    count = sums[1]
    small = ops.divide_no_nan(sums[0], count)
    inverse_small = ops.divide_no_nan(sums[2], count)
    big = sums[3]
    inverse_big = ops.divide_no_nan(1.0, big)
    gap = inverse_small - inverse_big
    trace = ops.divide_no_nan(small - big_squared_norm, gap)
    # (B * S_big - b * S_small) / (B - b), divided through by b * B.
    signal = ops.divide_no_nan(inverse_small * big_squared_norm - inverse_big * small, gap)
    finite = ops.logical_and(ops.isfinite(trace), ops.isfinite(signal))
    valid = ops.logical_and(ops.logical_and(count >= 1.0, gap > 1e-6 * inverse_small), finite)
    return trace, signal, valid


def smoothed(averages, trace, signal, valid, decay):
    """The moving averages ``[trace, signal]`` after this update, and their ratio.

    An update without an estimate (``valid`` false) leaves them.
    """
    current = ops.stack([trace, signal])
    moved = decay * averages + (1.0 - decay) * current
    averages = ops.where(valid, moved, averages)
    return averages, ops.divide_no_nan(averages[0], averages[1])


def _both(first, second):
    """``first and second`` of Python booleans and boolean tensors, Python where both are."""
    if first is False or second is False:
        return False
    if first is True:
        return second
    if second is True:
        return first
    return ops.logical_and(first, second)


class Schedule:
    """Which updates the noise scale measures: ``0, m, 2m, ...`` of the accumulator's count.

    The one rule (``noise_scale_every=m``), answered in Python where the
    answer is known when a step is traced (a whole group's function, one
    function per answer, no conditional) and as a tensor where it is not.

    Args:
        every: Integer >= 1, ``m`` (``1``: every update, and without the
            noise scale).
        last_only: Boolean, ``noise_scale_micro_batches="last"``: of a
            measured group, the last micro-batch only.
    """

    def __init__(self, every=1, last_only=False):
        self.every = every
        self.last_only = last_only
        self._next = None  # the count at the coming group, where known in Python

    def forget(self):
        """The count may have moved where :meth:`next_group` did not see it: read it again."""
        self._next = None

    def next_group(self, update_count):
        """Python boolean: whether the coming group's update is measured (counts it).

        ``update_count`` (a variable) is read once (a device sync) after
        :meth:`forget`, then counted here.
        """
        if self.every == 1:
            return True
        if self._next is None:
            self._next = int(update_count.numpy())
        measures = self._next % self.every == 0
        self._next += 1
        return measures

    def update_measured(self, update_count, known=None):
        """Whether the update being traced is measured: ``known`` if given, else at run time."""
        if known is not None or self.every == 1:
            return True if known is None else known
        return ops.equal(update_count.read_value() % self.every, 0)

    def micro_batch_measured(self, micro, update_count):
        """Whether a micro-step's gradient is measured (Python boolean, or tensor).

        ``micro``: its :class:`~gradient_accumulator.engine.MicroStep`
        (``measures`` and ``is_update_step`` where known when traced).
        """
        measured = self.update_measured(update_count, micro.measures)
        if self.last_only:
            measured = _both(measured, micro.is_update_step)
        return measured
