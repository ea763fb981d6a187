"""micro_batch_size="auto": fit states the update's batch and falls back when memory runs out.

Out-of-memory errors are TensorFlow's ``ResourceExhaustedError`` raised by an
op of the model (``tests.helpers``: a ``MemoryError`` in a ``tf.py_function``,
at once), made where a test wants them: above a micro-batch size (a model
whose whole batch does not fit and whose quarter does), or once at a given
forward pass (the first or last micro-step of a group), or in the
optimizer's update; and a real one (an allocation refused by TensorFlow's
capped CPU allocator) in a process of its own. The reference is plain Keras
``fit`` at the stated batch (float32: 1e-6, the sums' rounding; float16 and
float8 at ``tests.helpers``' tolerances), or, where layers see micro-batches
(BatchNormalization, Dropout) or to show that a run is exact,
``accum_steps`` at the micro-batch the fall-backs end at.
"""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from tests.helpers import (
    FLOAT8_KERNEL_RTOL,
    FLOAT8_STATE_RTOL,
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    TAG_CLASSES,
    TAG_LENGTH,
    TAG_VOCABULARY,
    BatchLogs,
    OutOfMemoryAbove,
    OutOfMemoryAtCalls,
    OutOfMemoryInUpdate,
    assert_diff_below,
    float8_differences,
    make_float8_data,
    make_padded_sequences,
    make_regression_data,
    max_abs_diff,
    run_python,
    run_script_module,
    script_results,
    unknown_length_dataset,
)
from tests.test_coupled import info_nce, pairs

BATCH = 32
X, Y = make_regression_data(88)  # batches of 32, 32, 24: the epoch's last one shorter
EPOCHS = 2


def build(
    cls=keras.Model,
    oom=None,
    batchnorm=False,
    dropout=False,
    constraint=None,
    activation="tanh",
    **kwargs,
):
    """A small MLP, the same weights at every call; ``oom`` (a layer) after its hidden layer."""
    steps_per_execution = kwargs.pop("steps_per_execution", 1)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation=activation, kernel_constraint=constraint)(inputs)
    if oom is not None:
        hidden = oom(hidden)
    if batchnorm:
        hidden = keras.layers.BatchNormalization()(hidden)
    if dropout:
        hidden = keras.layers.Dropout(0.3)(hidden)
    model = cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


def auto(**kwargs):
    return build(GradientAccumulateModel, micro_batch_size="auto", **kwargs)


def fit(model, data="arrays", batch=BATCH, **kwargs):
    if data == "unknown length":
        return model.fit(unknown_length_dataset(X, Y, batch), epochs=EPOCHS, verbose=0, **kwargs)
    if data == "dataset":
        dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch)
        return model.fit(dataset, epochs=EPOCHS, verbose=0, **kwargs)
    return model.fit(X, Y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)


def changes(model):
    return [(change.update, change.old, change.new) for change in model.micro_batch_changes]


def assert_trains_as(reference, model, history, reference_history, atol=FLOAT32_ATOL):
    assert_diff_below(max_abs_diff(reference.get_weights(), model.get_weights()), atol)
    for name in ("loss", "mae"):
        np.testing.assert_allclose(
            history.history[name], reference_history.history[name], atol=atol
        )
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


DATA_PATHS = ["arrays", "dataset", "unknown length", "steps_per_execution 2"]


@pytest.mark.parametrize("data", DATA_PATHS)
def test_falls_back_to_the_micro_batch_that_fits_and_trains_as_the_big_batch(data):
    # The whole batch (32) and its half do not fit, its quarter does: the
    # first group falls back twice, then every group runs at 8 (the short
    # last batch of 24 as three micro-batches).
    kwargs = {"steps_per_execution": 2} if data == "steps_per_execution 2" else {}
    data = "arrays" if kwargs else data
    # Plain Keras counts one update too many on data of unknown length (the
    # step that finds the data's end), and Keras < 3.7 at an epoch's end that
    # `steps_per_execution` does not divide: the reference is arrays' at
    # steps_per_execution=1.
    reference = build()
    reference_history = fit(reference, "arrays" if data == "unknown length" else data)
    model = auto(oom=OutOfMemoryAbove(8), **kwargs)
    history = fit(model, data)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]
    assert history.history["micro_batch_size"] == [8] * EPOCHS


