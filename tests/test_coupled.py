"""Losses that couple the samples of a batch (``coupled_loss``), against the big batch.

A dual encoder trained with a symmetric InfoNCE loss over the batch's
similarity matrix: each sample's loss depends on every other sample of its
batch. With ``coupled_loss`` the group's loss is computed on its whole batch
(two forward passes per micro-batch), and training equals plain Keras at the
big batch (float32: :data:`~tests.helpers.FLOAT32_ATOL`); without it, each
micro-batch is a smaller batch of negatives (checked to be far off, so that
the comparison can fail). Dropout and BatchNormalization compute per
micro-batch (their masks and statistics are the micro-batch's): the
reference is then the big batch whose those layers run on each micro-batch's
rows in turn (:class:`PerMicroBatch`), which plain Keras computes in one
forward pass under one tape.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from gradient_accumulator._compat import builds_before_first_trace
from tests.helpers import (
    FLOAT8_KERNEL_RTOL,
    FLOAT8_STATE_RTOL,
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    KERAS_VERSION,
    GradientNormLogging,
    assert_close,
    assert_diff_below,
    float8_differences,
    max_abs_diff,
    run_script_module,
    run_workers,
    script_results,
)

MICRO = 8
FEATURES = 12


def info_nce(y_true, y_pred):
    """Per sample, symmetric InfoNCE over the batch: ``y_pred`` is ``[query, candidate]``."""
    del y_true
    query, candidate = ops.split(y_pred, 2, axis=-1)
    logits = ops.matmul(query, ops.transpose(candidate)) / 0.1
    labels = ops.arange(ops.shape(query)[0])
    forward = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    backward = keras.losses.sparse_categorical_crossentropy(
        labels, ops.transpose(logits), from_logits=True
    )
    return (forward + backward) / 2


class PerMicroBatch(keras.layers.Layer):
    """The reference's form of a layer that computes per micro-batch: on each one's rows in turn."""

    def __init__(self, inner, parts, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.parts = parts

    def build(self, shape):
        self.inner.build((None, *shape[1:]))

    def call(self, x, training=None):
        parts = ops.split(x, self.parts, axis=0)
        return ops.concatenate([self.inner(p, training=training) for p in parts], axis=0)

    def compute_output_shape(self, shape):
        return shape


def dual_encoder(
    cls=keras.Model,
    *,
    per_micro_batch=None,
    dropout=False,
    batchnorm=None,
    regularizer=None,
    classifier=False,
    use_bias=True,
    **kwargs,
):
    """Two towers (query, candidate) -> ``[q, c]`` (and class logits if ``classifier``)."""
    keras.utils.set_random_seed(1)

    def wrap(layer):
        return layer if per_micro_batch is None else PerMicroBatch(layer, per_micro_batch)

    def tower(inputs):
        hidden = keras.layers.Dense(
            16, activation="relu", kernel_regularizer=regularizer, use_bias=use_bias
        )(inputs)
        if batchnorm is not None:
            hidden = wrap(batchnorm())(hidden)
        if dropout:
            hidden = wrap(keras.layers.Dropout(0.3, seed=3))(hidden)
        return keras.layers.UnitNormalization()(keras.layers.Dense(8, use_bias=use_bias)(hidden))

    query = keras.Input((FEATURES,), name="query")
    candidate = keras.Input((FEATURES,), name="candidate")
    q, c = tower(query), tower(candidate)
    outputs = {"pair": keras.layers.Concatenate(name="pair")([q, c])}
    if classifier:
        outputs["label"] = keras.layers.Dense(3, name="label")(q)
    else:
        outputs = outputs["pair"]
    return cls(inputs={"query": query, "candidate": candidate}, outputs=outputs, **kwargs)


def pairs(samples, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(samples, FEATURES)).astype("float32")
    candidate = (query + 0.3 * rng.normal(size=query.shape)).astype("float32")
    labels = rng.integers(0, 3, size=(samples, 1))
    return {"query": query, "candidate": candidate}, labels


def train(model, x, y, batch_size, epochs=2, compile_args=None, **fit_kwargs):
    arguments = {"optimizer": keras.optimizers.SGD(0.1, momentum=0.5), "loss": info_nce}
    model.compile(**{**arguments, **(compile_args or {})})
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return model, history.history


def accumulating(accum_steps, coupled_loss="replica", **kwargs):
    return dual_encoder(
        GradientAccumulateModel, accum_steps=accum_steps, coupled_loss=coupled_loss, **kwargs
    )


@pytest.mark.parametrize(
    "accum_steps, samples, jit_compile, steps_per_execution",
    [
        (4, 3 * 32, False, 1),
        (4, 3 * 32, True, 1),
        # The epoch's last group shorter (two micro-batches, as the big batch's last of 16).
        (4, 2 * 32 + 16, False, 1),
        pytest.param(4, 2 * 32 + 16, True, 1, marks=pytest.mark.slow),
        # ... and its last micro-batch too (8 and 4 samples: the big batch's last of 12).
        (4, 2 * 32 + 12, False, 3),
        pytest.param(4, 2 * 32 + 12, True, 3, marks=pytest.mark.slow),
        (33, 33 * MICRO + 2 * MICRO, False, 1),
        pytest.param(128, 128 * MICRO + 3 * MICRO, False, 1, marks=pytest.mark.slow),
        pytest.param(128, 128 * MICRO + 3 * MICRO, True, 2, marks=pytest.mark.slow),
    ],
)
def test_equals_the_big_batch(accum_steps, samples, jit_compile, steps_per_execution):
    x, y = pairs(samples)
    big = accum_steps * MICRO
    compile_args = {"jit_compile": jit_compile, "steps_per_execution": steps_per_execution}
    reference, ref_logs = train(dual_encoder(), x, y, big, compile_args=compile_args)
    model, logs = train(accumulating(accum_steps), x, y, MICRO, compile_args=compile_args)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    # The logged loss is the big batch's.
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    # Each micro-batch's loss on its own is another objective, far from it.
    naive, _ = train(accumulating(accum_steps, coupled_loss=None), x, y, MICRO)
    assert max_abs_diff(naive.get_weights(), reference.get_weights()) > 1e-2


def test_dropout_draws_each_micro_batchs_masks_in_both_passes():
    """Seed states put back before the second pass: the masks of the first, nothing drawn twice."""
    x, y = pairs(3 * 32)
    reference, _ = train(dual_encoder(per_micro_batch=4, dropout=True), x, y, 32)
    model, _ = train(accumulating(4, dropout=True), x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    # The seed generators moved once per micro-batch: 4 draws a group, 3 groups, 2 epochs.
    states = [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    assert [int(v.numpy()[1]) for v in states] == [24, 24]
    assert_close(states, [v for v in reference.non_trainable_variables if "seed" in v.path], 0.5)


@pytest.mark.parametrize("layer", ["keras", "accum"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_batchnorm_statistics_move_once_per_micro_batch(layer, jit_compile):
    """Keras's BatchNormalization: once per micro-batch, as the reference's per-micro-batch layer.

    AccumBatchNormalization: once per update, with the statistics of the
    group's batch (its whole-batch moments against numpy's).
    """
    x, y = pairs(3 * 32)
    compile_args = {"jit_compile": jit_compile}
    if layer == "keras":
        norm = keras.layers.BatchNormalization
        reference, _ = train(
            dual_encoder(per_micro_batch=4, batchnorm=norm), x, y, 32, compile_args=compile_args
        )
        model, _ = train(accumulating(4, batchnorm=norm), x, y, MICRO, compile_args=compile_args)
        assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)
        return

    def accum_norm():
        return AccumBatchNormalization(accum_steps=4, momentum=0.0)

    # Its forward pass is Keras's on the micro-batch: the weights equal the
    # per-micro-batch reference's.
    reference, _ = train(
        dual_encoder(per_micro_batch=4, batchnorm=keras.layers.BatchNormalization),
        x,
        y,
        32,
        epochs=1,
        compile_args=compile_args,
    )
    model, _ = train(
        accumulating(4, batchnorm=accum_norm), x, y, MICRO, epochs=1, compile_args=compile_args
    )
    assert_close(model.trainable_weights, reference.trainable_weights, FLOAT32_ATOL)
    # momentum=0: the moving statistics are the last group's batch moments,
    # of the layers' inputs under the weights before the last update: those
    # of a model trained on the first two groups.
    before, _ = train(
        accumulating(4, batchnorm=accum_norm),
        {k: v[:64] for k, v in x.items()},
        y[:64],
        MICRO,
        epochs=1,
        compile_args=compile_args,
    )
    last_group = {k: v[64:] for k, v in x.items()}
    norms = [lyr for lyr in model.layers if isinstance(lyr, AccumBatchNormalization)]
    norms_before = [lyr for lyr in before.layers if isinstance(lyr, AccumBatchNormalization)]
    for norm, norm_before in zip(norms, norms_before):
        inputs = keras.Model(before.inputs, norm_before.input).predict(last_group, verbose=0)
        assert_close([norm.moving_mean], [inputs.mean(axis=0)], FLOAT32_ATOL)
        assert_close([norm.moving_variance], [inputs.var(axis=0)], 1e-5)
        assert float(norm.pending_count.numpy().max()) == 0.0


def test_sample_weights_per_sample_losses_and_metrics_on_the_group():
    """A coupled output beside a per-sample loss, sample weights, metrics: all the big batch's."""
    x, y = pairs(3 * 32)
    targets = {"pair": np.zeros((len(y), 1), "float32"), "label": y}
    weights = np.random.default_rng(3).uniform(0.5, 2.0, size=len(y)).astype("float32")
    compile_args = {
        "loss": {"pair": info_nce, "label": "sparse_categorical_crossentropy"},
        "metrics": {"label": ["accuracy"]},
    }

    def run(model, batch_size):
        return train(
            model,
            x,
            targets,
            batch_size,
            epochs=1,
            # The gradients agree to 4.8e-7 (SGD at lr 1, one update); this
            # model's training amplifies that rounding (2.5e-6 after three
            # updates at lr 0.1 with momentum): a smaller step.
            compile_args={**compile_args, "optimizer": keras.optimizers.SGD(0.02)},
            sample_weight=weights,
        )

    reference, ref_logs = run(dual_encoder(classifier=True, regularizer="l2"), 32)
    model, logs = run(accumulating(4, classifier=True, regularizer="l2"), MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    for key in ("loss", "label_accuracy"):
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-5, err_msg=key)


