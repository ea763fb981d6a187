"""GradientAccumulateModel under MirroredStrategy (2 logical CPUs) against one device.

Run: ``python -m tests.scripts.mirrored_model WORKDIR CASE [CASE ...]`` (the
cases of :data:`CASES`; ``WORKDIR`` holds the checkpoints of the resume cases).

Each case trains the accumulating model under one MirroredStrategy over two
replicas at the global micro-batch 8 (4 samples per replica), 4 micro-steps
per update, and a reference on one device, without the strategy: plain Keras
at the global big batch 2 x 4 x 4 = 32 (same initial weights, same data
order), unless the case says otherwise. Prints one results line (see
``tests/scripts/__init__.py``), per case:

- ``diff``: max |weight difference| from the reference;
- ``state_diff``: the same for the optimizer's variables (moments, EMA, ...);
- ``updates`` / ``reference_updates``: optimizer updates of both;
- ``moved``: max |difference| of the reference's weights from the initial
  ones (an equivalence of two untrained models proves nothing);

and figures of the case's own (named in each case's docstring).
"""

import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from gradient_accumulator._compat import keras_version
from tests.helpers import (
    CLIPPING_OPTIMIZERS,
    DISTRIBUTED_OPTIMIZERS,
    build_classifier,
    build_dense,
    build_embedding,
    build_multi_io,
    build_tagger,
    build_two_heads,
    make_classification_data,
    make_multi_io_data,
    make_padded_sequences,
    make_regression_data,
    make_token_data,
    max_abs_diff,
    numpy_agc_all,
    train_big_batches,
)
from tests.helpers import (
    OPTIMIZERS as ALL_OPTIMIZERS,
)
from tests.scripts import (
    ACCUM_STEPS,
    BIG_BATCH,
    GLOBAL_MICRO_BATCH,
    MICRO_BATCH,
    REPLICAS,
    print_results,
    split_cpu,
    updates,
    values,
)

OPTIMIZERS = {name: ALL_OPTIMIZERS[name] for name in DISTRIBUTED_OPTIMIZERS}
CLIPPED = CLIPPING_OPTIMIZERS


# ----------------------------------------------------------------- helpers --


def compare(reference, model, build, reference_optimizer=None):
    """The figures every case reports; ``reference_optimizer`` defaults to the reference's."""
    reference_optimizer = reference_optimizer or reference.optimizer
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "state_diff": max_abs_diff(
            values(reference_optimizer.variables), values(model.optimizer.variables)
        ),
        "updates": updates(model.optimizer),
        "reference_updates": updates(reference_optimizer),
        "moved": max_abs_diff(reference.get_weights(), build(keras.Model).get_weights()),
    }


class ReplicaGroupLosses(keras.callbacks.Callback):
    """The losses the accumulating model must log per epoch under the strategy, from the reference.

    Per replica, its group is its own big batch, as each replica's batch is
    in plain Keras's logs: its rows of the group's micro-batches (the first
    half of each global micro-batch, or the second) as one batch, its losses
    computed by ``losses_of(model, rows)`` (a dict: ``loss`` and each
    output's) with the reference's weights at that group's big batch (the
    model's, as the cases show), averaged over the epoch's samples. Keras
    before 3.4 (or so) keeps its metrics in mirrored variables, which hold
    the first replica's values: its logs are the first replica's.
    """

    def __init__(self, losses_of, num_samples, strategy):
        super().__init__()
        self.losses_of = losses_of
        self.num_samples = num_samples
        self.epochs = []
        with strategy.scope():
            probe = keras.metrics.Mean()
        per_replica = probe.total.value.synchronization == tf.VariableSynchronization.ON_READ
        self.replicas = range(REPLICAS) if per_replica else range(1)

    def on_epoch_begin(self, epoch, logs=None):
        self.totals, self.count = {}, 0

    def on_train_batch_begin(self, batch, logs=None):
        start = batch * BIG_BATCH
        stop = min(start + BIG_BATCH, self.num_samples)
        for replica in self.replicas:
            rows = []
            for first in range(start, stop, GLOBAL_MICRO_BATCH):
                share = min(GLOBAL_MICRO_BATCH, stop - first) // REPLICAS
                rows += range(first + replica * share, first + (replica + 1) * share)
            for key, value in self.losses_of(self.model, np.array(rows)).items():
                self.totals[key] = self.totals.get(key, 0.0) + float(value) * len(rows)
            self.count += len(rows)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({key: total / self.count for key, total in self.totals.items()})


