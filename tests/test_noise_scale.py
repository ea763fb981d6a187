"""The gradient noise scale (``noise_scale=True``) against its closed form.

Linear regression ``y = x . w* + e`` with ``x ~ N(0, I_d)`` and
``e ~ N(0, sigma^2)``, trained with the mean squared error at fixed weights
``w`` (SGD with learning rate 0): one sample's gradient is
``2 x (x . d - e)`` with ``d = w - w*``, so ``G = 2 d`` and
``tr(Sigma) = 4 ((d_dim + 1) |d|^2 + sigma^2 d_dim)`` exactly (Isserlis's
theorem: ``E[|x|^2 (x . d)^2] = (d_dim + 2) |d|^2``). Each update's estimates
are unbiased; their mean over many updates must land within its standard
error of those values.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import (
    NOISE_DIM,
    NOISE_TRUE_W,
    BatchLogs,
    build_dense,
    build_tagger,
    make_padded_sequences,
    make_regression_data,
    mean_and_error,
    noise_closed_form,
    noise_estimates_numpy,
    noise_regression,
    noise_regression_data,
    run_script_module,
    run_workers,
    script_results,
    unknown_length_dataset,
)


@pytest.mark.parametrize(
    "accum_steps, micro_batch, policy",
    [
        (4, 8, "float32"),
        (16, 2, "float32"),
        (128, 1, "float32"),
        (4, 8, "mixed_float16"),
        (4, 8, "jit"),
        (4, 8, "unknown_length"),
        (4, 8, "last"),
        (16, 2, "last"),
        (4, 8, "last_jit"),
        (4, 8, "last_unknown_length"),
    ],
    ids=[
        "k4-b8",
        "k16-b2",
        "k128-b1",
        "k4-b8-mixed_float16",
        "k4-b8-jit",
        "k4-b8-unknown_length",
        "k4-b8-last",
        "k16-b2-last",
        "k4-b8-last-jit",
        "k4-b8-last-unknown_length",
    ],
)
def test_estimates_are_the_closed_form_within_their_standard_error(
    accum_steps, micro_batch, policy, request
):
    # Under mixed_float16 the micro-batches' gradients are loss-scaled
    # float16 products: the estimates divide the scale out.
    if policy == "mixed_float16":
        request.getfixturevalue("mixed_float16")
    updates = 400 if accum_steps < 128 else 50
    options = {}
    if policy.startswith("last"):
        # The group's last micro-batch only: a sample of one per update,
        # whose trace estimate is ~5x noisier; twice the updates keep its
        # standard error well inside the bound below (at 400 updates it
        # would be 11-19% of the truth, depending on the data's seed).
        options["noise_scale_micro_batches"] = "last"
        updates *= 2
    if policy.endswith("jit"):
        options["jit_compile"] = True
    if policy.endswith("unknown_length"):
        options["unknown_length"] = True
    _, logs = noise_regression(accum_steps, micro_batch, updates, **options)
    assert len(logs) == updates
    trace, signal = noise_closed_form()
    for key, truth in (("noise_scale_trace", trace), ("noise_scale_signal", signal)):
        mean, error = mean_and_error([entry[key] for entry in logs])
        # The test can fail: the standard error is a small part of the value.
        assert error < 0.15 * truth, (key, mean, error, truth)
        assert abs(mean - truth) < 4 * error, (key, mean, error, truth)


@pytest.mark.parametrize(
    "measured, every, mode",
    [
        ("all", 1, "graph"),
        ("all", 1, "jit"),
        ("all", 1, "unknown_length"),
        ("last", 1, "graph"),
        ("last", 1, "jit"),
        ("last", 1, "unknown_length"),
        ("all", 3, "graph"),
        ("all", 3, "jit"),
        ("all", 3, "unknown_length"),
        ("last", 3, "graph"),
        ("last", 3, "jit"),
        ("last", 3, "unknown_length"),
    ],
)
def test_each_update_s_estimates_are_numpy_s_from_the_measured_micro_batches(measured, every, mode):
    # Each update's logged estimates are numpy's (`_numpy_estimates`).
    # With noise_scale_every=3, updates 0, 3, 6 only: the others log the
    # previous figures.
    accum_steps, micro_batch, updates = 4, 8, 7
    options = {"jit_compile": mode == "jit", "unknown_length": mode == "unknown_length"}
    _, logs = noise_regression(
        accum_steps,
        micro_batch,
        updates,
        noise_scale_micro_batches=measured,
        noise_scale_every=every,
        **options,
    )
    x, _ = noise_regression_data(updates * accum_steps * micro_batch)
    assert len(logs) == updates
    for update, entry in enumerate(logs):
        measured_update = update - update % every
        expected = _numpy_estimates(measured_update, measured, accum_steps, micro_batch, len(x))
        for key, value in expected.items():
            np.testing.assert_allclose(entry[key], value, rtol=1e-4, err_msg=(key, update))


def _numpy_estimates(group, measured, accum_steps, micro_batch, num_samples):
    """Group ``group``'s estimates on noise_regression_data(num_samples), in
    numpy, on one device (:func:`tests.helpers.noise_estimates_numpy`): the
    group's micro-batches, all measured or the last one."""
    count = accum_steps if measured == "all" else 1
    return noise_estimates_numpy(group, accum_steps, micro_batch, count, num_samples)


