"""The micro-batch that choose_micro_batch picks for a batch at several memory budgets.

For each setup, one batch asked for and budgets taken as fractions of the
allocator peak of training the whole batch at once (``accum_steps=1``, found
by a first call with a budget that it fits): each budget's choice, its
measured peak, the tries and their wall time, then one budget below every
micro-batch (the error a user gets). Setups: a model whose activations
dominate (MobileNetV2 alpha 0.35 at 96x96, batch 64, Keras's own
BatchNormalization inside the wrapper) and one whose parameters weigh most
(an MLP 1024-4096-4096-10, 21.0 M parameters: 84 MiB of weights, twice that
of Adam's moments; batch 2048, whose activations are about as large), both
with Adam. MobileNetV2 also gets a budget of 1 byte (the error's tries).

The peak is TensorFlow's allocator's on the training device (the GPU's with
``--device gpu``): on a CPU it counts tensors of 256 KiB and more, not the
process's memory (``benchmarks.memory`` measures RSS).

The search (``--parts search``): how many tries, and how many seconds, the
search takes for batches 256, 1024 and 4096 on the dense model of
``benchmarks.fit_time``'s kind (256-512-512-10) and MobileNetV2 (alpha 0.35,
32x32), at a budget of micro-batch 8's allocator peak plus 2% (measured
first by one try, not counted; a model that needs micro-batches this small
is the case a search is for): ``choose_micro_batch`` as it is (the whole
batch, the next divisor, then a bisection), and the scan it replaced (every
divisor from the batch down until one fits), the same tries
(``micro_batch._try``) timed here in the same process, one after the other.

Run: ``python -m benchmarks.micro_batch`` (``--models mlp`` for a part of
the choices, ``--parts search`` for the search alone; ``--quick`` for CI: a
small dense model, figures meaningless). Writes ``micro_batch.json`` and
``micro_batch.png`` (peak against budget, each point labelled with its
choice).
"""

import time

from benchmarks._common import (
    LIBRARY,
    classification_data,
    compiled,
    dense_model,
    mobilenetv2,
    parser,
    print_table,
    save,
)

MIB = 2**20
SETUPS = {
    "mobilenetv2": {
        "batch": 64,
        "shape": (96, 96, 3),
        "fractions": (0.75, 0.5, 0.3, 0.15),
        "nothing_fits": True,
    },
    "mlp": {"batch": 2048, "shape": (1024,), "fractions": (0.97, 0.9)},
}
QUICK = {"dense": {"batch": 16, "shape": (256,), "fractions": (0.99,)}}
SEARCH = {"models": {"dense": (256,), "mobilenetv2": (32, 32, 3)}, "batches": (256, 1024, 4096)}
QUICK_SEARCH = {"models": {"dense": (256,)}, "batches": (16,)}
SEARCH_TARGET = 8  # the budget: this micro-batch's peak, plus 2%


def _layers(name, size=96):
    if name == "mobilenetv2":
        return mobilenetv2(size=size, alpha=0.35)
    if name == "mlp":
        return dense_model(features=1024, width=4096)
    return dense_model()


def run_setup(name, setup):
    from gradient_accumulator import choose_micro_batch

    def build(accum_steps):
        return compiled(LIBRARY, *_layers(name), accum_steps)

    x, y = classification_data(setup["batch"], setup["shape"])

    def choose(budget):
        try:
            choice = choose_micro_batch(
                build, x, y, batch_size=setup["batch"], memory_budget=budget
            )
        except ValueError as raised:  # nothing fits: the user's error
            print(raised, flush=True)
            return {"budget_mb": budget / MIB, "micro_batch": None, "error": str(raised)}
        return {
            "budget_mb": budget / MIB,
            "micro_batch": choice.micro_batch,
            "accum_steps": choice.accum_steps,
            "peak_mb": choice.peak_bytes / MIB,
            "tries": [
                [t.micro_batch, None if t.peak_bytes is None else t.peak_bytes / MIB]
                for t in choice.tries
            ],
            "seconds": choice.seconds,
        }

    whole = choose(2**40)  # fits: the peak of the whole batch at once
    rows = [whole]
    for fraction in setup["fractions"]:
        rows.append(choose(int(fraction * whole["peak_mb"] * MIB)))
    if setup.get("nothing_fits"):
        rows.append(choose(1))
    return {"model": name, "batch_size": setup["batch"], "choices": rows}


