"""Micro-batch weighting: masked, sample-weighted and summed losses equal the big batch."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator._compat import recorded_loss_reductions
from gradient_accumulator.weighting import SAMPLES, SUM, loss_term
from tests.helpers import (
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    KERAS_VERSION,
    TAG_CLASSES,
    TAG_LENGTH,
    assert_close,
    build_dense,
    build_tagger,
    build_two_heads,
    make_padded_sequences,
    make_regression_data,
    train_pair,
)

TAG_LOSS = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
MEAN_WITH_SAMPLE_WEIGHT = pytest.mark.skipif(
    KERAS_VERSION < (3, 8), reason='reduction="mean_with_sample_weight" exists from Keras 3.8'
)


def sgd():
    # Plain SGD: its sparse update (the Embedding's) is a scatter-add, which
    # sums repeated rows as the accumulated dense gradient does.
    return keras.optimizers.SGD(0.5)


def build_masked_regression(cls=keras.Model, seed=0, **kwargs):
    """Masking -> Dense per time step: a loss masked by `keras.layers.Masking`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((TAG_LENGTH, 3))
    hidden = keras.layers.Dense(6, activation="tanh")(keras.layers.Masking(0.0)(inputs))
    return cls(inputs=inputs, outputs=keras.layers.Dense(2)(hidden), **kwargs)


def make_masked_regression(num_samples=64, seed=0):
    x_tokens, _, weights = make_padded_sequences(num_samples, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(num_samples, TAG_LENGTH, 3)).astype("float32")
    x[x_tokens == 0] = 0.0
    y = rng.normal(size=(num_samples, TAG_LENGTH, 2)).astype("float32")
    return x, y, weights


