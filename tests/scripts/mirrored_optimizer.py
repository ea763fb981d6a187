"""GradientAccumulateOptimizer under MirroredStrategy (2 logical CPUs) against one device.

Run: ``python -m tests.scripts.mirrored_optimizer CASE [CASE ...]`` (the cases
of :data:`CASES`).

Two ways of training, each under one MirroredStrategy over two replicas at
the global micro-batch 8 (4 samples per replica), 4 micro-steps per update:

- ``loop_*``: a custom loop, ``strategy.run`` of a step that averages the
  loss over the global micro-batch and calls ``apply_gradients``;
- ``fit_*``: ``compile`` + ``fit`` of a plain ``keras.Model`` with the wrapper
  as its optimizer.

The reference trains on one device, without the strategy, one update per
global big batch of 2 x 4 x 4 = 32 (same initial weights, same data order):
plain Keras ``fit``, or a step-by-step loop where ``fit`` cannot give it
(``tests.helpers.train_big_batches``). Prints one results line (see
``tests/scripts/__init__.py``), per case ``diff`` (max |weight difference|),
``updates`` / ``reference_updates`` and ``moved`` (the reference's distance
from the initial weights), and figures of the case's own (in its docstring).
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateOptimizer
from tests.helpers import (
    CLIPPING_OPTIMIZERS,
    DISTRIBUTED_OPTIMIZERS,
    KERAS_VERSION,
    build_dense,
    build_embedding,
    build_tagger,
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

OPTIMIZERS = {
    **{name: ALL_OPTIMIZERS[name] for name in DISTRIBUTED_OPTIMIZERS},
    "sgd": lambda: keras.optimizers.SGD(0.5),
}
CLIPPED = CLIPPING_OPTIMIZERS


def figures(reference, reference_optimizer, model, optimizer, build):
    """The figures every case reports. ``state_diff``: max |difference| of the
    inner optimizer's variables (moments, EMA, ...) from the reference's
    (``None`` under a LossScaleOptimizer, whose structure differs)."""
    state_diff = None
    if isinstance(optimizer, GradientAccumulateOptimizer):
        state_diff = max_abs_diff(
            values(reference_optimizer.variables), values(optimizer.inner_optimizer.variables)
        )
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "state_diff": state_diff,
        "updates": updates(optimizer),
        "reference_updates": updates(reference_optimizer),
        "moved": max_abs_diff(reference.get_weights(), build().get_weights()),
    }


# ------------------------------------------------------------- custom loop --


def mean_squared_error_loss(model, optimizer, xb, yb):
    """A replica's share of the global micro-batch's mean squared error."""
    per_sample = keras.losses.mean_squared_error(yb, model(xb, training=True))
    return tf.nn.compute_average_loss(per_sample, global_batch_size=GLOBAL_MICRO_BATCH)


def train_loop(
    strategy,
    build,
    optimizer_factory,
    x,
    y,
    epochs=1,
    apply_rest=False,
    replica_loss=mean_squared_error_loss,
):
    """The custom loop under ``strategy``; returns ``(model, optimizer)``.

    ``apply_rest``: after the last micro-step, ``apply_accumulated_gradients``
    (in replica context) applies the unfinished group. ``replica_loss(model,
    optimizer, xb, yb)``: what each replica differentiates.
    """
    with strategy.scope():
        model = build()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_MICRO_BATCH)
    batches = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = replica_loss(model, optimizer, xb, yb)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=(xb, yb))

    for _ in range(epochs):
        for xb, yb in batches:
            step(xb, yb)
    if apply_rest:
        tf.function(lambda: strategy.run(optimizer.apply_accumulated_gradients))()
    return model, optimizer


def loop_case(name):
    def case(strategy):
        """64 samples, 2 epochs. Clipping cases add ``unclipped_gap``: the
        reference's distance from the same training without clipping."""
        x, y = make_regression_data(64)
        make = OPTIMIZERS[name]
        reference, reference_optimizer = train_big_batches(
            build_dense, make, x, y, BIG_BATCH, epochs=2
        )
        model, optimizer = train_loop(
            strategy,
            build_dense,
            lambda: GradientAccumulateOptimizer(make(), accum_steps=ACCUM_STEPS),
            x,
            y,
            epochs=2,
        )
        result = figures(reference, reference_optimizer, model, optimizer, build_dense)
        if name in CLIPPED:
            unclipped, _ = train_big_batches(
                build_dense, OPTIMIZERS["sgd"], x, y, BIG_BATCH, epochs=2
            )
            result["unclipped_gap"] = max_abs_diff(unclipped.get_weights(), reference.get_weights())
        return result

    return case


