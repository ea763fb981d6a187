"""AccumBatchNormalization against Keras BatchNormalization on the concatenated batch, and numpy."""

import inspect
import json
import os
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import steps
from gradient_accumulator.layers import AccumBatchNormalization
from tests.helpers import MEASURED, assert_close, run_script_module, script_results

# Keras ships its BatchNormalization tests and its layer test harness only
# under `keras.src`; no public route reaches them. Used here, nowhere else.
from keras.src import testing as keras_testing  # noqa: E402  isort: skip

try:
    from keras.src.layers.normalization import (  # noqa: E402  isort: skip
        batch_normalization_test as keras_bn_test,
    )
except ImportError:  # Keras wheels before 3.15 ship no tests.
    keras_bn_test = None

# Tolerances. Statistics are float32: a mean or variance computed from
# O(100) samples is within a few ulps (relative ~1e-6, float32 eps 1.2e-7) of
# float64 numpy, whichever of Chan's merge (ours) or two-pass moments on the
# whole batch (Keras) computed it. Relative errors below are measured with a
# floor of 1 on the reference (absolute for quantities near 0).
STATS_RTOL = 2e-6
# Normalized outputs are O(1): float32 -> 1e-5 absolute; half precision
# outputs are rounded to the output dtype (float16 ~1e-3, bfloat16 ~1e-2).
OUTPUT_ATOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}

# The accumulation state beyond Keras's four weights, in `weights` order.
ACCUMULATION_NAMES = [
    "pending_count",
    "pending_shift",
    "pending_mean_offset",
    "pending_m2",
    "micro_step",
]


# --------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------


def _micro_batches(spec, channels=4, seed=0, dtype="float32"):
    """Micro-batches from ``[(loc, scale, batch_size), ...]``, shape (b, C)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(loc, scale, (size, channels)).astype(dtype) for loc, scale, size in spec]


def _built_pair(input_shape, accum_steps, seed=0, **kwargs):
    """An AccumBatchNormalization and a Keras BatchNormalization, built with
    the same arguments and the same random (non-default) weights."""
    accum = AccumBatchNormalization(accum_steps=accum_steps, **kwargs)
    plain = keras.layers.BatchNormalization(**kwargs)
    plain.build(input_shape)
    accum.build(input_shape)
    rng = np.random.default_rng(seed)
    weights = [rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in plain.weights]
    plain.set_weights(weights)
    accum.set_weights(weights)  # Keras's weights only: the conversion path
    return accum, plain


def _stats(layer):
    return [np.array(layer.moving_mean), np.array(layer.moving_variance)]


def _numpy_moving_stats(initial, x, axis, momentum):
    """float64 Keras update rule on the whole batch ``x``."""
    x = np.moveaxis(np.asarray(x, "float64"), axis, -1).reshape(-1, np.shape(x)[axis])
    mean, variance = x.mean(axis=0), x.var(axis=0)
    return [
        momentum * np.asarray(initial[0], "float64") + (1 - momentum) * mean,
        momentum * np.asarray(initial[1], "float64") + (1 - momentum) * variance,
    ]


def _relative_error(actual, expected):
    actual = np.asarray(actual, "float64")
    expected = np.asarray(expected, "float64")
    return float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1.0)))


def _assert_stats_close(actual, expected, rtol=STATS_RTOL):
    """Asserts relative errors <= rtol and records them for the test summary."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    for name, got, want in zip(("moving_mean", "moving_variance"), actual, expected):
        error = _relative_error(got, want)
        key = f"{test} {name} (relative)"
        MEASURED[key] = max(error, MEASURED.get(key, 0.0))
        assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol:.0e}"


def _assert_identical(before, after):
    for got, want in zip(after, before):
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------
# Exactness: moving statistics of the whole accumulated batch
# --------------------------------------------------------------------------

# (micro-batch spec, what it exercises). Momentum 0 makes the moving
# statistics equal the batch statistics, the sharpest comparison; the update
# rule itself is tested with momentum 0.9 below.
EXACTNESS_CASES = {
    # Between-micro-batch spread dominates the variance.
    "different_means": [(-3.0, 0.5, 8), (0.0, 1.0, 8), (5.0, 2.0, 8)],
    "unequal_sizes": [(1.0, 1.0, 3), (2.0, 0.5, 11), (-1.0, 3.0, 6)],
    # float32 E[x^2] - E[x]^2 would be off by ~1e-2 here.
    "large_mean": [(1e3, 1.0, 16), (1e3 + 0.5, 1.0, 16), (1e3, 1.0, 16)],
}


