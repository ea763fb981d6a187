"""GradientAccumulateOptimizer: k micro-steps equal one inner step on the concatenated batch."""

import doctest
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import gradient_accumulator
from gradient_accumulator import optimizer as optimizer_module
from gradient_accumulator.agc import adaptive_clip_gradients
from gradient_accumulator.optimizer import GradientAccumulateOptimizer
from tests.helpers import (
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    KERAS_VERSION,
    OPTIMIZERS,
    assert_close,
    assert_diff_below,
    build_tagger,
    make_padded_sequences,
    max_abs_diff,
    run_script_module,
    script_results,
)

# The optimizers of the equivalence table here (of tests.helpers.OPTIMIZERS).
OPTIMIZER_NAMES = [
    "sgd_momentum",
    "adam",
    "adamw",
    "rmsprop_momentum",
    "adagrad",
    "lion",
    "adam_clipnorm_ema",
]
# How a micro-step is run: eager, inside a tf.function, XLA-compiled.
MODES = {
    "eager": lambda fn: fn,
    "function": tf.function,
    "xla": lambda fn: tf.function(fn, jit_compile=True),
}


# ----------------------------------------------------------------- helpers --


def _twin_models(build_model=None, seed=0):
    """Two models with identical weights: one to wrap, one for the reference."""
    build_model = build_model or _dense_model
    keras.utils.set_random_seed(seed)
    model = build_model()
    reference = build_model()
    reference.set_weights(model.get_weights())
    return model, reference


def _dense_model():
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )


def _embedding_model():
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(12, 3),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )


