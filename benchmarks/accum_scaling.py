"""How fit's cost grows with accum_steps: time per micro-batch, first call, program size, memory.

For ``accum_steps`` 1, 4, 16, 64 and 256, in graph mode and with XLA, on the
dense model and MobileNetV2 of ``fit_time``, each point in a fresh process:

- **time per micro-batch**: ``GradientAccumulateModel.fit`` and plain Keras
  ``fit`` at the same micro-batch, epochs of 256 micro-batches (one group at
  ``accum_steps=256``) taking turns (3 rounds); the figure is the median of
  the per-round ratio library / plain, wall and process CPU time, and the
  library's own milliseconds;
- **first call**: the wall time of the first call of the train function,
  timed by a callback's batch hooks (tracing, XLA compiling and its one
  group's work), a time of its own that cannot go below 0 (it was the first
  epoch's time minus a steady epoch's, which noise made negative at
  ``accum_steps`` 4); beside it the median steady call, the same group's
  work without tracing;
- **program size**: the operations of every traced function the group runs
  (the group's function and, under XLA, its compiled micro-step and update),
  nested function bodies included;
- **memory**: the peak RSS during a steady epoch above the RSS before it.

The data is four micro-batches repeated (``steps_per_epoch`` micro-batches
an epoch, a known length: whole groups), so that no input copy grows with
``accum_steps``. Goal: time per micro-batch flat or falling in
``accum_steps``, first call, program size and memory independent of it.

Run: ``python -m benchmarks.accum_scaling`` (on 2 cores: ~20 min for the
dense model and MobileNetV2 in graph mode, ~11 min per point of MobileNetV2
under XLA, whose CPU programs are slow; ``--models dense --modes graph``,
``--accum-steps 4,16`` and ``--rounds 2`` for a part; ``--quick`` for CI: the
dense model in graph mode at accum_steps 1 and 4, figures meaningless).
"""

import json
import sys
import time

from benchmarks._common import (
    MIB,
    add_parts,
    chosen_parts,
    dense_model,
    median,
    median_ratio,
    mobilenetv2,
    parser,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    rss_mb,
    run_child,
    save,
)

MICRO_BATCH = 16
ACCUM_STEPS = (1, 4, 16, 64, 256)
EPOCH = 256  # micro-batches
ROUNDS = 3
MODELS = {
    "dense": (lambda: dense_model(features=64 * 64 * 3, width=256), (64 * 64 * 3,)),
    "mobilenetv2": (lambda: mobilenetv2(size=64, alpha=0.35), (64, 64, 3)),
}
MODES = ("graph", "jit")
QUICK = {
    "models": ("dense",),
    "modes": ("graph",),
    "accum_steps": (1, 4),
    "rounds": 1,
    "epoch": 8,
}


def _operations(function):
    """Operations of a ``tf.function``'s traced graphs, nested function bodies included."""
    total = 0
    for concrete in function._list_all_concrete_functions():
        graphs, seen = [concrete.graph], set()
        while graphs:
            graph = graphs.pop()
            if id(graph) in seen:
                continue
            seen.add(id(graph))
            total += len(graph.get_operations())
            graphs.extend(f.graph for f in graph._functions.values() if hasattr(f, "graph"))
    return total