@pytest.mark.parametrize("case", list(EXACTNESS_CASES))
def test_moving_statistics_are_those_of_the_concatenated_batch(case):
    batches = _micro_batches(EXACTNESS_CASES[case])
    accum, plain = _built_pair((None, 4), len(batches), momentum=0.0)
    initial = _stats(plain)
    for x in batches:
        accum(x, training=True)
    whole = np.concatenate(batches)
    plain(whole, training=True)

    reference = _numpy_moving_stats(initial, whole, -1, momentum=0.0)
    errors = {
        "vs_numpy": [_relative_error(a, r) for a, r in zip(_stats(accum), reference)],
        "vs_keras": [_relative_error(a, k) for a, k in zip(_stats(accum), _stats(plain))],
    }
    print(f"{case}: [moving_mean, moving_variance] relative errors {errors}")
    _assert_stats_close(_stats(accum), reference)
    _assert_stats_close(_stats(accum), _stats(plain))


def test_mean_of_micro_batch_variances_is_far_off():
    # What gradient-accumulator 0.5.2 did: average the per-micro-batch
    # variances, dropping the spread between micro-batch means.
    batches = _micro_batches(EXACTNESS_CASES["different_means"])
    accum, _ = _built_pair((None, 4), len(batches), momentum=0.0)
    for x in batches:
        accum(x, training=True)
    true_variance = np.concatenate(batches).astype("float64").var(axis=0)
    old_variance = np.mean([x.astype("float64").var(axis=0) for x in batches], 0)
    old_error = _relative_error(old_variance, true_variance)
    our_error = _relative_error(accum.moving_variance, true_variance)
    print(f"mean of per-micro-batch variances: {old_error:.2f}; ours: {our_error:.1e}")
    assert old_error > 0.5
    assert our_error <= STATS_RTOL


def test_update_rule_uses_momentum_once_per_update():
    batches = _micro_batches([(2.0, 1.5, 5), (-1.0, 0.5, 7)])
    accum, plain = _built_pair((None, 4), 2, momentum=0.9)
    initial = _stats(plain)
    for x in batches:
        accum(x, training=True)
    plain(np.concatenate(batches), training=True)
    whole = np.concatenate(batches)
    _assert_stats_close(_stats(accum), _numpy_moving_stats(initial, whole, -1, 0.9))
    _assert_stats_close(_stats(accum), _stats(plain))


# (input shape of one micro-batch, axis): Dense, Conv1D/2D/3D feature maps,
# channels-first with positive and negative axis.
RANKS = {
    "dense": ((6, 3), -1),
    "conv1d": ((4, 5, 3), -1),
    "conv2d": ((3, 4, 4, 3), -1),
    "conv3d": ((2, 3, 3, 3, 3), -1),
    "channels_first_2d": ((3, 3, 4, 4), 1),
    "channels_first_negative_axis": ((3, 3, 4, 4), -3),
}


@pytest.mark.parametrize("case", list(RANKS))
def test_any_rank_and_axis_matches_keras(case):
    shape, axis = RANKS[case]
    rng = np.random.default_rng(1)
    batches = [
        rng.normal(loc, 1.0 + i, shape).astype("float32") for i, loc in enumerate((-2.0, 0.5, 3.0))
    ]
    accum, plain = _built_pair((None, *shape[1:]), 3, axis=axis, momentum=0.5)
    initial = _stats(plain)
    for x in batches:
        out = accum(x, training=True)
        # Forward pass: each micro-batch normalized with its own statistics,
        # as Keras BN does on that micro-batch (its state is restored below).
        expected = keras.layers.BatchNormalization.from_config(plain.get_config())
        expected.build(x.shape)
        expected.set_weights(plain.get_weights())
        np.testing.assert_allclose(out, expected(x, training=True), atol=OUTPUT_ATOL["float32"])
    whole = np.concatenate(batches)
    plain(whole, training=True)
    _assert_stats_close(_stats(accum), _stats(plain))
    _assert_stats_close(_stats(accum), _numpy_moving_stats(initial, whole, axis, momentum=0.5))


