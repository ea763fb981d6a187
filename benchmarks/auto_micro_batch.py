"""``micro_batch_size="auto"``: its cost once settled, the time to settle and to recover.

The dense model of ``fit_time`` (256-512-512-10, Adam), batch 256 stated,
behind a layer that runs out of memory above micro-batch 32 (a
``MemoryError`` in a ``tf.py_function``, which TensorFlow raises as
``ResourceExhaustedError`` at once; the same layer, which never fires, in
the fixed model):

- **settled**: an epoch of 16 updates in the mode, settled at micro-batch
  32, against ``GradientAccumulateModel(accum_steps=8)`` at batch 32 on the
  same samples, taking turns (``--rounds``); the median per-round ratio of
  wall and process CPU time (the goal: <= 1.02);
- **settle**: the first ``fit`` of one update in the mode (the whole batch,
  128 and 64 fail, 32 fits: three failed tries and the state they wrote
  put back) minus the first ``fit`` of one update of a model in the mode
  whose whole batch fits (the same traces), in steady groups;
- **recover**: one group that falls back once (64 put in force again, 32
  fits) minus a steady group, in steady groups: the medians of 7 of each,
  taking turns;
- **settled under XLA**: the same epoch with ``jit_compile=True`` (the mode's
  micro-steps are XLA programs that write no variable, their writes made
  after them), its micro-batch put at 32 (XLA cannot compile the layer
  above, so nothing falls back), against ``accum_steps=8`` under XLA.

A failed try on a pooled allocator (oneDNN's on a CPU, every GPU's) first
waits up to 10 s for memory to be freed (``BFCAllocator``); these errors
come at once, so the figures are the library's own cost, that wait excluded.

Run: ``python -m benchmarks.auto_micro_batch`` (``--rounds 15``, ``--width 512``; ``--quick``
for CI: a small model, figures meaningless). Writes ``auto_micro_batch.json`` and ``.png``.
"""

import time

from benchmarks._common import classification_data, dense_model, median, median_ratio, parser, save

BATCH = 256
FITS = 32
UPDATES = 16
ROUNDS = 15
RECOVERIES = 7
QUICK = {"batch": 32, "fits": 8, "updates": 2, "rounds": 1, "features": 16, "width": 32}


def out_of_memory_above(rows):
    import keras
    import tensorflow as tf

    def raise_memory_error():
        raise MemoryError("out of memory")  # TensorFlow's ResourceExhaustedError, at once

    class OutOfMemoryAbove(keras.layers.Layer):
        def call(self, x):
            fails = tf.cond(
                tf.shape(x)[0] > rows,
                lambda: tf.reshape(tf.py_function(raise_memory_error, [], tf.float32), ()),
                lambda: tf.constant(0.0),
            )
            return x + fails

    return OutOfMemoryAbove()