def test_a_model_that_fits_runs_the_whole_batch_with_no_fall_back():
    reference = build()
    reference_history = fit(reference)
    model = auto()
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == []
    assert history.history["micro_batch_size"] == [32] * EPOCHS


def test_falls_back_to_one_sample_at_a_batch_of_128():
    # The limits of the mode: a batch of 128 that fits only one sample at a
    # time, seven fall-backs in the first group, 128 micro-steps a group.
    x, y = make_regression_data(128, seed=4)
    reference = build()
    reference_history = reference.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0)
    model = auto(oom=OutOfMemoryAbove(1))
    history = model.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0)
    assert_trains_as(reference, model, history, reference_history)
    assert [new for _, _, new in changes(model)] == [64, 32, 16, 8, 4, 2, 1]


def test_mixed_float16_falls_back_and_trains_as_the_big_batch():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = build()
        reference_history = fit(reference)
        model = auto(oom=OutOfMemoryAbove(8))
        history = fit(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # float16 activations: the micro-batches' sums round apart from the batch's.
    assert_trains_as(reference, model, history, reference_history, atol=2e-3)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]


@pytest.mark.parametrize(
    "calls, expected",
    [
        # The first micro-step of the first group (the whole batch).
        ({0}, [(0, 32, 16)]),
        # Then the retry's last micro-step, after its first has added its
        # gradients to the sums (which the retry must start without).
        ({0, 2}, [(0, 32, 16), (0, 16, 8)]),
        # The first micro-step of the epoch's short last group (24 rows as
        # two micro-batches of 12): it falls to 24's next divisor, 12.
        ({0, 5}, [(0, 32, 16), (2, 16, 12)]),
    ],
    ids=["first micro-step", "last micro-step", "a later group"],
)
def test_a_group_that_fails_at_any_micro_step_is_run_again_from_its_start(calls, expected):
    reference = build()
    reference_history = fit(reference)
    model = auto(oom=OutOfMemoryAtCalls(calls))
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == expected


def test_a_failed_try_leaves_statistics_seeds_and_metrics_as_they_were():
    # BatchNormalization's moving statistics and Dropout's seeds are written
    # by every micro-step, the metrics too: after two failed tries the run
    # equals one that trained at micro-batch 8 from the start.
    reference = build(GradientAccumulateModel, accum_steps=4, batchnorm=True, dropout=True)
    reference_history = fit(reference, batch=8)
    model = auto(oom=OutOfMemoryAbove(8), batchnorm=True, dropout=True)
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]


# ------------------------------------------ fall-backs in the middle of training --
# Epoch 2's first group (update 3: 88 or 96 samples at 32 are three groups
# an epoch) runs out of memory at the whole batch (the model's 4th training
# pass), then at its retry's second micro-step of 16, after the first has
# added its gradients (and whatever else the case sums: maxima, token counts)
# to the sums, which the retry at 8 must start without.
MIDDLE = {3, 5}
MIDDLE_CHANGES = [(3, 32, 16), (3, 16, 8)]


