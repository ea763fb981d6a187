"""Shared benchmark plumbing: argument parsing, side-by-side repeats, JSON and PNG output."""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for CI (figures meaningless)")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON and PNG files")
    return p


def alternate(configurations, run_once, repeats):
    """Runs ``run_once(config)`` for every configuration in turn, ``repeats`` rounds.

    Alternating rounds spreads the machine's noise over all configurations, so
    that ratios taken within a round compare like with like.

    Returns:
        ``{name: [value per round]}``.
    """
    values = {name: [] for name in configurations}
    for _ in range(repeats):
        for name, config in configurations.items():
            values[name].append(run_once(config))
    return values


def median_ratio(numerators, denominators):
    """Median over rounds of the per-round ratio."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def save(out, name, payload, plot=None):
    """Writes ``<out>/<name>.json`` and, if ``plot`` is given, ``<out>/<name>.png``.

    ``plot(ax)`` draws on a matplotlib axis.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    paths = [out / f"{name}.json"]
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
        plot(ax)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        paths.append(out / f"{name}.png")
    print("\nwrote " + ", ".join(str(p) for p in paths))