def _data(samples, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = rng.normal(size=(samples, 2)).astype("float32")
    return x, y


def _token_data(samples, seed=1):
    """Few distinct tokens, so that every batch repeats indices."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 12, size=(samples, 6)).astype("int32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def _gradients(model, x, y):
    """Gradients of the mean squared error over the batch ``(x, y)``."""
    with tf.GradientTape() as tape:
        loss = ops.mean(ops.square(model(x, training=True) - y))
    return tape.gradient(loss, model.trainable_variables)


def _micro_step(model, optimizer, mode="function"):
    def step(x, y):
        grads = _gradients(model, x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return MODES[mode](step)


def _reference_step(model, optimizer, x, y, densify=False):
    """One plain step on a (big) batch; ``densify`` merges sparse gradients."""
    grads = _gradients(model, x, y)
    if densify:
        grads = [tf.convert_to_tensor(g) for g in grads]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _values(variables):
    return [np.array(v) for v in variables]


def _assert_bit_identical(before, after):
    assert len(before) == len(after)
    for u, v in zip(before, after):
        np.testing.assert_array_equal(u, v)


def _train_and_compare(
    make_optimizer,
    accum_steps,
    updates,
    mode="function",
    build_model=None,
    data=_data,
    batch=4,
    densify=False,
):
    """Runs wrapper and reference side by side; checks every micro-step.

    Returns ``(max |diff| of weights, max |diff| of inner optimizer state)``
    after the last update.
    """
    model, reference = _twin_models(build_model)
    optimizer = GradientAccumulateOptimizer(make_optimizer(), accum_steps=accum_steps)
    reference_optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    reference_optimizer.build(reference.trainable_variables)
    step = _micro_step(model, optimizer, mode)
    x, y = data(accum_steps * batch * updates)
    inner = optimizer.inner_optimizer
    for update in range(updates):
        for i in range(accum_steps):
            before = _values(model.weights + inner.variables)
            start = (update * accum_steps + i) * batch
            step(x[start : start + batch], y[start : start + batch])
            if i < accum_steps - 1:
                # Not an update: weights and every inner state untouched.
                _assert_bit_identical(before, _values(model.weights + inner.variables))
        group = slice(update * accum_steps * batch, (update + 1) * accum_steps * batch)
        _reference_step(reference, reference_optimizer, x[group], y[group], densify)
        assert int(optimizer.iterations.numpy()) == update + 1
        assert_close(model.weights, reference.weights, FLOAT32_ATOL)
        assert_close(inner.variables, reference_optimizer.variables, FLOAT32_ATOL)
    return (
        max_abs_diff(model.weights, reference.weights),
        max_abs_diff(inner.variables, reference_optimizer.variables),
    )


# ------------------------------------------------------------- equivalence --


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_updates_equal_inner_step_on_concatenated_batch(name):
    _train_and_compare(OPTIMIZERS[name], accum_steps=3, updates=3)


@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_equivalence_eager_and_xla(name, mode):
    _train_and_compare(OPTIMIZERS[name], accum_steps=2, updates=2, mode=mode)


def test_accum_steps_one_is_bit_identical_to_inner_optimizer():
    model, reference = _twin_models()
    optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=1)
    reference_optimizer = keras.optimizers.Adam(0.01)
    x, y = _data(12)
    for start in range(0, 12, 4):
        batch = (x[start : start + 4], y[start : start + 4])
        _micro_step(model, optimizer, "eager")(*batch)
        _reference_step(reference, reference_optimizer, *batch)
    _assert_bit_identical(_values(model.weights), _values(reference.weights))
    assert int(optimizer.iterations.numpy()) == 3


def test_compiled_fit_equals_big_batch_fit():
    model, reference = _twin_models()
    # SGD with momentum: unlike Adam, it is not invariant to gradient scale.
    model.compile(
        optimizer=GradientAccumulateOptimizer(OPTIMIZERS["sgd_momentum"](), accum_steps=3),
        loss="mse",
    )
    reference.compile(optimizer=OPTIMIZERS["sgd_momentum"](), loss="mse")
    x, y = _data(36)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert_close(model.weights, reference.weights, FLOAT32_ATOL)


def test_variables_without_gradient_stay_untouched():
    model, reference = _twin_models()
    optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=2)
    optimizer.build(model.trainable_variables)
    head = model.layers[-1].trainable_variables
    first = _values(model.layers[0].weights)
    x, y = _data(8)
    for start in (0, 4):
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(model(x[start : start + 4]) - y[start : start + 4]))
        optimizer.apply_gradients(zip(tape.gradient(loss, head), head))
    _assert_bit_identical(first, _values(model.layers[0].weights))
    assert int(optimizer.iterations.numpy()) == 1
    assert not np.allclose(np.array(head[0]), np.array(reference.layers[-1].kernel))


def test_apply_accumulated_gradients_applies_partial_group():
    model, reference = _twin_models()
    optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=3)
    reference_optimizer = keras.optimizers.SGD(0.1)
    x, y = _data(20)
    step = _micro_step(model, optimizer, "eager")
    for start in range(0, 20, 4):
        step(x[start : start + 4], y[start : start + 4])
    assert int(optimizer.iterations.numpy()) == 1
    optimizer.apply_accumulated_gradients()
    optimizer.apply_accumulated_gradients()  # nothing left: no-op
    _reference_step(reference, reference_optimizer, x[:12], y[:12])
    _reference_step(reference, reference_optimizer, x[12:], y[12:])
    assert int(optimizer.iterations.numpy()) == 2
    assert_close(model.weights, reference.weights, FLOAT32_ATOL)


# ------------------------------------------------- schedules and callbacks --


def test_learning_rate_schedule_sees_updates():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(schedule), accum_steps=3)
    model, _ = _twin_models()
    step = _micro_step(model, optimizer)
    x, y = _data(28)
    for start in range(0, 28, 4):
        step(x[start : start + 4], y[start : start + 4])
    assert int(optimizer.iterations.numpy()) == 2
    np.testing.assert_allclose(float(optimizer.learning_rate.numpy()), 0.1 * 0.5**2, rtol=1e-6)


def test_learning_rate_settable_by_callbacks():
    model, _ = _twin_models()
    optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2)
    optimizer.learning_rate = 0.2
    assert float(optimizer.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.2)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = _data(16)
    callbacks = [
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
        # Never improves by 1e9, so it halves the rate after the second epoch.
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9),
    ]
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    assert float(optimizer.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.2 / 8)
    assert int(optimizer.iterations.numpy()) == 4


@keras.saving.register_keras_serializable(package="gradient_accumulator_tests")
def growing_accum_steps(update_count):
    """Two updates of one micro-step, then three micro-steps per update."""
    return ops.where(update_count < 2, 1, 3)


def test_scheduled_accum_steps():
    model, reference = _twin_models()
    optimizer = GradientAccumulateOptimizer(
        keras.optimizers.Adam(0.01), accum_steps=growing_accum_steps
    )
    reference_optimizer = keras.optimizers.Adam(0.01)
    x, y = _data(32)
    step = _micro_step(model, optimizer)
    for start in range(0, 32, 4):
        step(x[start : start + 4], y[start : start + 4])
    for start, stop in [(0, 4), (4, 8), (8, 20), (20, 32)]:
        _reference_step(reference, reference_optimizer, x[start:stop], y[start:stop])
    assert int(optimizer.iterations.numpy()) == 4
    assert_close(model.weights, reference.weights, FLOAT32_ATOL)
    restored = GradientAccumulateOptimizer.from_config(optimizer.get_config())
    assert restored.accum_steps is growing_accum_steps


def test_unregistered_schedule_is_refused_on_save():
    optimizer = GradientAccumulateOptimizer("sgd", accum_steps=lambda update: 2)
    with pytest.raises(ValueError, match=r"`accum_steps` is a callable .*register_keras"):
        optimizer.get_config()


# ------------------------------------------------------ clipping, sparse --


def test_agc_clips_the_accumulated_gradient():
    model, reference = _twin_models()
    optimizer = GradientAccumulateOptimizer(
        keras.optimizers.SGD(0.5), accum_steps=2, use_agc=True, clip_factor=0.02
    )
    reference_optimizer = keras.optimizers.SGD(0.5)
    x, y = _data(8)
    step = _micro_step(model, optimizer)
    step(x[:4], y[:4])
    step(x[4:], y[4:])
    grads = _gradients(reference, x, y)
    clipped = adaptive_clip_gradients(grads, reference.trainable_variables, 0.02, 1e-3)
    assert any(not np.allclose(g, c) for g, c in zip(grads, clipped))  # it clips
    reference_optimizer.apply_gradients(zip(clipped, reference.trainable_variables))
    assert_close(model.weights, reference.weights, FLOAT32_ATOL)


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_sparse_gradients_equal_densified_big_batch(name):
    model, _ = _twin_models(_embedding_model)
    x, _ = _token_data(4)
    assert isinstance(_gradients(model, x, np.zeros((4, 1), "float32"))[0], tf.IndexedSlices)
    _train_and_compare(
        OPTIMIZERS[name],
        accum_steps=3,
        updates=2,
        build_model=_embedding_model,
        data=_token_data,
        densify=True,
    )


def test_sparse_sgd_equals_keras_sparse_path():
    # Plain SGD scatter-adds IndexedSlices, which sums duplicates, as the
    # accumulator does: no densifying needed for the reference.
    _train_and_compare(
        lambda: keras.optimizers.SGD(0.1),
        accum_steps=3,
        updates=2,
        build_model=_embedding_model,
        data=_token_data,
    )


# --------------------------------------------------------- mixed precision --


def test_compile_wraps_in_loss_scale_optimizer_under_mixed_float16(mixed_float16):
    model, reference = _twin_models()
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=2),
        loss="mse",
    )
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, GradientAccumulateOptimizer)
    x, y = _data(16)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # LossScaleOptimizer forwards `iterations` to its inner optimizer from Keras 3.9 on.
    assert int(model.optimizer.inner_optimizer.iterations.numpy()) == 2
    assert_close(model.weights, reference.weights, FLOAT16_ATOL)


def test_static_loss_scale_of_inner_optimizer():
    model, reference = _twin_models()
    inner = keras.optimizers.SGD(0.1, loss_scale_factor=8.0)
    optimizer = GradientAccumulateOptimizer(inner, accum_steps=2)
    assert optimizer.loss_scale_factor == 8.0
    optimizer.build(model.trainable_variables)
    x, y = _data(8)
    for start in (0, 4):
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(model(x[start : start + 4]) - y[start : start + 4]))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    _reference_step(reference, keras.optimizers.SGD(0.1), x, y)
    assert_close(model.weights, reference.weights, FLOAT32_ATOL)
    # LossScaleOptimizer clears the factor that is actually applied. Keras
    # < 3.10 leaves it (and scales twice, plain Keras optimizers too): there,
    # clearing it through the wrapper is checked.
    keras.optimizers.LossScaleOptimizer(optimizer)
    if KERAS_VERSION < (3, 10):
        optimizer.loss_scale_factor = None
    assert inner.loss_scale_factor is None


def test_loss_scale_optimizer_inside_and_outside_is_refused(mixed_float16):
    # Keras >= 3.10 clears the inner factor at compile, which the wrapper
    # refuses there; before, the outer LossScaleOptimizer's build does it.
    model, _ = _twin_models()
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    with pytest.raises(
        ValueError,
        match=r"wraps a `LossScaleOptimizer` and is being wrapped in another.*"
        r"`auto_scale_loss=False`.*Received: (loss_scale_factor=None|"
        r"LossScaleOptimizer\(GradientAccumulateOptimizer\(LossScaleOptimizer\(Adam\)\)\))",
    ):
        model.compile(optimizer=GradientAccumulateOptimizer(inner, accum_steps=2), loss="mse")
        model.fit(*_data(8), batch_size=4, verbose=0)


def _loss_scaled(order, optimizer, accum_steps, initial_scale=2.0**15):
    """``(to compile, the LossScaleOptimizer)`` for one order of the two wrappers.

    ``inside``: ``GradientAccumulateOptimizer(LossScaleOptimizer(optimizer))``
    (compile with ``auto_scale_loss=False``); ``outside``: the wrapper alone,
    which ``compile`` wraps under mixed_float16 (here wrapped by hand).
    """
    if order == "inside":
        loss_scale = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=initial_scale)
        return GradientAccumulateOptimizer(loss_scale, accum_steps=accum_steps), loss_scale
    loss_scale = keras.optimizers.LossScaleOptimizer(
        GradientAccumulateOptimizer(optimizer, accum_steps=accum_steps),
        initial_scale=initial_scale,
    )
    return loss_scale, loss_scale


LOSS_SCALE_ORDERS = ["inside", "outside"]


def test_wrapped_by_a_loss_scale_optimizer_takes_its_role(mixed_float16):
    # The LossScaleOptimizer that compile adds calls the wrapper for the
    # loss (share, then its scale) and for the gradients; its scale is the one
    # used. Built in its first apply while running eagerly, the step has been
    # scaled already: a warning says to build first.
    model, _ = _twin_models()
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4),
        loss="mse",
        run_eagerly=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.optimizer.build(model.trainable_variables)
    loss = model.optimizer.scale_loss(tf.constant(1.0, "float16"))
    assert float(loss) == 2.0**15 / 4  # the first micro-step's share, then the scale
    model, _ = _twin_models()
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.SGD(0.1), accum_steps=4),
        loss="mse",
        run_eagerly=True,
    )
    with pytest.warns(
        UserWarning,
        match=r"builds it in its first `apply`, eagerly.*"
        r"`model.optimizer.build\(model.trainable_variables\)`",
    ):
        model.fit(*_data(8), batch_size=4, verbose=0)


def _loss_scale_runs(accum_steps, order="inside", run_eagerly=False):
    """Plain Keras at batch 32 and at the micro-batch, and the wrapper in ``order``.

    ``order`` as in :func:`_loss_scaled`: ``inside`` compiles
    ``GradientAccumulateOptimizer(LossScaleOptimizer(Adam))`` with
    ``auto_scale_loss=False``, ``outside`` compiles
    ``GradientAccumulateOptimizer(Adam)`` and lets Keras wrap it.

    Issue 17's setup: an MLP 8-16-1, mse, 64 samples N(0, 1), 3 epochs,
    mixed_float16, Keras's default initial scale. Adam's epsilon is raised
    from 1e-7 so that float16 rounding of gradient components near zero is
    not divided by their own magnitude.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(hidden))

    def adam():
        return keras.optimizers.Adam(0.01, epsilon=1e-4)

    reference = build()
    reference.compile(optimizer=adam(), loss="mse")
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    micro = build()
    micro.compile(optimizer=adam(), loss="mse")
    micro.fit(x, y, batch_size=32 // accum_steps, epochs=3, shuffle=False, verbose=0)
    model = build()
    if order == "inside":
        optimizer = GradientAccumulateOptimizer(
            keras.optimizers.LossScaleOptimizer(adam()), accum_steps=accum_steps
        )
        model.compile(optimizer, "mse", auto_scale_loss=False, run_eagerly=run_eagerly)
        loss_scale = optimizer.inner_optimizer
    else:
        optimizer = GradientAccumulateOptimizer(adam(), accum_steps=accum_steps)
        model.compile(optimizer, "mse", run_eagerly=run_eagerly)
        loss_scale = model.optimizer
    if KERAS_VERSION < (3, 5) or run_eagerly:
        # Built inside the first step otherwise (eagerly: after the first
        # `scale_loss`, which then cannot weight the loss): build first.
        model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=32 // accum_steps, epochs=3, shuffle=False, verbose=0)
    return reference, micro, model, optimizer, loss_scale


@pytest.mark.parametrize("order", LOSS_SCALE_ORDERS)
@pytest.mark.parametrize("accum_steps", [2, 4, 16], ids=["k2", "k4", "k16"])
def test_loss_scale_follows_the_big_batch(mixed_float16, accum_steps, order):
    # `outside` is what `compile(optimizer=GradientAccumulateOptimizer(Adam))`
    # builds under mixed_float16 (it ended at 16384 for k=4 before the wrapper
    # took the outer LossScaleOptimizer's role).
    reference, micro, model, optimizer, loss_scale = _loss_scale_runs(accum_steps, order)
    assert isinstance(loss_scale, keras.optimizers.LossScaleOptimizer)
    scale = loss_scale.dynamic_scale
    assert float(scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy()) == 32768.0
    if accum_steps > 2:
        # Plain Keras at the micro-batch overflows and halves its scale: a
        # micro-batch not weighted by its share of the group would.
        assert float(micro.optimizer.dynamic_scale.numpy()) < 32768.0
    assert int(optimizer.iterations.numpy()) == 6
    # LossScaleOptimizer forwards `iterations` to its inner optimizer from Keras 3.9 on.
    assert int(reference.optimizer.inner_optimizer.iterations.numpy()) == 6
    diff = max_abs_diff(model.get_weights(), reference.get_weights())
    assert_diff_below(diff, FLOAT16_ATOL)


def test_loss_scale_follows_the_big_batch_in_eager_fit_when_built_first(mixed_float16):
    reference, _, model, optimizer, loss_scale = _loss_scale_runs(4, "outside", run_eagerly=True)
    scale = loss_scale.dynamic_scale
    assert float(scale.numpy()) == float(reference.optimizer.dynamic_scale.numpy()) == 32768.0
    assert int(optimizer.iterations.numpy()) == 6
    diff = max_abs_diff(model.get_weights(), reference.get_weights())
    assert_diff_below(diff, FLOAT16_ATOL)


@pytest.mark.parametrize("order", LOSS_SCALE_ORDERS)
def test_non_finite_micro_step_skips_its_group(order):
    # Either order: the group's mean is checked once, as the big batch's.
    model, _ = _twin_models()
    optimizer, loss_scale = _loss_scaled(order, keras.optimizers.SGD(0.1), 2, initial_scale=8.0)
    variables = model.trainable_variables
    optimizer.build(variables)
    before = _values(model.weights)
    bad = [np.full(v.shape, np.inf, "float32") for v in variables]
    good = [np.ones(v.shape, "float32") * 8.0 for v in variables]  # scaled by 8
    optimizer.apply(bad, variables)
    optimizer.apply(good, variables)  # the group's update: skipped, scale halved
    _assert_bit_identical(before, _values(model.weights))
    assert float(loss_scale.dynamic_scale.numpy()) == 4.0
    # (The innermost optimizer's count: a LossScaleOptimizer's own stays 0 before Keras 3.9.)
    assert int(loss_scale.inner_optimizer.iterations.numpy()) == 0
    half = [g / 2 for g in good]  # scaled by 4
    optimizer.apply(half, variables)
    optimizer.apply(half, variables)
    assert int(loss_scale.inner_optimizer.iterations.numpy()) == 1
    assert_close(model.weights, [w - 0.1 for w in before], FLOAT32_ATOL)


def test_token_count_normaliser_makes_a_custom_loop_exact():
    """A tf.function loop passes each micro-batch's valid-token count to scale_loss."""
    x, tags, _ = make_padded_sequences()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build_tagger()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss_fn)
    reference.fit(x, tags, batch_size=32, epochs=1, shuffle=False, verbose=0)

    def run(pass_normaliser):
        model = build_tagger()
        optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(0.5), accum_steps=4)
        optimizer.build(model.trainable_variables)

        @tf.function
        def micro_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
                tokens = ops.sum(ops.cast(ops.not_equal(xb, 0), "float32"))
                if pass_normaliser:
                    scaled = optimizer.scale_loss(loss, normaliser=tokens)
                else:
                    scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for start in range(0, len(x), 8):
            micro_step(x[start : start + 8], tags[start : start + 8])
        return max_abs_diff(model.get_weights(), reference.get_weights())

    assert_diff_below(run(True), FLOAT32_ATOL)
    assert run(False) > 1e-3  # micro-batches counted equally: visibly not the big batch