def _scan(build, x, y, batch, budget):
    """The search before the bisection: each divisor from ``batch`` down until one fits."""
    from gradient_accumulator._compat import custom_gradients_dropped
    from gradient_accumulator.micro_batch import _memory_devices, _try

    devices = _memory_devices()
    start, tries = time.perf_counter(), []
    for micro_batch in [m for m in range(batch, 0, -1) if not batch % m]:
        with custom_gradients_dropped():
            peak, _ = _try(build, batch // micro_batch, micro_batch, (x, y, None), devices)
        tries.append(micro_batch)
        if peak is not None and peak <= budget:
            return {
                "micro_batch": micro_batch,
                "tries": tries,
                "seconds": time.perf_counter() - start,
            }
    return {"micro_batch": None, "tries": tries, "seconds": time.perf_counter() - start}


def run_search(name, shape, batch, quick=False):
    """The bisection's and the scan's tries and seconds, at micro-batch 8's peak (+2%)."""
    from gradient_accumulator import choose_micro_batch
    from gradient_accumulator._compat import custom_gradients_dropped
    from gradient_accumulator.micro_batch import _memory_devices, _try

    size = shape[0] if len(shape) == 3 else 96

    def build(accum_steps):
        return compiled(LIBRARY, *_layers(name, size), accum_steps)

    x, y = classification_data(batch, shape)
    target = min(SEARCH_TARGET, batch)
    with custom_gradients_dropped():
        peak, _ = _try(build, batch // target, target, (x, y, None), _memory_devices())
    # --quick: a tiny model whose peaks are the allocator's noise; any fits.
    budget = 2**40 if quick else int(1.02 * peak)
    choice = choose_micro_batch(build, x, y, batch_size=batch, memory_budget=budget)
    bisection = {
        "micro_batch": choice.micro_batch,
        "tries": [t.micro_batch for t in choice.tries],
        "seconds": choice.seconds,
    }
    scan = _scan(build, x, y, batch, budget)
    print(
        f"{name} batch {batch}: budget {budget / MIB:.1f} MiB; bisection {bisection}; scan {scan}",
        flush=True,
    )
    return {
        "model": name,
        "batch_size": batch,
        "target_peak_mb": peak / MIB,
        "budget_mb": budget / MIB,
        "bisection": bisection,
        "scan": scan,
    }


def search_plotter(search):
    """``plot(ax)``: seconds of the bisection and of the scan, per model and batch."""

    def plot(ax):
        labels = [f"{r['model']}\n{r['batch_size']}" for r in search]
        positions = range(len(search))
        for offset, key in ((-0.2, "bisection"), (0.2, "scan")):
            ax.bar(
                [p + offset for p in positions],
                [r[key]["seconds"] for r in search],
                width=0.4,
                label=key,
            )
        ax.set_xticks(list(positions), labels, fontsize="small")
        ax.set_ylabel("seconds of the search")
        ax.set_title("choose_micro_batch: bisection against the scan it replaced")
        ax.legend(fontsize="small")

    return plot


def plotter(results):
    """``plot(ax)``: each budget's chosen split's peak against the budget."""

    def plot(ax):
        chosen = {r["model"]: [c for c in r["choices"][1:] if c["micro_batch"]] for r in results}
        for r in results:
            budgets = [c["budget_mb"] for c in chosen[r["model"]]]
            peaks = [c["peak_mb"] for c in chosen[r["model"]]]
            ax.plot(budgets, peaks, "o", label=f"{r['model']} (batch {r['batch_size']})")
            for c in chosen[r["model"]]:
                ax.annotate(
                    f"{c['accum_steps']}x{c['micro_batch']}",
                    (c["budget_mb"], c["peak_mb"]),
                    fontsize="small",
                    textcoords="offset points",
                    xytext=(4, -10),
                )
        top = max(c["budget_mb"] for r in results for c in r["choices"][1:])
        ax.plot([0, top], [0, top], color="gray", linewidth=0.8, linestyle="--", label="budget")
        ax.set_xlabel("memory budget (MiB)")
        ax.set_ylabel("chosen split's allocator peak (MiB)")
        ax.set_title("choose_micro_batch: accum_steps x micro-batch per budget")
        ax.legend(fontsize="small")

    return plot


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--models", default=",".join(SETUPS), help=f"comma-separated: {','.join(SETUPS)}"
    )
    p.add_argument("--parts", default="choices,search", help="comma-separated: choices,search")
    args = p.parse_args()
    if args.quick and args.models != p.get_default("models"):
        p.error("`--quick` runs its own tiny case: drop `--models`.")
    names = args.models.split(",")
    for name in names:
        if name not in SETUPS:
            p.error(f"`--models`: unknown name {name!r}; the names are {', '.join(SETUPS)}")
    parts = args.parts.split(",")
    for part in parts:
        if part not in ("choices", "search"):
            p.error(f"`--parts`: unknown part {part!r}; the parts are choices, search")
    setups = QUICK if args.quick else {name: SETUPS[name] for name in names}
    results = (
        [run_setup(name, setup) for name, setup in setups.items()] if "choices" in parts else []
    )
    search = []
    if "search" in parts:
        plan = QUICK_SEARCH if args.quick else SEARCH
        search = [
            run_search(name, shape, batch, args.quick)
            for name, shape in plan["models"].items()
            for batch in plan["batches"]
        ]

    def row(r, c):
        mib = c["budget_mb"]
        budget = f"{mib:.1f}" if mib >= 0.1 else f"{mib * MIB:.0f} B"
        budget = "whole batch" if c is r["choices"][0] else budget
        if c["micro_batch"] is None:
            return [r["model"], r["batch_size"], budget, "none fits", "", "", ""]
        return [
            r["model"],
            r["batch_size"],
            budget,
            f"{c['accum_steps']} x {c['micro_batch']}",
            f"{c['peak_mb']:.1f}",
            ", ".join(str(m) for m, _ in c["tries"]),
            f"{c['seconds']:.1f}",
        ]

    if results:
        rows = [row(r, c) for r in results for c in r["choices"]]
        print_table(
            "choose_micro_batch: the choice at each budget (allocator peak, MiB)",
            ["model", "batch", "budget MiB", "accum_steps x micro-batch", "peak MiB", "tried", "s"],
            rows,
        )
    if search:
        print_table(
            f"the search at micro-batch {SEARCH_TARGET}'s allocator peak + 2%: "
            "bisection (now) against the scan it replaced",
            ["model", "batch", "budget MiB", "chosen", "tries", "s", "scan: chosen", "tries", "s"],
            [
                [
                    r["model"],
                    r["batch_size"],
                    f"{r['budget_mb']:.1f}",
                    r["bisection"]["micro_batch"],
                    len(r["bisection"]["tries"]),
                    f"{r['bisection']['seconds']:.1f}",
                    r["scan"]["micro_batch"],
                    len(r["scan"]["tries"]),
                    f"{r['scan']['seconds']:.1f}",
                ]
                for r in search
            ],
        )

    save(
        args.out,
        "micro_batch" + ("_quick" if args.quick else ""),
        {"quick": args.quick, "parts": parts, "results": results, "search": search},
        plotter(results) if results else search_plotter(search),
    )


if __name__ == "__main__":
    main()
