"""Peak memory of accumulation against plain training at the big batch and at the micro-batch.

Four configurations of the same model, data (``2 * k * b`` samples, two
updates' worth, repeated as needed) and seed, each trained for 16 steps
(``fit`` batches; two updates with accumulation) in a FRESH process:

- ``plain k*b``: plain Keras at batch ``k * b`` (what accumulation replaces);
- ``library k x b``: ``GradientAccumulateModel(accum_steps=k)`` at batch ``b``;
- ``built-in k x b``: Keras's ``Adam(gradient_accumulation_steps=k)`` at batch ``b``;
- ``plain b``: plain Keras at batch ``b`` (the floor accumulation should reach).

Each process records its RSS once imports, data, model build and compile are
done (the idle process, ready to train), then its peak RSS during ``fit``
(see ``benchmarks/_memory.py``). The figure is *extra* = peak - idle, and the
goal is that accumulation's memory exceeds plain batch ``b``'s by no more than
its accumulators (4 bytes per trainable parameter) plus 5% of plain ``b``'s
extra. That comparison uses the absolute peaks, because the library creates
its accumulators when the model is built (before the idle measurement) and
Keras's built-in creates them in ``fit``. TensorFlow's allocator peak (tensors
only) is printed beside RSS to tell tensors from everything else (the traced
graph, its optimised copies, allocator slack).

Configurations alternate across repeats (the order rotates); figures are
medians over repeats.

Run: ``python -m benchmarks.memory`` (MobileNetV2 alpha 1.0 at 128x128, k=8,
b=16, 3 repeats; ``--quick`` for CI: a dense model, all configurations in one
process, figures meaningless).
"""

import numpy as np

from benchmarks._common import (
    KERAS_BUILTIN,
    LIBRARY,
    PLAIN,
    alternate,
    median,
    parser,
    print_table,
    save,
)
from benchmarks._memory import measure

# Name shown: (flavour, batch is k*b?)
CONFIGS = {
    "plain k*b": (PLAIN, True),
    "library k x b": (LIBRARY, False),
    "built-in k x b": (KERAS_BUILTIN, False),
    "plain b": (PLAIN, False),
}
FIGURES = ("baseline_mb", "peak_mb", "extra_mb", "tf_extra_mb", "ru_maxrss_mb")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration")
    args = p.parse_args()
    quick = args.quick
    if quick:
        model, accum_steps, micro_batch, repeats = {"kind": "dense"}, 2, 4, 1
    else:
        model = {"kind": "mobilenetv2", "size": 128, "alpha": 1.0}
        accum_steps, micro_batch, repeats = 8, 16, args.repeats
    samples = 2 * accum_steps * micro_batch
    steps = 2 * accum_steps  # 16 in the full run: RSS levels off after a few steps
    configs = {
        name: {
            "model": model,
            "flavour": flavour,
            "batch": accum_steps * micro_batch if big else micro_batch,
            "accum_steps": accum_steps,
            "samples": samples,
            "steps": steps,
        }
        for name, (flavour, big) in CONFIGS.items()
    }
    if quick:
        runs = {name: [r] for name, r in zip(configs, measure(list(configs.values()), fresh=False))}
    else:
        runs = alternate(configs, lambda config: measure([config])[0], repeats)

    results = {
        name: {key: median([r[key] for r in rs]) for key in FIGURES} for name, rs in runs.items()
    }
    params = runs["plain b"][0]["params"]
    accumulators_mb = runs["plain b"][0]["accumulator_mb"]
    floor = results["plain b"]
    allowed = accumulators_mb + 0.05 * floor["extra_mb"]
    for r in results.values():
        r["extra_over_plain_b"] = r["extra_mb"] / floor["extra_mb"]
        r["peak_minus_plain_b_mb"] = r["peak_mb"] - floor["peak_mb"]
    rows = [
        [
            name,
            f"{configs[name]['batch']} x {steps}",
            f"{r['peak_mb']:.0f}",
            f"{r['baseline_mb']:.0f}",
            f"{r['extra_mb']:.0f}",
            f"{r['extra_over_plain_b']:.3f}",
            f"{r['peak_minus_plain_b_mb']:+.0f}",
            f"{r['tf_extra_mb']:.0f}",
        ]
        for name, r in results.items()
    ]
    how = (
        "all in one process (--quick: figures meaningless)"
        if quick
        else f"one fresh process per configuration and repeat, median of {repeats}"
    )
    title = (
        f"peak memory, {model}, accum_steps={accum_steps}, micro-batch {micro_batch}, Adam; {how}"
    )
    print_table(
        title,
        [
            "configuration",
            "batch x steps",
            "peak RSS MiB",
            "idle RSS MiB",
            "extra MiB",
            "extra / plain b",
            "peak - plain b",
            "TF allocator extra MiB",
        ],
        rows,
    )
    verdicts = {}
    for name in ("library k x b", "built-in k x b"):
        over = results[name]["peak_minus_plain_b_mb"]
        verdicts[name] = over <= allowed
        print(
            f"goal ({name}): peak - plain b = {over:+.0f} MiB <= accumulators "
            f"{accumulators_mb:.1f} MiB + 5% of plain b's extra "
            f"({0.05 * floor['extra_mb']:.0f} MiB) = {allowed:.0f} MiB: "
            f"{'met' if verdicts[name] else 'NOT met'}"
        )

    def plot(ax):
        names = list(results)
        xs = np.arange(len(names))
        idle = [results[n]["baseline_mb"] for n in names]
        extra = [results[n]["extra_mb"] for n in names]
        ax.bar(xs, idle, 0.6, color="lightgray", label="idle process (ready to train)")
        bars = ax.bar(xs, extra, 0.6, bottom=idle, label="extra during fit")
        for bar, n in zip(bars, names):
            ax.annotate(
                f"+{results[n]['extra_mb']:.0f} MiB\n"
                f"({results[n]['extra_over_plain_b']:.2f}x plain b)",
                (bar.get_x() + bar.get_width() / 2, results[n]["peak_mb"]),
                ha="center",
                va="bottom",
                fontsize="small",
            )
        ax.axhline(
            floor["peak_mb"] + allowed,
            color="black",
            linewidth=0.8,
            linestyle="--",
            label="goal: plain b + accumulators + 5% of its extra",
        )
        ax.set_xticks(xs, names)
        ax.set_ylabel("peak RSS (MiB)")
        ax.set_title(f"Training memory (k={accum_steps}, b={micro_batch})")
        ax.margins(y=0.15)
        ax.legend(fontsize="small", loc="upper right")

    save(
        args.out,
        "memory" + ("_quick" if quick else ""),
        {
            "model": model,
            "accum_steps": accum_steps,
            "micro_batch": micro_batch,
            "samples": samples,
            "steps": steps,
            "repeats": repeats,
            "quick": quick,
            "trainable_parameters": params,
            "accumulators_mb": accumulators_mb,
            "allowed_over_plain_b_mb": allowed,
            "goal_met": verdicts,
            "configurations": {name: configs[name] for name in configs},
            "results": results,
            "runs": {
                name: [{k: r[k] for k in (*FIGURES, "per_step")} for r in rs]
                for name, rs in runs.items()
            },
        },
        plot,
    )


if __name__ == "__main__":
    main()
