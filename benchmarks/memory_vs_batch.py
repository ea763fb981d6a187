"""Training memory against the effective batch: plain big batches vs accumulation at micro-batch 16.

For each effective batch ``B`` (16 ... 512), the same model, seed and data
(``2 * B`` samples, repeated as needed) trained for the same number of
``fit`` batches, ``max(16, 2 * B / 16)`` (RSS levels off after a few steps;
at least two updates with accumulation), each point in a FRESH process (see
``benchmarks/_memory.py``):

- plain Keras at batch ``B``;
- ``GradientAccumulateModel(accum_steps=B / 16)`` at micro-batch 16;
- Keras's built-in ``Adam(gradient_accumulation_steps=B / 16)`` at micro-batch 16.

The figure is each process's peak RSS during ``fit`` minus its RSS once
ready to train (imports, data, model, compile done): the memory training
adds. Plain training grows with ``B``; accumulation stays at the micro-batch's
level, which the plot shows at a glance ("effective batch 512 in the memory
of 16").

Run: ``python -m benchmarks.memory_vs_batch`` (MobileNetV2 alpha 1.0 at 64x64;
``--repeats`` fresh processes per point, default 1, medians; ``--quick`` for
CI: a dense model, two batch sizes, all in one process, figures meaningless).
"""

from benchmarks._common import (
    KERAS_BUILTIN,
    LABELS,
    LIBRARY,
    PLAIN,
    alternate,
    median,
    parser,
    print_table,
    save,
)
from benchmarks._memory import measure

FIGURES = ("peak_mb", "baseline_mb", "extra_mb", "tf_extra_mb")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per point")
    args = p.parse_args()
    quick = args.quick
    if quick:
        model, micro_batch, batches, repeats, min_steps = {"kind": "dense"}, 4, [4, 8], 1, 4
    else:
        model = {"kind": "mobilenetv2", "size": 64, "alpha": 1.0}
        micro_batch, batches, repeats = 16, [16, 32, 64, 128, 256, 512], args.repeats
        min_steps = 16

    points = {}
    for batch in batches:
        k = batch // micro_batch
        common = {"model": model, "samples": 2 * batch, "steps": max(min_steps, 2 * k)}
        points[(PLAIN, batch)] = {**common, "flavour": PLAIN, "batch": batch, "accum_steps": 1}
        if k > 1:  # at k == 1 accumulation is plain training at the micro-batch
            for flavour in (LIBRARY, KERAS_BUILTIN):
                points[(flavour, batch)] = {
                    **common,
                    "flavour": flavour,
                    "batch": micro_batch,
                    "accum_steps": k,
                }
    if quick:
        runs = {key: [r] for key, r in zip(points, measure(list(points.values()), fresh=False))}
    else:
        runs = alternate(points, lambda config: measure([config])[0], repeats)
    results = {
        key: {figure: median([r[figure] for r in rs]) for figure in FIGURES}
        for key, rs in runs.items()
    }

    def cell(flavour, batch, figure="extra_mb"):
        r = results.get((flavour, batch))
        return "" if r is None else f"{r[figure]:.0f}"

    rows = [
        [
            batch,
            points[(PLAIN, batch)]["steps"],
            cell(PLAIN, batch),
            cell(LIBRARY, batch),
            cell(KERAS_BUILTIN, batch),
            cell(PLAIN, batch, "tf_extra_mb"),
            cell(LIBRARY, batch, "tf_extra_mb"),
            cell(KERAS_BUILTIN, batch, "tf_extra_mb"),
        ]
        for batch in batches
    ]
    how = (
        "all in one process (--quick)" if quick else f"fresh process per point, median of {repeats}"
    )
    print_table(
        f"memory training adds (peak RSS - idle RSS, MiB) against the effective batch; "
        f"{model}, accumulation at micro-batch {micro_batch}; {how}",
        [
            "effective batch",
            "fit batches",
            "plain",
            "library",
            "built-in",
            "plain (TF alloc.)",
            "library (TF alloc.)",
            "built-in (TF alloc.)",
        ],
        rows,
    )
    largest = batches[-1]
    headline = (
        f"effective batch {largest}: plain {results[(PLAIN, largest)]['extra_mb']:.0f} MiB, "
        f"library {results[(LIBRARY, largest)]['extra_mb']:.0f} MiB "
        f"(plain at {micro_batch}: {results[(PLAIN, micro_batch)]['extra_mb']:.0f} MiB)"
    )
    print(headline)

    def plot(ax):
        for flavour, style in ((PLAIN, "o-"), (LIBRARY, "s-"), (KERAS_BUILTIN, "^--")):
            xs = [b for b in batches if (flavour, b) in results]
            ax.plot(
                xs,
                [results[(flavour, b)]["extra_mb"] for b in xs],
                style,
                label=LABELS[flavour] + ("" if flavour == PLAIN else f" ({micro_batch} x k)"),
            )
        ax.axhline(
            results[(PLAIN, micro_batch)]["extra_mb"],
            color="gray",
            linewidth=0.8,
            linestyle=":",
            label=f"plain at batch {micro_batch}",
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("effective batch size")
        ax.set_ylabel("memory training adds (MiB, peak RSS)")
        ax.set_title(f"Effective batch {largest} in the memory of {micro_batch}")
        ax.legend(fontsize="small")

    save(
        args.out,
        "memory_vs_batch" + ("_quick" if quick else ""),
        {
            "model": model,
            "micro_batch": micro_batch,
            "effective_batches": batches,
            "repeats": repeats,
            "quick": quick,
            "headline": headline,
            "results": [
                {"flavour": f, "effective_batch": b, **points[(f, b)], **results[(f, b)]}
                for (f, b) in results
            ],
        },
        plot,
    )


if __name__ == "__main__":
    main()