def float8_mlp(cls=keras.Model, oom=None, **kwargs):
    """``tests.helpers.build_float8``'s float8 16-32-4 MLP, ``oom`` between its layers; compiled."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", use_bias=False)(inputs)
    if oom is not None:
        hidden = oom(hidden)
    model = cls(inputs=inputs, outputs=keras.layers.Dense(4, use_bias=False)(hidden), **kwargs)
    with warnings.catch_warnings():
        # "Layer ... does not have a `quantize` method implemented" (the input, the oom layer).
        warnings.simplefilter("ignore", UserWarning)
        model.quantize("float8")
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def fit_float8(model, batch=32):
    x, y = make_float8_data(96)  # each micro-batch of 8 has another largest magnitude
    return model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)


def assert_float8_as(reference, model):
    """The same updates; state and kernels within float8's tolerances; the amax histories moved.

    Six updates wrote six entries, not all the same.
    """
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    differences = float8_differences(reference, model)
    assert differences["state"] < FLOAT8_STATE_RTOL, differences
    assert differences["kernel"] < FLOAT8_KERNEL_RTOL, differences
    amax = np.asarray(model.layers[1].inputs_amax_history)
    assert np.count_nonzero(amax) == 6 and len(set(amax[amax > 0])) > 1, amax


def test_float8_falls_back_in_the_middle_of_training_and_keeps_the_big_batch_s_scales():
    # Float8 Dense layers: each update writes their scales and amax
    # histories (the variables marked overwrite_with_gradient) as the maximum
    # over the group's micro-batches, the big batch's value, and their kernels
    # as the sum. The reference is plain Keras at the stated batch, compared as
    # the repository's float8 tests compare (tests/test_engine.py,
    # tests.helpers.float8_differences), relative to each kind's largest
    # value: the state to FLOAT8_STATE_RTOL (the same maxima, up to float32
    # rounding of the weights they come from), the kernels to
    # FLOAT8_KERNEL_RTOL (float32 sums in another order, which the next
    # forward pass quantises to float8, where one ulp may flip a rounding).
    # The fixed mode is no exact reference here (epoch 1 ran at 32, epoch 2
    # at 8): see the next test. A retry that kept the failed try's sums
    # would show in the kernels; its maxima would not (the retry's micro-
    # batches hold the same rows, a maximum taken twice is the same).
    reference = float8_mlp()
    fit_float8(reference)
    model = float8_mlp(
        GradientAccumulateModel, micro_batch_size="auto", oom=OutOfMemoryAtCalls(MIDDLE)
    )
    history = fit_float8(model)
    assert changes(model) == MIDDLE_CHANGES
    assert history.history["micro_batch_size"] == [32, 8]
    assert_float8_as(reference, model)


def test_float8_after_fall_backs_is_the_fixed_mode_at_the_micro_batch_they_end_at():
    # The first group falls back 32 -> 16 -> 8 (its retry at 16 out of
    # memory after its first micro-step took its maxima and summed its
    # kernels' gradients), then every group runs at 8: the micro-batches, in
    # the order, of accum_steps=4 at batch 8, whose float32 and float8
    # operations it repeats: equal on every variable, scales and histories
    # included (observed 0.0; FLOAT32_ATOL, the sums' rounding, the margin).
    reference = float8_mlp(GradientAccumulateModel, accum_steps=4)
    fit_float8(reference, batch=8)
    model = float8_mlp(
        GradientAccumulateModel, micro_batch_size="auto", oom=OutOfMemoryAtCalls({0, 2})
    )
    fit_float8(model)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert_diff_below(max_abs_diff(reference.weights, model.weights), FLOAT32_ATOL)


def test_float8_under_xla_is_the_fixed_mode_at_the_micro_batch_in_force():
    # Under XLA the sums, the float8 maxima among them, go in and out of the
    # micro-steps' programs and are written once per group: the maximum of a
    # group's micro-batches is taken from the carried value, not the variable.
    # The reference is accum_steps=4 at batch 8 under XLA, whose programs add
    # in place (other XLA programs: float8_differences' tolerances).
    reference = float8_mlp(GradientAccumulateModel, accum_steps=4)
    reference.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    fit_float8(reference, batch=8)
    model = float8_mlp(GradientAccumulateModel, micro_batch_size="auto")
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    model._runner.auto.micro_batch_size = 8
    history = fit_float8(model)
    assert history.history["micro_batch_size"] == [8, 8]
    assert_float8_as(reference, model)


class PenalisedLoss:
    """An own ``compute_loss``: the compiled loss doubled, the outputs' and the kernels' squares.

    The outputs' term is a mean over samples and the kernels' depends on the
    weights only: the loss of the batch is its micro-batches' weighted by
    their samples, the kernels' term once.
    """

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        kernels = [layer.kernel for layer in self.layers if isinstance(layer, keras.layers.Dense)]
        penalty = sum(ops.sum(ops.square(kernel)) for kernel in kernels)
        return 2.0 * loss + 0.1 * ops.mean(ops.square(y_pred)) + 1e-3 * penalty


class PenalisedModel(PenalisedLoss, keras.Model):
    pass


class PenalisedAccumulateModel(PenalisedLoss, GradientAccumulateModel):
    pass


def test_an_own_compute_loss_falls_back_and_trains_as_the_big_batch():
    # The reference: a plain keras.Model with the same `compute_loss`, at the
    # stated batch (without the override the weights differ by 3.7e-3).
    reference = build(PenalisedModel)
    reference_history = fit(reference)
    model = build(PenalisedAccumulateModel, micro_batch_size="auto", oom=OutOfMemoryAtCalls(MIDDLE))
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == MIDDLE_CHANGES


def tagger(cls=keras.Model, oom=None, **kwargs):
    """``tests.helpers.build_tagger``'s masked tagger, ``oom`` on its token ids; compiled."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TAG_LENGTH,), dtype="int32", name="tokens")
    tokens = inputs if oom is None else oom(inputs)
    embedded = keras.layers.Embedding(TAG_VOCABULARY, 8, mask_zero=True, name="embedding")(tokens)
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(embedded)
    outputs = keras.layers.Dense(TAG_CLASSES, name="tags")(hidden)
    model = cls(inputs=inputs, outputs=outputs, **kwargs)
    # SGD: the Embedding rows a batch does not touch get exactly 0 (Adam would
    # turn two computations' float32 noise there into steps of its rate).
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.5), loss)
    return model