# Training output and its gradients: those of Keras BN on the micro-batch.
# float32 gradients of O(1) values through the normalization: ~1e-6; 1e-5
# absolute leaves room for the different (exact) order of the reductions.
GRADIENT_ATOL = 1e-5


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_training_gradients_match_keras_on_the_micro_batch(masked):
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(3.0, 2.0, (6, 5, 3)).astype("float32"))
    mask = tf.constant(rng.uniform(size=(6, 5)) < 0.7) if masked else None
    upstream = tf.constant(rng.normal(size=(6, 5, 3)).astype("float32"))
    accum, plain = _built_pair((None, 5, 3), 4)
    results = []
    for layer in (accum, plain):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, mask=mask, training=True)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
        results.append([np.asarray(t) for t in (out, *grads)])
    assert_close(results[0], results[1], atol=GRADIENT_ATOL)


@pytest.mark.parametrize(
    "policy, input_dtype",
    [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")],
)
def test_half_precision_in_same_dtype_out_float32_statistics(policy, input_dtype):
    batches = [
        tf.cast(x, input_dtype) for x in _micro_batches([(3.0, 2.0, 8), (-1.0, 1.0, 8)], seed=2)
    ]
    accum, plain = _built_pair((None, 4), 2, momentum=0.0, dtype=policy)
    initial = _stats(plain)
    outputs = [accum(x, training=True) for x in batches]
    assert {o.dtype.name for o in outputs} == {input_dtype}
    assert {accum.moving_mean.dtype, accum.moving_variance.dtype} == {"float32"}
    assert {getattr(accum, name).dtype for name in ACCUMULATION_NAMES[:-1]} == {"float32"}
    # The statistics of the half-precision values, computed in float32.
    whole = np.concatenate([tf.cast(x, "float32").numpy() for x in batches])
    _assert_stats_close(_stats(accum), _numpy_moving_stats(initial, whole, -1, 0.0))
    expected = keras.layers.BatchNormalization.from_config(plain.get_config())
    expected.build((None, 4))
    expected.set_weights(plain.get_weights())
    np.testing.assert_allclose(
        tf.cast(outputs[0], "float32"),
        tf.cast(expected(batches[0], training=True), "float32"),
        atol=OUTPUT_ATOL[input_dtype],
    )


def test_masked_entries_are_left_out_of_the_statistics():
    rng = np.random.default_rng(3)
    batches, masks = [], []
    for loc, lengths in ((0.0, (5, 2, 4)), (4.0, (1, 5)), (-2.0, (3, 3, 0, 5))):
        x = rng.normal(loc, 1.0, (len(lengths), 5, 3)).astype("float32")
        mask = np.arange(5)[None, :] < np.array(lengths)[:, None]
        x[~mask] = 100.0  # padding that would wreck the statistics
        batches.append(x)
        masks.append(mask)
    accum, plain = _built_pair((None, 5, 3), 3, momentum=0.0)
    initial = _stats(plain)
    for x, mask in zip(batches, masks):
        accum(x, mask=mask, training=True)
    valid = np.concatenate([x[m] for x, m in zip(batches, masks)])
    _assert_stats_close(_stats(accum), _numpy_moving_stats(initial, valid, -1, 0.0))
    # Keras's masked branch divides by count + 1e-7: ~1e-8 relative here.
    plain(np.concatenate(batches), mask=np.concatenate(masks), training=True)
    _assert_stats_close(_stats(accum), _stats(plain))


def test_fully_masked_micro_batch_changes_nothing():
    x = _micro_batches([(1.0, 2.0, 12)])[0].reshape(3, 4, 4)
    empty = np.zeros((2, 4), bool)
    runs = []
    for with_empty in (False, True):
        layer, _ = _built_pair((None, 4, 4), 2)
        with steps.update_step_scope(tf.constant(False)):
            if with_empty:
                layer(x[:2], mask=empty, training=True)
            layer(x, training=True)
        layer.apply_pending_statistics(True)
        runs.append(layer.get_weights())
    _assert_identical(runs[0], runs[1])


# --------------------------------------------------------------------------
# When the moving statistics change
# --------------------------------------------------------------------------

STEP_MODES = ["eager", "tf_function", "jit_compile"]


def _maybe_compiled(fn, mode):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=mode == "jit_compile")


