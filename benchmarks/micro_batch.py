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

Run: ``python -m benchmarks.micro_batch`` (``--models mlp`` for a part;
``--quick`` for CI: a small dense model, figures meaningless). Writes
``micro_batch.json`` and ``micro_batch.png`` (peak against budget, each point
labelled with its choice).
"""

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


def _layers(name):
    if name == "mobilenetv2":
        return mobilenetv2(size=96, alpha=0.35)
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
    args = p.parse_args()
    if args.quick and args.models != p.get_default("models"):
        p.error("`--quick` runs its own tiny case: drop `--models`.")
    names = args.models.split(",")
    for name in names:
        if name not in SETUPS:
            p.error(f"`--models`: unknown name {name!r}; the names are {', '.join(SETUPS)}")
    setups = QUICK if args.quick else {name: SETUPS[name] for name in names}
    results = [run_setup(name, setup) for name, setup in setups.items()]

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

    rows = [row(r, c) for r in results for c in r["choices"]]
    print_table(
        "choose_micro_batch: the choice at each budget (allocator peak, MiB)",
        ["model", "batch", "budget MiB", "accum_steps x micro-batch", "peak MiB", "tried", "s"],
        rows,
    )

    save(
        args.out,
        "micro_batch" + ("_quick" if args.quick else ""),
        {"quick": args.quick, "results": results},
        plotter(results),
    )


if __name__ == "__main__":
    main()
