"""Unit tests of the moment maths behind AccumBatchNormalization, against numpy float64."""

import numpy as np
import pytest
from keras import ops

from gradient_accumulator._moments import (
    batch_moments,
    merge_moments,
    merge_moments_along,
    merge_replica_summaries,
    variance_from_moments,
)

# float32 arithmetic on O(1e3) samples: a few ulps of relative error, so
# 1e-6 relative (float32 eps is 1.2e-7) with a small absolute floor for
# quantities that are near zero.
RTOL = 1e-6
ATOL = 1e-6

# (id, [(loc, scale, n), ...]): channel-wise samples of the sets to merge.
SETS = {
    "same_distribution": [(0.0, 1.0, 64), (0.0, 1.0, 64)],
    "different_means": [(-3.0, 0.5, 40), (0.0, 1.0, 40), (5.0, 2.0, 40)],
    "unequal_sizes": [(1.0, 1.0, 3), (2.0, 0.5, 100), (-1.0, 3.0, 17)],
    "large_mean": [(1e3, 1.0, 50), (1e3 + 0.5, 1.0, 70)],
    "single_samples": [(0.0, 1.0, 1), (4.0, 1.0, 1), (-2.0, 1.0, 1)],
}


def _sets(spec, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(loc, scale, (n, channels)).astype("float32") for loc, scale, n in spec]


def _numpy_moments(x):
    x = np.asarray(x, "float64")
    mean = x.mean(axis=0)
    return np.full(mean.shape, len(x), "float64"), mean, ((x - mean) ** 2).sum(0)


def _relative_error(actual, expected):
    actual = np.asarray(actual, "float64")
    return float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1.0)))


def _summary(x, **kwargs):
    """float64 numpy (count, mean, m2) of ``batch_moments``'s output."""
    count, mean, residual, m2 = (np.asarray(t, "float64") for t in batch_moments(x, **kwargs))
    return count, mean + residual, m2


def _merge_all(sets):
    """Merges the sets' summaries as the layer does: offsets from one shift."""
    state = [np.zeros(sets[0].shape[1], "float32")] * 3
    shift = None
    for x in sets:
        count, mean, residual, m2 = batch_moments(x, axes=[0])
        shift = mean if shift is None else shift
        state = merge_moments(*state, count, (mean - shift) + residual, m2)
    count, offset, m2 = (np.asarray(t, "float64") for t in state)
    return count, np.asarray(shift, "float64") + offset, m2


@pytest.mark.parametrize("name", list(SETS))
def test_batch_moments_match_numpy(name):
    for x in _sets(SETS[name]):
        count, mean, m2 = _summary(ops.convert_to_tensor(x), axes=[0])
        n, mu, ss = _numpy_moments(x)
        np.testing.assert_array_equal(count, n)
        # mean + residual is the mean to well below float32 resolution.
        np.testing.assert_allclose(mean, mu, rtol=1e-9, atol=ATOL)
        np.testing.assert_allclose(m2, ss, rtol=RTOL, atol=ATOL * len(x))


