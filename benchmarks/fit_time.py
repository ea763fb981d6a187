"""Wall time of whole ``fit`` epochs per micro-batch: accumulation against plain ``fit``.

What a user sees: plain Keras ``fit(batch_size=b)`` (one Adam update per
micro-batch), Keras's built-in ``Adam(gradient_accumulation_steps=k)`` at
``b``, and ``GradientAccumulateModel(accum_steps=k)`` at ``b``, on the same
data, model and seed, in graph mode and with XLA. Unlike ``step_time``,
which times single train-function calls, this times ``fit`` itself: its
loop, its callbacks and however many train-function calls each
configuration makes (the library makes one per update).

How: each model runs one warm-up epoch (tracing and compiling, excluded
from the ratios, its wall time printed apart); then the configurations take
turns, round after round, one epoch each. The figure is the median over
rounds of the per-round ratio of epoch times, for wall time and for the
process's CPU time (user and system, every thread). On a CPU the wall time is
bimodal: TensorFlow's executor runs a step's independent operations on both
cores or on one, and an epoch's wall time per micro-batch sits near one of
two values (10.6 or 20.6 ms for plain ``fit`` of the dense model, with its
CPU time 18-20 ms in either) whatever the configuration; the CPU time counts
the work done whatever the overlap, and moves by a few percent.

Run: ``python -m benchmarks.fit_time`` (``--models dense --modes jit`` for a
part; ``--quick`` for CI: the dense model in graph mode, two rounds; figures
meaningless; ``--accum-steps 64`` for another ``k``: whole groups of about
the epoch's micro-batches at 4, at least one group). ``--noise-scale`` adds
the library with ``noise_scale=True`` to the same rounds, measuring every
micro-batch's gradient, (a fifth configuration) the group's last only
(``noise_scale_micro_batches="last"``) and (a sixth) the last of one group in
``--noise-scale-every`` (default 4; ``noise_scale_every``), and prints their
times over the library's.
"""

import time

from benchmarks._common import (
    KERAS_BUILTIN,
    LABELS,
    LIBRARY,
    PLAIN,
    add_parts,
    alternate,
    chosen_parts,
    classification_data,
    compiled,
    dense_model,
    median,
    median_ratio,
    mobilenetv2,
    parser,
    print_table,
    save,
)

ACCUM_STEPS = 4
MICRO_BATCH = 16
FLAVOURS = (PLAIN, KERAS_BUILTIN, LIBRARY)

# name: (builder, input shape); the models of `step_time` and of issue 23's
# prototype (a 64x64x3 input flattened into a 256-256-10 dense network).
MODELS = {
    "dense": (lambda: dense_model(features=64 * 64 * 3, width=256), (64 * 64 * 3,)),
    "mobilenetv2": (lambda: mobilenetv2(size=64, alpha=0.35), (64, 64, 3)),
}

# (model, mode, rounds, groups per epoch)
FULL_CASES = [
    ("dense", "graph", 7, 16),
    ("dense", "jit", 7, 16),
    ("mobilenetv2", "graph", 5, 8),
    ("mobilenetv2", "jit", 5, 8),
]
QUICK_CASES = [("dense", "graph", 2, 2)]


# With --noise-scale: the library with `noise_scale=True`, a fourth, fifth and
# sixth configuration in the same rounds (their cost over the library's):
# every micro-batch measured, the group's last only, and the last of one group
# in `--noise-scale-every`. name: (record key, noise_scale_micro_batches, every
# or None for the option's).
NOISE_SCALE = "library_noise_scale"
NOISE_SCALE_LAST = "library_noise_scale_last"
NOISE_SCALE_EVERY = "library_noise_scale_last_every"
NOISE_CONFIGURATIONS = {
    NOISE_SCALE: ("noise_scale", "all", 1),
    NOISE_SCALE_LAST: ("noise_scale_last", "last", 1),
    NOISE_SCALE_EVERY: ("noise_scale_last_every", "last", None),
}
NOISE_SCALE_EVERY_DEFAULT = 4


