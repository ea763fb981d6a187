"""The benchmark scripts: each runs its ``--quick`` mode in a fresh process and writes its files.

Timing claims live in the benchmarks, not in tests; these tests only keep the
scripts running (``--quick`` sizes are tiny and their figures meaningless):
each script is run as a user would, ``python -m benchmarks.<name> --quick``
from the repository root, with ``--out`` in ``tmp_path``, and must write its
JSON and PNG files with the keys its documentation promises.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

from tests.helpers import KERAS_VERSION, ROOT, run_python
from tests.test_examples import skip_without

# The scripts are development tools, not the package: CI runs them with the
# newest TensorFlow and Keras only (see .ci/run).
pytestmark = pytest.mark.benchmarks

# Every script in benchmarks/ (checked below) and the keys of its JSON file:
# top level, then those of every entry of its per-configuration results.
EXPECTED = {
    "step_time": (
        {"accum_steps", "micro_batch", "quick", "goal", "results"},
        {
            "model",
            "mode",
            "plain_ms_per_micro_step",
            "keras_builtin_over_plain",
            "library_over_plain",
            "library_over_plain_cpu",
            "library_accumulate_only_over_plain",
            "library_update_step_over_plain",
            "rounds",
        },
    ),
    "fit_time": (
        {"accum_steps", "micro_batch", "quick", "results"},
        {
            "model",
            "mode",
            "rounds",
            "plain_ms",
            "keras_builtin_over_plain",
            "library_over_plain",
            "library_over_builtin",
        },
    ),
    "memory": (
        {"quick", "repeats", "setups"},
        {
            "model",
            "mode",
            "accum_steps",
            "trainable_parameters",
            "accumulators_mb",
            "allowed_1_10_accumulators_mb",
            "goal_1_10_met",
            "allocator_goal_1_10_met",
            "device",
            "results",
        },
    ),
    "memory_vs_batch": (
        {"model", "micro_batch", "effective_batches", "repeats", "headline", "results"},
        {"flavour", "effective_batch", "batch", "accum_steps", "peak_mb", "extra_mb"},
    ),
    "communication": (
        {"accum_steps", "replicas", "trainable_parameters", "rounds", "results", "embedding"},
        None,  # checked in the test: crashed configurations hold only "crashes"
    ),
    "normaliser_classes": (
        {"accum_steps", "micro_batch", "quick", "results"},
        {"mode", "memory", "two_over_one_class", "one_class_over_plain", "two_classes_over_plain"},
    ),
    "micro_batch": (
        {"quick", "parts", "results", "search"},
        {"model", "batch_size", "choices"},
    ),
    "accum_scaling": (
        {"micro_batch", "quick", "accum_steps", "results"},
        {
            "model",
            "mode",
            "accum_steps",
            "library_ms_per_micro_batch",
            "library_over_plain",
            "library_cpu_over_plain",
            "first_call_seconds",
            "program_operations",
            "peak_rss_growth_mb",
        },
    ),
    "coupled": (
        {"quick", "parts", "micro_batch", "accum_steps", "results", "quality"},
        {
            "accum_steps",
            "batch",
            "big_batch_ms_per_sample",
            "over_big_batch",
            "cpu_over_big_batch",
            "over_big_batch_quartiles",
            "memory",
            "rounds",
        },
    ),
    "compare_trees": (
        {"benchmark", "base", "rounds", "options", "quick", "results"},
        None,  # per configuration, per figure: this tree's, the base's, their difference
    ),
    "auto_micro_batch": (
        {"quick", "results"},
        {
            "settled_over_fixed",
            "settled_over_fixed_cpu",
            "settled_over_fixed_xla",
            "settled_over_fixed_xla_cpu",
            "settle_groups",
            "recover_groups",
        },
    ),
    "gpu_check": (
        {
            "quick",
            "jit_compile_asked",
            "xla",
            "xla_accepted",
            "xla_refusal",
            "factor",
            "updates",
            "simulated_limit",
            "versions",
            "results",
        },
        {
            "model",
            "name",
            "probes",
            "largest_plain_batch",
            "trainable_parameters",
            "plain",
            "auto",
            "builtin",
            "auto_over_plain",
            "builtin_over_plain",
        },
    ),
    "bn_overhead": (
        {"accum_steps", "widths", "micro_batch", "goal", "single_device", "mirrored"},
        {"mode", "accum_over_keras", "accumulate_only_over_keras", "update_step_over_keras"},
    ),
    "remat": (
        {"quick", "accum_steps", "setups", "results", "fits", "time", "goals"},
        {"model", "variant", "mode", "micro_batch", "tf_idle_mb", "tf_extra_mb", "over_none"},
    ),
}


def run_quick(name, out):
    return run_python(["-m", f"benchmarks.{name}", "--quick", "--out", str(out)], timeout=300)


def load_outputs(name, out):
    json_path, png_path = out / f"{name}_quick.json", out / f"{name}_quick.png"
    assert json_path.is_file(), sorted(p.name for p in out.iterdir())
    assert png_path.is_file() and png_path.stat().st_size > 1000
    payload = json.loads(json_path.read_text())
    assert payload["quick"] is True
    return payload


def entries(payload):
    results = payload["results"]
    return list(results.values()) if isinstance(results, dict) else results


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``quick(name)`` runs ``benchmarks.<name> --quick`` once per module: (stdout, JSON)."""
    runs = {}

    def run(name):
        if name == "gpu_check":
            skip_without("keras_hub", "kerashub")  # its GPT-2 model
        if name not in runs:
            out = tmp_path_factory.mktemp(name)
            stdout = run_quick(name, out)
            runs[name] = stdout, load_outputs(name, out)
        return runs[name]

    return run