def no_warnings(fn):
    """Runs ``fn`` and fails on any warning of the library's weighting."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    messages = [str(w.message) for w in caught if "not exactly the big batch" in str(w.message)]
    assert not messages, messages
    return result


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "temporal_weights"])
def test_embedding_masked_token_loss_equals_big_batch(weighted):
    x, tags, weights = make_padded_sequences()
    fit_kwargs = {"sample_weight": weights} if weighted else {}
    reference, accumulating = no_warnings(
        lambda: train_pair(
            build_tagger, sgd, x, tags, epochs=1, compile_kwargs=TAG_LOSS, fit_kwargs=fit_kwargs
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "temporal_weights"])
def test_masking_layer_loss_equals_big_batch(weighted):
    x, y, weights = make_masked_regression()
    fit_kwargs = {"sample_weight": weights} if weighted else {}
    reference, accumulating = no_warnings(
        lambda: train_pair(build_masked_regression, sgd, x, y, epochs=2, fit_kwargs=fit_kwargs)
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@MEAN_WITH_SAMPLE_WEIGHT
def test_mean_with_sample_weight_equals_big_batch():
    x, tags, weights = make_padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    reference, accumulating = no_warnings(
        lambda: train_pair(
            build_tagger,
            sgd,
            x,
            tags,
            epochs=1,
            compile_kwargs={"loss": loss},
            fit_kwargs={"sample_weight": weights},
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@MEAN_WITH_SAMPLE_WEIGHT
def test_mean_with_sample_weight_per_sample_equals_big_batch():
    x, y = make_regression_data()
    weights = np.random.default_rng(4).uniform(0.0, 5.0, size=len(x)).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    reference, accumulating = no_warnings(
        lambda: train_pair(
            build_dense,
            lambda: keras.optimizers.Adam(0.01),
            x,
            y,
            compile_kwargs={"loss": loss},
            fit_kwargs={"sample_weight": weights},
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("regularized", [False, True], ids=["plain", "kernel_regularizer"])
def test_sum_reduction_equals_big_batch(regularized):
    x, tags, _ = make_padded_sequences()
    regularizer = keras.regularizers.L2(0.05) if regularized else None
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    reference, accumulating = no_warnings(
        lambda: train_pair(
            lambda cls, **kw: build_tagger(cls, regularizer=regularizer, **kw),
            lambda: keras.optimizers.SGD(0.002),
            x,
            tags,
            epochs=1,
            compile_kwargs={"loss": loss},
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def test_masked_loss_with_regularizer_counts_it_once_per_update():
    x, tags, _ = make_padded_sequences()
    reference, accumulating = no_warnings(
        lambda: train_pair(
            lambda cls, **kw: build_tagger(cls, regularizer=keras.regularizers.L2(0.05), **kw),
            sgd,
            x,
            tags,
            epochs=1,
            compile_kwargs=TAG_LOSS,
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def test_two_outputs_with_the_same_mask_equal_big_batch():
    x, tags, _ = make_padded_sequences()
    scores = np.random.default_rng(5).normal(size=(len(x), TAG_LENGTH, 1)).astype("float32")
    compile_kwargs = {
        "loss": [TAG_LOSS["loss"], "mse"],
        "loss_weights": [1.0, 0.3],
    }
    reference, accumulating = no_warnings(
        lambda: train_pair(
            build_two_heads, sgd, x, [tags, scores], epochs=1, compile_kwargs=compile_kwargs
        )
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


TWO_NORMALISERS = {"loss": [TAG_LOSS["loss"], "mse"], "loss_weights": [1.0, 0.3]}


@pytest.mark.parametrize(
    "num_samples, epochs, compile_kwargs, regularized, model_kwargs",
    [
        (64, 2, {}, False, {}),
        (64, 1, {}, True, {}),
        (60, 1, {}, False, {}),
        (64, 1, {"jit_compile": True}, False, {}),
        (64, 1, {"run_eagerly": True}, False, {}),
        (76, 2, {"steps_per_execution": 3}, False, {}),
        (64, 1, {}, False, {"reduce_every_micro_step": True}),
    ],
    ids=[
        "graph",
        "kernel_regularizer",
        "last_group_shorter",
        "jit",
        "eager",
        "steps_per_execution",
        "reduce_every_micro_step",
    ],
)
def test_outputs_with_different_normalisers_equal_big_batch(
    num_samples, epochs, compile_kwargs, regularized, model_kwargs
):
    # A masked per-token head beside a per-sequence head: two normaliser
    # classes (valid tokens, samples), each with its own sums and divisor.
    reference, accumulating = no_warnings(
        lambda: _two_heads_pair(num_samples, epochs, compile_kwargs, regularized, model_kwargs)
    )
    assert accumulating._accumulator.num_classes == 2
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    assert int(reference.optimizer.iterations.numpy()) == int(
        accumulating.optimizer.iterations.numpy()
    )


def _two_heads_pair(
    num_samples=64, epochs=1, compile_kwargs=None, regularized=False, model_kwargs=None, opt=None
):
    x, tags, _ = make_padded_sequences(num_samples)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")
    regularizer = keras.regularizers.L2(0.05) if regularized else None

    def build(cls, **kwargs):
        if cls is GradientAccumulateModel:
            kwargs.update(model_kwargs or {})
        return build_two_heads(cls, pooled_head=True, regularizer=regularizer, **kwargs)

    return train_pair(
        build,
        opt or sgd,
        x,
        [tags, scores],
        epochs=epochs,
        compile_kwargs={**TWO_NORMALISERS, **(compile_kwargs or {})},
    )


def test_outputs_with_different_normalisers_mixed_float16(mixed_float16):
    # Within float16 rounding, with the big batch's loss scale and updates.
    # (SGD: Keras's Adam updates an Embedding's sparse gradient otherwise
    # than its dense sum, which the wrapper hands the optimizer.)
    reference, accumulating = _two_heads_pair(epochs=2)
    assert accumulating._accumulator.num_classes == 2
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT16_ATOL)
    for attribute in ("iterations", "dynamic_scale"):
        assert float(getattr(reference.optimizer, attribute).numpy()) == float(
            getattr(accumulating.optimizer, attribute).numpy()
        )


def test_normaliser_classes_get_sums_only_where_several_reach():
    x, tags, _ = make_padded_sequences(32)
    scores = np.zeros((len(x), 1), "float32")
    model = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    model.compile(optimizer=sgd(), **TWO_NORMALISERS)
    model.fit(x, [tags, scores], batch_size=8, verbose=0)
    accumulator = model._accumulator
    # Embedding, trunk kernel and bias: both classes; each head: its own.
    routing = [(0, 1), (0, 1), (0, 1), (0,), (0,), (1,), (1,)]
    assert list(model._normaliser_classes.routing) == routing
    shared = model.trainable_variables[:3]
    assert [tuple(a.shape) for a in accumulator.class_gradient_sums] == [
        tuple(v.shape) for v in shared
    ]
    state = accumulator.state_variables
    assert len(state) == 4 + len(model.trainable_variables) + 2 + len(shared)
    assert all(float(np.abs(a.numpy()).max()) == 0.0 for a in accumulator.class_gradient_sums)


def test_a_group_without_valid_tokens_gives_keras_zero_gradient():
    # Keras's masked loss of a batch without a valid token is 0; the group's
    # divisor is 0 too, and its gradient must be 0 (not 0 / 0).
    x, tags, _ = make_padded_sequences(64)
    x[:32] = 0
    reference, accumulating = train_pair(
        build_tagger, sgd, x, tags, epochs=1, compile_kwargs=TAG_LOSS
    )
    assert all(np.isfinite(w).all() for w in accumulating.get_weights())
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@keras.saving.register_keras_serializable(package="tests")
class MeanActivityPenalty(keras.layers.Layer):
    """Adds ``rate * mean(x ** 2)`` over the whole batch (a mean over samples) as a loss."""

    def __init__(self, rate=0.05, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.supports_masking = True

    def call(self, inputs):
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


def build_penalized_tagger(cls=keras.Model, seed=0, activity_regularizer=False, **kwargs):
    """The tagger with a data-dependent additional loss on its hidden features."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((TAG_LENGTH,), dtype="int32")
    embedded = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        activity_regularizer=keras.regularizers.L2(0.01) if activity_regularizer else None,
    )(embedded)
    if not activity_regularizer:
        hidden = MeanActivityPenalty()(hidden)
    tags = keras.layers.Dense(TAG_CLASSES, name="tags")(hidden)
    return cls(inputs=inputs, outputs=tags, **kwargs)