def test_the_measured_updates_follow_the_count_across_epochs_calls_and_train_on_batch():
    # noise_scale_every=3 measures updates 0, 3, 6, ... of the accumulator's
    # count, whichever call made them: two epochs of 7 updates with
    # steps_per_execution=2 (Keras logs every second update and the
    # epoch's last), two groups through train_on_batch (updates 14 and 15:
    # the second measured), then an epoch of fit from update 16. The group
    # runner counts in Python within a call: a count that went out of step
    # with the accumulator's (or started again at each call) would log
    # another group's estimates.
    accum_steps, micro_batch, groups, every = 4, 8, 7, 3
    x, y = noise_regression_data(groups * accum_steps * micro_batch)
    inputs = keras.Input((NOISE_DIM,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = GradientAccumulateModel(
        accum_steps=accum_steps,
        noise_scale=True,
        noise_scale_every=every,
        inputs=inputs,
        outputs=dense(inputs),
    )
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=2)

    def expected(update):
        # The group of data update u trained on: each epoch, and the last
        # fit, start at group 0 (as do train_on_batch's, updates 14 and 15).
        measured_update = update - update % every
        if measured_update < 2 * groups:
            group = measured_update % groups
        elif measured_update < 2 * groups + 2:
            group = measured_update - 2 * groups
        else:
            group = measured_update - (2 * groups + 2)
        return _numpy_estimates(group, "all", accum_steps, micro_batch, len(x))

    def check(entry, update):
        for key, value in expected(update).items():
            np.testing.assert_allclose(entry[key], value, rtol=1e-4, err_msg=(key, update))

    logs = BatchLogs()
    model.fit(x, y, batch_size=micro_batch, epochs=2, shuffle=False, verbose=0, callbacks=[logs])
    # Per epoch, logs after updates 1, 3, 5 and 6 of the epoch.
    logged = [epoch * groups + u for epoch in range(2) for u in (1, 3, 5, 6)]
    assert len(logs.batches) == len(logged)
    for entry, update in zip(logs.batches, logged):
        check(entry, update)
    for group in range(2):
        for i in range(group * accum_steps, (group + 1) * accum_steps):
            batch = slice(i * micro_batch, (i + 1) * micro_batch)
            entry = model.train_on_batch(x[batch], y[batch], return_dict=True)
        check(entry, 2 * groups + group)
    assert int(model._accumulator.update_count.numpy()) == 2 * groups + 2
    logs = BatchLogs()
    model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0, callbacks=[logs])
    assert len(logs.batches) == 4
    for entry, u in zip(logs.batches, (1, 3, 5, 6)):
        check(entry, 2 * groups + 2 + u)