def test_a_token_mean_falls_back_and_trains_as_the_big_batch():
    # The tagger's loss is a mean over the batch's valid tokens (the padding
    # masked by the Embedding). Its sequences come in blocks of 8 of 1-3
    # tokens and of 8-12: after the fall-back each micro-batch of 8 holds
    # another count of tokens than the next, and the group must weigh each
    # by its tokens, not its samples, to be the batch's token mean.
    x, tags, _ = make_padded_sequences(88, shard_size=8)
    counts = np.count_nonzero(x[:32].reshape(4, -1), axis=1)  # the fall-back's micro-batches
    assert len(set(counts.tolist())) == 4 and counts.max() > 3 * counts.min(), counts
    runs = []
    for model in (
        tagger(),
        tagger(GradientAccumulateModel, micro_batch_size="auto", oom=OutOfMemoryAtCalls(MIDDLE)),
    ):
        logs = BatchLogs()
        history = model.fit(
            x, tags, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[logs]
        )
        runs.append((model, history.history, [batch["loss"] for batch in logs.batches]))
    (reference, expected, expected_losses), (model, history, losses) = runs
    assert changes(model) == MIDDLE_CHANGES
    assert_diff_below(max_abs_diff(reference.get_weights(), model.get_weights()), FLOAT32_ATOL)
    # Each update's logged loss is the batch's token mean (float32: 1e-6 relative).
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


class LossScaleLog(keras.callbacks.Callback):
    """``(loss scale, updates applied)`` after each batch (one group each)."""

    def on_train_begin(self, logs=None):
        self.trace = []

    def on_train_batch_end(self, batch, logs=None):
        # The inner optimizer's count: Keras 3.3.3's LossScaleOptimizer keeps
        # an `iterations` of its own that stays 0.
        optimizer = self.model.optimizer
        applied = optimizer.inner_optimizer.iterations
        self.trace.append((float(optimizer.dynamic_scale.numpy()), int(applied.numpy())))


def test_mixed_float16_near_overflow_falls_back_and_keeps_the_big_batch_s_loss_scale(
    mixed_float16,
):
    # Sample 36 (in every epoch's second group) has inputs 20 times the
    # others': its group's loss-scaled float16 gradients overflow at Keras's
    # initial scale (32768) and at 16384 (its second kernel's is infinite in
    # epochs 1 and 2), not at 8192, where its kernels' largest are 3.1e4 to
    # 3.7e4 (measured on the whole batch; float16's largest is 65504). So
    # the group is skipped and the scale halved in epochs 1 and 2, and it is
    # applied in epoch 3. Two of those groups fall back: epoch 1's,
    # 32 -> 16 -> 8 (the retry at 16 out of memory after its first
    # micro-step, which holds sample 36, put non-finite gradients in the
    # sums), and epoch 3's, 8 -> 4 at its last micro-step, after three
    # micro-steps summed gradients near the overflow. A failed try must
    # neither halve the scale nor leave its sums behind: the same scale and
    # the same updates, skipped and applied, as plain Keras after every group.
    x, y = make_regression_data(88)
    x[36] *= 20.0
    epochs = 3
    runs = []
    for model in (
        build(activation="relu"),
        build(
            GradientAccumulateModel,
            micro_batch_size="auto",
            oom=OutOfMemoryAtCalls({1, 3, 29}),
            activation="relu",
        ),
    ):
        scales = LossScaleLog()
        history = model.fit(
            x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[scales]
        )
        runs.append((model, history, scales.trace))
    (reference, reference_history, expected), (model, history, trace) = runs
    assert changes(model) == [(1, 32, 16), (1, 16, 8), (5, 8, 4)]
    assert history.history["micro_batch_size"] == [8, 8, 4]
    assert expected[:3] == [(32768.0, 1), (16384.0, 1), (16384.0, 2)]  # the 2nd group skipped
    assert expected[3:6] == [(16384.0, 3), (8192.0, 3), (8192.0, 4)]  # skipped again
    assert expected[6:] == [(8192.0, 5), (8192.0, 6), (8192.0, 7)]  # applied at 8192
    assert trace == expected
    # float16 activations and gradients: the micro-batches' sums round apart
    # from the batch's (FLOAT16_ATOL, the tests' float16 tolerance).
    assert_trains_as(reference, model, history, reference_history, atol=FLOAT16_ATOL)