def build(batch, fits, features, width, jit_compile=False, **kwargs):
    import keras

    from gradient_accumulator import GradientAccumulateModel

    inputs, outputs = dense_model(features=features, width=width)
    if not jit_compile:
        outputs = out_of_memory_above(fits)(outputs)
    model = GradientAccumulateModel(inputs=inputs, outputs=outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        jit_compile=jit_compile,
    )
    return model


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    import logging

    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=ROUNDS, help="epochs of each, taking turns")
    p.add_argument("--width", type=int, default=512, help="the hidden layers' width")
    args = p.parse_args()
    logging.getLogger("gradient_accumulator").setLevel(logging.ERROR)  # the fall-backs' lines
    setup = QUICK if args.quick else {"batch": BATCH, "fits": FITS, "updates": UPDATES}
    setup.setdefault("rounds", args.rounds)
    setup.setdefault("features", 256)
    setup.setdefault("width", args.width)
    batch, fits, updates = setup["batch"], setup["fits"], setup["updates"]
    shape = {"features": setup["features"], "width": setup["width"]}
    x, y = classification_data(batch * updates, (setup["features"],))
    models = {
        "auto": build(batch, fits, micro_batch_size="auto", **shape),
        "fixed": build(batch, fits, accum_steps=batch // fits, **shape),
    }
    sizes = {"auto": batch, "fixed": fits}
    fitting = build(batch, batch, micro_batch_size="auto", **shape)

    def fit(name, samples=None):
        rows = slice(0, samples)
        models[name].fit(x[rows], y[rows], batch_size=sizes[name], shuffle=False, verbose=0)

    first = timed(lambda: fit("auto", batch))[0]
    first_fitting = timed(lambda: fitting.fit(x[:batch], y[:batch], batch_size=batch, verbose=0))
    fit("auto"), fit("fixed")  # warm: every shape traced
    rounds = {"auto": [], "fixed": []}
    for r in range(setup["rounds"]):
        for name in ["auto", "fixed"] if r % 2 == 0 else ["fixed", "auto"]:
            rounds[name].append(timed(lambda n=name: fit(n)))
    group = median([wall for wall, _ in rounds["fixed"]]) / updates
    auto = models["auto"]
    assert auto._runner.auto.micro_batch_size == fits  # settled where the layer allows
    steady, recover = [], []
    for _ in range(1 if args.quick else RECOVERIES):
        steady.append(timed(lambda: fit("auto", batch))[0])
        auto._runner.auto.micro_batch_size = 2 * fits
        recover.append(timed(lambda: fit("auto", batch))[0])
    models = {
        "auto": build(batch, fits, micro_batch_size="auto", jit_compile=True, **shape),
        "fixed": build(batch, fits, accum_steps=batch // fits, jit_compile=True, **shape),
    }
    fit("auto", batch)  # builds the runner
    models["auto"]._runner.auto.micro_batch_size = fits
    fit("auto"), fit("fixed")  # warm: every program compiled
    xla = {"auto": [], "fixed": []}
    for r in range(setup["rounds"]):
        for name in ["auto", "fixed"] if r % 2 == 0 else ["fixed", "auto"]:
            xla[name].append(timed(lambda n=name: fit(n)))
    result = {
        "batch": batch,
        "micro_batch": fits,
        "updates_per_epoch": updates,
        "rounds": setup["rounds"],
        "settled_over_fixed": median_ratio(
            [wall for wall, _ in rounds["auto"]], [wall for wall, _ in rounds["fixed"]]
        ),
        "settled_over_fixed_cpu": median_ratio(
            [cpu for _, cpu in rounds["auto"]], [cpu for _, cpu in rounds["fixed"]]
        ),
        "settled_over_fixed_xla": median_ratio(
            [wall for wall, _ in xla["auto"]], [wall for wall, _ in xla["fixed"]]
        ),
        "settled_over_fixed_xla_cpu": median_ratio(
            [cpu for _, cpu in xla["auto"]], [cpu for _, cpu in xla["fixed"]]
        ),
        "group_ms": 1000 * group,
        "settle_groups": (first - first_fitting[0]) / group,
        "recover_groups": (median(recover) - median(steady)) / group,
        "changes": [[c.update, c.old, c.new] for c in auto.micro_batch_changes],
    }
    for key, value in result.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")

    def plot(ax):
        ratios = [
            result[f"settled_over_fixed{mode}{cpu}"]
            for mode in ("", "_xla")
            for cpu in ("", "_cpu")
        ]
        ax.bar(["wall", "CPU", "XLA wall", "XLA CPU"], ratios)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.02, color="grey", linestyle="--", linewidth=0.8, label="goal: 1.02")
        ax.set_ylabel(f"settled 'auto' / accum_steps={batch // fits}, an epoch")
        ax.set_title(
            f"batch {batch}: settling {result['settle_groups']:.1f} groups, "
            f"one fall-back {result['recover_groups']:.1f}",
            fontsize=9,
        )
        ax.legend()

    name = "auto_micro_batch_quick" if args.quick else "auto_micro_batch"
    save(args.out, name, {"quick": args.quick, "results": [result]}, plot=plot)


if __name__ == "__main__":
    main()