def test_scale_loss_refuses_an_unbuilt_optimizer_in_eager_mode():
    optimizer = GradientAccumulateOptimizer("sgd", accum_steps=2)
    with pytest.raises(ValueError, match=r"build the optimizer first.*normaliser=3"):
        optimizer.scale_loss(ops.ones(()), normaliser=3)


def test_scale_loss_refuses_capacity_without_normaliser():
    optimizer = GradientAccumulateOptimizer("sgd", accum_steps=2)
    with pytest.raises(ValueError, match=r"needs it. Received: normaliser=None, capacity=4"):
        optimizer.scale_loss(ops.ones(()), capacity=4)


# -------------------------------------------------- state, serialization --


def test_variables_hold_accumulation_state():
    model, _ = _twin_models()
    optimizer = GradientAccumulateOptimizer("adam", accum_steps=4)
    optimizer.build(model.trainable_variables)
    # The accumulation state is TensorFlow variables named by TensorFlow's name
    # scopes, listed apart: `variables` holds Keras variables only (Keras code
    # reads their `path`, e.g. `model.get_state_tree()`).
    names = [v.name.removesuffix(":0") for v in optimizer.accumulation_variables]
    for weight in model.trainable_variables:
        assert any(n.endswith(weight.path.replace("/", "_") + "_accumulator") for n in names)
    assert any(n.endswith("/micro_step") for n in names)
    assert all(hasattr(v, "path") for v in optimizer.variables)
    ids = {id(v) for v in optimizer.variables}
    assert all(id(v) in ids for v in optimizer.inner_optimizer.variables)
    if hasattr(model, "get_state_tree"):  # Keras >= 3.6
        model.compile(optimizer, "mse")
        assert "optimizer_variables" in model.get_state_tree()