def test_each_change_is_said_once_in_one_line(caplog):
    model = auto(oom=OutOfMemoryAbove(8), batchnorm=True)
    with caplog.at_level(logging.WARNING, logger="gradient_accumulator"):
        fit(model)
    lines = [record.getMessage() for record in caplog.records]
    falls = [line for line in lines if "ran out of memory" in line]
    assert len(falls) == 2
    assert "micro-batch 32" in falls[0] and "micro-batch 16" in falls[0] and "update 0" in falls[0]
    assert all("\n" not in line for line in lines)
    # Keras's BatchNormalization normalises each micro-batch: said once.
    assert len([line for line in lines if "AccumBatchNormalization" in line]) == 1


def test_train_on_batch_is_one_update_of_the_batch():
    reference = build()
    model = auto(oom=OutOfMemoryAbove(8))
    for start in (0, 32):
        expected = reference.train_on_batch(X[start : start + 32], Y[start : start + 32])
        logs = model.train_on_batch(X[start : start + 32], Y[start : start + 32], return_dict=True)
        np.testing.assert_allclose(logs["loss"], expected[0], atol=FLOAT32_ATOL)
    assert_diff_below(max_abs_diff(reference.get_weights(), model.get_weights()), FLOAT32_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 2


def test_micro_batch_one_that_does_not_fit_ends_fit_saying_so():
    model = auto(oom=OutOfMemoryAbove(0))
    with pytest.raises(tf.errors.ResourceExhaustedError, match="one sample per replica"):
        fit(model)
    assert [new for _, _, new in changes(model)] == [16, 8, 4, 2, 1]
    assert int(model.optimizer.iterations.numpy()) == 0


def test_running_out_of_memory_in_the_update_ends_fit_saying_so():
    constraint = OutOfMemoryInUpdate()
    model = auto(constraint=constraint)

    class Arm(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            constraint.armed = True

    with pytest.raises(tf.errors.ResourceExhaustedError, match="in the optimizer's update"):
        fit(model, callbacks=[Arm()])
    assert changes(model) == []


def test_the_mode_survives_serialization(tmp_path):
    model = auto()
    assert model.get_config()["micro_batch_size"] == "auto"
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.micro_batch_size == "auto" and loaded.accum_steps == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"micro_batch_size": 16}, "micro_batch_size=16"),
        ({"micro_batch_size": "Auto"}, "micro_batch_size='Auto'"),
        ({"micro_batch_size": "auto", "accum_steps": 4}, "accum_steps=4, micro_batch_size='auto'"),
    ],
)
def test_refuses_arguments_the_mode_cannot_take(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(GradientAccumulateModel, **kwargs)


def dual_encoder(cls=keras.Model, oom=None, dropout=False, **kwargs):
    """tests/test_coupled.py's two towers, ``oom`` (a layer) on the queries' hidden layer."""
    from tests.test_coupled import FEATURES

    keras.utils.set_random_seed(1)

    def tower(inputs, oom):
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        hidden = hidden if oom is None else oom(hidden)
        hidden = keras.layers.Dropout(0.3, seed=3)(hidden) if dropout else hidden
        return keras.layers.UnitNormalization()(keras.layers.Dense(8)(hidden))

    query = keras.Input((FEATURES,), name="query")
    candidate = keras.Input((FEATURES,), name="candidate")
    outputs = keras.layers.Concatenate()([tower(query, oom), tower(candidate, None)])
    model = cls(inputs={"query": query, "candidate": candidate}, outputs=outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss=info_nce)
    return model


def test_a_coupled_loss_falls_back_and_trains_as_the_big_batch():
    # InfoNCE over the batch (tests/test_coupled.py): the group's loss on the
    # whole batch's outputs, whatever micro-batches the fall-backs leave (the
    # first group's failed tries: their cached outputs dropped, the seeds
    # and sums put back). 88 pairs: batches of 32, 32, 24.
    x, y = pairs(88)
    reference = dual_encoder()
    reference_history = reference.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    model = dual_encoder(
        GradientAccumulateModel,
        OutOfMemoryAbove(8),
        micro_batch_size="auto",
        coupled_loss="replica",
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_diff_below(max_abs_diff(reference.get_weights(), model.get_weights()), FLOAT32_ATOL)
    np.testing.assert_allclose(
        history.history["loss"], reference_history.history["loss"], rtol=1e-6
    )
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]
    # With Dropout, whose masks are drawn per micro-batch (and replayed in
    # the second pass): accum_steps=4 at the micro-batch the fall-backs end at.
    reference = dual_encoder(
        GradientAccumulateModel, dropout=True, accum_steps=4, coupled_loss="replica"
    )
    reference.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
    model = dual_encoder(
        GradientAccumulateModel,
        OutOfMemoryAbove(8),
        dropout=True,
        micro_batch_size="auto",
        coupled_loss="replica",
    )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_diff_below(max_abs_diff(reference.get_weights(), model.get_weights()), FLOAT32_ATOL)
    # Under XLA, the passes' programs write variables: refused.
    model = dual_encoder(GradientAccumulateModel, micro_batch_size="auto", coupled_loss="replica")
    model.compile(optimizer="sgd", loss=info_nce, jit_compile=True)
    with pytest.raises(ValueError, match="coupled loss's passes under XLA"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


NOISE_LOGS = ("noise_scale", "noise_scale_trace", "noise_scale_signal")


def assert_logs_as(reference_history, history, names, rtol=1e-6):
    for name in names:
        np.testing.assert_allclose(
            history.history[name], reference_history.history[name], rtol=rtol, err_msg=name
        )


def test_noise_scale_falls_back_and_estimates_as_accum_steps_at_the_micro_batch_in_force():
    # The noise scale compares each micro-batch's gradient with its group's:
    # after the fall-backs (the first group's failed tries leave no summary
    # behind) its estimates are accum_steps=4's at 8, whose are numpy's
    # (tests/test_noise_scale.py). The epoch's last batch of 24: three
    # micro-batches in both.
    reference = build(GradientAccumulateModel, accum_steps=4, noise_scale=True)
    reference_history = fit(reference, batch=8)
    model = auto(oom=OutOfMemoryAbove(8), noise_scale=True)
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert_logs_as(reference_history, history, NOISE_LOGS)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]
    # A batch run whole on one replica has no smaller batch to compare:
    # not measured, the logs at their start (0).
    history = fit(auto(noise_scale=True))
    assert {name: history.history[name] for name in NOISE_LOGS} == {
        name: [0.0] * EPOCHS for name in NOISE_LOGS
    }


def test_xla_at_a_micro_batch_in_force_trains_as_accum_steps_under_xla():
    # Under XLA at micro-batch 8 (put in force as a fall-back would: XLA
    # cannot compile the injected errors; a real fall-back is the test at
    # the end), with BatchNormalization, Dropout and the noise scale: their
    # writes come out of each micro-step's program. accum_steps=4 at 8
    # under XLA is the reference (the layers see micro-batches of 8).
    def compiled(model):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=True
        )
        return model

    layers = {"batchnorm": True, "dropout": True, "noise_scale": True}
    reference = compiled(build(GradientAccumulateModel, accum_steps=4, **layers))
    reference_history = fit(reference, batch=8)
    model = compiled(auto(**layers))
    model._runner.auto.micro_batch_size = 8
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert_logs_as(reference_history, history, NOISE_LOGS, rtol=1e-5)