@pytest.mark.parametrize("mode", ["graph", "unknown_length"])
def test_micro_batches_of_other_token_counts_and_an_empty_one_are_numpy_s_estimates(mode):
    # A masked tagger at fixed weights (SGD(0)): micro-batch i's gradient
    # g_i is its mean over its n_i valid tokens, computed here on a plain
    # Keras twin; S_small and 1 / b are the means over the micro-batches
    # with tokens (an all-padding one, n_i = 0, has no gradient to measure:
    # counted, it would pull both means to 0), B = sum n_i.
    accum_steps, micro_batch, updates = 4, 4, 3
    x, tags, _ = make_padded_sequences(updates * accum_steps * micro_batch)
    x[micro_batch : 2 * micro_batch] = 0  # The first group's second micro-batch: all padding.
    model = build_tagger(GradientAccumulateModel, accum_steps=accum_steps, noise_scale=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.0), loss)
    logs = BatchLogs()
    if mode == "unknown_length":
        model.fit(unknown_length_dataset(x, tags, micro_batch), verbose=0, callbacks=[logs])
    else:
        model.fit(x, tags, batch_size=micro_batch, shuffle=False, verbose=0, callbacks=[logs])
    twin = build_tagger()
    grads, tokens = [], []
    for start in range(0, len(x), micro_batch):
        xi, ti = x[start : start + micro_batch], tags[start : start + micro_batch]
        mask = (xi != 0).astype("float32")
        with tf.GradientTape() as tape:
            per_token = keras.losses.sparse_categorical_crossentropy(
                ti, twin(xi, training=True), from_logits=True
            )
            mean = tf.reduce_sum(per_token * mask) / max(mask.sum(), 1.0)
        flat = [tf.convert_to_tensor(g) for g in tape.gradient(mean, twin.trainable_variables)]
        grads.append(np.concatenate([g.numpy().ravel() for g in flat]).astype("float64"))
        tokens.append(mask.sum())
    assert len(logs.batches) == updates and tokens[1] == 0
    for update, entry in enumerate(logs.batches):
        group = slice(update * accum_steps, (update + 1) * accum_steps)
        g, n = np.array(grads[group]), np.array(tokens[group])
        big = np.sum(((n[:, None] * g).sum(axis=0) / n.sum()) ** 2)
        measured = n > 0
        small = np.mean(np.sum(g[measured] ** 2, axis=1))
        inverse_small, inverse_big = np.mean(1.0 / n[measured]), 1.0 / n.sum()
        gap = inverse_small - inverse_big
        trace = (small - big) / gap
        signal = (inverse_small * big - inverse_big * small) / gap
        np.testing.assert_allclose(entry["noise_scale_trace"], trace, rtol=1e-4, err_msg=update)
        np.testing.assert_allclose(entry["noise_scale_signal"], signal, rtol=1e-4, err_msg=update)


def test_the_logged_noise_scale_is_the_ratio_of_the_moving_averages():
    decay = 0.9
    _, logs = noise_regression(4, 8, 50, noise_scale_smoothing=decay)
    averages = np.zeros(2)
    for entry in logs:
        current = np.array([entry["noise_scale_trace"], entry["noise_scale_signal"]])
        averages = decay * averages + (1 - decay) * current
        np.testing.assert_allclose(entry["noise_scale"], averages[0] / averages[1], rtol=1e-4)
    trace, signal = noise_closed_form()
    # After 50 updates the ratio is near B_simple (the moving averages hold ~10).
    assert 0.5 < logs[-1]["noise_scale"] / (trace / signal) < 2.0


def test_a_group_of_one_micro_batch_keeps_the_previous_figures():
    # 2 whole groups of 4 and a last group of 1 micro-batch: no estimate there.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 9, NOISE_DIM)).astype("float32")
    y = (x @ NOISE_TRUE_W).astype("float32")
    model = build_dense(GradientAccumulateModel, accum_steps=4, noise_scale=True)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    logs = BatchLogs()
    x5 = np.concatenate([x, np.zeros((len(x), 1), "float32")], axis=1)
    model.fit(x5, y, batch_size=8, shuffle=False, verbose=0, callbacks=[logs])
    assert len(logs.batches) == 3
    assert logs.batches[2]["noise_scale_trace"] == logs.batches[1]["noise_scale_trace"]
    assert np.isfinite(logs.batches[1]["noise_scale"])


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"accum_steps": 1}, "one micro-batch per update on one replica"),
        ({"accum_steps": 4, "noise_scale_smoothing": 1.0}, "must be below 1"),
        ({"accum_steps": 4, "noise_scale_smoothing": 1.5}, "must be a float in"),
        ({"accum_steps": 4, "coupled_loss": "replica"}, "has no gradient of its own"),
        ({"accum_steps": 4, "noise_scale_micro_batches": "first"}, 'must be "all" or "last"'),
        ({"accum_steps": 4, "noise_scale_every": 0}, "must be an integer >= 1"),
        ({"accum_steps": 4, "noise_scale_every": 2.0}, "must be an integer >= 1"),
    ],
    ids=[
        "accum_steps_1",
        "smoothing_1",
        "smoothing_out_of_range",
        "coupled_loss",
        "micro_batches",
        "every_0",
        "every_float",
    ],
)
def test_what_has_no_noise_scale_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        model = build_dense(GradientAccumulateModel, noise_scale=True, **arguments)
        model.compile("sgd", "mse")


def test_a_regularized_model_is_refused():
    x, y = make_regression_data(64)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(1, kernel_regularizer="l2")(inputs)
    model = GradientAccumulateModel(accum_steps=4, noise_scale=True, inputs=inputs, outputs=outputs)
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="no regularizer"):
        model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mirrored", "multi_worker"])
