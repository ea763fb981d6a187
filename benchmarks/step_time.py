"""Per-micro-step time of accumulation relative to plain training at the same micro-batch.

The library's per-micro-step path: ``train_on_batch``, and ``fit`` on data of
unknown length (``model.train_function`` called outside ``fit`` runs one
micro-step per call). ``fit`` on data of known length runs a whole group per
call: ``benchmarks.fit_time`` measures that.

Compares, at the same micro-batch size, model, data and seed: plain Keras
training (one Adam update per micro-batch), Keras's built-in
``Adam(gradient_accumulation_steps=k)`` and ``GradientAccumulateModel(k)``, on a
dense network and on MobileNetV2 (alpha 0.35, 64x64), in graph mode and with
XLA (``jit_compile=True``).

How: each model is traced and compiled first (a warm-up ``fit`` and two
groups of steps, excluded). Then the configurations take turns, round after
round, each running whole accumulation groups of ``model.train_function``
calls on the same endless iterator of fixed batches, every call timed on its
own. The figure is the median over rounds of time(accumulation) /
time(plain), by wall clock and by process CPU time (the latter moves less
with other processes' load). Timing single calls also splits the
accumulating models' micro-steps into those that only accumulate and the
update step, each against a plain step: that is where any overhead lives.
``fit``'s own per-step Python (callbacks, progress bar) is the same for all
and left out, which makes the ratios stricter, not looser.

Run: ``python -m benchmarks.step_time`` (``--models dense --modes jit`` for a
part; ``--quick`` for CI: the dense model in graph mode only, a few rounds;
figures meaningless).
"""

import numpy as np

from benchmarks._common import (
    KERAS_BUILTIN,
    LABELS,
    LIBRARY,
    PLAIN,
    add_parts,
    chosen_parts,
    classification_data,
    compiled,
    dense_model,
    median_ratio,
    mobilenetv2,
    parser,
    print_table,
    ratio_quartiles,
    save,
    step_times,
)

ACCUM_STEPS = 4
FLAVOURS = (PLAIN, KERAS_BUILTIN, LIBRARY)

# name: (builder, input shape)
MODELS = {
    "dense": (dense_model, (256,)),
    "mobilenetv2": (lambda: mobilenetv2(size=64, alpha=0.35), (64, 64, 3)),
}

# (model, mode, rounds, groups per round): rounds sized so that each case
# takes about a minute at most on 2 busy cores.
FULL_CASES = [
    ("dense", "graph", 60, 4),
    ("dense", "jit", 60, 4),
    ("mobilenetv2", "graph", 30, 1),
    ("mobilenetv2", "jit", 15, 1),
]
QUICK_CASES = [("dense", "graph", 3, 1)]


def measure(kind, mode, rounds, groups, micro_batch):
    """Times the three configurations side by side; returns the case's record."""
    builder, shape = MODELS[kind]
    x, y = classification_data(2 * ACCUM_STEPS * micro_batch, shape)
    models = {
        flavour: compiled(flavour, *builder(), ACCUM_STEPS, jit_compile=mode == "jit")
        for flavour in FLAVOURS
    }
    times = step_times(models, x, y, micro_batch, ACCUM_STEPS, rounds, groups)
    plain_step = float(np.median(times[PLAIN]["by_position"]))
    record = {
        "model": kind,
        "mode": mode,
        "micro_batch": micro_batch,
        "rounds": rounds,
        "micro_steps_per_round": groups * ACCUM_STEPS,
        "plain_ms_per_micro_step": 1e3 * float(np.median(times[PLAIN]["wall"])),
        "cpu_ms_per_micro_step": {f: 1e3 * float(np.median(times[f]["cpu"])) for f in FLAVOURS},
    }
    for f in (KERAS_BUILTIN, LIBRARY):
        position = times[f]["by_position"]
        record[f"{f}_over_plain"] = median_ratio(times[f]["wall"], times[PLAIN]["wall"])
        record[f"{f}_over_plain_quartiles"] = ratio_quartiles(
            times[f]["wall"], times[PLAIN]["wall"]
        )
        record[f"{f}_over_plain_cpu"] = median_ratio(times[f]["cpu"], times[PLAIN]["cpu"])
        record[f"{f}_accumulate_only_over_plain"] = float(np.median(position[:-1])) / plain_step
        record[f"{f}_update_step_over_plain"] = position[-1] / plain_step
    record["ms_per_micro_step_by_round"] = {
        f: [1e3 * v for v in times[f]["wall"]] for f in FLAVOURS
    }
    return record


def main():
    p = parser(__doc__.splitlines()[0])
    add_parts(p, MODELS)
    args = p.parse_args()
    models, modes = chosen_parts(p, args, MODELS)
    quick = args.quick
    micro_batch = 8 if quick else 16
    payload = []
    for kind, mode, rounds, groups in QUICK_CASES if quick else FULL_CASES:
        if kind not in models or mode not in modes:
            continue
        payload.append(measure(kind, mode, rounds, groups, micro_batch))
        r = payload[-1]
        print(
            f"{kind} {mode}: plain {r['plain_ms_per_micro_step']:.2f} ms, "
            f"built-in/plain {r['keras_builtin_over_plain']:.3f}, "
            f"library/plain {r['library_over_plain']:.3f}",
            flush=True,
        )

    rows = [
        [
            r["model"],
            r["mode"],
            f"{r['plain_ms_per_micro_step']:.2f}",
            f"{r['keras_builtin_over_plain']:.3f} ({r['keras_builtin_over_plain_cpu']:.3f})",
            f"{r['library_over_plain']:.3f} ({r['library_over_plain_cpu']:.3f})",
            "{:.2f}-{:.2f}".format(*r["library_over_plain_quartiles"]),
            f"{r['library_accumulate_only_over_plain']:.3f}",
            f"{r['library_update_step_over_plain']:.3f}",
            f"{r['keras_builtin_accumulate_only_over_plain']:.3f}",
            f"{r['keras_builtin_update_step_over_plain']:.3f}",
        ]
        for r in payload
    ]
    rounds = ", ".join(f"{r['model']}/{r['mode']}: {r['rounds']}" for r in payload)
    print_table(
        f"time per micro-step relative to plain training (accum_steps={ACCUM_STEPS}, "
        f"micro-batch {micro_batch}, Adam; median over alternating rounds, each of "
        f"whole groups; rounds: {rounds}). Goal: library / plain <= 1.00",
        [
            "model",
            "mode",
            "plain ms/step",
            "built-in/plain wall (cpu)",
            "library/plain wall (cpu)",
            "library/plain quartiles",
            "library accumulate-only",
            "library update step",
            "built-in accumulate-only",
            "built-in update step",
        ],
        rows,
    )

    def plot(ax):
        labels = [f"{r['model']}\n{r['mode']}" for r in payload]
        xs = np.arange(len(labels))
        for offset, flavour in ((-0.2, KERAS_BUILTIN), (0.2, LIBRARY)):
            ax.bar(
                xs + offset,
                [r[f"{flavour}_over_plain"] for r in payload],
                0.4,
                label=LABELS[flavour],
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(xs, labels)
        ax.set_ylabel("time per micro-step / plain")
        ax.set_title(f"Accumulation overhead (k={ACCUM_STEPS}, micro-batch {micro_batch})")
        ax.legend()

    save(
        args.out,
        "step_time" + ("_quick" if quick else ""),
        {
            "accum_steps": ACCUM_STEPS,
            "micro_batch": micro_batch,
            "quick": quick,
            "goal": "library_over_plain <= 1.00",
            "results": payload,
        },
        plot,
    )


if __name__ == "__main__":
    main()