def accum_batchnorm(cls=keras.Model, oom=None, layer_steps="auto", jit_compile=False, **kwargs):
    """Dense, AccumBatchNormalization(accum_steps=layer_steps), Dense; ``oom`` before the BN."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    hidden = hidden if oom is None else oom(hidden)
    hidden = AccumBatchNormalization(accum_steps=layer_steps)(hidden)
    model = cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=jit_compile
    )
    return model


def statistics_and_weights(model):
    """The trainable weights and every AccumBatchNormalization's moving statistics."""
    layers = [layer for layer in model.layers if isinstance(layer, AccumBatchNormalization)]
    return [
        *(v.numpy() for v in model.trainable_variables),
        *(v.numpy() for layer in layers for v in (layer.moving_mean, layer.moving_variance)),
    ]


def test_accum_batchnormalization_auto_moves_once_per_update_with_the_group_s_statistics():
    # AccumBatchNormalization(accum_steps="auto") follows the model's groups,
    # whatever their length: after the fall-backs (32, 16, then 8 in force;
    # the failed tries' pending statistics put back) every update moves the
    # moving statistics once with its whole batch's, as accum_steps=4 at 8
    # does (whose statistics tests/test_layers.py checks against numpy's on
    # the batch). The epoch's last batch of 24: three micro-batches in both.
    reference = accum_batchnorm(GradientAccumulateModel, layer_steps=4, accum_steps=4)
    reference_history = fit(reference, batch=8)
    model = accum_batchnorm(GradientAccumulateModel, OutOfMemoryAbove(8), micro_batch_size="auto")
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]
    # Without fall-backs, under XLA: Keras's layer at the whole batch.
    plain = accum_batchnorm(layer_steps=1, jit_compile=True)
    fit(plain)
    model = accum_batchnorm(GradientAccumulateModel, micro_batch_size="auto", jit_compile=True)
    fit(model)
    assert_diff_below(
        max_abs_diff(statistics_and_weights(plain), statistics_and_weights(model)), FLOAT32_ATOL
    )