def run_failing(args):
    """``python -m *args`` from the repository root, expected to fail: the completed process."""
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def test_device_gpu_without_a_gpu_fails_before_running_anything(tmp_path):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees a GPU here")
    result = run_failing(["benchmarks.step_time", "--quick", "--device", "gpu", "--out", tmp_path])
    assert result.returncode != 0
    assert "`--device gpu`: TensorFlow sees no GPU" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing measured on the CPU instead


@pytest.mark.parametrize("name", ["communication", "bn_overhead"])
def test_logical_cpu_benchmarks_refuse_device_gpu(tmp_path, name):
    result = run_failing([f"benchmarks.{name}", "--quick", "--device", "gpu", "--out", tmp_path])
    assert result.returncode == 2
    assert "`--device gpu` is not supported by this script" in result.stderr


@pytest.mark.parametrize("name", ["step_time", "memory"])
@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "dens"], "`--models`: unknown name 'dens'"),
        (["--modes", "xla"], "`--modes`: unknown name 'xla'"),
        (["--quick", "--modes", "jit"], "`--quick` runs its own tiny case"),
    ],
)
def test_a_part_that_cannot_run_is_refused(tmp_path, name, args, message):
    result = run_failing([f"benchmarks.{name}", *args, "--out", tmp_path])
    assert result.returncode == 2
    assert message in result.stderr


def test_every_benchmark_is_run_here():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(EXPECTED)


# ------------------------------------------------------------------------
# benchmarks.memory's plots: drawn from the saved figures, the table's numbers
# ------------------------------------------------------------------------

# One setup of a saved memory.json, as on docs/benchmarks.rst: configuration:
# (idle MiB, extra MiB). The goal line (plain b's peak + 53.5 MiB) passes
# just above two bars, where labels standing on them would cross it.
_MEMORY_FIGURES = {
    "plain k*b": (721.4, 3264.8),
    "library k x b": (733.0, 876.6),
    "built-in k x b": (721.2, 1063.1),
    "plain b": (720.6, 899.4),
}


def _memory_setup():
    results = {
        name: {"baseline_mb": idle, "extra_mb": extra, "peak_mb": idle + extra}
        for name, (idle, extra) in _MEMORY_FIGURES.items()
    }
    floor_peak = results["plain b"]["peak_mb"]
    for r in results.values():
        r["over_plain_b_per_accumulators"] = (r["peak_mb"] - floor_peak) / 8.5
    return {
        "accum_steps": 8,
        "micro_batch": 16,
        "allowed_over_plain_b_mb": 8.5 + 0.05 * results["plain b"]["extra_mb"],
        "results": results,
    }


def test_memory_ratio_is_that_of_the_shown_figures():
    from benchmarks.memory import shown_ratio

    # 876.6 / 899.4 = 0.9747 would show 0.97 beside "877" and "899"; 877 / 899 = 0.98.
    assert f"{shown_ratio(876.6, 899.4):.2f}" == "0.98"
    assert f"{shown_ratio(3264.8, 899.4):.2f}" == "3.63"
    assert f"{shown_ratio(899.4, 899.4):.2f}" == "1.00"