@pytest.mark.parametrize("mode", STEP_MODES)
def test_on_its_own_updates_once_every_accum_steps_calls(mode):
    batches = _micro_batches([(i - 3.0, 1.0 + 0.2 * i, 4) for i in range(7)])
    accum, plain = _built_pair((None, 4), 3, momentum=0.8)
    train = _maybe_compiled(lambda x: accum(x, training=True), mode)
    micro_steps = []
    for i, x in enumerate(batches):
        before = _stats(accum)
        train(tf.constant(x))
        micro_steps.append(int(accum.micro_step.numpy()))
        if (i + 1) % 3:
            _assert_identical(before, _stats(accum))  # bit-identical
        else:
            assert not np.array_equal(before[1], _stats(accum)[1])
            plain(np.concatenate(batches[i - 2 : i + 1]), training=True)
            _assert_stats_close(_stats(accum), _stats(plain))
    assert micro_steps == [1, 2, 0, 1, 2, 0, 1]
    assert float(accum.pending_count.numpy()[0]) == 4.0


@pytest.mark.parametrize("mode", STEP_MODES)
def test_inside_an_update_step_scope_only_the_caller_applies(mode):
    batches = _micro_batches([(-1.0, 1.0, 6), (2.0, 3.0, 4), (0.5, 0.5, 5)])
    accum, plain = _built_pair((None, 4), 2, momentum=0.7)

    def micro_step(x, is_update_step):
        # What GradientAccumulateModel.train_step does.
        with steps.update_step_scope(is_update_step):
            accum(x, training=True)
        accum.apply_pending_statistics(is_update_step)

    micro_step = _maybe_compiled(micro_step, mode)
    # accum_steps=2 on the layer, but the caller decides: three micro-steps.
    for x in batches[:2]:
        before = accum.get_weights()
        micro_step(tf.constant(x), tf.constant(False))
        after = accum.get_weights()
        _assert_identical(before[:4], after[:4])
        assert int(accum.micro_step.numpy()) == 0  # the layer counts nothing
    pending = accum.get_weights()[4:]
    micro_step(tf.constant(batches[2]), tf.constant(True))
    plain(np.concatenate(batches), training=True)
    _assert_stats_close(_stats(accum), _stats(plain))
    assert pending[0][0] == 10.0
    for value in accum.get_weights()[4:]:
        np.testing.assert_array_equal(value, 0)


def test_apply_pending_statistics_semantics():
    batches = _micro_batches([(-1.0, 1.0, 6), (2.0, 3.0, 4)])
    accum, plain = _built_pair((None, 4), 4, momentum=0.5)
    with steps.update_step_scope(tf.constant(False)):
        for x in batches:
            accum(x, training=True)
    before = accum.get_weights()
    accum.apply_pending_statistics(tf.constant(False))  # not an update step
    _assert_identical(before, accum.get_weights())
    accum.apply_pending_statistics(None)  # flush, e.g. at the end of an epoch
    plain(np.concatenate(batches), training=True)
    _assert_stats_close(_stats(accum), _stats(plain))
    flushed = accum.get_weights()
    accum.apply_pending_statistics(True)  # nothing pending: nothing changes
    _assert_identical(flushed, accum.get_weights())


def test_shared_layer_pools_both_calls_of_a_step():
    a, b = _micro_batches([(-2.0, 1.0, 5), (3.0, 2.0, 7)])
    accum, plain = _built_pair((None, 4), 2, momentum=0.0)
    with steps.update_step_scope(tf.constant(True)):
        accum(a, training=True)
        accum(b, training=True)
    accum.apply_pending_statistics(tf.constant(True))
    plain(np.concatenate([a, b]), training=True)
    _assert_stats_close(_stats(accum), _stats(plain))