def test_refuses_a_fixed_accum_batchnormalization_and_trains_an_auto_one_only_in_a_model():
    model = accum_batchnorm(GradientAccumulateModel, layer_steps=4, micro_batch_size="auto")
    with pytest.raises(ValueError, match=r"accum_steps=4, a fixed group.*accum_steps='auto'"):
        fit(model)
    with pytest.raises(ValueError, match=r"has accum_steps='auto'.*trained outside one"):
        fit(accum_batchnorm())
    with pytest.raises(ValueError, match=r"integer >= 1, or 'auto'.*accum_steps='four'"):
        AccumBatchNormalization(accum_steps="four")
    # Inference of the layer alone is Keras's; its configuration round-trips.
    layer = AccumBatchNormalization(accum_steps="auto")
    assert layer(np.ones((2, 3), "float32")).shape == (2, 3)
    assert AccumBatchNormalization.from_config(layer.get_config()).accum_steps == "auto"


def test_replace_batchnorm_layers_makes_auto_layers_for_the_mode():
    from gradient_accumulator import replace_batchnorm_layers

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
    auto_model = GradientAccumulateModel(
        micro_batch_size="auto", inputs=inputs, outputs=keras.layers.Dense(1)(hidden)
    )
    converted = replace_batchnorm_layers(auto_model, accum_steps="auto")
    layers = [layer for layer in converted.layers if isinstance(layer, AccumBatchNormalization)]
    assert [layer.accum_steps for layer in layers] == ["auto"]
    with pytest.raises(ValueError, match=r"accum_steps='auto'\)"):
        replace_batchnorm_layers(auto_model, accum_steps=4)


# Under XLA each micro-step is a program that writes no variable (its writes
# are its outputs, made after it), so that one that runs out of memory leaves
# the variables whole. The injected errors above are Python calls, which XLA
# cannot compile: XLA's fall-backs are the real ones of the test at the end.
@pytest.mark.parametrize("data", ["arrays", "unknown length"])
def test_xla_trains_as_the_big_batch(data):
    # BatchNormalization and Dropout: their writes (statistics, seeds) and the
    # metrics' are the program's outputs.
    reference = build(batchnorm=True, dropout=True)
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=True
    )
    reference_history = fit(reference)
    model = auto(batchnorm=True, dropout=True)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], jit_compile=True
    )
    history = fit(model, data)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == []


