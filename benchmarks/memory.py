"""Peak memory of accumulation against plain training at the big batch and at the micro-batch.

Four configurations of the same model, data (``2 * k * b`` samples, two
updates' worth, repeated as needed) and seed, each trained for ``2 * k``
steps (``fit`` batches; two updates with accumulation) in a FRESH process:

- ``plain k*b``: plain Keras at batch ``k * b`` (what accumulation replaces);
- ``library k x b``: ``GradientAccumulateModel(accum_steps=k)`` at batch ``b``;
- ``built-in k x b``: Keras's ``Adam(gradient_accumulation_steps=k)`` at batch ``b``;
- ``plain b``: plain Keras at batch ``b`` (the floor accumulation should reach).

for each setup: a model whose activations dominate (MobileNetV2 alpha 1.0 at
128x128, ``k=8``, ``b=16``) and one whose parameters dominate (an MLP
1024-4096-4096-10, 21.0 M parameters, ``k=4``, ``b=16``), each in graph mode
and with ``jit_compile=True``.

Each process records its RSS once imports, data, model build and compile are
done (the idle process, ready to train), then its peak RSS during ``fit``
(see ``benchmarks/_memory.py``). The figure is *extra* = peak - idle. Goals,
on the absolute peaks (the library creates its accumulators when the model is
built, before the idle measurement; Keras's built-in creates them in
``fit``): accumulation's peak exceeds plain batch ``b``'s by no more than its
accumulators (4 bytes per trainable parameter) plus 10% of them (issue 15's
goal), and, the older goal, plus 5% of plain ``b``'s extra.

Two peaks, each with its verdict: the process's RSS (everything: tensors, the
traced graph and its optimised copies, the C allocator's slack) and
TensorFlow's allocator of the training device (tensors only). On a GPU
(``--device gpu``, or ``auto`` where TensorFlow sees one) the allocator's
peak is the GPU memory, the one whose excess makes training fail there, and
RSS is the host's; on a CPU both are the same memory, and RSS is the bound.

Configurations alternate across repeats (the order rotates); figures are
medians over repeats.

Run: ``python -m benchmarks.memory`` (all four setups, 3 repeats;
``--models mlp --modes jit`` for a part; ``--quick`` for CI: a small dense
model, all configurations in one process, figures meaningless). It writes
``memory.json``, ``memory.png`` (every setup against the goal) and
``memory_<model>_<mode>.png`` (one setup's peaks); ``--plot-only
memory.json`` draws the PNGs again from a saved JSON file, measuring nothing.
"""

import json
import math
from pathlib import Path

import numpy as np

from benchmarks._common import (
    KERAS_BUILTIN,
    LIBRARY,
    PLAIN,
    add_parts,
    alternate,
    chosen_parts,
    median,
    parser,
    print_table,
    save,
    save_plot,
)
from benchmarks._memory import measure

# Name shown: (flavour, batch is k*b?)
CONFIGS = {
    "plain k*b": (PLAIN, True),
    "library k x b": (LIBRARY, False),
    "built-in k x b": (KERAS_BUILTIN, False),
    "plain b": (PLAIN, False),
}
FIGURES = (
    "baseline_mb",
    "peak_mb",
    "extra_mb",
    "steady_peak_mb",
    "steady_extra_mb",
    "tf_extra_mb",
    "tf_peak_mb",
    "ru_maxrss_mb",
)


SETUPS = {
    "mobilenetv2": ({"kind": "mobilenetv2", "size": 128, "alpha": 1.0}, 8, 16),
    "mlp": ({"kind": "mlp", "features": 1024, "width": 4096}, 4, 16),
}


def shown_ratio(extra_mb, plain_b_extra_mb):
    """``extra / plain b's extra`` as the table and the plots show it.

    Both figures are shown in whole MiB beside the ratio, so the ratio is
    theirs: dividing the shown figures gives the shown ratio (to its two
    decimals). ``nan`` when plain b's extra rounds to 0 MiB (``--quick``).
    """
    whole = round(plain_b_extra_mb)
    return round(extra_mb) / whole if whole else math.nan