def test_batch_moments_over_several_axes():
    x = np.random.default_rng(1).normal(2.0, 3.0, (4, 5, 6, 3)).astype("float32")
    count, mean, m2 = _summary(x, axes=[0, 1, 2])
    n, mu, ss = _numpy_moments(x.reshape(-1, 3))
    np.testing.assert_array_equal(count, n)
    np.testing.assert_allclose(mean, mu, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(m2, ss, rtol=RTOL)


def test_batch_moments_with_mask_ignore_masked_entries():
    rng = np.random.default_rng(2)
    x = rng.normal(1.0, 2.0, (6, 4)).astype("float32")
    mask = rng.random((6, 4)) > 0.4
    mask[:, 3] = False  # an empty channel
    count, mean, m2 = _summary(x, axes=[0], mask=mask)
    for c in range(3):
        n, mu, ss = _numpy_moments(x[mask[:, c], c : c + 1])
        np.testing.assert_array_equal(count[c], n[0])
        np.testing.assert_allclose(mean[c], mu[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(m2[c], ss[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal([count[3], mean[3], m2[3]], [0.0, 0.0, 0.0])


def test_empty_batch_gives_zeros_not_nan():
    for mask in (None, np.zeros((0, 3), bool)):
        summary = batch_moments(np.zeros((0, 3), "float32"), axes=[0], mask=mask)
        for value in summary:
            np.testing.assert_array_equal(value, np.zeros(3))


@pytest.mark.parametrize("name", list(SETS))
def test_merge_moments_equals_moments_of_the_union(name):
    sets = _sets(SETS[name])
    count, mean, m2 = _merge_all(sets)
    n, mu, ss = _numpy_moments(np.concatenate(sets))
    np.testing.assert_array_equal(count, n)
    assert _relative_error(mean, mu) < RTOL
    assert _relative_error(m2 / n, ss / n) < RTOL


def test_merge_moments_with_an_empty_side_returns_the_other():
    x = _sets(SETS["different_means"])[0]
    count, mean, _, m2 = batch_moments(x, axes=[0])
    summary = [np.asarray(t) for t in (count, mean, m2)]
    empty = [np.zeros(3, "float32"), np.full(3, 7.0, "float32"), np.zeros(3, "float32")]
    for merged in (merge_moments(*empty, *summary), merge_moments(*summary, *empty)):
        for got, want in zip(merged, summary):
            np.testing.assert_array_equal(got, want)  # bit-identical
    count, _, m2 = merge_moments(*empty, *empty)
    np.testing.assert_array_equal(count, 0.0)
    np.testing.assert_array_equal(m2, 0.0)


def test_merge_moments_along_matches_pairwise_merges():
    sets = _sets(SETS["unequal_sizes"])
    summaries = [_summary(x, axes=[0]) for x in sets]
    stacked = [np.stack([s[i] for s in summaries]).astype("float32") for i in range(3)]
    count, mean, m2 = merge_moments_along(*stacked)
    n, mu, ss = _numpy_moments(np.concatenate(sets))
    np.testing.assert_array_equal(count, n)
    assert _relative_error(mean, mu) < RTOL
    assert _relative_error(np.asarray(m2) / n, ss / n) < 2 * RTOL


def test_large_mean_beats_the_naive_formula():
    # The reason for Chan's formula: float32 E[x^2] - E[x]^2 on data with
    # mean 1e3 and std 1 has an error of the order of the variance itself.
    sets = _sets(SETS["large_mean"])
    count, _, m2 = _merge_all(sets)
    union = np.concatenate(sets)
    true_var = union.astype("float64").var(axis=0)
    ours = m2 / count
    naive = (np.mean(np.square(union), 0) - np.square(np.mean(union, 0))).astype("float64")
    assert _relative_error(ours, true_var) < RTOL
    assert np.max(np.abs(naive - true_var) / true_var) > 1e-2


def test_large_mean_needs_the_shift():
    # Merging plain float32 means (no shift/residual) is stable but carries
    # the means' own rounding (6e-5 at 1e3) into the between-set term: the
    # variance is then off by ~1e-5 relative, ten times the float32 target.
    sets = _sets(SETS["large_mean"])
    state = [np.zeros(3, "float32")] * 3
    for x in sets:
        count, mean, _, m2 = batch_moments(x, axes=[0])
        state = merge_moments(*state, count, mean, m2)
    plain = np.asarray(state[2], "float64") / np.asarray(state[0])
    true_var = np.concatenate(sets).astype("float64").var(axis=0)
    assert _relative_error(plain, true_var) > 5 * RTOL
    _, _, m2 = _merge_all(sets)
    assert _relative_error(m2 / np.asarray(state[0]), true_var) < RTOL


@pytest.mark.parametrize("name", list(SETS))
def test_merge_replica_summaries_equals_moments_of_the_union(name):
    # Each set is one replica's pending statistics, as AccumBatchNormalization
    # gathers them at the update: a float32 mean, its residual and m2.
    sets = _sets(SETS[name])
    stacked = [
        np.stack([np.asarray(t) for t in parts]).astype("float32")
        for parts in zip(*(batch_moments(x, axes=[0]) for x in sets))
    ]
    count, origin, residual, m2 = merge_replica_summaries(*stacked)
    n, mu, ss = _numpy_moments(np.concatenate(sets))
    np.testing.assert_array_equal(count, n)
    assert _relative_error(np.asarray(origin, "float64") + np.asarray(residual), mu) < RTOL
    assert _relative_error(np.asarray(m2) / n, ss / n) < 2 * RTOL


def test_merge_replica_summaries_ignores_empty_replicas():
    x = _sets([(3.0, 2.0, 20)])[0]
    one = [np.asarray(t) for t in batch_moments(x, axes=[0])]
    empty = [np.zeros_like(one[0])] * 4
    stacked = [np.stack([e, o]).astype("float32") for e, o in zip(empty, one)]
    count, origin, residual, m2 = merge_replica_summaries(*stacked)
    n, mu, ss = _numpy_moments(x)
    np.testing.assert_array_equal(count, n)
    assert _relative_error(np.asarray(origin, "float64") + np.asarray(residual), mu) < RTOL
    assert _relative_error(np.asarray(m2) / n, ss / n) < 2 * RTOL


def test_variance_from_moments_empty_is_zero_and_never_negative():
    var = variance_from_moments(
        np.array([0.0, 2.0, 4.0], "float32"), np.array([0.0, -1e-9, 8.0], "float32")
    )
    np.testing.assert_array_equal(var, [0.0, 0.0, 2.0])
