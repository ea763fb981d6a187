"""Rematerialisation: a model built under ``keras.RematScope`` trains as without it.

The reference is the same model built from the same seed without the scope
(identical weights and random seed states), trained the same way: the
weights, BatchNormalization's statistics and the seed states after training
agree within float32 rounding (``FLOAT32_ATOL``; the recomputation's ops run
apart from the forward pass's, under XLA in a program of their own). Each
model also shows that the recomputation happens (its layers are traced again
in the backward pass) and, for Keras's own remat, that it fails (Keras issue
21207) where ours trains.
"""

import contextlib
import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradient_accumulator
from gradient_accumulator import (
    AccumBatchNormalization,
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    _compat,
    choose_micro_batch,
)
from tests.helpers import (
    FLOAT8_KERNEL_RTOL,
    FLOAT8_STATE_RTOL,
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    KERAS_VERSION,
    assert_close,
    assert_diff_below,
    build_float8,
    float8_differences,
    make_float8_data,
    run_script_module,
    script_results,
)

pytestmark = pytest.mark.skipif(
    KERAS_VERSION < (3, 9), reason="keras.RematScope is Keras 3.9's (this Keras has none)"
)


# float16 under XLA, with rematerialisation against without: see
# test_remat_under_mixed_precision.
REMAT_XLA_FLOAT16_ATOL = 1e-2


class Traced(keras.layers.Layer):
    """The identity, counting the times its call is traced (forward and recomputation)."""

    traces = 0

    def call(self, x):
        Traced.traces += 1
        return x


class AddsLoss(keras.layers.Layer):
    """The identity that adds a loss of its input (``add_loss`` in a training call)."""

    def call(self, x):
        self.add_loss(keras.ops.cast(0.01 * keras.ops.mean(keras.ops.square(x)), "float32"))
        return x


def conv_net(
    cls=GradientAccumulateModel,
    remat=None,
    seed=0,
    batchnorm=keras.layers.BatchNormalization,
    head=keras.layers.Flatten,
    **kwargs,
):
    """A small ConvNet with BatchNormalization, GELU and two Dropouts, built under ``remat``.

    ``remat``: a ``keras.RematScope`` mode, or ``None`` (the reference). The
    convolutions feeding BatchNormalization have no bias (their true gradient is 0,
    and float noise in it is not the model's).
    """
    keras.utils.set_random_seed(seed)
    scope = contextlib.nullcontext() if remat is None else keras.RematScope(**remat)
    with scope:
        inputs = keras.Input((8, 8, 3))
        x = keras.layers.Conv2D(8, 3, use_bias=False, name="conv1")(inputs)
        x = batchnorm()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.Conv2D(8, 3, use_bias=False, name="conv2")(x)
        x = batchnorm()(x)
        x = keras.layers.Activation("gelu")(x)
        x = Traced(name="traced")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Dropout(0.3)(x)
        x = head()(x)
        x = keras.layers.Dense(16, activation="gelu", name="dense")(x)
        x = AddsLoss()(x)
        x = keras.layers.Dropout(0.5)(x)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(x)
        return cls(inputs=inputs, outputs=outputs, **kwargs)


def image_data(samples=48, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def train(model, x, y, batch_size, jit_compile=False, epochs=2, **fit):
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.5), loss="mse", jit_compile=jit_compile
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit)
    return model


MODES = {
    "full": {"mode": "full"},
    "activations": {"mode": "activations"},
    "larger_than": {"mode": "larger_than", "output_size_threshold": 100},
    "list_of_layers": {"mode": "list_of_layers", "layer_names": ["conv2", "dense", "traced"]},
}