PENALTIES = {
    "add_loss_masked": (False, "sum_over_batch_size"),
    "add_loss_summed": (False, "sum"),
    # Keras divides an activity regularizer by the batch size from 3.14 on.
    "activity_regularizer_masked": (True, "sum_over_batch_size"),
}


@pytest.mark.parametrize("case", list(PENALTIES))
def test_data_dependent_additional_loss_beside_a_token_loss_equals_big_batch(case):
    # The additional loss is a mean over samples, the compiled one is not:
    # two classes, the additional loss weighted by samples.
    activity, reduction = PENALTIES[case]
    if activity and KERAS_VERSION < (3, 14):
        pytest.skip("Keras < 3.14 sums an activity regularizer over the batch")
    x, tags, _ = make_padded_sequences(64)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    rate = 0.5 if reduction != "sum" else 0.005
    reference, accumulating = no_warnings(
        lambda: train_pair(
            lambda cls, **kw: build_penalized_tagger(cls, activity_regularizer=activity, **kw),
            lambda: keras.optimizers.SGD(rate),
            x,
            tags,
            epochs=2,
            compile_kwargs={"loss": loss},
        )
    )
    assert accumulating._accumulator.num_classes == 2
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("how", ["checkpoint", "save_weights", "keras_file"])
def test_normaliser_classes_resume_in_the_middle_of_a_group(tmp_path, how):
    # The class sums and divisors are state: saved, restored (configured
    # from the saved routing before `fit` finds the classes), resumed.
    x, tags, _ = make_padded_sequences(64)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")
    y = [tags, scores]

    def build(seed=0):
        model = build_two_heads(GradientAccumulateModel, seed=seed, pooled_head=True, accum_steps=4)
        model.compile(optimizer=sgd(), **TWO_NORMALISERS)
        return model

    uninterrupted = build()
    uninterrupted.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    first = build()
    # fit finds the classes (train_on_batch does too, from Keras 3.5 on).
    first.fit(x, y, batch_size=8, epochs=0, verbose=0)
    for start in range(0, 48, 8):  # a run that stops after 6 micro-batches: 1 update, 2 pending
        batch = slice(start, start + 8)
        first.train_on_batch(x[batch], [tags[batch], scores[batch]])
    assert int(first._accumulator.micro_step.numpy()) == 2
    assert max(float(np.abs(a.numpy()).max()) for a in first._accumulator.class_gradient_sums) > 0
    if how == "checkpoint":
        path = tf.train.Checkpoint(model=first).save(str(tmp_path / "ckpt"))
        resumed = build(seed=7)
        tf.train.Checkpoint(model=resumed).restore(path)
    elif how == "save_weights":
        path = str(tmp_path / "model.weights.h5")
        first.save_weights(path)
        resumed = build(seed=7)
        resumed.load_weights(path)
    else:
        path = str(tmp_path / "model.keras")
        first.save(path)
        resumed = keras.saving.load_model(path)
    resumed.fit(x[48:], [tags[48:], scores[48:]], batch_size=8, shuffle=False, verbose=0)
    assert int(resumed._accumulator.micro_step.numpy()) == 0
    assert_close(uninterrupted.get_weights(), resumed.get_weights(), FLOAT32_ATOL)