def test_mixed_float16(mixed_float16):
    x, y = pairs(3 * 32)
    reference, _ = train(dual_encoder(), x, y, 32)
    model, _ = train(accumulating(4), x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT16_ATOL)


def test_accum_steps_one_is_plain_training():
    x, y = pairs(64)
    reference, _ = train(dual_encoder(), x, y, MICRO)
    model, _ = train(accumulating(1), x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)


def test_the_argument_is_checked_and_saved():
    with pytest.raises(
        ValueError, match="`coupled_loss` must be None.*Received: coupled_loss='yes'"
    ):
        accumulating(4, coupled_loss="yes")
    model = accumulating(4, coupled_loss="global")
    config = model.get_config()
    assert config["coupled_loss"] == "global"
    assert GradientAccumulateModel.from_config(config).coupled_loss == "global"


@pytest.mark.parametrize("how", ["train_on_batch", "unknown_length", "group_step"])
def test_what_cannot_see_a_whole_group_is_refused(how):
    x, y = pairs(64)
    model = accumulating(4)
    model.compile(optimizer="sgd", loss=info_nce)
    if how == "train_on_batch":
        with pytest.raises(ValueError, match="coupled_loss='replica'.*`train_on_batch`"):
            model.train_on_batch({k: v[:MICRO] for k, v in x.items()}, y[:MICRO])
    elif how == "unknown_length":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
        dataset = dataset.filter(lambda *_: True)  # its length unknown
        with pytest.raises(ValueError, match="data of unknown length"):
            model.fit(dataset, epochs=1, verbose=0)
    else:
        batch = ({k: v[:MICRO] for k, v in x.items()}, y[:MICRO])
        with pytest.raises(ValueError, match="`group_step` runs one micro-step per batch"):
            model.group_step([batch] * 4)