def _two_bn_model(accum_steps=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = AccumBatchNormalization(accum_steps=accum_steps, name="bn_in")(inputs)
    h = keras.layers.Dense(4)(h)
    h = AccumBatchNormalization(accum_steps=accum_steps, name="bn_hidden")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_layers_of_one_model_update_on_the_same_step():
    model = _two_bn_model()
    rng = np.random.default_rng(4)
    layers = [model.get_layer("bn_in"), model.get_layer("bn_hidden")]
    for step in range(4):
        before = [_stats(layer) for layer in layers]
        x = rng.normal(step, 1.0, (8, 5)).astype("float32")
        model.train_on_batch(x, rng.normal(size=(8, 1)))
        changed = [not np.array_equal(b[0], _stats(layer)[0]) for b, layer in zip(before, layers)]
        assert changed == [step % 2 == 1] * 2


def test_inference_changes_no_state():
    model = _two_bn_model()
    rng = np.random.default_rng(5)
    x = rng.normal(2.0, 1.0, (8, 5)).astype("float32")
    model.train_on_batch(x, np.zeros((8, 1)))  # leaves a pending group
    before = model.get_weights()
    model.predict(x, verbose=0)
    model.evaluate(x, np.zeros((8, 1)), verbose=0)
    model(x, training=False)
    _assert_identical(before, model.get_weights())


def test_trainable_false_means_inference_and_frozen_state():
    accum, _ = _built_pair((None, 4), 2)
    x = _micro_batches([(3.0, 2.0, 8)])[0]
    accum.trainable = False
    before = accum.get_weights()
    out = accum(x, training=True)
    np.testing.assert_array_equal(out, accum(x, training=False))
    accum.apply_pending_statistics(True)
    _assert_identical(before, accum.get_weights())
    assert len(accum.trainable_weights) == 0


def test_synchronized_without_strategy_is_a_no_op():
    x = _micro_batches([(1.0, 2.0, 8), (-1.0, 1.0, 8)])
    runs = []
    for synchronized in (False, True):
        accum, _ = _built_pair((None, 4), 2, synchronized=synchronized)
        outputs = [accum(b, training=True) for b in x]
        runs.append([*outputs, *accum.get_weights()])
    _assert_identical(runs[0], runs[1])


# --------------------------------------------------------------------------
# Weights, configuration, saving
# --------------------------------------------------------------------------


def test_weights_keep_keras_order_then_accumulation_state():
    accum, plain = _built_pair((None, 3), 2)
    assert [w.name for w in accum.weights] == [
        *[w.name for w in plain.weights],
        *ACCUMULATION_NAMES,
    ]
    accum(np.ones((2, 3), "float32"), training=True)  # something pending
    accum.set_weights(plain.get_weights())  # Keras's four: state emptied
    _assert_identical(plain.get_weights(), accum.get_weights()[:4])
    for value in accum.get_weights()[4:]:
        np.testing.assert_array_equal(value, 0)
    full = [w + 1 for w in accum.get_weights()]
    accum.set_weights(full)
    _assert_identical(full, accum.get_weights())
    with pytest.raises(ValueError, match="weight list of length 3"):
        accum.set_weights(full[:3])


def test_accum_steps_one_has_only_keras_weights():
    accum, plain = _built_pair((None, 3), 1)
    assert [w.name for w in accum.weights] == [w.name for w in plain.weights]
    assert isinstance(accum, keras.layers.BatchNormalization)


# Keras's BatchNormalization takes these from Keras 3.14 on; with earlier
# Keras, AccumBatchNormalization accepts them but keeps Keras's arguments only.
RENORM_ARGUMENTS = {"renorm", "renorm_clipping", "renorm_momentum"}
KERAS_HAS_RENORM = "renorm" in inspect.signature(keras.layers.BatchNormalization).parameters

# Non-default values for every constructor argument.
FULL_CONFIG = dict(
    accum_steps=3,
    axis=1,
    momentum=0.9,
    epsilon=1e-5,
    center=False,
    scale=True,
    beta_initializer="ones",
    gamma_initializer=keras.initializers.Constant(2.0),
    moving_mean_initializer="ones",
    moving_variance_initializer=keras.initializers.Constant(3.0),
    beta_regularizer="l2",
    gamma_regularizer=keras.regularizers.L1(0.01),
    beta_constraint="non_neg",
    gamma_constraint=keras.constraints.MaxNorm(2.0),
    synchronized=True,
    renorm=False,
    renorm_clipping=None,
    renorm_momentum=0.5,
    name="accum_bn",
)


def test_get_config_covers_every_argument_and_round_trips():
    layer = AccumBatchNormalization(**FULL_CONFIG)
    config = layer.get_config()
    arguments = set(inspect.signature(AccumBatchNormalization).parameters) - {"kwargs"}
    keras_arguments = set(inspect.signature(keras.layers.BatchNormalization).parameters) - {
        "kwargs"
    }
    assert keras_arguments <= arguments
    if not KERAS_HAS_RENORM:
        arguments -= RENORM_ARGUMENTS
        assert not RENORM_ARGUMENTS & set(config)
    assert arguments <= set(config)
    assert config["accum_steps"] == 3
    clone = AccumBatchNormalization.from_config(json.loads(json.dumps(config)))
    assert clone.get_config() == config
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is AccumBatchNormalization
    assert revived.get_config() == config


def test_keras_file_round_trip_keeps_the_pending_group(tmp_path):
    model = _two_bn_model(accum_steps=3)
    rng = np.random.default_rng(6)
    x = rng.normal(1.0, 2.0, (8, 5)).astype("float32")
    model.train_on_batch(x, np.zeros((8, 1)))  # one micro-step of three
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.get_layer("bn_in"), AccumBatchNormalization)
    assert loaded.get_layer("bn_in").get_config() == model.get_layer("bn_in").get_config()
    _assert_identical(model.get_weights(), loaded.get_weights())
    assert int(loaded.get_layer("bn_in").micro_step.numpy()) == 1
    for m in (model, loaded):
        for _ in range(2):
            m.get_layer("bn_in")(x, training=True)
    _assert_identical(_stats(model.get_layer("bn_in")), _stats(loaded.get_layer("bn_in")))


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "accum_steps, received",
    [(0, "0"), (-2, "-2"), (2.0, "2.0"), (True, "True"), ("4", "'4'"), (None, "None")],
)
def test_bad_accum_steps(accum_steps, received):
    with pytest.raises(
        ValueError,
        match=rf"`accum_steps` must be an integer >= 1, or 'auto' .*\. "
        rf"Received: accum_steps={received}$",
    ):
        AccumBatchNormalization(accum_steps=accum_steps)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(momentum=1.5), r"`momentum` must be a float in \[0, 1\]\. Received: momentum=1\.5$"),
        (dict(momentum=-0.1), r"Received: momentum=-0\.1$"),
        (dict(momentum="0.9"), r"Received: momentum='0\.9'$"),
        (dict(momentum=float("nan")), r"Received: momentum=nan$"),
        (dict(epsilon=0.0), r"`epsilon` must be a float > 0\. Received: epsilon=0\.0$"),
        (dict(epsilon=-1e-3), r"Received: epsilon=-0\.001$"),
    ],
    ids=["momentum_gt_1", "momentum_lt_0", "momentum_str", "momentum_nan", "eps_0", "eps_neg"],
)
def test_bad_momentum_and_epsilon(kwargs, message):
    # Keras's BatchNormalization takes these and trains on without a word.
    with pytest.raises(ValueError, match=message):
        AccumBatchNormalization(accum_steps=2, **kwargs)


