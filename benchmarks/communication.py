"""Cross-replica reductions, bytes and time per update under MirroredStrategy (2 logical CPUs).

One fresh process (this script) splits the CPU into two logical devices and
trains the same dense model (same seed, data and steps) under
``tf.distribute.MirroredStrategy`` with
``benchmarks._counting.CountingCrossDeviceOps``, which counts the
batched cross-replica reductions that actually run and the bytes of one
replica's values they carry:

- plain Keras at the micro-batch (one all-reduce of the gradients per step);
- ``GradientAccumulateModel(accum_steps=k)`` (one all-reduce per update: the
  float32 sums and the weight sum, batched);
- ``GradientAccumulateModel(accum_steps=k, reduce_every_micro_step=True)``
  (an all-reduce every micro-step, as plain data parallelism);
- Keras's built-in ``Adam(gradient_accumulation_steps=k)``, which fails under
  MirroredStrategy (keras-team/keras issue 20582): it is tried, and the error's
  first line is reported.

Then an embedding model (``Embedding(50_000, 64)``, mean over 16 tokens, a
softmax head; token ids below 1000, so each update touches few rows) with the
library, once per update: its update all-reduces the dense float32 sum of the
whole table, 4 bytes per entry whatever rows were touched, printed next to
the dense model's figure with the rows the update's micro-batches touched and
the size of one micro-batch's sparse gradient (``tf.IndexedSlices``: one row
of values and one int32 index per token, what a sparse reduction would carry
from each replica; not counted here, as ``CountingCrossDeviceOps`` sizes every
value by its dense shape).

Figures are per ``k`` micro-batches (the samples of one accumulated update;
plain Keras makes ``k`` updates on them). Times: each configuration's
``train_function`` runs ``k`` micro-steps per turn on an endless distributed
iterator, configurations alternating round after round (warm-up excluded);
medians over rounds, and ratios to plain taken within each round.

Run: ``python -m benchmarks.communication`` (``--quick`` for CI: a small model,
few rounds, figures meaningless).
"""

import re

from benchmarks._common import (
    KERAS_BUILTIN,
    LABELS,
    LIBRARY,
    PLAIN,
    alternate,
    logical_cpus,
    median,
    median_ratio,
    parser,
    print_table,
    save,
    trainable_parameters,
)

ACCUM_STEPS = 4
REPLICAS = 2
SEQUENCE_LENGTH = 16
EVERY_MICRO_STEP = "library_every_micro_step"
NAMES = {
    PLAIN: "plain Keras (micro-batch)",
    LIBRARY: "library, once per update",
    EVERY_MICRO_STEP: "library, reduce_every_micro_step",
    KERAS_BUILTIN: "Keras built-in",
}


def _first_line(error):
    """``Type: first line`` of an error, the cause's first sentence added if Keras wrapped it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line] or [""]
    kind = type(error).__name__
    raised = [i for i, line in enumerate(lines) if re.match(r"\w+(Error|Exception): ", line)]
    if lines[0] == "in user code:" and raised:
        # Wrapped by autograph (seen with TF 2.16 + Keras 3.3.3): the error's own lines.
        kind, _, first = lines[raised[0]].partition(": ")
        lines = [first, *lines[raised[0] + 1 :]]
    text = f"{kind}: {lines[0]}"
    if lines[0].startswith("Exception encountered when calling") and len(lines) > 1:
        text += " " + lines[1].split(". ")[0].rstrip(".") + "."
    return text


def embedding_model(vocabulary, dim, classes=10, seed=0):
    """Token ids -> ``Embedding(vocabulary, dim)`` -> mean over the sequence -> softmax."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SEQUENCE_LENGTH,), dtype="int32")
    embedded = keras.layers.Embedding(vocabulary, dim, name="embedding")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    return inputs, keras.layers.Dense(classes, activation="softmax")(pooled)


