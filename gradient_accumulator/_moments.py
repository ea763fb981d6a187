"""Per-micro-batch moments and Chan's parallel merge: the maths of AccumBatchNormalization.

A set of samples is summarised per channel by ``(count, mean, m2)`` where
``m2 = sum((x - mean) ** 2)`` is the sum of squared deviations from the set's
own mean; the biased variance is ``m2 / count``. Two summaries merge exactly
(Chan, Golub and LeVeque, 1979)::

    count = count_a + count_b
    delta = mean_b - mean_a
    mean  = mean_a + delta * count_b / count
    m2    = m2_a + m2_b + delta ** 2 * count_a * count_b / count

The ``delta ** 2`` term is the spread *between* the merged sets: dropping it
(averaging per-set variances) underestimates the variance of the union.

Why it is stable in float32: every term of ``m2`` is a sum of non-negative
quantities, so nothing cancels, unlike ``E[x^2] - E[x]^2``, which loses every
significant digit once ``|mean| / std`` nears ``1e3`` (``E[x^2] ~ 1e6`` has a
float32 spacing of ``0.06``). One float32 weakness remains: a mean of
``1e3`` is itself only stored to ``6e-5``, an error that enters ``delta``
and hence ``m2`` at about ``1e-4 * |delta| / std`` relative. So means are
carried in two parts, a float32 *shift* and the offset of the mean from it:
:func:`batch_moments` returns the float32 mean together with its residual
``mean(x - mean)`` (the rounding error it made, computed exactly enough from
the deviations it already needs for ``m2``), and the caller merges offsets
from one shift per group (Chan's formula is translation-invariant). Offsets
are ``O(std)``, so variances keep a relative error of about ``1e-6``
whatever ``|mean| / std`` is.

All functions are pure, take and return float32 tensors of one shape (the
channel shape), and treat ``count == 0`` as the empty set (merging it is a
no-op; its mean, residual, m2 and variance are 0). Counts are float32:
integers are exact up to ``2 ** 24`` samples per channel and their relative
rounding stays below ``6e-8`` beyond.
"""

from keras import ops

_STATS_DTYPE = "float32"


def batch_moments(x, axes, mask=None):
    """Returns ``(count, mean, residual, m2)`` of ``x`` over ``axes``, float32.

    Two passes: the float32 ``mean``, then the deviations ``x - mean``, from
    which both ``residual = mean(x - mean)`` (so that ``mean + residual`` is
    the mean to about float32 epsilon squared) and ``m2`` (about the exact
    mean: ``sum((x - mean) ** 2) - count * residual ** 2``, clamped at 0)
    are reduced.

    Gradients flow to ``x`` through ``mean`` and ``m2`` only: the mean
    inside the deviations and the residual are held constant, because their
    derivatives are zero in exact arithmetic (the deviations from the mean
    sum to zero, so ``d m2 / d mean = -2 * sum(x - mean) = 0`` and
    ``d residual / d x = 0``). This is what ``tf.nn.moments`` does for the
    mean, and it spares the backward pass two reductions over ``x``.

    Args:
        x: Tensor of any float dtype (cast to float32).
        axes: List of ints, the axes reduced over (every axis but the
            channel axis).
        mask: Optional boolean tensor of ``x``'s shape (already broadcast);
            ``False`` entries are left out of every statistic.

    Returns:
        Four float32 tensors with ``axes`` removed: the number of samples
        (per channel), their float32 mean, its residual and the sum of
        squared deviations. An empty channel gets zeros.
    """
    x = ops.cast(x, _STATS_DTYPE)
    if mask is None:
        count = _element_count(x, axes)
        # Sums divided by the count (not `ops.mean`): an empty batch, e.g. a
        # replica's shard of a short last batch, gives zeros, not NaN.
        divide = _divider(count)
        mean = divide(ops.sum(x, axis=axes, keepdims=True))
        deviation = x - ops.stop_gradient(mean)
        residual = ops.stop_gradient(divide(ops.sum(deviation, axis=axes)))
        squares = ops.sum(ops.square(deviation), axis=axes)
        count = ops.broadcast_to(ops.cast(count, _STATS_DTYPE), ops.shape(residual))
    else:
        count = ops.sum(ops.cast(mask, _STATS_DTYPE), axis=axes, keepdims=True)
        total = ops.sum(ops.where(mask, x, 0.0), axis=axes, keepdims=True)
        mean = _divide_or_zero(total, count)
        deviation = ops.where(mask, x - ops.stop_gradient(mean), 0.0)
        count = ops.squeeze(count, axis=axes)
        residual = ops.stop_gradient(_divide_or_zero(ops.sum(deviation, axis=axes), count))
        squares = ops.sum(ops.square(deviation), axis=axes)
    m2 = ops.maximum(squares - count * ops.square(residual), 0.0)
    return count, ops.squeeze(mean, axis=axes), residual, m2