class Penalized(keras.layers.Layer):
    """A layer whose ``call`` adds a loss of its own weight (``add_loss``), the only use of it."""

    def build(self, shape):
        self.w = self.add_weight((shape[-1],), initializer="ones")

    def call(self, x):
        self.add_loss(ops.sum(ops.square(self.w)))
        return x


@pytest.mark.parametrize("term", ["activity_regularizer", "add_loss"])
def test_loss_terms_of_the_forward_pass_are_refused_by_name(term):
    """Terms a micro-batch's forward pass adds are not part of the group's loss: refused."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    if term == "activity_regularizer":
        hidden = keras.layers.Dense(16, activity_regularizer="l2")(inputs)
    else:
        hidden = Penalized()(keras.layers.Dense(16)(inputs))
    outputs = keras.layers.Concatenate()([hidden[:, :8], hidden[:, 8:]])
    model = GradientAccumulateModel(
        accum_steps=2, coupled_loss="replica", inputs=inputs, outputs=outputs
    )
    model.compile(optimizer="sgd", loss=info_nce)
    x = np.ones((32, FEATURES), "float32")
    message = "adds 1 loss term.*activity regularizer or `add_loss`.*coupled_loss='replica'"
    with pytest.raises(ValueError, match=message):
        model.fit(x, np.zeros((32, 1)), batch_size=MICRO, epochs=1, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mirrored", "multi_worker"])
def test_two_replicas_equal_one_device(kind):
    """'global': the negatives of both replicas' rows; 'replica': each replica's own.

    Each for the dual encoder and for the KerasRS-style retrieval model
    (its candidate tower in ``compute_loss``).

    MirroredStrategy over two logical CPUs, or two workers on loopback
    (``tests/scripts/mirrored_coupled.py``); each against plain Keras on one
    device at the global batch, with the loss of that case.
    """
    if kind == "mirrored":
        outputs = [run_script_module("mirrored_coupled")]
    else:
        outputs = [out for _, out, _ in run_workers("mirrored_coupled", args=("multi_worker",))]
    for output in outputs:
        result = script_results(output)
        assert result["replicas"] == 2
        # The dual encoder's two scopes (and 'global' at accum_steps=1), the
        # retrieval model's cases (the loss-side BatchNormalization and
        # reduce_every_micro_step: 'global').
        assert len(result["results"]) == 3 + 2 * len(LOSS_SIDE_CASES[:-1]) - 1 + 1
        for case, figures in result["results"].items():
            assert_diff_below(figures["diff"], FLOAT32_ATOL, (case, figures))
            # The retrieval model's embeddings start small and move less.
            moved, other = (0.01, 1e-3) if case.startswith("retrieval") else (0.1, 1e-2)
            assert figures["moved"] > moved
            # The two objectives differ: each case is far from the other's reference.
            assert figures["other"] > other, (case, figures)
            assert figures["updates"] == 4
            if case.endswith("global") or KERAS_VERSION >= (3, 8):
                # Keras < 3.8 logs each replica's own mean loss summed (its
                # strategy bug, also without the library); the global loss is
                # every replica's.
                np.testing.assert_allclose(figures["loss"], figures["reference_loss"], rtol=1e-5)


class UnseededNoise(keras.layers.Layer):
    """Noise from a stateful TensorFlow random op: drawn anew in the second pass."""

    def call(self, x, training=None):
        if training:
            return x + tf.random.uniform(tf.shape(x))
        return x


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_forward_pass_that_cannot_be_replayed_fails_the_step(jit_compile):
    """Its cached loss gradient would belong to other outputs: an error, not a silent update."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = UnseededNoise()(keras.layers.Dense(16)(inputs))
    model = GradientAccumulateModel(
        accum_steps=2, coupled_loss="replica", inputs=inputs, outputs=hidden
    )
    model.compile(optimizer="sgd", loss=info_nce, jit_compile=jit_compile)
    before = [w.copy() for w in model.get_weights()]
    x = np.random.default_rng(0).normal(size=(32, FEATURES)).astype("float32")
    with pytest.raises(tf.errors.InvalidArgumentError, match="computed other outputs"):
        model.fit(x, np.zeros((32, 1)), batch_size=MICRO, epochs=1, verbose=0)
    assert max_abs_diff(model.get_weights(), before) == 0.0