def batch_losses(model, x, y, sample_weight=None):
    """The losses plain Keras logs for ``(x, y)`` as one batch (one device): ``evaluate``'s."""
    return model.evaluate(
        x, y, sample_weight=sample_weight, batch_size=len(x), verbose=0, return_dict=True
    )


def logged_difference(expected, history):
    """Max relative difference of ``history``'s losses from ``ReplicaGroupLosses``'s."""
    return max(
        abs(history[key][epoch] - value) / abs(value)
        for epoch, losses in enumerate(expected.epochs)
        for key, value in losses.items()
        if key in history
    )


def distributed(strategy, build, make_optimizer, compile_kwargs=None, seed=0, **model_kwargs):
    """The accumulating model, created and compiled in the strategy's scope."""
    with strategy.scope():
        model = build(GradientAccumulateModel, seed=seed, accum_steps=ACCUM_STEPS, **model_kwargs)
        model.compile(optimizer=make_optimizer(), **{"loss": "mse", **(compile_kwargs or {})})
    return model


def fit_pair(
    strategy,
    make_optimizer,
    data,
    build=build_dense,
    epochs=2,
    model_kwargs=None,
    compile_kwargs=None,
    fit_kwargs=None,
    reference_logs=None,
):
    """Plain Keras on one device at the big batch, and the model under the strategy.

    ``reference_logs``: a :class:`ReplicaGroupLosses` for the reference's
    ``fit``; the model's ``History`` is left in ``model.history_logged``.
    """
    x, y = data
    compile_kwargs = {"loss": "mse", **(compile_kwargs or {})}
    fit_kwargs = {"epochs": epochs, "shuffle": False, "verbose": 0, **(fit_kwargs or {})}
    reference = build(keras.Model)
    reference.compile(optimizer=make_optimizer(), **compile_kwargs)
    callbacks = [] if reference_logs is None else [reference_logs]
    reference.fit(x, y, batch_size=BIG_BATCH, callbacks=callbacks, **fit_kwargs)
    model = distributed(strategy, build, make_optimizer, compile_kwargs, **(model_kwargs or {}))
    model.history_logged = model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, **fit_kwargs).history
    return reference, model


# ------------------------------------------------------------------- cases --


def optimizer_case(name):
    def case(strategy, workdir):
        """Clipping cases add ``unclipped_gap``: the reference's distance from
        the same training without clipping (clipping must bite)."""
        data = make_regression_data()
        reference, model = fit_pair(strategy, OPTIMIZERS[name], data)
        result = compare(reference, model, build_dense)
        if name in CLIPPED:
            unclipped = build_dense()
            unclipped.compile(keras.optimizers.SGD(0.5), "mse")
            unclipped.fit(*data, batch_size=BIG_BATCH, epochs=2, shuffle=False, verbose=0)
            result["unclipped_gap"] = max_abs_diff(unclipped.get_weights(), reference.get_weights())
        return result

    return case


def use_agc(strategy, workdir):
    """Reference: each big batch's gradient clipped by the numpy AGC formula
    (float64) on one device. ``unclipped_gap``: the reference's distance from
    the same training without clipping (clipping must bite)."""
    x, y = make_regression_data()

    def make_optimizer():
        return keras.optimizers.SGD(0.5)

    clip = numpy_agc_all(0.02, 1e-3)
    reference, optimizer = train_big_batches(
        build_dense, make_optimizer, x, y, BIG_BATCH, epochs=2, clip=clip
    )
    unclipped, _ = train_big_batches(build_dense, make_optimizer, x, y, BIG_BATCH, epochs=2)
    model = distributed(strategy, build_dense, make_optimizer, use_agc=True, clip_factor=0.02)
    model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    result = compare(reference, model, build_dense, optimizer)
    result["unclipped_gap"] = max_abs_diff(unclipped.get_weights(), reference.get_weights())
    return result