def measure(
    kind,
    mode,
    rounds,
    groups,
    noise_scale=False,
    accum_steps=ACCUM_STEPS,
    noise_scale_every=NOISE_SCALE_EVERY_DEFAULT,
):
    """Times one epoch of each configuration per round; returns the case's record.

    ``groups`` is per epoch at ``ACCUM_STEPS``: another ``accum_steps``
    runs whole groups of about as many micro-batches (at least one group;
    the figures are per micro-batch).
    """
    builder, shape = MODELS[kind]
    groups = max(1, groups * ACCUM_STEPS // accum_steps)
    x, y = classification_data(groups * accum_steps * MICRO_BATCH, shape)
    jit_compile = mode == "jit"
    models = {
        flavour: compiled(flavour, *builder(), accum_steps, jit_compile=jit_compile)
        for flavour in FLAVOURS
    }
    if noise_scale:
        for name, (_, measured, every) in NOISE_CONFIGURATIONS.items():
            kwargs = {
                "noise_scale": True,
                "noise_scale_micro_batches": measured,
                "noise_scale_every": every or noise_scale_every,
            }
            models[name] = compiled(
                LIBRARY, *builder(), accum_steps, jit_compile, model_kwargs=kwargs
            )

    def epoch(model):
        start, cpu = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
        steps = len(x) // MICRO_BATCH
        return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps

    # The first epoch traces and compiles: timed whole, apart from the rounds.
    first = {}
    for flavour, model in models.items():
        start = time.perf_counter()
        epoch(model)
        first[flavour] = time.perf_counter() - start
    both = alternate(models, epoch, rounds)
    times = {flavour: [wall for wall, _ in values] for flavour, values in both.items()}
    cpu = {flavour: [spent for _, spent in values] for flavour, values in both.items()}
    record = {
        "model": kind,
        "mode": mode,
        "micro_batch": MICRO_BATCH,
        "accum_steps": accum_steps,
        "noise_scale_every": noise_scale_every if noise_scale else None,
        "rounds": rounds,
        "micro_batches_per_epoch": len(x) // MICRO_BATCH,
        "seconds_per_micro_batch": times,
        "cpu_seconds_per_micro_batch": cpu,
        "plain_ms": 1e3 * median(times[PLAIN]),
        "plain_cpu_ms": 1e3 * median(cpu[PLAIN]),
        "first_epoch_seconds": first,
    }
    for flavour in (KERAS_BUILTIN, LIBRARY):
        record[f"{flavour}_over_plain"] = median_ratio(times[flavour], times[PLAIN])
        record[f"{flavour}_cpu_over_plain"] = median_ratio(cpu[flavour], cpu[PLAIN])
    record["library_over_builtin"] = median_ratio(times[LIBRARY], times[KERAS_BUILTIN])
    record["library_cpu_over_builtin"] = median_ratio(cpu[LIBRARY], cpu[KERAS_BUILTIN])
    if noise_scale:
        for name, (key, _, _) in NOISE_CONFIGURATIONS.items():
            record[f"{key}_over_library"] = median_ratio(times[name], times[LIBRARY])
            record[f"{key}_cpu_over_library"] = median_ratio(cpu[name], cpu[LIBRARY])
    return record


def main():
    p = parser(__doc__.splitlines()[0])
    add_parts(p, MODELS)
    p.add_argument(
        "--noise-scale",
        action="store_true",
        help="also time the library with noise_scale=True (its cost over the library's)",
    )
    p.add_argument(
        "--accum-steps",
        type=int,
        default=ACCUM_STEPS,
        help=f"accum_steps of the accumulating configurations (default {ACCUM_STEPS}); "
        "an epoch holds whole groups of about as many micro-batches",
    )
    p.add_argument(
        "--noise-scale-every",
        type=int,
        default=NOISE_SCALE_EVERY_DEFAULT,
        help="with --noise-scale, noise_scale_every of the sixth configuration "
        f"(default {NOISE_SCALE_EVERY_DEFAULT})",
    )
    args = p.parse_args()
    if args.accum_steps < 1:
        p.error(f"--accum-steps must be >= 1. Received: {args.accum_steps}")
    if args.noise_scale_every < 1:
        p.error(f"--noise-scale-every must be >= 1. Received: {args.noise_scale_every}")
    models, modes = chosen_parts(p, args, MODELS)
    cases = (
        QUICK_CASES
        if args.quick
        else [case for case in FULL_CASES if case[0] in models and case[1] in modes]
    )
    records = [
        measure(
            *case,
            noise_scale=args.noise_scale,
            accum_steps=args.accum_steps,
            noise_scale_every=args.noise_scale_every,
        )
        for case in cases
    ]
    print_table(
        f"fit epoch time per micro-batch over plain fit (k={args.accum_steps}, micro-batch "
        f"{MICRO_BATCH}, Adam; medians of per-round ratios)",
        [
            "model",
            "mode",
            "rounds",
            "plain ms",
            LABELS[KERAS_BUILTIN],
            LABELS[LIBRARY],
            "library / built-in",
            "first epoch s (plain, built-in, library)",
        ],
        [
            [
                r["model"],
                r["mode"],
                r["rounds"],
                f"{r['plain_ms']:.2f}",
                f"{r[f'{KERAS_BUILTIN}_over_plain']:.3f}",
                f"{r[f'{LIBRARY}_over_plain']:.3f}",
                f"{r['library_over_builtin']:.3f}",
                ", ".join(f"{r['first_epoch_seconds'][f]:.1f}" for f in FLAVOURS),
            ]
            for r in records
        ],
    )
    print_table(
        "the same epochs' process CPU time per micro-batch over plain fit's (medians of "
        "per-round ratios)",
        [
            "model",
            "mode",
            "plain CPU ms",
            LABELS[KERAS_BUILTIN],
            LABELS[LIBRARY],
            "library / built-in",
        ],
        [
            [
                r["model"],
                r["mode"],
                f"{r['plain_cpu_ms']:.2f}",
                f"{r[f'{KERAS_BUILTIN}_cpu_over_plain']:.3f}",
                f"{r[f'{LIBRARY}_cpu_over_plain']:.3f}",
                f"{r['library_cpu_over_builtin']:.3f}",
            ]
            for r in records
        ],
    )

    if args.noise_scale:
        print_table(
            "noise_scale=True over the library without it, same epochs (medians of per-round "
            "ratios; goal <= 1.03): every micro-batch measured, the group's last only, and "
            f"the last of one group in {args.noise_scale_every} (noise_scale_every)",
            ["model", "mode"]
            + [
                f"{label}: {what}"
                for label in ("all", "last", f"last, every {args.noise_scale_every}")
                for what in ("wall", "CPU")
            ],
            [
                [r["model"], r["mode"]]
                + [
                    f"{r[f'{key}{what}_over_library']:.3f}"
                    for key, _, _ in NOISE_CONFIGURATIONS.values()
                    for what in ("", "_cpu")
                ]
                for r in records
            ],
        )

    def plot(ax):
        labels = [f"{r['model']}\n{r['mode']}" for r in records]
        for offset, flavour in ((-0.2, KERAS_BUILTIN), (0.2, LIBRARY)):
            ax.bar(
                [i + offset for i in range(len(records))],
                [r[f"{flavour}_over_plain"] for r in records],
                width=0.4,
                label=LABELS[flavour],
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8, label="goal: 0.95")
        ax.set_xticks(range(len(records)), labels)
        ax.set_ylabel("fit time per micro-batch / plain fit")
        ax.legend()

    save(
        args.out,
        ("fit_time_quick" if args.quick else "fit_time")
        + ("" if args.accum_steps == ACCUM_STEPS else f"_k{args.accum_steps}"),
        {
            "accum_steps": args.accum_steps,
            "micro_batch": MICRO_BATCH,
            "quick": args.quick,
            "results": records,
        },
        plot=plot,
    )


if __name__ == "__main__":
    main()