def test_memory_peaks_plot_labels_clear_the_goal_line():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.memory import plot_peaks

    setup = _memory_setup()
    # As benchmarks._common.save_plot draws it.
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    try:
        plot_peaks(ax, "mobilenetv2/graph", setup)
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        goal = setup["results"]["plain b"]["peak_mb"] + setup["allowed_over_plain_b_mb"]
        goal_y = ax.transData.transform((0, goal))[1]
        labels = {text.get_text(): text.get_window_extent(renderer) for text in ax.texts}
        assert set(labels) == {
            "+3265 MiB\n(3.63x plain b)",
            "+877 MiB\n(0.98x plain b)",
            "+1063 MiB\n(1.18x plain b)",
            "+899 MiB\n(1.00x plain b)",
        }
        for text, box in labels.items():
            assert not box.y0 <= goal_y <= box.y1, f"the goal line crosses {text!r}"
            assert ax.bbox.y0 < box.y0 and box.y1 < ax.bbox.y1, f"{text!r} is outside the axis"
        assert ax.get_ylabel() == "peak RSS (MiB)"
    finally:
        plt.close(fig)


def test_memory_plot_only_redraws_a_saved_run(tmp_path):
    saved = tmp_path / "memory.json"
    saved.write_text(json.dumps({"quick": False, "setups": {"mobilenetv2/graph": _memory_setup()}}))
    stdout = run_python(
        ["-m", "benchmarks.memory", "--plot-only", str(saved), "--out", str(tmp_path / "out")]
    )
    assert "wrote " in stdout
    written = {p.name: p.stat().st_size for p in (tmp_path / "out").iterdir()}
    assert set(written) == {"memory.png", "memory_mobilenetv2_graph.png"}
    assert min(written.values()) > 1000


def test_memory_plot_only_refuses_measuring_options(tmp_path):
    result = run_failing(["benchmarks.memory", "--plot-only", tmp_path / "memory.json", "--quick"])
    assert result.returncode == 2
    assert "`--plot-only` measures nothing: drop --quick." in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quick_run_writes_its_figures(quick, name):
    stdout, payload = quick(name)
    assert "wrote " in stdout
    top, per_entry = EXPECTED[name]
    assert top <= set(payload), top - set(payload)
    # What the figures were measured on (`--device`, default auto).
    assert payload["device"] in ("CPU:0", "GPU:0")
    assert payload["device_name"]
    if per_entry is None:
        return
    if name == "bn_overhead":
        results = payload["single_device"]
    elif name == "memory":
        results = list(payload["setups"].values())
    else:
        results = entries(payload)
    assert results
    for entry in results:
        assert per_entry <= set(entry), per_entry - set(entry)


@pytest.mark.slow
def test_bn_overhead_reports_the_mirrored_comparison(quick):
    _, payload = quick("bn_overhead")
    mirrored = payload["mirrored"]
    assert mirrored["replicas"] == 2
    assert set(mirrored["synchronized_over_not"]) == {"keras_bn", "accum_bn"}
    assert set(mirrored["accum_over_keras"]) == {"False", "True"}