def sample_weight_regularizers(strategy, workdir):
    x, y = make_classification_data()
    sample_weight = np.random.default_rng(2).uniform(0.1, 3.0, size=len(x))
    reference, model = fit_pair(
        strategy,
        OPTIMIZERS["adam"],
        (x, y),
        build=build_classifier,
        compile_kwargs={"loss": "sparse_categorical_crossentropy"},
        fit_kwargs={"sample_weight": sample_weight},
    )
    return compare(reference, model, build_classifier)


def class_weight(strategy, workdir):
    reference, model = fit_pair(
        strategy,
        OPTIMIZERS["sgd_momentum"],
        make_classification_data(),
        build=build_classifier,
        compile_kwargs={"loss": "sparse_categorical_crossentropy"},
        fit_kwargs={"class_weight": {0: 0.2, 1: 1.0, 2: 3.0}},
    )
    return compare(reference, model, build_classifier)


def multi_io(strategy, workdir):
    """Two inputs and outputs, ``loss_weights`` and an ``add_loss`` penalty."""
    reference, model = fit_pair(
        strategy,
        OPTIMIZERS["rmsprop"],
        make_multi_io_data(),
        build=build_multi_io,
        compile_kwargs={
            "loss": {"first": "mse", "second": "sparse_categorical_crossentropy"},
            "loss_weights": {"first": 0.3, "second": 2.0},
        },
    )
    return compare(reference, model, build_multi_io)


def token_case(reduction):
    def case(strategy, workdir):
        """A masked per-token loss (Embedding(mask_zero=True)) with temporal
        sample weights, ``reduction`` as named; replica 0's sequences hold 1-3
        tokens and replica 1's 8-12 in every micro-step (SGD: its sparse
        update sums repeated rows as the dense sum does)."""
        x, tags, weights = make_padded_sequences(76, shard_size=MICRO_BATCH)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        # Keras >= 3.8 logs a sum times the replicas (its tracker "unscales"
        # every loss, and only means were scaled).
        logged_sum = REPLICAS if keras_version() >= (3, 8) else 1

        def losses_of(model, rows):
            losses = batch_losses(model, x[rows], tags[rows], weights[rows])
            return {"loss": losses["loss"] * (logged_sum if reduction == "sum" else 1)}

        expected = ReplicaGroupLosses(losses_of, len(x), strategy)
        reference, model = fit_pair(
            strategy,
            lambda: keras.optimizers.SGD(0.5 if reduction != "sum" else 0.005),
            (x, tags),
            build=build_tagger,
            compile_kwargs={"loss": loss},
            fit_kwargs={"sample_weight": weights},
            reference_logs=expected,
        )
        logged = logged_difference(expected, model.history_logged)
        return {**compare(reference, model, build_tagger), "logged_diff": logged}

    return case


def two_normalisers(strategy, workdir):
    """Two heads whose losses divide by different normalisers: a masked
    per-token head (valid tokens; replica 0's sequences hold 1-3 tokens and
    replica 1's 8-12) and a per-sequence head on pooled features (samples),
    with ``loss_weights``. ``classes``: the model's normaliser classes (2)."""
    x, tags, _ = make_padded_sequences(76, shard_size=MICRO_BATCH)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")

    def build(cls=keras.Model, **kwargs):
        return build_two_heads(cls, pooled_head=True, **kwargs)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def losses_of(model, rows):
        return batch_losses(model, x[rows], [tags[rows], scores[rows]])

    expected = ReplicaGroupLosses(losses_of, len(x), strategy)
    reference, model = fit_pair(
        strategy,
        lambda: keras.optimizers.SGD(0.5),
        (x, [tags, scores]),
        build=build,
        compile_kwargs={"loss": [loss, "mse"], "loss_weights": [1.0, 0.3]},
        reference_logs=expected,
    )
    return {
        **compare(reference, model, build),
        "classes": model._accumulator.num_classes,
        "logged_diff": logged_difference(expected, model.history_logged),
    }