@pytest.mark.skipif(
    not builds_before_first_trace(), reason="Keras < 3.5: no batch before the first trace"
)
def test_an_undeclared_coupled_loss_is_warned_about():
    """coupled_loss=None with InfoNCE: the first fit says the loss compares the samples."""
    x, y = pairs(64)
    with pytest.warns(UserWarning, match="compares the samples of a batch.*coupled_loss='replica'"):
        train(accumulating(4, coupled_loss=None), x, y, MICRO, epochs=1)


@pytest.mark.parametrize("case", ["mse_sample_weights", "masked_tokens", "two_outputs"])
def test_per_sample_losses_are_not_warned_about(case, recwarn):
    """Losses of each sample's own outputs (any normaliser) give no such warning."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if case == "masked_tokens":
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(20, 8, mask_zero=True)(inputs)
        outputs = keras.layers.Dense(5)(hidden)
        x = rng.integers(0, 20, size=(32, 6)).astype("int32")
        x[:, 4:] = 0  # padding: masked tokens
        y = rng.integers(0, 5, size=(32, 6))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        inputs = keras.Input((FEATURES,))
        outputs = keras.layers.Dense(2)(inputs)
        if case == "two_outputs":
            outputs = [outputs, keras.layers.Dense(1)(inputs)]
        x = rng.normal(size=(32, FEATURES)).astype("float32")
        y = rng.normal(size=(32, 2)).astype("float32")
        y = [y, y[:, :1]] if case == "two_outputs" else y
        loss = ["mse", "mae"] if case == "two_outputs" else "mse"
    model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    model.compile(optimizer="sgd", loss=loss)
    shape = (32, 6) if case == "masked_tokens" else (32,)  # per token, or per sample
    weights = rng.uniform(0.5, 2.0, size=shape).astype("float32")
    model.fit(x, y, sample_weight=weights, batch_size=MICRO, epochs=1, verbose=0)
    assert not [w for w in recwarn if "compares the samples" in str(w.message)]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_float8_equals_the_big_batch(jit_compile):
    # Float8 Dense layers (model.quantize("float8")): their scales and amax
    # histories are written by each micro-batch's second pass (the amax of
    # its inputs, and of its rows of the group's output gradient) and take
    # the group's maximum, the big batch's value. No biases, as in
    # tests.helpers.build_float8: Keras's float8 Dense rounds a bias's
    # gradient through bfloat16 per micro-batch (after one update the biases
    # differ by up to 2.2e-4 here, the kernels not at all), and the
    # contrastive loss carries that into every weight over a few updates
    # (4e-3 after three).
    x, y = pairs(3 * 32)
    models = []
    for model in (dual_encoder(use_bias=False), accumulating(4, use_bias=False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # layers without `quantize`
            model.quantize("float8")
        models.append(model)
    compile_args = {"jit_compile": jit_compile}
    reference, _ = train(models[0], x, y, 32, compile_args=compile_args)
    model, _ = train(models[1], x, y, MICRO, compile_args=compile_args)
    assert int(model.optimizer.iterations.numpy()) == 6
    marked = [w for w in model.weights if getattr(w, "overwrite_with_gradient", False)]
    assert len(marked) == 24  # 4 Dense layers x (inputs, kernel, outputs' gradient) x 2
    differences = float8_differences(reference, model)
    assert differences["state"] < FLOAT8_STATE_RTOL, differences
    assert differences["kernel"] < FLOAT8_KERNEL_RTOL, differences


@pytest.mark.parametrize("jit_compile", [False, True])
def test_gradient_norm_is_the_big_batch_s(jit_compile):
    x, y = pairs(3 * 32 + MICRO)  # 3 groups of 4, then one of 1
    logged = []
    for model, batch_size in (
        (dual_encoder(GradientNormLogging), 32),
        (accumulating(4, gradient_norm=True), MICRO),
    ):
        norms = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, out=norms: out.append(logs["gradient_norm"])
        )
        train(
            model, x, y, batch_size, compile_args={"jit_compile": jit_compile}, callbacks=[record]
        )
        logged.append(np.array(norms, dtype="float64"))
    assert len(logged[0]) == len(logged[1]) == 8
    np.testing.assert_allclose(logged[1], logged[0], rtol=1e-5)


# ----------------------------------------------------------------------------
# Models written the KerasRS way: a subclass whose `compute_loss` runs weights
# ----------------------------------------------------------------------------

USERS, MOVIES, EMBEDDING = 40, 50, 8

# What `compute_loss` reads besides the model's outputs, one case each: the
# candidate tower (KerasRS's retrieval tutorial), an embedding both towers
# share, the model called again, a loss-side layer with state of its own, an
# output that only the loss reads, weights read only by a metric.
LOSS_SIDE_CASES = (
    "candidate_tower",
    "shared_embedding",
    "calls_the_model_again",
    "loss_layer_with_state",
    "output_read_by_the_loss_only",
    "weights_read_by_a_metric_only",
)


class Retrieval:
    """A two-tower retrieval model as KerasRS writes it: the query tower in ``call``.

    ``compute_loss`` runs the candidate tower on ``y`` (movie ids) and scores
    every query against every candidate of the batch (in-batch softmax,
    labels on the diagonal); ``case`` (:data:`LOSS_SIDE_CASES`) adds what
    else the loss reads. Mixed into ``keras.Model`` (the big batch's
    reference) or ``GradientAccumulateModel``: see :func:`retrieval`.
    ``blocks``: ``(rows, replicas)`` scores a query only against the
    candidates of its own replica's rows (each global micro-batch of
    ``rows`` rows split in ``replicas`` equal shards): the reference of
    ``coupled_loss='replica'`` under several replicas.
    """

    def __init__(self, case="candidate_tower", blocks=None, **kwargs):
        super().__init__(**kwargs)
        self.case = case
        self.blocks = blocks
        self.users = keras.layers.Embedding(USERS, EMBEDDING, name="users")
        self.movies = keras.layers.Embedding(MOVIES, EMBEDDING, name="movies")
        self.query = keras.layers.Dense(EMBEDDING, name="query")
        self.bias = keras.layers.Dense(1, name="bias")
        self.candidate_norm = None
        if case == "loss_layer_with_state":
            self.candidate_norm = keras.layers.BatchNormalization(
                momentum=0.5, name="candidate_norm"
            )
        self.probe = keras.layers.Dense(1, name="probe")
        self.probe_tracker = keras.metrics.Mean(name="probe")
        self.retrieval_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(self, input_shape):
        self.users.build((None,))
        self.movies.build((None,))
        self.query.build((None, EMBEDDING))
        self.bias.build((None, EMBEDDING))
        if self.candidate_norm is not None:
            self.candidate_norm.build((None, EMBEDDING))
        self.probe.build((None, EMBEDDING))

    def call(self, x):
        query = self.query(self.users(x["user"]))
        if self.case == "shared_embedding":
            query = query + self.movies(x["liked"])
        if self.case == "output_read_by_the_loss_only":
            return {"query": query, "bias": self.bias(query)}
        return query

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        candidates = self.movies(y)
        if self.case == "loss_layer_with_state":
            candidates = self.candidate_norm(candidates, training=training)
        query = y_pred["query"] if isinstance(y_pred, dict) else y_pred
        scores = ops.matmul(query, ops.transpose(candidates))
        if self.case == "calls_the_model_again":
            scores = scores + 0.5 * ops.matmul(self(x), ops.transpose(candidates))
        if self.case == "output_read_by_the_loss_only":
            scores = scores + y_pred["bias"]
        if self.blocks is not None:
            rows, replicas = self.blocks
            index = ops.arange(ops.shape(scores)[0])
            replica = (index % rows) // (rows // replicas)
            same = ops.equal(replica[:, None], replica[None, :])
            scores = ops.where(same, scores, -1e9)
        # A Keras loss object, as KerasRS's tutorial: its reduction makes the
        # loss each replica's share under a strategy, as the compiled loss's.
        labels = ops.arange(ops.shape(scores)[0])
        return self.retrieval_loss(labels, scores)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        if self.case == "weights_read_by_a_metric_only":
            query = y_pred["query"] if isinstance(y_pred, dict) else y_pred
            self.probe_tracker.update_state(ops.mean(self.probe(query)))
            logs = {**logs, "probe": self.probe_tracker.result()}
        return logs


class RetrievalModel(Retrieval, keras.Model):
    pass


class AccumulatingRetrievalModel(Retrieval, GradientAccumulateModel):
    pass


def retrieval(accum_steps=None, **kwargs):
    """A built :class:`Retrieval`: plain Keras, or accumulating with ``accum_steps``."""
    keras.utils.set_random_seed(1)
    if accum_steps is None:
        model = RetrievalModel(**kwargs)
    else:
        kwargs.setdefault("coupled_loss", "replica")
        model = AccumulatingRetrievalModel(accum_steps=accum_steps, **kwargs)
    model.build(None)
    return model


def ratings(samples, seed=0):
    """Users, a movie each liked, and the movie watched (the target): ids drawn per group."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, USERS, size=samples)
    # The movie watched depends on the user (so there is something to learn),
    # with micro-batches that differ: ids from a range that moves along the data.
    shift = np.arange(samples) // MICRO
    watched = (users + 3 * shift + rng.integers(0, 5, size=samples)) % MOVIES
    liked = (watched + rng.integers(0, 3, size=samples)) % MOVIES
    return {"user": users, "liked": liked}, watched