def test_train_on_batch_finds_the_normaliser_classes():
    # Keras >= 3.5 hands train_on_batch's batch to the build hook before the
    # first trace; Keras 3.3 and 3.4 do not: there it warns.
    x, tags, _ = make_padded_sequences(64)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")
    reference = build_two_heads(pooled_head=True)
    reference.compile(optimizer=sgd(), **TWO_NORMALISERS)
    reference.fit(x, [tags, scores], batch_size=32, shuffle=False, verbose=0)
    model = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    model.compile(optimizer=sgd(), **TWO_NORMALISERS)

    def train():
        for start in range(0, len(x), 8):
            part = slice(start, start + 8)
            model.train_on_batch(x[part], [tags[part], scores[part]])

    if KERAS_VERSION < (3, 5):
        with pytest.warns(UserWarning, match="divide by different normalisers"):
            train()
        return
    no_warnings(train)
    assert model._accumulator.num_classes == 2
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


def test_restored_classes_without_discovery_keep_training_with_the_warning(tmp_path):
    # State saved with two classes in the middle of a group, loaded into a
    # model whose train function is traced without the discovery pass: the
    # warning, and training goes on.
    x, tags, _ = make_padded_sequences(32)
    scores = np.zeros((len(x), 1), "float32")
    first = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    first.compile(optimizer=sgd(), **TWO_NORMALISERS)
    first.fit(x[:24], [tags[:24], scores[:24]], batch_size=8, verbose=0)
    first.train_on_batch(x[24:], [tags[24:], scores[24:]])  # a group pending
    path = str(tmp_path / "model.weights.h5")
    first.save_weights(path)
    other = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    other.compile(optimizer=sgd(), **TWO_NORMALISERS)
    other.load_weights(path)
    assert other._accumulator.num_classes == 2
    other.make_train_function()
    batch = (x[:8], (tags[:8], scores[:8]))
    with pytest.warns(UserWarning, match="divide by different normalisers"):
        other.train_function(iter([batch]))
    assert int(other._accumulator.micro_step.numpy()) == 2  # the restored group goes on
    assert all(np.isfinite(w).all() for w in other.get_weights())


def test_outputs_with_different_normalisers_warn_without_discovery():
    # The classes are found before the first trace by fit (and
    # train_on_batch); a train function traced without either falls back
    # to per-sample weights, with the warning.
    x, tags, _ = make_padded_sequences(32)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")
    model = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    model.compile(optimizer=sgd(), **TWO_NORMALISERS)
    model.make_train_function()
    batch = (x[:8], (tags[:8], scores[:8]))
    with pytest.warns(UserWarning, match="divide by different normalisers"):
        model.train_function(iter([batch]))