def test_axis_must_be_an_integer():
    with pytest.raises(ValueError, match=r"`axis` must be an integer.*Received: axis=\[1, 2\]"):
        AccumBatchNormalization(axis=[1, 2])


@pytest.mark.parametrize("axis", [2, -3])
def test_axis_out_of_range_for_the_input(axis):
    layer = AccumBatchNormalization(accum_steps=2, axis=axis)
    with pytest.raises(
        ValueError,
        match=rf"`axis` must be in \[-2, 2\).*Received: axis={axis} for input_shape=\(4, 3\)",
    ):
        layer(np.ones((4, 3), "float32"), training=True)


def test_unknown_channel_dimension():
    layer = AccumBatchNormalization(accum_steps=2)
    with pytest.raises(
        ValueError, match=r"must be known.*Received: axis=-1 for input_shape=\(None, None\)"
    ):
        layer.build((None, None))


def test_renorm_needs_accum_steps_one():
    with pytest.raises(
        ValueError, match=r"Use `renorm=False`.*Received: renorm=True, accum_steps=2"
    ):
        AccumBatchNormalization(accum_steps=2, renorm=True)
    if KERAS_HAS_RENORM:
        assert AccumBatchNormalization(accum_steps=1, renorm=True).renorm
        return
    installed = keras.__version__.replace(".", r"\.")
    with pytest.raises(
        ValueError,
        match=rf"`renorm` needs Keras >= 3\.14 \(installed: {installed}\)\. Received: renorm=True",
    ):
        AccumBatchNormalization(accum_steps=1, renorm=True)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_mask_of_the_wrong_rank(accum_steps):
    layer = AccumBatchNormalization(accum_steps=accum_steps)
    with pytest.raises(
        ValueError,
        match=r"`mask` must have one dimension less than `inputs`.*"
        r"Received: mask\.shape=\(4, 5, 3\), inputs\.shape=\(4, 5, 3\)",
    ):
        layer(np.ones((4, 5, 3), "float32"), mask=np.ones((4, 5, 3), bool), training=True)