def test_a_layer_that_writes_its_state_falls_back_and_trains_as_the_big_batch():
    # SpectralNormalization normalises its kernel in each training call: once
    # per update, as the big batch's one call, at the group's first micro-step
    # (gradient_accumulator.state_writes). Each failed try has written it
    # (the out-of-memory layer is after it): the retry starts from the kernel
    # before the try. It was written at every micro-batch, and not put back:
    # 0.052 from plain Keras.
    def spectral(cls=keras.Model, oom=None, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        dense = keras.layers.Dense(16, activation="tanh")
        hidden = keras.layers.SpectralNormalization(dense)(inputs)
        hidden = hidden if oom is None else oom(hidden)
        model = cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
        return model

    reference = spectral()
    reference_history = fit(reference)
    model = spectral(GradientAccumulateModel, OutOfMemoryAbove(8), micro_batch_size="auto")
    history = fit(model)
    assert_trains_as(reference, model, history, reference_history)
    assert changes(model) == [(0, 32, 16), (0, 16, 8)]


class CountsCalls(keras.layers.Layer):
    """The identity, counting its training calls in a TensorFlow variable Keras does not track."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = tf.Variable(0.0, trainable=False)

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1.0)
        return x


@pytest.mark.parametrize(
    "layer, match",
    [
        (
            lambda dense: keras.layers.SpectralNormalization(dense),
            r"cannot return from the micro-step's program .*Received: writes of \['spectral",
        ),
        (lambda dense: keras.Sequential([dense, CountsCalls()]), r"writes variables \(Assign"),
    ],
    ids=["a weight written", "a variable Keras does not track"],
)
def test_xla_refuses_a_model_whose_writes_it_cannot_return(layer, match):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = layer(keras.layers.Dense(16, activation="tanh"))(inputs)
    model = GradientAccumulateModel(
        micro_batch_size="auto", inputs=inputs, outputs=keras.layers.Dense(1)(hidden)
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match=match):
        fit(model)
    # Without XLA the group writes them as the big batch does.
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    fit(model)


def test_group_step_is_refused_in_the_mode():
    model = auto()
    with pytest.raises(ValueError, match="micro_batch_size='auto'"):
        model.group_step([(X[:8], Y[:8])])


@pytest.mark.slow
def test_two_replicas_switch_together_and_train_as_the_big_batch():
    result = script_results(run_script_module("mirrored_auto_micro_batch"))
    assert result["moved"] > 0.05
    # Every replica out of memory, or replica 1 only; a coupled loss over the
    # global batch (every replica).
    for case in ("every", "one", "coupled"):
        figures = result[case]
        assert_diff_below(figures["diff"], FLOAT32_ATOL, case)
        assert figures["changes"] == [[0, 32, 16], [0, 16, 8]], case
        assert figures["iterations"] == 6, case
        assert figures["logged"] == [8, 8], case


# A real out-of-memory error: oneDNN's pooled CPU allocator capped at 24 MiB,
# where the script's batch of 512 does not fit and its half does (each
# refusal comes after the allocator's 10 s wait).
CAPPED = {"TF_ENABLE_ONEDNN_OPTS": "1", "TF_MKL_ALLOC_MAX_BYTES": str(24 * 2**20)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_real_out_of_memory_error_falls_back_and_gives_its_memory_back(tmp_path, mode):
    script = ["-m", "tests.scripts.auto_micro_batch_oom"]
    run_python([*script, "reference", str(tmp_path / "reference.npz")])
    result = script_results(run_python([*script, mode, str(tmp_path / "auto.npz")], env=CAPPED))
    reference, model = np.load(tmp_path / "reference.npz"), np.load(tmp_path / "auto.npz")
    diff = max(float(np.abs(reference[k] - model[k]).max()) for k in reference.files)
    assert_diff_below(diff, FLOAT32_ATOL)
    if mode == "graph":
        assert result["changes"] == [[0, 512, 256]]
    else:
        # XLA's programs take more memory than the graph's ops (TensorFlow
        # 2.21: 256 does not fit either): halvings in the first group.
        olds = [old for _, old, _ in result["changes"]]
        assert olds and olds[0] == 512, result["changes"]
        assert all(new == old // 2 for _, old, new in result["changes"]), result["changes"]
        assert {update for update, _, _ in result["changes"]} == {0}, result["changes"]
    # The whole batch tried twice more once settled: each failed try gives
    # back what it took (bytes in use as after the first group) and peaks
    # no higher than the one before; the weights untouched.
    before, settled, *after_failures = result["in_use"]
    assert after_failures == [settled] * len(after_failures)
    assert result["peaks"][1] <= result["peaks"][0]
    assert result["after_failures"] == 0.0