@pytest.mark.parametrize(
    "num_samples, compile_kwargs",
    [
        (60, {}),
        (100, {"steps_per_execution": 3}),
        (60, {"jit_compile": True}),
        (60, {"run_eagerly": True}),
    ],
    ids=["last_group_shorter", "steps_per_execution", "jit", "eager"],
)
def test_masked_loss_in_every_execution_mode(num_samples, compile_kwargs):
    reference, accumulating = _weighted_tagger_pair(num_samples, compile_kwargs)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def _weighted_tagger_pair(num_samples=64, compile_kwargs=None):
    """The tagger with temporal sample weights, 2 epochs of SGD: reference and accumulating."""
    x, tags, weights = make_padded_sequences(num_samples)
    return no_warnings(
        lambda: train_pair(
            build_tagger,
            sgd,
            x,
            tags,
            epochs=2,
            compile_kwargs={**TAG_LOSS, **(compile_kwargs or {})},
            fit_kwargs={"sample_weight": weights},
        )
    )


def test_masked_loss_mixed_float16_equals_big_batch(mixed_float16):
    reference, accumulating = _weighted_tagger_pair()
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT16_ATOL)
    for attribute in ("iterations", "dynamic_scale"):
        assert float(getattr(reference.optimizer, attribute).numpy()) == float(
            getattr(accumulating.optimizer, attribute).numpy()
        )


# (reduction, mask?, sample weights?) -> the normaliser's key kind.
REDUCTION_CASES = {
    "default": ("sum_over_batch_size", False, False, SAMPLES),
    "default_weighted": ("sum_over_batch_size", False, True, SAMPLES),
    "default_masked": ("sum_over_batch_size", True, False, "mask"),
    "default_masked_weighted": ("sum_over_batch_size", True, True, "mask"),
    "sum": ("sum", True, True, SUM),
}
if KERAS_VERSION >= (3, 8):
    REDUCTION_CASES.update(
        {
            "mean_with_sample_weight": ("mean_with_sample_weight", False, True, "weights"),
            "mean_with_sample_weight_masked": ("mean_with_sample_weight", True, True, "weights"),
            "mean_with_sample_weight_mask_only": (
                "mean_with_sample_weight",
                True,
                False,
                "weights",
            ),
        }
    )


@pytest.mark.parametrize("case", list(REDUCTION_CASES), ids=list(REDUCTION_CASES))
def test_normaliser_is_what_keras_divides_by(case):
    """Keras's loss == sum(values * weights * mask) / normaliser, for the installed Keras."""
    reduction, masked, weighted, kind = REDUCTION_CASES[case]
    rng = np.random.default_rng(0)
    y_true = rng.normal(size=(4, 5, 1)).astype("float32")
    y_pred = keras.ops.convert_to_tensor(rng.normal(size=(4, 5, 1)).astype("float32"))
    mask = rng.uniform(size=(4, 5)) < 0.6
    weights = rng.uniform(0.5, 2.0, size=(4, 5)).astype("float32")
    if masked:
        y_pred._keras_mask = keras.ops.convert_to_tensor(mask)
    loss_fn = keras.losses.MeanSquaredError(reduction=reduction)
    with recorded_loss_reductions() as records:
        loss = loss_fn(y_true, y_pred, sample_weight=weights if weighted else None)
    assert len(records) == 1
    term = loss_term(*records[0][:4], batch_size=4)
    kind_of = term.key if isinstance(term.key, str) else term.key[0]
    assert kind_of == kind
    values = np.mean((y_true - np.asarray(y_pred)) ** 2, axis=-1)
    total = np.sum(values * (weights if weighted else 1.0) * (mask if masked else 1.0))
    normaliser = 1.0 if term.normaliser is None else float(term.normaliser)
    if kind == SAMPLES:
        normaliser *= 5  # elements per sample: a constant the engine's ratio cancels
    np.testing.assert_allclose(float(loss), total / normaliser, rtol=1e-6)