# --------------------------------------------------------------------------
# Keras's own harness and BatchNormalization tests
# --------------------------------------------------------------------------


class _LayersWithAccumBatchNormalization:
    """`keras.src.layers` with BatchNormalization replaced by this layer."""

    # accum_steps defaults to 1: the class itself is the drop-in.
    BatchNormalization = AccumBatchNormalization

    def __getattr__(self, name):
        return getattr(keras.layers, name)


if keras_bn_test is None:

    @pytest.mark.skip(reason=f"Keras {keras.__version__} ships no BatchNormalization tests")
    def test_keras_batchnormalization_suite_at_accum_steps_one():
        """Stands for the class below where the Keras wheel has no tests."""

else:

    class TestKerasBatchNormalizationSuiteAtAccumStepsOne(keras_bn_test.BatchNormalizationTest):
        """Every test Keras ships for BatchNormalization, run on this layer.

        Keras's test module refers to the layer as ``layers.BatchNormalization``;
        the module's ``layers`` is swapped for each test, so every test case,
        unmodified, builds ``AccumBatchNormalization()`` (``accum_steps=1``).
        """

        def setUp(self):
            super().setUp()
            keras.utils.set_random_seed(0)
            patcher = mock.patch.object(
                keras_bn_test, "layers", _LayersWithAccumBatchNormalization()
            )
            patcher.start()
            self.addCleanup(patcher.stop)
            assert keras_bn_test.layers.BatchNormalization is AccumBatchNormalization


class TestKerasLayerHarnessWithAccumulation(keras_testing.TestCase):
    """Keras's layer harness (serialization, symbolic call, fit, mixed precision)."""

    def test_accumulating_layer(self):
        for input_shape in ((4, 3), (2, 4, 4, 3)):
            self.run_layer_test(
                AccumBatchNormalization,
                init_kwargs={"accum_steps": 2, "gamma_regularizer": "l2"},
                call_kwargs={"training": True},
                input_shape=input_shape,
                expected_output_shape=input_shape,
                expected_num_trainable_weights=2,
                expected_num_non_trainable_weights=2 + len(ACCUMULATION_NAMES),
                expected_num_seed_generators=0,
                expected_num_losses=1,
                supports_masking=True,
            )


# --------------------------------------------------------------------------
# With GradientAccumulateModel
# --------------------------------------------------------------------------


def _small_cnn(bn_layer, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, name="conv_a")(inputs)
    h = bn_layer(name="bn_a")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(4, 3, name="conv_b")(h)
    h = bn_layer(name="bn_b")(h)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(h))
    return inputs, outputs


def test_gradient_accumulate_model_first_group_matches_keras_big_batch():
    from gradient_accumulator import GradientAccumulateModel

    accum_steps, micro_batch = 3, 4
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 2.0, (accum_steps * micro_batch, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(accum_steps * micro_batch, 1)).astype("float32")

    plain = keras.Model(*_small_cnn(keras.layers.BatchNormalization))
    plain.compile(optimizer="sgd", loss="mse")
    inputs, outputs = _small_cnn(lambda name: AccumBatchNormalization(accum_steps, name=name))
    model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    for source, target in zip(plain.layers, model.layers):  # same weights
        target.set_weights(source.get_weights())
    before = _stats(model.get_layer("bn_a"))
    before_b = _stats(model.get_layer("bn_b"))

    model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0)
    plain.train_on_batch(x, y)

    after = _stats(model.get_layer("bn_a"))
    assert not np.array_equal(before[0], after[0])
    _assert_stats_close(after, _stats(plain.get_layer("bn_a")))
    # The second BN (its input depends on the micro-batch BN forward pass,
    # so no big-batch equality) updated on the same step, once.
    assert float(model.get_layer("bn_b").pending_count.numpy()[0]) == 0.0
    assert not np.array_equal(before_b[0], _stats(model.get_layer("bn_b"))[0])