@pytest.mark.parametrize(
    "mode, jit_compile, accum_steps",
    [
        ("full", False, 4),
        ("full", True, 4),
        ("full", False, 1),
        ("full", True, 1),
        ("activations", False, 4),
        ("activations", True, 4),
        ("larger_than", False, 4),
        ("list_of_layers", True, 4),
    ],
)
def test_remat_trains_as_without(mode, jit_compile, accum_steps):
    """Every RematScope mode, graph and XLA: weights, statistics and seeds as without it."""
    x, y = image_data()
    # `larger_than` asks Flatten for its output spec on graph tensors, which fails (a Keras bug).
    head = keras.layers.GlobalAveragePooling2D if mode == "larger_than" else keras.layers.Flatten
    reference = train(conv_net(head=head, accum_steps=accum_steps), x, y, 4, jit_compile)
    Traced.traces = 0
    model = train(
        conv_net(remat=MODES[mode], head=head, accum_steps=accum_steps), x, y, 4, jit_compile
    )
    if mode in ("full", "list_of_layers"):
        assert Traced.traces > 1  # traced again in the backward pass: recomputed
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)
    moved = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(reference.trainable_variables, conv_net(head=head).trainable_variables)
    )
    assert moved > 100 * FLOAT32_ATOL  # it trained


def test_keras_own_remat_fails_where_the_package_s_trains_a_plain_model():
    """Keras's TensorFlow remat (``tf.recompute_grad``) fails in a compiled ``fit`` (issue 21207).

    With the package imported, Keras's API recomputes with the package's,
    for a plain ``keras.Model`` too: trained as without rematerialisation.
    """
    x, y = image_data(16)
    model = conv_net(cls=keras.Model, remat=MODES["full"])
    model.compile(optimizer="sgd", loss="mse")
    with _compat.backend_remat(tf.recompute_grad):
        with pytest.raises(ValueError, match="custom_gradient decorator currently supports"):
            model.fit(x, y, batch_size=4, verbose=0)
    Traced.traces = 0
    model = train(conv_net(cls=keras.Model, remat=MODES["full"]), x, y, 4)
    assert Traced.traces > 1
    reference = train(conv_net(cls=keras.Model), x, y, 4)
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)


def test_remat_at_the_limits_of_accum_steps():
    """accum_steps=128 at micro-batch 1, under XLA, with a shorter last group."""
    x, y = image_data(160)
    reference = train(conv_net(accum_steps=128), x, y, 1, True, epochs=1)
    model = train(conv_net(remat=MODES["full"], accum_steps=128), x, y, 1, True, epochs=1)
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_remat_with_accum_batchnorm(jit_compile):
    """AccumBatchNormalization recomputed: its statistics move once per update, as without."""
    x, y = image_data()

    def build(remat=None):
        return conv_net(
            remat=remat, accum_steps=4, batchnorm=lambda: AccumBatchNormalization(accum_steps=4)
        )

    reference = train(build(), x, y, 4, jit_compile)
    model = train(build(MODES["full"]), x, y, 4, jit_compile)
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)


def spectral_net(remat=None, seed=0):
    keras.utils.set_random_seed(seed)
    scope = contextlib.nullcontext() if remat is None else keras.RematScope(**remat)
    with scope:
        inputs = keras.Input((6,))
        x = keras.layers.SpectralNormalization(keras.layers.Dense(8, activation="tanh"))(inputs)
        x = keras.layers.Dropout(0.2)(x)
        outputs = keras.layers.Dense(1)(x)
        return GradientAccumulateModel(accum_steps=3, inputs=inputs, outputs=outputs)