def train_retrieval(
    model, x, y, batch_size, jit_compile=False, epochs=2, learning_rate=2.0, **fit_kwargs
):
    optimizer = keras.optimizers.SGD(learning_rate, momentum=0.5)
    model.compile(optimizer=optimizer, jit_compile=jit_compile)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return model, history.history


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("case", LOSS_SIDE_CASES)
def test_weights_the_loss_reads_train_as_in_the_big_batch(case, jit_compile):
    """Every weight plain Keras trains gets the big batch's gradient: through the outputs or not.

    The group's last shorter (two micro-batches). The moving statistics of
    a loss-side BatchNormalization move once per group, on its batch, as the
    big batch's; weights read only by a metric train in neither.
    """
    x, y = ratings(3 * 32 + 16)
    # The loss-side BatchNormalization's training amplifies float32 rounding
    # at a large step (7e-3 after two epochs at 2.0; 2e-7 after one): a smaller step.
    learning_rate = 0.5 if case == "loss_layer_with_state" else 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Gradients do not exist" (probe)
        reference, ref_logs = train_retrieval(
            retrieval(case=case), x, y, 32, jit_compile, learning_rate=learning_rate
        )
        model, logs = train_retrieval(
            retrieval(4, case=case), x, y, MICRO, jit_compile, learning_rate=learning_rate
        )
    initial = retrieval(case=case)
    assert max_abs_diff(reference.get_weights(), initial.get_weights()) > 0.05
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    np.testing.assert_allclose(logs["loss"], ref_logs["loss"], rtol=1e-5)
    if case == "weights_read_by_a_metric_only":
        assert max_abs_diff(model.probe.get_weights(), initial.probe.get_weights()) == 0.0
        np.testing.assert_allclose(logs["probe"], ref_logs["probe"], rtol=1e-5)