def last_group_case(num_samples):
    def case(strategy, workdir):
        """One epoch of ``num_samples``; ``micro_step``: left in the group after it (0)."""
        reference, model = fit_pair(
            strategy, OPTIMIZERS["sgd_momentum"], make_regression_data(num_samples), epochs=1
        )
        result = compare(reference, model, build_dense)
        result["micro_step"] = int(model._accumulator.micro_step.numpy())
        return result

    return case


def _error(error):
    """``Type: line``: the message's line naming the root cause if TensorFlow
    gives one (``You must feed ...``, ``Trying to access resource ...``), else its
    first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    causes = ("must feed a value", "Trying to access resource")
    cause = next((line for line in lines if any(c in line for c in causes)), lines[0])
    return f"{type(error).__name__}: {cause}"


def beside_plain_keras(compile_kwargs):
    """A case with ``compile_kwargs`` under which plain Keras's own ``fit`` may
    fail under the strategy: ``keras_error`` says how (``None``: it trains);
    if this model's fails too, ``error`` replaces the figures."""

    def case(strategy, workdir):
        data = make_regression_data()  # 76 samples: the last group 8 + 4
        with strategy.scope():
            plain = build_dense()
            plain.compile(OPTIMIZERS["adam"](), "mse", **compile_kwargs)
        try:
            plain.fit(*data, batch_size=GLOBAL_MICRO_BATCH, shuffle=False, verbose=0)
            keras_error = None
        except Exception as error:  # noqa: BLE001 - Keras's own outcome is the figure
            keras_error = _error(error)
        try:
            reference, model = fit_pair(
                strategy, OPTIMIZERS["adam"], data, compile_kwargs=compile_kwargs
            )
        except Exception as error:  # noqa: BLE001 - reported by the test
            return {"error": _error(error), "keras_error": keras_error}
        return {**compare(reference, model, build_dense), "keras_error": keras_error}

    return case


def reduce_every_micro_step(strategy, workdir):
    reference, model = fit_pair(
        strategy,
        OPTIMIZERS["adam"],
        make_regression_data(),
        model_kwargs={"reduce_every_micro_step": True},
    )
    return compare(reference, model, build_dense)


def sparse_case(name):
    def case(strategy, workdir):
        """Embedding gradients (IndexedSlices). 72 samples: replica 0's shard of
        every micro-batch holds ids 0-14, replica 1's ids 15-29, each shard
        repeats ids; rows 30-39 get no gradient. SGD's reference is plain
        Keras ``fit`` on the raw IndexedSlices (its sparse update scatter-adds,
        which sums repeated rows as the dense gradient does); Adam's has its
        gradients densified (``train_big_batches``: Keras's sparse Adam squares
        each repeated row's slice before summing, while the wrappers hand it the
        dense sum).
        ``untouched_moved``: max change of rows 30-39 (0); ``keras_sparse_gap``:
        plain Keras on the raw IndexedSlices against the reference."""
        make_optimizer = {
            "sgd": lambda: keras.optimizers.SGD(0.5),
            "adam": lambda: keras.optimizers.Adam(0.01),
        }[name]
        x, y = make_token_data(72, shard_size=MICRO_BATCH)
        keras_sparse, model = fit_pair(strategy, make_optimizer, (x, y), build=build_embedding)
        if name == "sgd":
            reference, reference_optimizer = keras_sparse, keras_sparse.optimizer
        else:
            reference, reference_optimizer = train_big_batches(
                build_embedding, make_optimizer, x, y, BIG_BATCH, epochs=2, densify=True
            )
        initial = build_embedding().get_layer("embedding").get_weights()[0]
        table = model.get_layer("embedding").get_weights()[0]
        result = compare(reference, model, build_embedding, reference_optimizer)
        result["untouched_moved"] = float(np.abs(table[30:] - initial[30:]).max())
        result["keras_sparse_gap"] = max_abs_diff(
            keras_sparse.get_weights(), reference.get_weights()
        )
        return result

    return case