def test_remat_with_spectral_normalization():
    """A layer that writes a weight in its training call writes it once (its power iteration)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(36, 6)).astype("float32")
    y = rng.normal(size=(36, 1)).astype("float32")
    reference = train(spectral_net(), x, y, 4)
    model = train(spectral_net(MODES["full"]), x, y, 4)
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_remat_under_mixed_precision(jit_compile):
    """mixed_float16: the recomputation casts as the forward pass did (its autocast scope).

    Without it the recomputation would read float32 kernels beside float16
    inputs and fail. Under XLA the recomputation is compiled apart from the
    forward pass and rounds its float16 activations its own way: 4.9e-3 after
    24 updates (Keras 3.10 / TensorFlow 2.19; the same model without
    rematerialisation is 2.2e-3 from itself between graph mode and XLA there):
    ``REMAT_XLA_FLOAT16_ATOL``.
    """
    x, y = image_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = train(conv_net(accum_steps=4), x, y, 4, jit_compile)
        model = train(conv_net(remat=MODES["full"], accum_steps=4), x, y, 4, jit_compile)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    tolerance = REMAT_XLA_FLOAT16_ATOL if jit_compile else FLOAT16_ATOL
    assert_close(reference.variables, model.variables, tolerance)


def test_remat_with_the_run_time_micro_batch():
    """micro_batch_size="auto" recomputes too (the micro-batch found with remat in force)."""
    x, y = image_data()
    reference = train(conv_net(accum_steps=2), x, y, 8)
    model = conv_net(remat=MODES["full"], micro_batch_size="auto")
    model._runner.auto.micro_batch_size = 8
    train(model, x, y, 16)
    assert_close(reference.variables, model.variables, FLOAT32_ATOL)


def test_remat_in_a_custom_loop():
    """GradientAccumulateOptimizer and a loop of one's own: Keras's API as documented."""
    x, y = image_data(32)

    def run(remat):
        model = conv_net(cls=keras.Model, remat=remat)
        optimizer = GradientAccumulateOptimizer(keras.optimizers.SGD(0.01), accum_steps=4)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(model(x, training=True) - y))
                loss = loss + keras.ops.sum(model.losses)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        for start in range(0, 32, 4):
            step(x[start : start + 4], y[start : start + 4])
        return model

    assert_close(run(None).variables, run(MODES["full"]).variables, FLOAT32_ATOL)


def test_remat_function_of_ours():
    """``gradient_accumulator.remat(layer)``, called in a custom layer, as without it."""

    class Block(keras.layers.Layer):
        def __init__(self, remat, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(8, activation="gelu")
            self.dropout = keras.layers.Dropout(0.4)
            self.forward = gradient_accumulator.remat(self.inner) if remat else self.inner

        def inner(self, x):
            return self.dropout(self.dense(x))

        def call(self, x):
            return self.forward(x)

    def build(remat):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(1)(Block(remat)(inputs))
        return GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=outputs)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 6)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    assert_close(
        train(build(False), x, y, 4).variables, train(build(True), x, y, 4).variables, FLOAT32_ATOL
    )


class GlobalNoise(keras.layers.Layer):
    """Adds noise drawn from Keras's global seed generator (``seed=None``) in training."""

    def call(self, x, training=None):
        if training:
            return x + keras.random.normal(keras.ops.shape(x), stddev=0.1)
        return x


class TensorFlowNoise(keras.layers.Layer):
    """Adds noise drawn by TensorFlow's stateful ``tf.random.uniform`` in training."""

    def call(self, x, training=None):
        if training:
            return x + tf.random.uniform(tf.shape(x), maxval=0.1)
        return x


@pytest.mark.parametrize(
    "noise, match",
    [
        (GlobalNoise, r"Layer 'noise' .* Received: writes of \[.*seed_generator_state"),
        (
            TensorFlowNoise,
            r"Layer 'noise' .* Received: TensorFlow random operations \['RandomUniform'\]",
        ),
    ],
)
@pytest.mark.parametrize("jit_compile", [False, True])
def test_random_numbers_the_layer_does_not_own_are_refused(noise, match, jit_compile):
    """A recomputation cannot repeat them: refused by the layer's name, not trained silently."""
    with keras.RematScope(mode="full"):
        inputs = keras.Input((4,))
        hidden = noise(name="noise")(keras.layers.Dense(8)(inputs))
    model = GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(1)(hidden)
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    x = np.ones((8, 4), "float32")
    with pytest.raises(ValueError, match=match):
        model.fit(x, x[:, :1], batch_size=2, verbose=0)