def measure_setup(model, accum_steps, micro_batch, jit, repeats, quick):
    """The four configurations of one setup: figures and goals."""
    samples = 2 * accum_steps * micro_batch
    steps = 2 * accum_steps
    configs = {
        name: {
            "model": model,
            "flavour": flavour,
            "batch": accum_steps * micro_batch if big else micro_batch,
            "accum_steps": accum_steps,
            "samples": samples,
            "steps": steps,
            "jit": jit,
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
    accumulators_mb = runs["plain b"][0]["accumulator_mb"]
    floor = results["plain b"]
    allowed = accumulators_mb + 0.05 * floor["extra_mb"]
    allowed_issue = 1.10 * accumulators_mb
    for r in results.values():
        r["extra_over_plain_b"] = r["extra_mb"] / floor["extra_mb"]
        r["peak_minus_plain_b_mb"] = r["peak_mb"] - floor["peak_mb"]
        r["over_plain_b_per_accumulators"] = r["peak_minus_plain_b_mb"] / accumulators_mb
        r["steady_minus_plain_b_mb"] = r["steady_peak_mb"] - floor["steady_peak_mb"]
        r["tf_peak_minus_plain_b_mb"] = r["tf_peak_mb"] - floor["tf_peak_mb"]
        r["tf_over_plain_b_per_accumulators"] = r["tf_peak_minus_plain_b_mb"] / accumulators_mb
    return {
        "model": model,
        "mode": "jit" if jit else "graph",
        "accum_steps": accum_steps,
        "micro_batch": micro_batch,
        "samples": samples,
        "steps": steps,
        "trainable_parameters": runs["plain b"][0]["params"],
        "accumulators_mb": accumulators_mb,
        "allowed_over_plain_b_mb": allowed,
        "allowed_1_10_accumulators_mb": allowed_issue,
        "goal_met": {
            name: results[name]["peak_minus_plain_b_mb"] <= allowed
            for name in ("library k x b", "built-in k x b")
        },
        "goal_1_10_met": {
            name: results[name]["peak_minus_plain_b_mb"] <= allowed_issue
            for name in ("library k x b", "built-in k x b")
        },
        "allocator_goal_1_10_met": {
            name: results[name]["tf_peak_minus_plain_b_mb"] <= allowed_issue
            for name in ("library k x b", "built-in k x b")
        },
        "device": runs["plain b"][0]["device"],
        "device_name": runs["plain b"][0]["device_name"],
        "results": results,
        "runs": {
            name: [{k: r[k] for k in (*FIGURES, "per_step")} for r in rs]
            for name, rs in runs.items()
        },
    }


def print_setup(name, setup, how):
    accumulators_mb = setup["accumulators_mb"]
    big, small = setup["accum_steps"] * setup["micro_batch"], setup["micro_batch"]
    rows = [
        [
            config,
            f"{big if config == 'plain k*b' else small} x {setup['steps']}",
            f"{r['peak_mb']:.0f}",
            f"{r['baseline_mb']:.0f}",
            f"{r['extra_mb']:.0f}",
            f"{shown_ratio(r['extra_mb'], setup['results']['plain b']['extra_mb']):.2f}",
            f"{r['peak_minus_plain_b_mb']:+.0f}",
            f"{r['over_plain_b_per_accumulators']:.2f}",
            f"{r['steady_minus_plain_b_mb']:+.0f}",
            f"{r['tf_extra_mb']:.0f}",
            f"{r['tf_peak_minus_plain_b_mb']:+.0f}",
            f"{r['tf_over_plain_b_per_accumulators']:.2f}",
        ]
        for config, r in setup["results"].items()
    ]
    print_table(
        f"{name}, {setup['mode']}: {setup['model']}, accum_steps={setup['accum_steps']}, "
        f"micro-batch {setup['micro_batch']}, Adam, {setup['trainable_parameters']} parameters "
        f"(accumulators {accumulators_mb:.1f} MiB); on {setup['device_name']}; {how}",
        [
            "configuration",
            "batch x steps",
            "peak RSS MiB",
            "idle RSS MiB",
            "extra MiB",
            "extra / plain b",
            "peak - plain b",
            "(peak - plain b) / accumulators",
            "after the first group: peak - plain b",
            "TF allocator extra MiB",
            "allocator peak - plain b",
            "/ accumulators",
        ],
        rows,
    )
    for config in ("library k x b", "built-in k x b"):
        over = setup["results"][config]["peak_minus_plain_b_mb"]
        print(
            f"goal ({config}): peak - plain b = {over:+.0f} MiB <= 1.10 x accumulators "
            f"= {setup['allowed_1_10_accumulators_mb']:.0f} MiB: "
            f"{'met' if setup['goal_1_10_met'][config] else 'NOT met'}; <= accumulators + 5% "
            f"of plain b's extra = {setup['allowed_over_plain_b_mb']:.0f} MiB: "
            f"{'met' if setup['goal_met'][config] else 'NOT met'}"
        )
        over = setup["results"][config]["tf_peak_minus_plain_b_mb"]
        print(
            f"goal ({config}), {setup['device']} allocator (tensors): peak - plain b = "
            f"{over:+.0f} MiB <= 1.10 x accumulators: "
            f"{'met' if setup['allocator_goal_1_10_met'][config] else 'NOT met'}"
        )


def _label_above(ax, x, top, text, line):
    """Writes ``text`` centred above ``top`` at ``x``; above ``line`` instead if it would cross it.

    ``line`` is the level of a horizontal line. Measured in the axis's final
    coordinates: call once its limits and the figure's layout are set.
    """
    gap = 3  # points between the label and what it stands on
    label = ax.annotate(
        text,
        (x, top),
        xytext=(0, gap),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize="small",
    )
    box = label.get_window_extent(ax.figure.canvas.get_renderer())
    line_y = ax.transData.transform((x, line))[1]
    if box.y0 - gap <= line_y <= box.y1 + gap:
        label.xy = (x, line)
    return label


def plot_peaks(ax, name, setup):
    """One setup's peak RSS per configuration: the idle process, the extra during ``fit``, the goal.

    Each bar is labelled with its extra and :func:`shown_ratio`, the figures
    of the printed table; no label crosses the goal line.
    """
    results = setup["results"]
    names = list(results)
    xs = np.arange(len(names))
    idle = [results[n]["baseline_mb"] for n in names]
    extra = [results[n]["extra_mb"] for n in names]
    goal = results["plain b"]["peak_mb"] + setup["allowed_over_plain_b_mb"]
    ax.bar(xs, idle, 0.6, color="lightgray", label="idle process (ready to train)")
    ax.bar(xs, extra, 0.6, bottom=idle, label="extra during fit")
    ax.axhline(
        goal,
        color="black",
        linewidth=0.8,
        linestyle="--",
        label="goal: plain b + accumulators + 5% of its extra",
    )
    ax.set_xticks(xs, names)
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title(f"Training memory, {name} (k={setup['accum_steps']}, b={setup['micro_batch']})")
    ax.set_ylim(0, 1.2 * max(goal, *(results[n]["peak_mb"] for n in names)))
    ax.figure.tight_layout()  # the final layout, in which the labels are placed
    floor_extra = results["plain b"]["extra_mb"]
    for x, n in zip(xs, names):
        r = results[n]
        text = f"+{r['extra_mb']:.0f} MiB\n({shown_ratio(r['extra_mb'], floor_extra):.2f}x plain b)"
        _label_above(ax, x, r["peak_mb"], text, goal)
    ax.legend(fontsize="small", loc="best")  # after the labels: placed clear of them


def plot_goals(ax, setups):
    """Every setup's peak over plain b's, per accumulator byte, against the goal of 1.10."""
    names = list(setups)
    xs = np.arange(len(names))
    for offset, config in ((-0.2, "library k x b"), (0.2, "built-in k x b")):
        ax.bar(
            xs + offset,
            [setups[n]["results"][config]["over_plain_b_per_accumulators"] for n in names],
            0.4,
            label=config,
        )
    ax.axhline(1.10, color="black", linewidth=0.8, linestyle="--", label="goal 1.10")
    ax.set_xticks(xs, names, fontsize="small")
    ax.set_ylabel("(peak - plain b's peak) / accumulator bytes")
    ax.set_title("Extra training memory of accumulation")
    ax.legend(fontsize="small")


def plot_files(out, name, payload):
    """Writes ``<name>.png`` (:func:`plot_goals`) and ``<name>_<model>_<mode>.png`` per setup."""
    setups = payload["setups"]
    paths = [save_plot(out, name, lambda ax: plot_goals(ax, setups))]
    for setup_name, setup in setups.items():
        paths.append(
            save_plot(
                out,
                f"{name}_{setup_name.replace('/', '_')}",
                lambda ax, n=setup_name, s=setup: plot_peaks(ax, n, s),
            )
        )
    print("wrote " + ", ".join(str(p) for p in paths))


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration")
    p.add_argument(
        "--plot-only",
        metavar="JSON",
        help="draw the PNGs of a JSON file this script wrote, into --out; measure nothing",
    )
    add_parts(p, SETUPS)
    args = p.parse_args()
    models, modes = chosen_parts(p, args, SETUPS)
    if args.plot_only:
        measuring = [
            f"--{option}"
            for option in ("quick", "repeats", "models", "modes")
            if getattr(args, option) != p.get_default(option)
        ]
        if measuring:
            p.error(f"`--plot-only` measures nothing: drop {', '.join(measuring)}.")
        path = Path(args.plot_only)
        plot_files(args.out, path.stem, json.loads(path.read_text()))
        return
    quick = args.quick
    repeats = 1 if quick else args.repeats
    if quick:
        plan = {"dense": ({"kind": "dense"}, 2, 4)}
    else:
        plan = {name: SETUPS[name] for name in models}
    how = (
        "all in one process (--quick: figures meaningless)"
        if quick
        else f"one fresh process per configuration and repeat, median of {repeats}"
    )
    setups = {}
    for name, (model, accum_steps, micro_batch) in plan.items():
        for mode in modes:
            setup = measure_setup(model, accum_steps, micro_batch, mode == "jit", repeats, quick)
            setups[f"{name}/{mode}"] = setup
            print_setup(name, setup, how)

    stem = "memory" + ("_quick" if quick else "")
    payload = {"quick": quick, "repeats": repeats, "setups": setups}
    save(args.out, stem, payload)
    plot_files(args.out, stem, payload)


if __name__ == "__main__":
    main()