def loop_agc(strategy):
    """``use_agc=True``. Reference: each big batch's gradient clipped by the
    numpy AGC formula. ``unclipped_gap`` as for clipping."""
    x, y = make_regression_data(64)
    make = OPTIMIZERS["sgd"]
    reference, reference_optimizer = train_big_batches(
        build_dense, make, x, y, BIG_BATCH, epochs=2, clip=numpy_agc_all(0.02, 1e-3)
    )
    unclipped, _ = train_big_batches(build_dense, make, x, y, BIG_BATCH, epochs=2)
    model, optimizer = train_loop(
        strategy,
        build_dense,
        lambda: GradientAccumulateOptimizer(
            make(), accum_steps=ACCUM_STEPS, use_agc=True, clip_factor=0.02
        ),
        x,
        y,
        epochs=2,
    )
    result = figures(reference, reference_optimizer, model, optimizer, build_dense)
    result["unclipped_gap"] = max_abs_diff(unclipped.get_weights(), reference.get_weights())
    return result


def loop_apply_rest(strategy):
    """80 samples, one epoch: 10 micro-steps, groups of 4, 4 and 2, the last
    applied by ``apply_accumulated_gradients`` after the loop (the reference's
    last batch: 16 samples)."""
    x, y = make_regression_data(80)
    make = OPTIMIZERS["adam"]
    reference, reference_optimizer = train_big_batches(build_dense, make, x, y, BIG_BATCH)
    model, optimizer = train_loop(
        strategy,
        build_dense,
        lambda: GradientAccumulateOptimizer(make(), accum_steps=ACCUM_STEPS),
        x,
        y,
        apply_rest=True,
    )
    result = figures(reference, reference_optimizer, model, optimizer, build_dense)
    result["micro_step"] = int(optimizer._accumulator.micro_step.numpy())
    return result


SPARSE = {"sgd": OPTIMIZERS["sgd"], "adam": OPTIMIZERS["adam"]}


def _sparse_figures(reference, reference_optimizer, model, optimizer):
    """``untouched_moved``: the largest change of the rows no sample uses (0)."""
    result = figures(reference, reference_optimizer, model, optimizer, build_embedding)
    initial = build_embedding().get_layer("embedding").get_weights()[0]
    table = model.get_layer("embedding").get_weights()[0]
    result["untouched_moved"] = float(np.abs(table[30:] - initial[30:]).max())
    return result


def loop_sparse_case(name):
    def case(strategy):
        """Embedding gradients (IndexedSlices), 64 samples, 2 epochs: replica
        0's shard of each micro-batch uses ids 0-14, replica 1's ids 15-29,
        each repeating ids; rows 30-39 unused. SGD's reference applies the
        raw IndexedSlices (Keras's sparse SGD scatter-adds: repeats summed, as
        densified), Adam's densified gradients (Keras's sparse Adam treats
        repeats otherwise; see ``tests.helpers.train_big_batches``)."""
        x, y = make_token_data(64, shard_size=MICRO_BATCH)
        make = SPARSE[name]
        reference, reference_optimizer = train_big_batches(
            build_embedding, make, x, y, BIG_BATCH, epochs=2, densify=name != "sgd"
        )
        model, optimizer = train_loop(
            strategy,
            build_embedding,
            lambda: GradientAccumulateOptimizer(make(), accum_steps=ACCUM_STEPS),
            x,
            y,
            epochs=2,
        )
        return _sparse_figures(reference, reference_optimizer, model, optimizer)

    return case


# --------------------------------------------------------- compile and fit --


def fit_model(strategy, build, make, x, y):
    """A plain ``keras.Model`` compiled with the wrapper in the strategy's scope, fitted."""
    with strategy.scope():
        model = build()
        model.compile(GradientAccumulateOptimizer(make(), accum_steps=ACCUM_STEPS), "mse")
        if KERAS_VERSION < (3, 5):
            # Keras < 3.5 builds the optimizer in the first traced step: a
            # LossScaleOptimizer's own variables (mixed_float16) would be
            # created inside it, which fails under the strategy once the
            # wrapper's update sits in the LossScaleOptimizer's conditional.
            # docs/guides/distributed.rst tells users to build it first.
            model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    return model


def fit_big_batch(build, make, x, y):
    reference = build()
    reference.compile(make(), "mse")
    reference.fit(x, y, batch_size=BIG_BATCH, epochs=2, shuffle=False, verbose=0)
    return reference


def fit_case(name):
    def case(strategy):
        """64 samples, 2 epochs: 2 groups per epoch (``fit`` does not end a
        group with the epoch: whole groups only)."""
        x, y = make_regression_data(64)
        reference = fit_big_batch(build_dense, OPTIMIZERS[name], x, y)
        model = fit_model(strategy, build_dense, OPTIMIZERS[name], x, y)
        return figures(reference, reference.optimizer, model, model.optimizer, build_dense)

    return case