def test_a_loss_side_tower_with_a_per_sample_loss_needs_no_coupled_loss():
    """``coupled_loss=None``: each micro-step's tape sees the loss's weights too."""

    class PerSample(Retrieval):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            # The score of each user's own movie, towards 1.
            score = ops.sum(y_pred * self.movies(y), axis=-1)
            return ops.mean(ops.square(score - 1.0))

    class Plain(PerSample, keras.Model):
        pass

    class Accumulating(PerSample, GradientAccumulateModel):
        pass

    x, y = ratings(3 * 32 + 16)
    keras.utils.set_random_seed(1)
    reference = Plain()
    reference.build(None)
    keras.utils.set_random_seed(1)
    model = Accumulating(accum_steps=4)
    model.build(None)
    reference, _ = train_retrieval(reference, x, y, 32)
    model, _ = train_retrieval(model, x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)


def test_a_loss_side_tower_under_mixed_float16(mixed_float16):
    x, y = ratings(3 * 32)
    reference, _ = train_retrieval(retrieval(), x, y, 32)
    model, _ = train_retrieval(retrieval(4), x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT16_ATOL)


@pytest.mark.parametrize("accum_steps", [1, 128])
def test_a_loss_side_tower_at_the_limits_of_accum_steps(accum_steps):
    # Micro-batches of 2, two groups of 128 (the big batch of 2 at step 2.0 diverges).
    x, y = ratings(2 * 128 * 2)
    arguments = {"epochs": 1, "learning_rate": 0.2}
    reference, _ = train_retrieval(retrieval(), x, y, accum_steps * 2, **arguments)
    model, _ = train_retrieval(retrieval(accum_steps), x, y, 2, **arguments)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)