def test_two_replicas_log_numpy_s_estimates_of_every_replica_s_micro_batches(kind):
    # Each replica's micro-batch is a small batch of 4 (a global
    # micro-batch's first half is replica 0's), B the global group: every
    # update's logged estimates are numpy's from those small batches, rtol
    # 1e-4 (tests/scripts/mirrored_noise_scale.py, 9 updates per case).
    # "last": each replica's last micro-batch is measured; every 4: updates
    # 0, 4, 8 only, the others log the previous figures. MirroredStrategy
    # over two logical CPUs, or two workers on loopback (each worker counts
    # the updates, and must choose as the other does). Against the closed
    # form: the one-device tests above (the same estimator).
    if kind == "mirrored":
        outputs = [run_script_module("mirrored_noise_scale", [])]
        cases = {"k4": (4, 8, 1), "k1": (1, 2, 1), "k4_last": (4, 2, 1), "k4_every4": (4, 8, 4)}
    else:
        outputs = [out for _, out, _ in run_workers("mirrored_noise_scale", args=(kind,))]
        cases = {"k4": (4, 8, 1), "k4_every4": (4, 8, 4)}
    for output in outputs:
        results = script_results(output)
        assert results["replicas"] == 2
        for case, (accum_steps, measured, every) in cases.items():
            logs = results[case]
            assert len(logs) == results["updates"] == 9, case
            for update, entry in enumerate(logs):
                expected = noise_estimates_numpy(
                    update - update % every,
                    small_batches=2 * accum_steps,
                    small_batch=4,
                    measured=measured,
                    num_samples=9 * accum_steps * 8,
                )
                for key, value in expected.items():
                    np.testing.assert_allclose(
                        entry[key], value, rtol=1e-4, err_msg=(kind, case, key, update)
                    )


def test_the_arguments_are_saved(tmp_path):
    # In the configuration, and through a .keras file (gradient_norm too).
    model = build_dense(
        GradientAccumulateModel,
        accum_steps=4,
        noise_scale=True,
        noise_scale_smoothing=0.8,
        noise_scale_micro_batches="last",
        noise_scale_every=3,
        gradient_norm=True,
    )
    model.compile("sgd", "mse")
    x, y = make_regression_data(64)
    model.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    saved = (("noise_scale", True), ("noise_scale_smoothing", 0.8))
    for name, value in (*saved, ("noise_scale_micro_batches", "last"), ("noise_scale_every", 3)):
        assert model.get_config()[name] == getattr(loaded, name) == value
    assert loaded.gradient_norm is True
    history = loaded.fit(x, y, batch_size=8, verbose=0)
    assert {"noise_scale", "gradient_norm"} <= set(history.history)


def test_the_schedule_answers_in_python_where_known_and_as_a_tensor_where_not():
    # One rule (updates 0, m, 2m, ... of the count), three answers: the
    # runner's Python one for the coming group (the count read once, then
    # counted), the tensor of an update traced without it, and a micro-step's
    # (the last micro-batch only with noise_scale_micro_batches="last").
    from gradient_accumulator.engine import MicroStep
    from gradient_accumulator.noise_scale import Schedule

    count = tf.Variable(4, dtype="int64")
    schedule = Schedule(every=3)
    assert [schedule.next_group(count) for _ in range(5)] == [False, False, True, False, False]
    count.assign(7)
    assert schedule.next_group(count) is True  # counted from 4 (9), not read again
    schedule.forget()
    assert schedule.next_group(count) is False  # read again: 7
    assert [bool(schedule.update_measured(count.assign(c))) for c in (0, 1, 3, 5)] == [
        True,
        False,
        True,
        False,
    ]
    assert schedule.update_measured(count, known=False) is False
    assert Schedule(every=1).update_measured(count) is True

    last = Schedule(every=1, last_only=True)
    assert last.micro_batch_measured(MicroStep(False, True, 4.0), count) is False
    assert last.micro_batch_measured(MicroStep(True, False, 4.0), count) is True
    ends = tf.constant(True)
    assert last.micro_batch_measured(MicroStep(ends, False, 4.0), count) is ends
    count.assign(2)
    measured = Schedule(every=2, last_only=True).micro_batch_measured(
        MicroStep(ends, False, 4.0), count
    )
    assert bool(measured) is True
    count.assign(3)
    measured = Schedule(every=2, last_only=True).micro_batch_measured(
        MicroStep(ends, False, 4.0), count
    )
    assert bool(measured) is False
