"""Both wrappers under MultiWorkerMirroredStrategy against one device at the global big batch.

Run on every worker of a cluster described by ``TF_CONFIG``:
``python -m tests.scripts.multi_worker`` (``tests.helpers.run_workers`` starts
two on loopback, one CPU replica each).

Each worker trains, for every case:

- ``fit_<case>``: ``GradientAccumulateModel(accum_steps=2)``, ``fit`` at the
  global micro-batch 16 (8 per worker): 2 x 8 x 2 = 32 samples per update;
- ``loop_<case>``: a custom loop with ``GradientAccumulateOptimizer
  (accum_steps=4)`` at the global micro-batch 8 (4 per worker, each taking its
  half by replica id): 2 x 4 x 4 = 32 samples per update;

and the reference, plain Keras on one device (no strategy) at the global
batch 32, same initial weights and data order. Cases: optimizers, and sparse
Embedding gradients (``sparse_*``), whose micro-batches give each worker's half
its own ids (0-14, 15-29; ids repeat inside each half; rows 30-39 unused). The
sparse SGD reference is plain Keras ``fit`` on the raw IndexedSlices (Keras's
sparse SGD scatter-adds: repeats summed, as the dense gradient); the sparse
Adam reference's gradients are densified (``tests.helpers.train_big_batches``:
Keras's sparse Adam treats repeated rows otherwise, the wrappers hand it the
dense sum). Prints one results line (see ``tests/scripts/__init__.py``): per
run ``diff`` (max |weight difference|), ``updates`` and ``moved`` (the
reference's distance from the initial weights).
"""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.helpers import (
    build_dense,
    build_embedding,
    build_two_heads,
    make_padded_sequences,
    make_regression_data,
    make_token_data,
    max_abs_diff,
    train_big_batches,
)
from tests.scripts import print_results

BIG_BATCH = 32

# case -> (model builder, optimizer factory, data, densified reference)
CASES = {
    "sgd_clipnorm": (
        build_dense,
        lambda: keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=0.05),
        lambda: make_regression_data(num_samples=64),
        False,
    ),
    "adam": (
        build_dense,
        lambda: keras.optimizers.Adam(0.01),
        lambda: make_regression_data(num_samples=64),
        False,
    ),
    "adamw": (
        build_dense,
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        lambda: make_regression_data(num_samples=64),
        False,
    ),
    "schedule": (
        build_dense,
        lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.2, 1, 0.5)),
        lambda: make_regression_data(num_samples=64),
        False,
    ),
    # Per-worker shards of 8 (fit) and 4 (loop): the halves of each global
    # micro-batch, so that the token data gives each worker its own ids.
    "sparse_sgd": (build_embedding, lambda: keras.optimizers.SGD(0.5), None, False),
    "sparse_adam": (build_embedding, lambda: keras.optimizers.Adam(0.01), None, True),
}


_references = {}


def reference_for(case, shard_size, x, y):
    """The reference of ``case``, trained once per data (``fit_run`` and
    ``loop_run`` share it where their data are the same)."""
    build, make, data, densify = CASES[case]
    key = (case, shard_size if data is None else None)
    if key not in _references:
        _references[key] = _train_reference(build, make, x, y, densify)
    return _references[key]


def _train_reference(build, make, x, y, densify):
    if densify:
        return train_big_batches(build, make, x, y, BIG_BATCH, epochs=2, densify=True)[0]
    reference = build()
    reference.compile(make(), "mse")
    reference.fit(x, y, batch_size=BIG_BATCH, epochs=2, shuffle=False, verbose=0)
    return reference


def data_for(case, shard_size):
    data = CASES[case][2]
    if data is None:
        return make_token_data(64, shard_size=shard_size)
    return data()


def figures(reference, model, optimizer, build):
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "updates": int(optimizer.iterations.numpy()),
        "moved": max_abs_diff(reference.get_weights(), build().get_weights()),
    }


def fit_run(strategy, case):
    build, make, _, _ = CASES[case]
    x, y = data_for(case, shard_size=8)
    reference = reference_for(case, 8, x, y)
    with strategy.scope():
        model = build(GradientAccumulateModel, accum_steps=2)
        model.compile(make(), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return figures(reference, model, model.optimizer, build)


def loop_run(strategy, case):
    build, make, _, _ = CASES[case]
    x, y = data_for(case, shard_size=4)
    reference = reference_for(case, 4, x, y)
    with strategy.scope():
        model = build()
        optimizer = GradientAccumulateOptimizer(make(), accum_steps=4)
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            # Each worker takes its half of the global micro-batch of 8.
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            xb, yb = xb[index * 4 : index * 4 + 4], yb[index * 4 : index * 4 + 4]
            with tf.GradientTape() as tape:
                per_sample = keras.losses.mean_squared_error(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=8)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=(xb, yb))

    for _ in range(2):
        for xb, yb in dataset:
            step(xb, yb)
    return figures(reference, model, optimizer, build)


def fit_two_normalisers(strategy):
    """Two heads whose losses divide by different normalisers (valid tokens,
    samples); worker 0's sequences hold 1-3 tokens, worker 1's 8-12."""
    x, tags, _ = make_padded_sequences(64, shard_size=8)
    scores = np.random.default_rng(5).normal(size=(len(x), 1)).astype("float32")

    def build(cls=keras.Model, **kwargs):
        return build_two_heads(cls, pooled_head=True, **kwargs)

    compile_kwargs = {
        "loss": [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        "loss_weights": [1.0, 0.3],
    }
    reference = build()
    reference.compile(keras.optimizers.SGD(0.5), **compile_kwargs)
    reference.fit(x, [tags, scores], batch_size=BIG_BATCH, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = build(GradientAccumulateModel, accum_steps=2)
        model.compile(keras.optimizers.SGD(0.5), **compile_kwargs)
    model.fit(x, [tags, scores], batch_size=16, epochs=2, shuffle=False, verbose=0)
    return {
        **figures(reference, model, model.optimizer, build),
        "classes": model._accumulator.num_classes,
    }


def fit_shorter_last_group(strategy):
    """``accum_steps=3`` on 80 samples: each epoch's groups are 3 and 2
    micro-batches of 16, the second one run in a loop (not unrolled)."""
    x, y = make_regression_data(num_samples=80)
    reference = build_dense()
    reference.compile(keras.optimizers.Adam(0.01), "mse")
    reference.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = build_dense(GradientAccumulateModel, accum_steps=3)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return figures(reference, model, model.optimizer, build_dense)


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = {}
    for case in CASES:
        results[f"fit_{case}"] = fit_run(strategy, case)
        results[f"loop_{case}"] = loop_run(strategy, case)
    results["fit_two_normalisers"] = fit_two_normalisers(strategy)
    results["fit_shorter_last_group"] = fit_shorter_last_group(strategy)
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main()