def merge_moments(count_a, mean_a, m2_a, count_b, mean_b, m2_b):
    """Merges two ``(count, mean, m2)`` summaries with Chan's formula.

    Exact in real arithmetic. In float32 the merged mean and variance are
    within a few ulps (relative ~1e-6) of a float64 computation on the union,
    provided both means are given as offsets of size ``O(std)`` from a common
    origin (see the module docstring); the origin does not matter otherwise.
    Either side may be empty (``count == 0``): the other is returned
    unchanged.

    Returns:
        ``(count, mean, m2)`` of the union, float32.
    """
    count_a, mean_a, m2_a, count_b, mean_b, m2_b = (
        ops.cast(t, _STATS_DTYPE) for t in (count_a, mean_a, m2_a, count_b, mean_b, m2_b)
    )
    count = count_a + count_b
    weight_b = _divide_or_zero(count_b, count)
    delta = mean_b - mean_a
    # An empty `a` may hold any mean: return `b`'s exactly, not via `delta`.
    mean = ops.where(count_a > 0, mean_a + delta * weight_b, mean_b)
    m2 = m2_a + m2_b + ops.square(delta) * count_a * weight_b
    return count, mean, m2


def merge_moments_along(counts, means, m2s):
    """Merges ``n`` summaries stacked on axis 0 (``n`` static) into one.

    Used to combine per-replica summaries gathered in one collective. Merges
    left to right with :func:`merge_moments`, so every replica computes the
    identical result from the identical gathered tensor.
    """
    count, mean, m2 = counts[0], means[0], m2s[0]
    for i in range(1, counts.shape[0]):
        count, mean, m2 = merge_moments(count, mean, m2, counts[i], means[i], m2s[i])
    return count, mean, m2


def merge_replica_summaries(counts, means, residuals, m2s):
    """Merges per-replica ``(count, mean, residual, m2)`` summaries stacked on axis 0.

    Each replica's mean is ``means[r] + residuals[r]`` (a float32 value and
    its small correction, as :func:`batch_moments` returns them). The merged
    mean is returned the same way: a common origin (the count-weighted mean
    of the float32 means, a float32 value near the data) and the offset of
    the exact mean from it, so nothing cancels however large the mean is
    against the spread. Replicas with ``count == 0`` contribute nothing;
    every replica computes the identical result from the identical stack.

    Returns:
        ``(count, origin, residual, m2)`` of the union, float32.
    """
    counts, means, residuals, m2s = (
        ops.cast(t, _STATS_DTYPE) for t in (counts, means, residuals, m2s)
    )
    origin = ops.sum(counts * means, axis=0) / ops.maximum(ops.sum(counts, axis=0), 1.0)
    count, residual, m2 = merge_moments_along(counts, (means - origin) + residuals, m2s)
    return count, origin, residual, m2


def variance_from_moments(count, m2):
    """Biased variance ``m2 / count`` (0 for an empty set), clamped at 0."""
    return ops.maximum(_divide_or_zero(ops.cast(m2, _STATS_DTYPE), count), 0.0)


def _divide_or_zero(numerator, denominator):
    return _divider(denominator)(numerator)


def _divider(denominator):
    """``numerator -> numerator / denominator``, 0 where ``denominator`` is 0.

    Not ``ops.divide_no_nan``: the ``where`` form keeps the NaN of 0/0 out
    of the gradient as well as out of the value. A Python number > 0 (a
    count known when traced) divides directly: the same quotient, without
    the selections.
    """
    if isinstance(denominator, (int, float)):
        if denominator > 0:
            return lambda numerator: numerator / float(denominator)
        return ops.zeros_like
    positive = denominator > 0
    safe = ops.where(positive, denominator, 1.0)
    return lambda numerator: ops.where(positive, numerator / safe, 0.0)


def _element_count(x, axes):
    """The number of entries of ``x`` over ``axes``: a Python int where the shape is known.

    Otherwise a float32 tensor, of the product of the sizes (integers, exact below ``2 ** 31``).
    """
    count = 1
    for axis in axes:
        count = count * (ops.shape(x)[axis] if x.shape[axis] is None else x.shape[axis])
    return count if isinstance(count, int) else ops.cast(count, _STATS_DTYPE)