def mixed_float16(strategy, workdir):
    """mixed_float16, and one micro-batch (in replica 0's shard) overflows
    float16 in each epoch's first group: the group is skipped and the loss
    scale halved, as the big batch's step. ``scales``: both final loss scales;
    ``sums_finite``: no inf/NaN left in the sums."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_regression_data(num_samples=64)
        x[10, 0] = 1e5  # micro-batch 1 (samples 8-15) of group 1, replica 0's half
        reference, model = fit_pair(strategy, OPTIMIZERS["adam"], (x, y))
        result = compare(reference, model, build_dense)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    sums = [np.asarray(v.numpy()) for v in model._accumulator.gradient_sums]
    result["scales"] = [float(m.optimizer.dynamic_scale.numpy()) for m in (reference, model)]
    result["sums_finite"] = bool(all(np.all(np.isfinite(s)) for s in sums))
    return result


def loss_scale(strategy, workdir):
    """mixed_float16 with Keras's default initial scale (32768), Adam, 64
    samples for 3 epochs: each micro-batch's loss is scaled by its share of
    the group, so no micro-batch overflows where the big batch does not.
    ``scales``: both final loss scales."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 5)).astype("float32")
        y = rng.normal(size=(64, 1)).astype("float32")
        reference, model = fit_pair(
            strategy, lambda: keras.optimizers.Adam(0.01, epsilon=1e-4), (x, y), epochs=3
        )
        result = compare(reference, model, build_dense)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result["scales"] = [float(m.optimizer.dynamic_scale.numpy()) for m in (reference, model)]
    return result


def sparse_mixed_float16(strategy, workdir):
    """Embedding gradients under mixed_float16 (SGD): float16 IndexedSlices are
    unscaled and scatter-added into float32 sums on each replica. Reference:
    plain Keras under the same policy at the big batch, on one device.
    ``scales``: both final loss scales."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_token_data(72, shard_size=MICRO_BATCH)
        reference, model = fit_pair(
            strategy, lambda: keras.optimizers.SGD(0.5), (x, y), build=build_embedding
        )
        result = compare(reference, model, build_embedding)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result["scales"] = [float(m.optimizer.dynamic_scale.numpy()) for m in (reference, model)]
    return result


def _numpy_moving_statistics(x, groups, momentum, epochs):
    """Moving mean and variance after each group's float64 statistics, as Keras updates them."""
    mean, variance = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    for _ in range(epochs):
        for start, stop in groups:
            batch = x[start:stop].astype("float64")
            mean = momentum * mean + (1 - momentum) * batch.mean(0)
            variance = momentum * variance + (1 - momentum) * batch.var(0)
    return mean, variance


def batchnorm(strategy, workdir):
    """AccumBatchNormalization(synchronized=True) on the input. Reference: the
    same GradientAccumulateModel on one device at the global micro-batch (the
    forward pass normalizes micro-batches, so plain Keras at the big batch
    differs). ``stats_diff``: max relative error (floor 1) of every replica's
    moving mean and variance against numpy's of the global accumulated batches;
    ``replica_gap``: max |difference| between the replicas' copies."""
    rng = np.random.default_rng(4)
    # O(1) statistics, so that float32 rounding stays below FLOAT32_ATOL.
    x = rng.normal(size=(76, 3)) * [1.0, 1.2, 0.5]
    x[np.arange(76) % GLOBAL_MICRO_BATCH >= MICRO_BATCH] += 1.0  # replica 1's shards
    x = x.astype("float32")
    y = rng.normal(size=(76, 1)).astype("float32")

    def build(cls=GradientAccumulateModel, seed=0, **kwargs):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((3,))
        normalized = AccumBatchNormalization(
            ACCUM_STEPS, momentum=0.5, synchronized=True, name="bn"
        )(inputs)
        outputs = keras.layers.Dense(1, name="out")(normalized)
        if cls is keras.Model:
            return keras.Model(inputs, outputs)
        return GradientAccumulateModel(accum_steps=ACCUM_STEPS, inputs=inputs, outputs=outputs)

    make = OPTIMIZERS["sgd_momentum"]
    reference = build()
    reference.compile(make(), "mse")
    reference.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = build()
        model.compile(make(), "mse")
    model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=2, shuffle=False, verbose=0)

    expected = _numpy_moving_statistics(x, [(0, 32), (32, 64), (64, 76)], 0.5, 2)
    layer = model.get_layer("bn")
    copies = [
        [np.asarray(v) for v in strategy.experimental_local_results(w.value)]
        for w in (layer.moving_mean, layer.moving_variance)
    ]
    stats_diff = max(
        float(np.max(np.abs(copy - want) / np.maximum(np.abs(want), 1.0)))
        for statistic, want in zip(copies, expected)
        for copy in statistic
    )
    return {
        **compare(reference, model, build),
        "stats_diff": stats_diff,
        "replica_gap": max(float(np.abs(c[0] - c[1]).max()) for c in copies),
    }