def child(config):
    """One (model, mode, accum_steps) point; prints its record as JSON."""
    import keras
    import numpy as np
    import tensorflow as tf

    from gradient_accumulator import GradientAccumulateModel
    from gradient_accumulator.runner import WHOLE_GROUPS

    builder, shape = MODELS[config["model"]]
    accum_steps, jit = config["accum_steps"], config["mode"] == "jit"
    steps = config["epoch"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * MICRO_BATCH, *shape)).astype("float32")
    y = rng.integers(0, 10, size=(4 * MICRO_BATCH,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH).repeat()

    def build(cls, **kwargs):
        inputs, outputs = builder()
        model = cls(inputs=inputs, outputs=outputs, **kwargs)
        loss = "sparse_categorical_crossentropy"
        model.compile(keras.optimizers.Adam(1e-3), loss, jit_compile=jit)
        return model

    library = build(GradientAccumulateModel, accum_steps=accum_steps)
    plain = build(keras.Model)

    class CallTimes(keras.callbacks.Callback):
        """The wall time of each train-function call (Keras's batch hooks surround each)."""

        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    def epoch(model, calls=None):
        start, cpu = time.perf_counter(), time.process_time()
        callbacks = [] if calls is None else [calls]
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start, time.process_time() - cpu

    first_calls, steady_calls = CallTimes(), CallTimes()
    first, _ = epoch(library, first_calls)
    epoch(plain)
    before = rss_mb()
    reset_peak_rss()
    epoch(library, steady_calls)
    memory = peak_rss_mb() - before
    walls, cpus = {"library": [], "plain": []}, {"library": [], "plain": []}
    for round_ in range(config["rounds"]):
        order = (library, plain) if round_ % 2 == 0 else (plain, library)
        for model in order:
            name = "library" if model is library else "plain"
            wall, cpu = epoch(model)
            walls[name].append(wall / steps)
            cpus[name].append(cpu / steps)
    runner = library._runner
    # Without the noise scale every group is traced as one that measures.
    xla = runner.compiled("xla") or ()
    traced = [runner.compiled(WHOLE_GROUPS), *xla[:1], *xla[2:]]
    record = {
        **config,
        "micro_batch": MICRO_BATCH,
        "library_ms_per_micro_batch": 1e3 * median(walls["library"]),
        "plain_ms_per_micro_batch": 1e3 * median(walls["plain"]),
        "library_over_plain": median_ratio(walls["library"], walls["plain"]),
        "library_cpu_over_plain": median_ratio(cpus["library"], cpus["plain"]),
        "first_call_seconds": first_calls.seconds[0],
        "steady_call_seconds": median(steady_calls.seconds),
        "first_fit_seconds": first,
        "program_operations": sum(_operations(f) for f in traced),
        "peak_rss_growth_mb": memory,
        "sums_mb": sum(int(np.prod(v.shape)) * 4 for v in library.trainable_variables) / MIB,
    }
    print(json.dumps(record))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    p = parser(__doc__.splitlines()[0])
    add_parts(p, MODELS)
    p.add_argument(
        "--accum-steps",
        default=",".join(map(str, ACCUM_STEPS)),
        help="comma-separated accum_steps to measure",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per point (median)")
    p.add_argument(
        "--from-logs",
        help=(
            "comma-separated outputs of earlier runs: print the table and draw the "
            "plot of the points they printed (one JSON line each), measuring nothing"
        ),
    )
    args = p.parse_args()
    models, modes = chosen_parts(p, args, MODELS)
    if args.quick:
        models, modes = QUICK["models"], QUICK["modes"]
    steps = QUICK["accum_steps"] if args.quick else [int(k) for k in args.accum_steps.split(",")]
    rounds = QUICK["rounds"] if args.quick else args.rounds
    epoch = QUICK["epoch"] if args.quick else EPOCH
    records = []
    if args.from_logs:
        for path in args.from_logs.split(","):
            with open(path) as log:
                records += [json.loads(line) for line in log if line.startswith('{"model"')]
        models = list(dict.fromkeys(r["model"] for r in records))
        modes = list(dict.fromkeys(r["mode"] for r in records))
        steps = sorted({r["accum_steps"] for r in records})
        rounds = "/".join(str(n) for n in sorted({r["rounds"] for r in records}))
        records.sort(
            key=lambda r: (models.index(r["model"]), modes.index(r["mode"]), r["accum_steps"])
        )
    for model in models if not args.from_logs else []:
        for mode in modes:
            for accum_steps in steps:
                config = {
                    "model": model,
                    "mode": mode,
                    "accum_steps": accum_steps,
                    "rounds": rounds,
                    "epoch": epoch,
                }
                records.append(run_child("benchmarks.accum_scaling", config))
                print(json.dumps(records[-1]), flush=True)
    print_table(
        f"fit's cost against accum_steps (micro-batch {MICRO_BATCH}, Adam; time: medians of "
        f"{rounds} per-round ratios to plain fit at the same micro-batch)",
        [
            "model",
            "mode",
            "k",
            "ms/micro-batch",
            "/ plain",
            "CPU / plain",
            "first call s",
            "program ops",
            "peak RSS growth MiB",
        ],
        [
            [
                r["model"],
                r["mode"],
                r["accum_steps"],
                f"{r['library_ms_per_micro_batch']:.2f}",
                f"{r['library_over_plain']:.3f}",
                f"{r['library_cpu_over_plain']:.3f}",
                f"{r['first_call_seconds']:.2f}",
                r["program_operations"],
                f"{r['peak_rss_growth_mb']:.1f}",
            ]
            for r in records
        ],
    )

    def plot(ax):
        for model in models:
            for mode in modes:
                points = [r for r in records if r["model"] == model and r["mode"] == mode]
                ax.plot(
                    [r["accum_steps"] for r in points],
                    [r["library_over_plain"] for r in points],
                    marker="o",
                    label=f"{model} {mode}: time per micro-batch / plain",
                )
                ax.plot(
                    [r["accum_steps"] for r in points],
                    [
                        r["first_call_seconds"] / max(points[0]["first_call_seconds"], 1e-9)
                        for r in points
                    ],
                    marker="x",
                    linestyle="--",
                    label=f"{model} {mode}: first call / first call at k=1",
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accum_steps")
        ax.set_ylabel("ratio")
        ax.legend(fontsize=6)

    save(
        args.out,
        "accum_scaling_quick" if args.quick else "accum_scaling",
        {
            "micro_batch": MICRO_BATCH,
            "quick": args.quick,
            "accum_steps": list(steps),
            "results": records,
        },
        plot=plot,
    )


if __name__ == "__main__":
    main()