def fit_sparse_adam(strategy):
    """Embedding gradients, as ``loop_sparse_adam``, through ``fit``."""
    x, y = make_token_data(64, shard_size=MICRO_BATCH)
    make = SPARSE["adam"]
    reference, reference_optimizer = train_big_batches(
        build_embedding, make, x, y, BIG_BATCH, epochs=2, densify=True
    )
    model = fit_model(strategy, build_embedding, make, x, y)
    return _sparse_figures(reference, reference_optimizer, model, model.optimizer)


def fit_mixed_float16(strategy):
    """mixed_float16: ``compile`` wraps the wrapper in a LossScaleOptimizer.
    ``outer``: that optimizer's class and its inner one's; ``scales``: both
    final loss scales."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_regression_data(64)
        reference = fit_big_batch(build_dense, OPTIMIZERS["adam"], x, y)
        model = fit_model(strategy, build_dense, OPTIMIZERS["adam"], x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result = figures(reference, reference.optimizer, model, model.optimizer, build_dense)
    result["outer"] = [
        type(model.optimizer).__name__,
        type(model.optimizer.inner_optimizer).__name__,
    ]
    result["scales"] = [float(m.optimizer.dynamic_scale.numpy()) for m in (reference, model)]
    return result


def loop_tokens(strategy):
    """A masked per-token loss in a custom loop: each replica divides its
    token losses by its own valid tokens (and by the replicas, as
    ``compute_average_loss`` does) and passes ``normaliser=`` its token count
    and ``capacity=`` its padded token count to ``scale_loss``. Replica 0's
    sequences hold 1-3 tokens, replica 1's 8-12. Reference: plain Keras
    ``fit`` on one device at the big batch (its masked mean over the big
    batch's tokens). SGD: its sparse update sums repeated rows as the dense
    sum does."""
    x, tags, _ = make_padded_sequences(64, shard_size=MICRO_BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build_tagger()
    reference.compile(OPTIMIZERS["sgd"](), loss)
    reference.fit(x, tags, batch_size=BIG_BATCH, epochs=2, shuffle=False, verbose=0)

    def token_loss(model, optimizer, xb, yb):
        logits = model(xb, training=True)
        per_token = keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True)
        mask = tf.cast(xb != 0, "float32")
        tokens = tf.reduce_sum(mask)
        mean = tf.reduce_sum(per_token * mask) / tokens / REPLICAS
        capacity = tf.cast(tf.size(mask), "float32")
        return optimizer.scale_loss(mean, normaliser=tokens, capacity=capacity)

    model, optimizer = train_loop(
        strategy,
        build_tagger,
        lambda: GradientAccumulateOptimizer(OPTIMIZERS["sgd"](), accum_steps=ACCUM_STEPS),
        x,
        tags,
        epochs=2,
        replica_loss=token_loss,
    )
    return figures(reference, reference.optimizer, model, optimizer, build_tagger)


def fit_loss_scale_inside(strategy):
    """``GradientAccumulateOptimizer(LossScaleOptimizer(Adam))`` compiled with
    ``auto_scale_loss=False`` under mixed_float16: Keras's default initial
    scale, 64 samples, 3 epochs. ``scales``: both final loss scales."""

    def adam():
        return keras.optimizers.Adam(0.01, epsilon=1e-4)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 5)).astype("float32")
        y = rng.normal(size=(64, 1)).astype("float32")
        reference = build_dense()
        reference.compile(adam(), "mse")
        reference.fit(x, y, batch_size=BIG_BATCH, epochs=3, shuffle=False, verbose=0)
        with strategy.scope():
            model = build_dense()
            optimizer = GradientAccumulateOptimizer(
                keras.optimizers.LossScaleOptimizer(adam()), accum_steps=ACCUM_STEPS
            )
            model.compile(optimizer, "mse", auto_scale_loss=False)
            if KERAS_VERSION < (3, 5):
                optimizer.build(model.trainable_variables)  # see fit_model
        model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=3, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result = figures(reference, reference.optimizer, model, optimizer, build_dense)
    result["scales"] = [
        float(reference.optimizer.dynamic_scale.numpy()),
        float(optimizer.inner_optimizer.dynamic_scale.numpy()),
    ]
    return result


CASES = {
    **{f"loop_{name}": loop_case(name) for name in OPTIMIZERS if name != "sgd"},
    "loop_agc": loop_agc,
    "loop_apply_rest": loop_apply_rest,
    **{f"loop_sparse_{name}": loop_sparse_case(name) for name in SPARSE},
    "fit_adam": fit_case("adam"),
    "fit_sgd_momentum": fit_case("sgd_momentum"),
    "fit_global_clipnorm": fit_case("global_clipnorm"),
    "fit_sparse_adam": fit_sparse_adam,
    "fit_mixed_float16": fit_mixed_float16,
    "loop_tokens": loop_tokens,
    "fit_loss_scale_inside": fit_loss_scale_inside,
}


def main(*names):
    strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    results = {}
    for name in names or CASES:
        results[name] = CASES[name](strategy)
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main(*sys.argv[1:])