def resume_case(how):
    def case(strategy, workdir):
        """64 samples (2 updates), interrupted after 6 micro-steps (2 into the
        second group), saved (``tf.train.Checkpoint`` or ``save_weights``),
        restored into a fresh model under the strategy, trained on the rest.
        ``uninterrupted_diff``: against the same run without interruption;
        ``micro_step``: restored micro-steps (2)."""
        x, y = make_regression_data(num_samples=64)
        make = OPTIMIZERS["adam"]
        reference = build_dense()
        reference.compile(make(), "mse")
        reference.fit(x, y, batch_size=BIG_BATCH, shuffle=False, verbose=0)
        uninterrupted = distributed(strategy, build_dense, make)
        uninterrupted.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, shuffle=False, verbose=0)

        first = distributed(strategy, build_dense, make)
        # A run that stops inside a group: `fit` calls its batch callbacks
        # between groups; outside `fit`, each call of the train function is
        # one micro-step, on the replicas' shards of the global micro-batch.
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_MICRO_BATCH)
        shards = iter(strategy.experimental_distribute_dataset(dataset))
        first.make_train_function()
        for _ in range(6):
            first.train_function(shards)
        resumed = distributed(strategy, build_dense, make, seed=7)
        with strategy.scope():
            resumed.optimizer.build(resumed.trainable_variables)
        if how == "checkpoint":
            checkpoint = tf.train.Checkpoint(model=first, optimizer=first.optimizer)
            path = checkpoint.save(str(Path(workdir) / "resume" / "ckpt"))
            restored = tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer)
            restored.restore(path).assert_existing_objects_matched()
        else:
            path = str(Path(workdir) / "resume.weights.h5")
            first.save_weights(path)
            resumed.load_weights(path)
        micro_step = int(resumed._accumulator.micro_step.numpy())
        resumed.fit(x[48:], y[48:], batch_size=GLOBAL_MICRO_BATCH, shuffle=False, verbose=0)
        return {
            **compare(reference, resumed, build_dense),
            "uninterrupted_diff": max_abs_diff(uninterrupted.get_weights(), resumed.get_weights()),
            "micro_step": micro_step,
        }

    return case


CASES = {
    **{name: optimizer_case(name) for name in OPTIMIZERS},
    "use_agc": use_agc,
    "sample_weight_regularizers": sample_weight_regularizers,
    "class_weight": class_weight,
    "multi_io": multi_io,
    "short_group": last_group_case(72),
    "short_last_micro_batch": last_group_case(76),
    "steps_per_execution": beside_plain_keras({"steps_per_execution": 3}),
    "jit_compile": beside_plain_keras({"jit_compile": True}),
    "reduce_every_micro_step": reduce_every_micro_step,
    "sparse_sgd": sparse_case("sgd"),
    "sparse_adam": sparse_case("adam"),
    "mixed_float16": mixed_float16,
    "loss_scale": loss_scale,
    "masked_tokens": token_case("sum_over_batch_size"),
    "summed_tokens": token_case("sum"),
    "two_normalisers": two_normalisers,
    "sparse_mixed_float16": sparse_mixed_float16,
    "batchnorm": batchnorm,
    "resume_checkpoint": resume_case("checkpoint"),
    "resume_save_weights": resume_case("save_weights"),
}


def main(workdir, *names):
    devices = split_cpu(REPLICAS)
    strategy = tf.distribute.MirroredStrategy(devices)
    results = {}
    for name in names:
        results[name] = CASES[name](strategy, workdir)
        keras.backend.clear_session()
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main(*sys.argv[1:])