def embedding_figures(strategy, counter, quick, micro_batch):
    """Counts one update of the embedding model; returns its figures (bytes)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks._common import compiled, repeating_iterator, time_calls

    vocabulary, dim, used = (2_000, 16, 100) if quick else (50_000, 64, 1_000)
    global_batch = REPLICAS * micro_batch
    rng = np.random.default_rng(0)
    x = rng.integers(0, used, size=(2 * ACCUM_STEPS * global_batch, SEQUENCE_LENGTH))
    x = x.astype("int32")
    y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    with strategy.scope():
        model = compiled(LIBRARY, *embedding_model(vocabulary, dim), ACCUM_STEPS)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)  # trace
    iterator = repeating_iterator(x, y, global_batch, strategy)
    time_calls(model.train_function, iterator, 2 * ACCUM_STEPS)  # new signature
    before = int(counter.reductions.numpy()), int(counter.bytes.numpy())
    updates = int(model.optimizer.iterations.numpy())
    time_calls(model.train_function, iterator, ACCUM_STEPS)  # one group: the first k batches
    table = model.get_layer("embedding").embeddings
    # One replica's micro-batch: its gradient is a tf.IndexedSlices.
    with tf.GradientTape() as tape:
        probs = model(x[:micro_batch])
        loss = keras.losses.sparse_categorical_crossentropy(y[:micro_batch], probs)
    slices = tape.gradient(loss, table)
    assert isinstance(slices, tf.IndexedSlices), type(slices)
    group = x[: ACCUM_STEPS * global_batch]
    return {
        "vocabulary": vocabulary,
        "dim": dim,
        "table_bytes": 4 * vocabulary * dim,
        "trainable_parameters": trainable_parameters(model),
        "reductions": int(counter.reductions.numpy()) - before[0],
        "bytes": int(counter.bytes.numpy()) - before[1],
        "updates": int(model.optimizer.iterations.numpy()) - updates,
        "rows_touched_per_update": int(len(np.unique(group))),
        "indexed_slices_bytes_per_micro_batch": int(
            slices.values.shape.num_elements() * slices.values.dtype.size
            + slices.indices.shape.num_elements() * slices.indices.dtype.size
        ),
    }


def batchnorm_model(width, channels, seed=0):
    """Dense -> unsynchronized AccumBatchNormalization, twice, -> softmax head."""
    import keras

    from gradient_accumulator import AccumBatchNormalization

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    hidden = inputs
    for units in (width, channels):
        hidden = keras.layers.Dense(units)(hidden)
        hidden = AccumBatchNormalization(accum_steps=ACCUM_STEPS)(hidden)
        hidden = keras.layers.ReLU()(hidden)
    return inputs, keras.layers.Dense(10, activation="softmax")(hidden)


def batchnorm_figures(strategy, counter, quick, micro_batch):
    """Counts one update of the model with BN layers; returns its figures (bytes).

    Unsynchronized ``AccumBatchNormalization`` layers merge every replica's
    pending statistics at the update: ``replicas x 4 x channels`` float32
    values per layer travel in the update's one batched all-reduce.
    """
    from benchmarks._common import classification_data, compiled, repeating_iterator, time_calls

    width, channels = (64, 32) if quick else (1024, 512)
    global_batch = REPLICAS * micro_batch
    x, y = classification_data(2 * ACCUM_STEPS * global_batch, (256,))
    with strategy.scope():
        model = compiled(LIBRARY, *batchnorm_model(width, channels), ACCUM_STEPS)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)  # trace
    iterator = repeating_iterator(x, y, global_batch, strategy)
    time_calls(model.train_function, iterator, 2 * ACCUM_STEPS)  # new signature
    before = int(counter.reductions.numpy()), int(counter.bytes.numpy())
    updates = int(model.optimizer.iterations.numpy())
    time_calls(model.train_function, iterator, ACCUM_STEPS)
    params = trainable_parameters(model)
    return {
        "trainable_parameters": params,
        "channels": [width, channels],
        "reductions": int(counter.reductions.numpy()) - before[0],
        "bytes": int(counter.bytes.numpy()) - before[1],
        "updates": int(model.optimizer.iterations.numpy()) - updates,
        "gradient_bytes": 4 * params + 4,
        "statistics_bytes": 4 * REPLICAS * 4 * (width + channels),
    }


def main():
    p = parser(
        __doc__.splitlines()[0],
        cpu_only="it splits the CPU into logical devices for MirroredStrategy",
    )
    args = p.parse_args()
    logical_cpus(REPLICAS)  # before anything else starts TensorFlow's devices

    import numpy as np
    import tensorflow as tf

    from benchmarks._common import (
        classification_data,
        compiled,
        dense_model,
        repeating_iterator,
        time_calls,
    )
    from benchmarks._counting import CountingCrossDeviceOps

    quick = args.quick
    width, rounds, micro_batch = (64, 3, 8) if quick else (1024, 60, 16)
    global_batch = REPLICAS * micro_batch
    x, y = classification_data(2 * ACCUM_STEPS * global_batch, (256,))
    counter = CountingCrossDeviceOps()
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=counter)
    assert strategy.num_replicas_in_sync == REPLICAS

    def counted():
        return int(counter.reductions.numpy()), int(counter.bytes.numpy())

    models, iterators, crashes = {}, {}, {}
    for name, flavour, kwargs in [
        (PLAIN, PLAIN, None),
        (LIBRARY, LIBRARY, None),
        (EVERY_MICRO_STEP, LIBRARY, {"reduce_every_micro_step": True}),
        (KERAS_BUILTIN, KERAS_BUILTIN, None),
    ]:
        with strategy.scope():
            model = compiled(flavour, *dense_model(width=width), ACCUM_STEPS, model_kwargs=kwargs)
        try:
            # Warm-up, excluded: trace (two groups' worth, ends on a group boundary).
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
        except Exception as error:  # noqa: BLE001 - any failure is the finding
            crashes[name] = _first_line(error)
            print(f"{NAMES[name]} crashes: {crashes[name]}", flush=True)
            continue
        models[name] = model
        iterators[name] = repeating_iterator(x, y, global_batch, strategy)
        time_calls(model.train_function, iterators[name], 2 * ACCUM_STEPS)  # new signature

    params = trainable_parameters(models[PLAIN])

    # Counting: one group of k micro-steps per configuration, nothing else running.
    counts = {}
    for name, model in models.items():
        before = counted()
        updates_before = int(model.optimizer.iterations.numpy())
        time_calls(model.train_function, iterators[name], ACCUM_STEPS)
        after = counted()
        counts[name] = {
            "reductions": after[0] - before[0],
            "bytes": after[1] - before[1],
            "updates": int(model.optimizer.iterations.numpy()) - updates_before,
        }

    results = alternate(
        {name: name for name in models},
        lambda name: sum(time_calls(models[name].train_function, iterators[name], ACCUM_STEPS)[0]),
        rounds,
    )
    record = {}
    for name in NAMES:
        if name in crashes:
            record[name] = {"crashes": crashes[name]}
            continue
        c = counts[name]
        record[name] = {
            **c,
            "reductions_per_update": c["reductions"] / c["updates"],
            "mb_per_update": c["bytes"] / c["updates"] / 2**20,
            "ms_per_k_micro_batches": 1e3 * median(results[name]),
            "time_over_plain": median_ratio(results[name], results[PLAIN]),
            "ms_per_k_micro_batches_by_round": [1e3 * t for t in results[name]],
        }

    rows = []
    for name, r in record.items():
        if "crashes" in r:
            rows.append([NAMES[name], "crashes", "", "", "", "", "", ""])
            continue
        rows.append(
            [
                NAMES[name],
                r["updates"],
                r["reductions"],
                f"{r['bytes'] / 2**20:.2f}",
                f"{r['reductions_per_update']:.0f}",
                f"{r['mb_per_update']:.2f}",
                f"{r['ms_per_k_micro_batches']:.1f}",
                f"{r['time_over_plain']:.3f}",
            ]
        )
    print_table(
        f"cross-replica communication per k={ACCUM_STEPS} micro-batches "
        f"({REPLICAS} replicas x {micro_batch} samples each), MirroredStrategy on "
        f"{REPLICAS} logical CPUs, dense model of {params} parameters "
        f"({4 * params / 2**20:.2f} MiB of float32 gradients); times: median of "
        f"{rounds} alternating rounds",
        [
            "configuration",
            "updates",
            "all-reduces",
            "MiB reduced",
            "all-reduces / update",
            "MiB / update",
            "ms",
            "time / plain",
        ],
        rows,
    )

    embedding = embedding_figures(strategy, counter, quick, micro_batch)
    dense = record[LIBRARY]
    print_table(
        f"library, once per update (k={ACCUM_STEPS}): bytes all-reduced per update; the "
        f"embedding model's table is Embedding({embedding['vocabulary']}, {embedding['dim']}), "
        f"its tokens touch {embedding['rows_touched_per_update']} rows per update",
        ["model", "parameters", "all-reduces / update", "MiB / update", "of which the table"],
        [
            [
                "dense",
                params,
                f"{dense['reductions_per_update']:.0f}",
                f"{dense['mb_per_update']:.2f}",
                "",
            ],
            [
                "embedding",
                embedding["trainable_parameters"],
                f"{embedding['reductions'] / embedding['updates']:.0f}",
                f"{embedding['bytes'] / embedding['updates'] / 2**20:.2f}",
                f"{embedding['table_bytes'] / 2**20:.2f} (4 x {embedding['vocabulary']} x "
                f"{embedding['dim']} bytes)",
            ],
        ],
    )
    batchnorm = batchnorm_figures(strategy, counter, quick, micro_batch)
    print_table(
        f"library, once per update (k={ACCUM_STEPS}): a dense model with two "
        f"unsynchronized AccumBatchNormalization layers of {batchnorm['channels']} channels, "
        "whose replicas' pending statistics are merged in the update's all-reduce",
        [
            "all-reduces / update",
            "bytes / update",
            "gradients + weight sum",
            "BN statistics (replicas x 4 x channels)",
        ],
        [
            [
                f"{batchnorm['reductions'] / batchnorm['updates']:.0f}",
                batchnorm["bytes"] // batchnorm["updates"],
                batchnorm["gradient_bytes"],
                batchnorm["statistics_bytes"],
            ]
        ],
    )
    print(
        "one replica's micro-batch gradient of the table as tf.IndexedSlices: "
        f"{embedding['indexed_slices_bytes_per_micro_batch'] / 2**20:.3f} MiB "
        f"({micro_batch} samples x {SEQUENCE_LENGTH} tokens, values and int indices)"
    )

    def plot(ax):
        names = [n for n in NAMES if n not in crashes]
        xs = np.arange(len(names))
        bars = ax.bar(xs, [record[n]["bytes"] / 2**20 for n in names], 0.6)
        for bar, n in zip(bars, names):
            ax.annotate(
                f"{record[n]['reductions']} all-reduce(s)\n"
                f"{record[n]['time_over_plain']:.2f}x time",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize="small",
            )
        ax.set_xticks(xs, [NAMES[n].replace(", ", ",\n") for n in names], fontsize="small")
        ax.set_ylabel(f"MiB all-reduced per {ACCUM_STEPS} micro-batches")
        title = f"Communication, {REPLICAS} replicas, k={ACCUM_STEPS}"
        if KERAS_BUILTIN in crashes:
            title += f" ({LABELS[KERAS_BUILTIN]}: crashes)"
        ax.set_title(title, fontsize="medium")
        ax.margins(y=0.25)

    save(
        args.out,
        "communication" + ("_quick" if quick else ""),
        {
            "accum_steps": ACCUM_STEPS,
            "replicas": REPLICAS,
            "micro_batch_per_replica": micro_batch,
            "trainable_parameters": params,
            "gradient_mb": 4 * params / 2**20,
            "rounds": rounds,
            "quick": quick,
            "results": record,
            "embedding": embedding,
            "batchnorm": batchnorm,
        },
        plot,
    )


if __name__ == "__main__":
    main()