def test_gradient_accumulate_model_deeper_layer_gets_the_statistics_it_received():
    """bn_b's input depends on bn_a's per-micro-batch forward pass: compare with
    the exact statistics of the inputs bn_b actually received in the group."""
    from gradient_accumulator import GradientAccumulateModel

    accum_steps, micro_batch = 3, 4
    rng = np.random.default_rng(8)
    x = rng.normal(1.0, 2.0, (accum_steps * micro_batch, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(accum_steps * micro_batch, 1)).astype("float32")
    inputs, outputs = _small_cnn(lambda name: AccumBatchNormalization(accum_steps, name=name))
    model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    # A Keras-BN twin with the same weights computes, in training mode, what
    # bn_b receives for each micro-batch (the weights are fixed within a group).
    twin = keras.Model(*_small_cnn(keras.layers.BatchNormalization))
    for source, target in zip(model.layers, twin.layers):
        target.set_weights(source.get_weights()[: len(target.get_weights())])
    probe = keras.Model(twin.input, twin.get_layer("bn_b").input)
    received = np.concatenate(
        [
            np.asarray(probe(x[i : i + micro_batch], training=True))
            for i in range(0, len(x), micro_batch)
        ]
    )
    initial = _stats(model.get_layer("bn_b"))
    model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0)
    _assert_stats_close(
        _stats(model.get_layer("bn_b")),
        _numpy_moving_stats(initial, received, -1, model.get_layer("bn_b").momentum),
    )


def _input_bn_model(accum_steps, momentum=0.5):
    """AccumBatchNormalization on the raw input: its inputs are the data itself."""
    from gradient_accumulator import GradientAccumulateModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    normalized = AccumBatchNormalization(accum_steps, momentum=momentum, name="bn")(inputs)
    model = GradientAccumulateModel(
        accum_steps=accum_steps, inputs=inputs, outputs=keras.layers.Dense(1)(normalized)
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_model_boundary_partial_group_resume_and_predict_in_between(tmp_path):
    # 11 micro-batches of 4 with accum_steps=4: groups [0:16], [16:32] and the
    # epoch's last, shorter group [32:44].
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(44, 3)) * [1.0, 3.0, 0.5] + np.arange(44)[:, None] / 4.0).astype(
        "float32"
    )
    y = rng.normal(size=(44, 1)).astype("float32")
    expected = [np.zeros(3), np.ones(3)]
    for start, stop in ((0, 16), (16, 32), (32, 44)):
        expected = _numpy_moving_stats(expected, x[start:stop], -1, 0.5)

    class PredictInBetween(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.predict(x[:4], verbose=0)  # must not advance anything

    uninterrupted = _input_bn_model(4)
    uninterrupted.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[PredictInBetween()])
    _assert_stats_close(_stats(uninterrupted.get_layer("bn")), expected)
    assert float(uninterrupted.get_layer("bn").pending_count.numpy()[0]) == 0.0

    first = _input_bn_model(4)
    for start in range(0, 24, 4):  # a run that stops two micro-batches into the second group
        first.train_on_batch(x[start : start + 4], y[start : start + 4])
    assert float(first.get_layer("bn").pending_count.numpy()[0]) == 8.0
    path = tf.train.Checkpoint(model=first).save(str(tmp_path / "ckpt"))
    resumed = _input_bn_model(4)
    tf.train.Checkpoint(model=resumed).restore(path)
    resumed.fit(x[24:], y[24:], batch_size=4, shuffle=False, verbose=0)
    _assert_stats_close(_stats(resumed.get_layer("bn")), expected)


# --------------------------------------------------------------------------
# Across replicas (fresh process: logical devices must be set before TF runs)
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_synchronized_under_mirrored_strategy_uses_the_global_batch():
    # tests/scripts/mirrored_synchronized_bn.py: two replicas on logical CPUs.
    results = script_results(run_script_module("mirrored_synchronized_bn", timeout=300))
    # Same forward/backward as Keras's synchronized BN: float32 rounding only.
    assert results["trainable_max_abs_diff"] <= 1e-5
    for case, reference in (
        ("plain_fit", "numpy"),
        ("model_fit", "numpy"),
        ("unequal_shards", "numpy_large"),
    ):
        per_replica = [[np.array(copy) for copy in statistic] for statistic in results[case]]
        # Both replicas hold the same values, up to the last bit: the two
        # logical CPUs share one thread pool, whose reductions may split
        # differently from one call to the next (observed: 1 ulp, 1 run in 2).
        for copies in per_replica:
            np.testing.assert_allclose(copies[0], copies[1], rtol=2e-7, atol=0)
        _assert_stats_close([c[0] for c in per_replica], results[reference])