@pytest.mark.slow
def test_communication_counts_reductions_and_reports_the_builtin_crash(quick):
    stdout, payload = quick("communication")
    results = payload["results"]
    k = payload["accum_steps"]
    gradient_bytes = 4 * payload["trainable_parameters"]
    # Counted, so exact even in --quick: over k micro-batches plain Keras
    # all-reduces k times, the library once (the float32 sums and the weight
    # sum, batched), and reduce_every_micro_step k times.
    if KERAS_VERSION >= (3, 5):  # Keras 3.3 and 3.4 do not all-reduce at all.
        assert results["plain"]["reductions"] == k
        assert results["plain"]["bytes"] == k * gradient_bytes
    assert results["library"]["reductions"] == 1
    assert results["library"]["updates"] == 1
    assert results["library"]["bytes"] == gradient_bytes + 4
    assert results["library_every_micro_step"]["reductions"] == k
    for name in ("plain", "library", "library_every_micro_step"):
        assert results[name]["ms_per_k_micro_batches"] > 0
        assert results[name]["time_over_plain"] > 0
    # The embedding model: one reduction per update of the dense float32 sum
    # of every variable, the whole table included (4 bytes per entry), and
    # the weight sum, whatever rows the micro-batches touched.
    embedding = payload["embedding"]
    assert embedding["updates"] == 1
    assert embedding["reductions"] == 1
    assert embedding["bytes"] == 4 * embedding["trainable_parameters"] + 4
    # Unsynchronized AccumBatchNormalization: the replicas' pending statistics
    # (replicas x 4 x channels per layer) ride in the same single reduction.
    batchnorm = payload["batchnorm"]
    assert batchnorm["updates"] == 1
    assert batchnorm["reductions"] == 1
    assert batchnorm["bytes"] == batchnorm["gradient_bytes"] + batchnorm["statistics_bytes"]
    assert batchnorm["statistics_bytes"] == 4 * 2 * 4 * sum(batchnorm["channels"])
    assert embedding["table_bytes"] == 4 * embedding["vocabulary"] * embedding["dim"]
    assert embedding["rows_touched_per_update"] < embedding["vocabulary"]
    assert 0 < embedding["indexed_slices_bytes_per_micro_batch"] < embedding["table_bytes"]
    # Keras's built-in accumulation: crashes with keras-team/keras issue
    # 20582's error, or, once Keras fixes it, trains; recorded, not required.
    builtin = results["keras_builtin"]
    if "crashes" in builtin:
        assert set(builtin) == {"crashes"}
        assert "merge_call" in builtin["crashes"]
        assert "crashes" in stdout
    else:
        assert builtin["updates"] == 1, builtin
        warnings.warn(
            "keras-team/keras issue 20582 looks fixed: Keras's built-in accumulation "
            "trains under MirroredStrategy; update the benchmarks page.",
            stacklevel=1,
        )


@pytest.mark.slow
def test_gpu_check_falls_back_from_a_stated_batch_that_does_not_fit(quick):
    # Quick: the simulated limit (8 samples) refuses at once, so every step is exact.
    _, payload = quick("gpu_check")
    assert payload["simulated_limit"] == 8 and payload["factor"] == 4
    assert payload["versions"]["tensorflow"] and payload["versions"]["keras"]
    # XLA: refused by the mode (the refusal recorded), or accepted and, under
    # the simulated limit, which XLA cannot compile, not used.
    assert payload["xla"] is False
    assert (payload["xla_refusal"] is None) == payload["xla_accepted"]
    for entry in payload["results"]:
        assert [(p["batch"], p["fits"]) for p in entry["probes"]] == [(8, True), (16, False)]
        assert entry["largest_plain_batch"] == 8
        auto = entry["auto"]
        assert auto["batch"] == 32 and auto["micro_batch"] == 8
        assert [(c["update"], c["old"], c["new"]) for c in auto["changes"]] == [
            (0, 32, 16),
            (0, 16, 8),
        ]
        assert auto["history_micro_batch_size"] == [8, 8]
        assert entry["builtin"]["micro_batch"] == 8 and entry["builtin"]["accum_steps"] == 4
        for run in (entry["plain"], auto, entry["builtin"]):
            assert run["seconds_per_sample"] > 0


def test_fit_time_times_noise_scale_beside_the_library(tmp_path):
    stdout = run_python(
        ["-m", "benchmarks.fit_time", "--quick", "--noise-scale", "--out", str(tmp_path)],
        timeout=300,
    )
    assert "noise_scale=True over the library" in stdout
    payload = load_outputs("fit_time", tmp_path)
    for entry in payload["results"]:
        assert entry["noise_scale_over_library"] > 0
        assert entry["noise_scale_cpu_over_library"] > 0
        assert entry["noise_scale_last_over_library"] > 0
        assert entry["noise_scale_last_every_cpu_over_library"] > 0
        assert entry["noise_scale_every"] == 4


@pytest.mark.slow
def test_compare_trees_reports_each_tree_s_figures(quick):
    # Quick: this tree against itself, one run each; the figures of both.
    _, payload = quick("compare_trees")
    assert payload["benchmark"] == "fit_time" and payload["results"]
    for entry in payload["results"].values():
        assert set(entry) == {"library_cpu_over_plain", "library_over_plain"}
        for values in entry.values():
            assert values["difference"] == pytest.approx(values["this_tree"] - values["base"])