def test_config_round_trip():
    optimizer = GradientAccumulateOptimizer(
        keras.optimizers.AdamW(0.003, weight_decay=0.1),
        accum_steps=5,
        use_agc=True,
        clip_factor=0.05,
        eps=1e-4,
        name="accumulate",
    )
    config = optimizer.get_config()
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert isinstance(restored, GradientAccumulateOptimizer)
    assert restored.get_config() == config
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert restored.inner_optimizer.weight_decay == 0.1
    assert restored.name == "accumulate"


def test_keras_file_round_trip_mid_group(tmp_path):
    model, _ = _twin_models()
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=3),
        loss="mse",
    )
    x, y = _data(28)
    model.fit(x[:16], y[:16], batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, GradientAccumulateOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer._accumulator.micro_step.numpy()) == 1
    _assert_bit_identical(_values(model.optimizer.variables), _values(loaded.optimizer.variables))
    for m in (model, loaded):
        m.fit(x[16:], y[16:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    _assert_bit_identical(_values(model.weights), _values(loaded.weights))


def test_tf_checkpoint_resumes_mid_group(tmp_path):
    def run(model, optimizer, x, y):
        step = _micro_step(model, optimizer, "eager")
        for start in range(0, len(x), 4):
            step(x[start : start + 4], y[start : start + 4])

    x, y = _data(20)
    model, twin = _twin_models()
    optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=3)
    run(model, optimizer, x[:8], y[:8])  # two micro-steps of the first group
    prefix = tf.train.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "ckpt")
    run(model, optimizer, x[8:], y[8:])

    resumed = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=3)
    resumed.build(twin.trainable_variables)
    tf.train.Checkpoint(model=twin, optimizer=resumed).restore(prefix).assert_consumed()
    run(twin, resumed, x[8:], y[8:])
    assert int(resumed.iterations.numpy()) == 1
    _assert_bit_identical(_values(model.weights), _values(twin.weights))
    _assert_bit_identical(_values(optimizer.variables), _values(resumed.variables))