@pytest.mark.slow
def test_remat_under_two_replicas():
    """MirroredStrategy, the replicas' shards unlike (tests/scripts/mirrored_remat.py)."""
    results = script_results(run_script_module("mirrored_remat"))
    assert results["replicas"] == 2
    for accum_steps, result in results["results"].items():
        assert result["updates"][0] == result["updates"][1] == 64 // (8 * int(accum_steps)) * 2
        assert result["traces"]["remat"] > result["traces"]["reference"], result
        assert result["moved"] > 100 * FLOAT32_ATOL, result
        assert_diff_below(result["diff"], FLOAT32_ATOL, f"accum_steps={accum_steps}")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_remat_model_validates_evaluates_and_predicts(jit_compile):
    """Keras's TensorFlow remat fails in these calls too; the wrapper's run them as without it."""
    x, y = image_data()
    reference = conv_net(accum_steps=2)
    model = conv_net(remat=MODES["full"], accum_steps=2)
    histories = [
        train(m, x, y, 4, jit_compile, epochs=1, validation_data=(x[:16], y[:16])).history.history
        for m in (reference, model)
    ]
    assert_diff_below(abs(histories[0]["val_loss"][0] - histories[1]["val_loss"][0]), 1e-5)
    assert_diff_below(
        abs(reference.evaluate(x, y, verbose=0) - model.evaluate(x, y, verbose=0)), 1e-5
    )
    assert_close([reference.predict(x, verbose=0)], [model.predict(x, verbose=0)], 1e-5)


def test_remat_with_a_coupled_loss():
    """coupled_loss: both passes over the group's micro-batches recompute, masks replayed."""
    from tests.test_coupled import accumulating, info_nce, pairs

    x, y = pairs(48)

    def run(remat):
        scope = contextlib.nullcontext() if remat is None else keras.RematScope(**remat)
        with scope:
            model = accumulating(4, coupled_loss="replica", dropout=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss=info_nce)
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return model

    assert_close(run(None).variables, run(MODES["full"]).variables, FLOAT32_ATOL)


def gelu_blocks(remat, accum_steps=1):
    """Three blocks of four Dense(512, GELU), each block one checkpoint under ``remat``."""
    keras.utils.set_random_seed(0)
    blocks = [
        keras.Sequential([keras.layers.Dense(512, activation="gelu") for _ in range(4)])
        for _ in range(3)
    ]
    inputs = keras.Input((512,))
    hidden = inputs
    for block in blocks:
        # A container made in the scope around layers made outside it: one checkpoint.
        with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
            checkpoint = keras.Sequential([block])
        hidden = checkpoint(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_choose_micro_batch_measures_with_the_model_s_remat():
    """The search measures the model as it trains: rematerialised, a larger micro-batch fits.

    The peaks are the allocator's, whatever else the process holds (a pytest
    worker's earlier tests): compared by their difference (alone: 49.5 and
    34.5 MiB at 256 rows, 28 MiB apart at 512). The budget is halfway between
    the whole batch's peaks with and without rematerialisation.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 512)).astype("float32")
    y = rng.normal(size=(1024, 1)).astype("float32")

    def choose(remat, budget="1 GiB"):
        gc.collect()
        return choose_micro_batch(
            lambda k: gelu_blocks(remat, k), x, y, batch_size=512, memory_budget=budget, verbose=0
        )

    plain, rematerialised = choose(False), choose(True)
    saved = plain.peak_bytes - rematerialised.peak_bytes
    assert saved > 16 * 2**20, (plain, rematerialised)
    budget = (plain.peak_bytes + rematerialised.peak_bytes) // 2
    assert choose(False, budget).micro_batch < 512
    assert choose(True, budget).micro_batch == 512


@pytest.mark.parametrize("jit_compile", [False, True])
def test_remat_with_float8_layers(jit_compile):
    """Float8 Dense layers recomputed: their scales and amax histories written once, as without."""
    x, y = make_float8_data()

    def run(remat):
        with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
            model = build_float8(GradientAccumulateModel, accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    differences = float8_differences(run(False), run(True))
    assert differences["state"] < FLOAT8_STATE_RTOL, differences
    assert differences["kernel"] < FLOAT8_KERNEL_RTOL, differences


@pytest.mark.parametrize("data", ["steps_per_execution", "unknown_length"])
def test_remat_with_other_data_paths(data):
    """steps_per_execution=2 (two groups per call); data of unknown length (micro-steps)."""
    x, y = image_data()

    def run(remat):
        model = conv_net(remat=remat, accum_steps=4)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.5),
            loss="mse",
            steps_per_execution=2 if data == "steps_per_execution" else 1,
        )
        if data == "unknown_length":
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(4)
            model.fit(dataset, epochs=2, verbose=0)
        else:
            model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return model

    assert_close(run(None).variables, run(MODES["full"]).variables, FLOAT32_ATOL)
