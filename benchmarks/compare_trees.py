"""Speed and memory of this tree against another commit's, measured side by side.

A refactoring that claims "speed and memory unchanged" is measured so: the
same benchmark (``fit_time`` or ``memory``) runs in this repository's tree
and in another commit's (a folder of its own, e.g. ``git worktree add
/tmp/base <commit>``), in fresh processes, the order alternating round after
round (this tree first, then the other, then the other first). Each run
compares the library with plain Keras in the same process, so each tree's
figure is a ratio that machine load moves little; the trees' figures are
compared as medians over rounds.

- ``fit_time``: per (model, mode), the library's CPU time and wall time per
  micro-batch over plain ``fit``'s (``library_cpu_over_plain``,
  ``library_over_plain``); the difference of CPU ratios is the figure to
  hold within a few hundredths.
- ``memory``: per setup, the library's own peak (``library k x b``), as the
  process's RSS and as TensorFlow's allocator's (``peak_mb``,
  ``tf_peak_mb``), in MiB: not its peak above plain batch ``b``'s, which
  adds plain Keras's own variation. TensorFlow's allocator's peak moves by
  a buffer or two from one fresh process to the next, in either tree (the
  MLP's library peak, graph mode: 448.5, 480.5 or 512.0 MiB; plain ``k*b``
  401.8 to 480.8), so compare its medians over several rounds; the RSS moved
  by under 3 MiB.

Run: ``python -m benchmarks.compare_trees --base /tmp/base`` (``--benchmark
memory``; ``--rounds 4``; the benchmark's own options after ``--``, e.g.
``-- --models dense --modes graph``); ``--quick`` for CI: this tree against
itself, one round of each benchmark's quick mode, figures meaningless.
"""

import json
import os
import subprocess
import sys
import tempfile

from benchmarks._common import ROOT, median, parser, print_table, save

# Per benchmark: the figures compared, read from each configuration's entry.
FIGURES = {
    "fit_time": ("library_cpu_over_plain", "library_over_plain"),
    "memory": ("peak_mb", "tf_peak_mb"),
}


def _configurations(benchmark, payload):
    """``{configuration name: {figure: value}}`` of one run's JSON."""
    figures = FIGURES[benchmark]
    if benchmark == "fit_time":
        return {f"{r['model']}/{r['mode']}": {f: r[f] for f in figures} for r in payload["results"]}
    return {
        name: {f: setup["results"]["library k x b"][f] for f in figures}
        for name, setup in payload["setups"].items()
    }


def run(tree, benchmark, options, out):
    """One fresh run of ``benchmarks.<benchmark>`` in ``tree``; its configurations' figures."""
    command = [sys.executable, "-m", f"benchmarks.{benchmark}", "--out", out, *options]
    # The tree's own package first: `python -m` puts the working folder on the path.
    environment = {**os.environ, "PYTHONPATH": tree}
    subprocess.run(command, cwd=tree, env=environment, check=True, stdout=subprocess.DEVNULL)
    (written,) = [name for name in os.listdir(out) if name.endswith(".json")]
    with open(os.path.join(out, written)) as handle:
        return _configurations(benchmark, json.load(handle))


def compare(base, benchmark, rounds, options):
    """Runs both trees ``rounds`` times, alternating; returns the per-configuration medians."""
    trees = {"this tree": str(ROOT), "base": os.path.abspath(base)}
    runs = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for name in order:
                out = os.path.join(scratch, f"{name.replace(' ', '_')}_{round_}")
                os.makedirs(out)
                runs[name].append(run(trees[name], benchmark, options, out))
    results = {}
    for configuration in runs["this tree"][0]:
        entry = {}
        for figure in FIGURES[benchmark]:
            here = median([r[configuration][figure] for r in runs["this tree"]])
            there = median([r[configuration][figure] for r in runs["base"]])
            entry[figure] = {"this_tree": here, "base": there, "difference": here - there}
        results[configuration] = entry
    return results


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--base", help="the other commit's tree (a folder); --quick: this tree")
    p.add_argument("--benchmark", choices=sorted(FIGURES), default="fit_time")
    p.add_argument("--rounds", type=int, default=4, help="runs of each tree, alternating")
    p.add_argument("options", nargs="*", help="the benchmark's own options (after --)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"`--rounds` must be >= 1. Received: --rounds={args.rounds}")
    if args.quick:
        base, rounds, options = str(ROOT), 1, ["--quick", *args.options]
    elif args.base is None:
        p.error("`--base` names the other tree (e.g. `git worktree add /tmp/base cfb04f7`).")
    else:
        base, rounds, options = args.base, args.rounds, args.options
    results = compare(base, args.benchmark, rounds, options)
    rows = [
        [
            configuration,
            figure,
            f"{values['this_tree']:.3f}",
            f"{values['base']:.3f}",
            f"{values['difference']:+.3f}",
        ]
        for configuration, entry in results.items()
        for figure, values in entry.items()
    ]
    print_table(
        f"{args.benchmark}: this tree against {base} (medians over {rounds} alternating runs)",
        ["configuration", "figure", "this tree", "base", "difference"],
        rows,
    )

    def plot(ax):
        labels = [f"{row[0]}\n{row[1]}" for row in rows]
        ax.bar(range(len(rows)), [float(row[4]) for row in rows])
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("this tree - base")

    save(
        args.out,
        "compare_trees_quick" if args.quick else f"compare_trees_{args.benchmark}",
        {
            "benchmark": args.benchmark,
            "base": base,
            "rounds": rounds,
            "options": options,
            "quick": args.quick,
            "results": results,
        },
        plot,
    )


if __name__ == "__main__":
    main()