# ------------------------------------------------------------ bad input --

BAD_ARGUMENTS = {
    "optimizer_int": (
        dict(optimizer=42),
        r"`optimizer` must be a `keras.optimizers.Optimizer`.*Received: optimizer=42",
    ),
    "optimizer_unknown_name": (
        dict(optimizer="adamm"),
        r"`optimizer` must be .*Received: optimizer='adamm'",
    ),
    "optimizer_accumulates": (
        dict(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=4)),
        r"`accum_steps=4`.*Received: optimizer=Adam\(gradient_accumulation_steps=4\)",
    ),
    "optimizer_nested": (
        dict(optimizer=GradientAccumulateOptimizer("sgd", accum_steps=2)),
        r"product.*Received: optimizer=GradientAccumulateOptimizer\(accum_steps=2\)",
    ),
    "accum_steps_zero": (dict(accum_steps=0), r"Received: accum_steps=0"),
    "accum_steps_float": (dict(accum_steps=2.0), r"Received: accum_steps=2.0"),
    "accum_steps_bool": (dict(accum_steps=True), r"Received: accum_steps=True"),
    "use_agc_string": (
        dict(use_agc="yes"),
        r"`use_agc` must be a boolean. Received: use_agc='yes'",
    ),
    "clip_factor_negative": (
        dict(clip_factor=-1),
        r"`clip_factor` must be a float > 0. Received: clip_factor=-1",
    ),
    "clip_factor_string": (
        dict(clip_factor="0.1"),
        r"`clip_factor` must be a float > 0. Received: clip_factor='0.1'",
    ),
    "eps_zero": (dict(eps=0.0), r"`eps` must be a float > 0. Received: eps=0.0"),
    "clip_factor_without_agc": (
        dict(clip_factor=0.5),
        r"`clip_factor` only acts with `use_agc=True`.*Received: clip_factor=0.5, use_agc=False",
    ),
    "eps_nan": (dict(eps=float("nan")), r"`eps` must be a float > 0. Received: eps=nan"),
    "inner_argument": (
        dict(weight_decay=0.1),
        r"set it on the inner optimizer.*Received: weight_decay=0.1",
    ),
    "keras_accumulation": (
        dict(gradient_accumulation_steps=2),
        r"pass `accum_steps` instead. Received: gradient_accumulation_steps=2",
    ),
    "reduction": (dict(reduction="SUM"), r"always averaged.*Received: reduction='SUM'"),
    "unknown": (dict(foo=1), r"does not take an argument `foo`\. Its arguments.*Received: foo=1"),
    "typo": (
        dict(accum_step=4),
        r"does not take an argument `accum_step`\. Did you mean `accum_steps`\?.*"
        r"Received: accum_step=4",
    ),
    "lr_of_0.5": (dict(lr=0.1), r"set `learning_rate` on the inner optimizer.*Received: lr=0.1"),
    "decay_of_0.5": (dict(decay=1e-4), r"learning-rate schedule.*Received: decay=0.0001"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_refused(case):
    kwargs, message = BAD_ARGUMENTS[case]
    kwargs = {"optimizer": "sgd", "accum_steps": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        GradientAccumulateOptimizer(**kwargs)


def test_apply_without_variables_needs_build():
    optimizer = GradientAccumulateOptimizer("sgd", accum_steps=2)
    with pytest.raises(ValueError, match=r"must already be built"):
        optimizer.apply([tf.ones((2,))])


def test_docstring_example(monkeypatch):
    # Until `gradient_accumulator/__init__.py` re-exports the class (then this
    # line is a no-op), make the example's top-level import resolvable.
    monkeypatch.setattr(
        gradient_accumulator,
        "GradientAccumulateOptimizer",
        GradientAccumulateOptimizer,
        raising=False,
    )
    result = doctest.testmod(optimizer_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------- distributed --

# GradientAccumulateOptimizer under MirroredStrategy (tests/scripts/mirrored_optimizer.py),
# one process: case -> (updates, tolerance). Two replicas at the global
# micro-batch 8, accum_steps=4; the reference trains on one device at the
# global big batch 32. 64 samples for 2 epochs: 4 updates.
MIRRORED_CASES = {
    "loop_sgd_momentum": (4, FLOAT32_ATOL),
    "loop_adam": (4, FLOAT32_ATOL),
    "loop_adamw": (4, FLOAT32_ATOL),
    "loop_rmsprop": (4, FLOAT32_ATOL),
    "loop_schedule": (4, FLOAT32_ATOL),
    "loop_use_ema": (4, FLOAT32_ATOL),
    "loop_clipnorm": (4, FLOAT32_ATOL),
    "loop_global_clipnorm": (4, FLOAT32_ATOL),
    "loop_clipvalue": (4, FLOAT32_ATOL),
    "loop_agc": (4, FLOAT32_ATOL),
    # 80 samples, one epoch: groups of 4, 4 and 2 micro-steps, the last
    # applied by apply_accumulated_gradients after the loop.
    "loop_apply_rest": (3, FLOAT32_ATOL),
    "loop_sparse_sgd": (4, FLOAT32_ATOL),
    "loop_sparse_adam": (4, FLOAT32_ATOL),
    "fit_adam": (4, FLOAT32_ATOL),
    "fit_sgd_momentum": (4, FLOAT32_ATOL),
    "fit_global_clipnorm": (4, FLOAT32_ATOL),
    "fit_sparse_adam": (4, FLOAT32_ATOL),
    "fit_mixed_float16": (4, FLOAT16_ATOL),
    # Padded sequences, replicas with different token counts, scale_loss(normaliser=...).
    "loop_tokens": (4, FLOAT32_ATOL),
    # GradientAccumulateOptimizer(LossScaleOptimizer(Adam)), 3 epochs.
    "fit_loss_scale_inside": (6, FLOAT16_ATOL),
}


@pytest.fixture(scope="module")
def mirrored_results():
    results = script_results(run_script_module("mirrored_optimizer", list(MIRRORED_CASES)))
    assert results["replicas"] == 2
    return results["results"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MIRRORED_CASES))
def test_mirrored_strategy_two_replicas(mirrored_results, case):
    updates, atol = MIRRORED_CASES[case]
    result = mirrored_results[case]
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["updates"] == updates, result
    if case.startswith("fit_") and KERAS_VERSION < (3, 8):
        # Keras < 3.8's fit does not divide each replica's loss by the
        # replicas while summing their gradients: there plain Keras, and so
        # the wrapper it hands the gradients to, steps `replicas` times too far.
        pytest.skip("Keras < 3.8: fit under a strategy sums the replicas' mean losses")
    assert result["moved"] > 1e-3, result  # the reference trained
    if "unclipped_gap" in result:  # clipping must bite
        assert result["unclipped_gap"] > 1e-3, result
    if result["state_diff"] is not None:  # moments, EMA, ... of the inner optimizer
        assert result["state_diff"] < atol, result
    if "untouched_moved" in result:  # embedding rows no sample uses
        assert result["untouched_moved"] == 0.0, result
    if case == "fit_mixed_float16":
        assert result["outer"] == ["LossScaleOptimizer", "GradientAccumulateOptimizer"]
        assert result["scales"][0] == result["scales"][1], result
    if case == "fit_loss_scale_inside":
        assert result["scales"] == [32768.0, 32768.0], result
    assert_diff_below(result["diff"], atol, result)