def test_regularizers_are_the_loss_s_own():
    """An overridden ``compute_loss`` that leaves ``self.losses`` out trains without them.

    As plain Keras's train step, which only calls ``compute_loss``: the
    regularizers are part of the loss only where it adds them.
    """

    class Unregularized(Retrieval):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.users = keras.layers.Embedding(
                USERS, EMBEDDING, embeddings_regularizer="l2", name="users"
            )

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            scores = ops.matmul(y_pred, ops.transpose(self.movies(y)))
            labels = ops.arange(ops.shape(scores)[0])
            return ops.mean(
                keras.losses.sparse_categorical_crossentropy(labels, scores, from_logits=True)
            )

    class Plain(Unregularized, keras.Model):
        pass

    class Accumulating(Unregularized, GradientAccumulateModel):
        pass

    x, y = ratings(3 * 32)
    models = []
    for cls, kwargs in ((Plain, {}), (Accumulating, {"accum_steps": 4, "coupled_loss": "replica"})):
        keras.utils.set_random_seed(1)
        model = cls(**kwargs)
        model.build(None)
        models.append(model)
    reference, _ = train_retrieval(models[0], x, y, 32)
    model, _ = train_retrieval(models[1], x, y, MICRO)
    assert_close(model.get_weights(), reference.get_weights(), FLOAT32_ATOL)


def test_float8_state_the_loss_reads_itself_is_refused_by_name():
    """A float8 layer run in ``compute_loss``: its scales would be summed, not kept; refused."""

    class Float8Loss(Retrieval):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.projection = keras.layers.Dense(EMBEDDING, use_bias=False, name="projection")

        def build(self, input_shape):
            super().build(input_shape)
            self.projection.build((None, EMBEDDING))

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            candidates = self.projection(self.movies(y))
            scores = ops.matmul(y_pred, ops.transpose(candidates))
            return self.retrieval_loss(ops.arange(ops.shape(scores)[0]), scores)

    class Accumulating(Float8Loss, GradientAccumulateModel):
        pass

    x, y = ratings(64)
    keras.utils.set_random_seed(1)
    model = Accumulating(accum_steps=4, coupled_loss="replica")
    model.build(None)
    model.projection.quantize("float8")  # the loss's layer only (Embedding has no float8)
    model.compile(optimizer="sgd")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(
        ValueError, match="Variable '.*projection.*' holds float8 state.*`compute_loss`"
    ):
        model.fit(x, y, batch_size=MICRO, epochs=1, verbose=0)
    assert max_abs_diff(model.get_weights(), before) == 0.0
