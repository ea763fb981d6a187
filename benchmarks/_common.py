"""Shared benchmark plumbing: arguments, models, side-by-side repeats, fresh processes, output.

Every script compares configurations *in the same run* on the same model,
data, seed and step count, alternating them round after round (the starting
configuration rotates, so none always runs first), and reports medians over
rounds of per-round ratios: on a shared, noisy machine absolute times move
with the load of others, ratios taken side by side much less.

Nothing here imports TensorFlow at module level, so that a parent process that
only starts fresh children (the memory scripts) stays small.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent

# The three ways of training compared everywhere.
PLAIN = "plain"
KERAS_BUILTIN = "keras_builtin"
LIBRARY = "library"
LABELS = {
    PLAIN: "plain Keras",
    KERAS_BUILTIN: "Keras built-in",
    LIBRARY: "gradient_accumulator",
}

MIB = 1024 * 1024


# Which device the benchmarks train on: set by `--device`, read by the
# process and inherited by its fresh children.
DEVICE_ENV = "GRADIENT_ACCUMULATOR_BENCHMARK_DEVICE"
DEVICES = ("auto", "cpu", "gpu")


class _Parser(argparse.ArgumentParser):
    def parse_args(self, *args, **kwargs):
        parsed = super().parse_args(*args, **kwargs)
        choose_device(parsed.device)
        if parsed.device == "gpu":
            training_device()  # no GPU: fails now, before anything runs on the CPU
        return parsed


def parser(description, cpu_only=None):
    """The scripts' common arguments: ``--quick``, ``--out``, ``--device``.

    Args:
        cpu_only: ``None``, or why the script measures on the CPU only (e.g.
            it splits the CPU into logical devices): ``--device`` then takes
            ``cpu`` only (``auto`` meaning it), and refuses ``gpu`` saying why.
    """
    p = _Parser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for CI (figures meaningless)")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON and PNG files")
    if cpu_only is None:
        p.add_argument(
            "--device",
            choices=DEVICES,
            default="auto",
            help="train on the CPU, on the first GPU, or (auto) on a GPU if TensorFlow sees one",
        )
    else:
        p.add_argument(
            "--device",
            type=lambda value: _cpu_device(value, cpu_only),
            default="cpu",
            help=f"cpu only: {cpu_only}",
        )
    return p


MODES = ("graph", "jit")


def add_parts(p, models, default_models=None):
    """``--models`` and ``--modes``: the part of a script's setups to run."""
    names = ",".join(models)
    p.add_argument("--models", default=default_models or names, help=f"comma-separated: {names}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {','.join(MODES)}")


def chosen_parts(p, args, models):
    """The ``(models, modes)`` asked for, each name checked; ``--quick`` takes neither.

    ``--quick`` runs the script's own tiny case: a part asked for beside it
    is refused rather than silently not run.
    """
    asked = {
        "--models": (args.models.split(","), models),
        "--modes": (args.modes.split(","), MODES),
    }
    for option, (names, known) in asked.items():
        for name in names:
            if name not in known:
                p.error(f"`{option}`: unknown name {name!r}; the names are {', '.join(known)}")
    if args.quick and (
        args.models != p.get_default("models") or args.modes != p.get_default("modes")
    ):
        p.error("`--quick` runs its own tiny case: drop `--models` and `--modes`.")
    return asked["--models"][0], asked["--modes"][0]


def _cpu_device(value, why):
    if value not in ("auto", "cpu"):
        raise argparse.ArgumentTypeError(
            f"`--device {value}` is not supported by this script: {why}; it runs on the CPU."
        )
    return "cpu"


def choose_device(device):
    """Makes ``device`` (one of :data:`DEVICES`) the one this process and its children train on.

    Call before TensorFlow starts its devices. ``"cpu"`` hides the GPUs from
    TensorFlow (``CUDA_VISIBLE_DEVICES=-1``); ``"gpu"`` requires one
    (:func:`training_device` fails otherwise); ``"auto"`` takes what
    TensorFlow sees.
    """
    if device not in DEVICES:
        raise ValueError(f"`--device` must be one of {DEVICES}, got {device!r}.")
    os.environ[DEVICE_ENV] = device
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"


def training_device():
    """The device the benchmarks train on: ``"GPU:0"`` or ``"CPU:0"``.

    TensorFlow places ops on its first GPU when it sees one, so this is where
    they run; ``--device gpu`` without a GPU is an error, not a silent CPU run.
    """
    import tensorflow as tf

    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    if os.environ.get(DEVICE_ENV) == "gpu" and not has_gpu:
        sys.exit(
            "`--device gpu`: TensorFlow sees no GPU "
            "(`tf.config.list_physical_devices('GPU')` is empty); "
            "use `--device cpu` or install a GPU build of TensorFlow."
        )
    return "GPU:0" if has_gpu else "CPU:0"


def cpu_name():
    """The CPU's name: ``/proc/cpuinfo``'s first ``model name``, else ``"CPU"``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def device_description():
    """What the figures were measured on, for the output: device and its name."""
    import tensorflow as tf

    device = training_device()
    if device == "CPU:0":
        return {"device": device, "device_name": f"{cpu_name()} ({os.cpu_count()} logical cores)"}
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    return {"device": device, "device_name": details.get("device_name", "GPU")}


# --- side by side -------------------------------------------------------------


def alternate(configurations, run_once, repeats):
    """Runs ``run_once(config)`` for every configuration in turn, ``repeats`` rounds.

    Alternating rounds spreads the machine's noise over all configurations, so
    that ratios taken within a round compare like with like. Round ``r``
    starts with configuration ``r mod n``, so that no configuration always
    runs first (just after another one's different memory traffic).

    Returns:
        ``{name: [value per round]}``, rounds in order.
    """
    names = list(configurations)
    values = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            values[name].append(run_once(configurations[name]))
    return values


def median(values):
    return statistics.median(values)


def median_ratio(numerators, denominators):
    """Median over rounds of the per-round ratio."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def ratio_quartiles(numerators, denominators):
    """``[25th, 75th]`` percentiles over rounds of the per-round ratio: the noise."""
    ratios = [a / b for a, b in zip(numerators, denominators)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return [q1, q3]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- models -------------------------------------------------------------------
# Builders return ``(inputs, outputs)`` of fresh layers; the seed makes every
# configuration start from identical weights.


def dense_model(features=256, width=512, classes=10, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    hidden = keras.layers.Dense(width, activation="relu")(hidden)
    outputs = keras.layers.Dense(classes, activation="softmax")(hidden)
    return inputs, outputs


def mobilenetv2(size, alpha, classes=10, seed=0):
    """MobileNetV2 from scratch (``weights=None``: nothing is downloaded)."""
    import keras

    keras.utils.set_random_seed(seed)
    base = keras.applications.MobileNetV2(
        input_shape=(size, size, 3), alpha=alpha, weights=None, classes=classes
    )
    return base.input, base.output


def compiled(flavour, inputs, outputs, accum_steps, jit_compile=False, model_kwargs=None):
    """``flavour`` in (PLAIN, KERAS_BUILTIN, LIBRARY), compiled with Adam(1e-3).

    PLAIN: ``keras.Model`` (one update per batch). KERAS_BUILTIN: ``keras.Model``
    with ``Adam(gradient_accumulation_steps=accum_steps)``. LIBRARY:
    ``GradientAccumulateModel(accum_steps=accum_steps, **model_kwargs)``.
    """
    import keras

    from gradient_accumulator import GradientAccumulateModel

    if flavour == LIBRARY:
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=outputs, **(model_kwargs or {})
        )
        optimizer = keras.optimizers.Adam(1e-3)
    elif flavour in (PLAIN, KERAS_BUILTIN):
        model = keras.Model(inputs, outputs)
        steps = accum_steps if flavour == KERAS_BUILTIN else None
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps)
    else:
        raise ValueError(f"Unknown flavour {flavour!r}")
    model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=jit_compile)
    return model


def classification_data(samples, shape, classes=10, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, classes, size=(samples,)).astype("int32")
    return x, y


def trainable_parameters(model):
    import numpy as np

    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


# --- timing train steps -------------------------------------------------------


def batches(x, y, batch_size):
    """``(x, y)`` as a dataset of batches (the last one may be short), in order."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def repeating_iterator(x, y, batch_size, strategy=None):
    """An endless iterator over ``batches(x, y, batch_size)``, the same order for every caller.

    Its elements have the signature of ``fit(batches(...))``'s, so a train
    function traced by that ``fit`` runs on it without tracing again.
    """
    dataset = batches(x, y, batch_size).repeat().prefetch(2)
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)
    return iter(dataset)


def time_calls(train_function, iterator, calls):
    """Times ``calls`` successive train-function calls one by one.

    Returns:
        ``(wall seconds per call, process CPU seconds over all calls)``. A
        graph or XLA train function returns once its step has run, so each
        wall time is that step's.
    """
    walls = []
    cpu = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        train_function(iterator)
        walls.append(time.perf_counter() - start)
    return walls, time.process_time() - cpu


def step_times(models, x, y, batch_size, accum_steps, rounds, groups, strategy=None):
    """Times every model's micro-steps side by side; the core of the timing scripts.

    Each model is warmed up first (excluded): a ``fit`` on ``(x, y)``, which
    must hold a whole number of groups of ``accum_steps`` batches (it traces),
    then two groups of calls on an endless iterator over the same batches.
    Then the models take turns (see
    :func:`alternate`), each running ``groups`` whole groups of
    ``train_function`` calls per round, every call timed.

    Returns:
        ``{name: {"wall": [mean seconds per micro-step, per round], "cpu":
        [process CPU seconds per micro-step, per round], "by_position":
        [median seconds of the i-th micro-step of a group, i < accum_steps]}}``.
        With accumulation, positions ``0 .. k-2`` only accumulate and ``k-1``
        is the update step.
    """
    if len(x) % (accum_steps * batch_size):
        raise ValueError("`x` must hold a whole number of groups of batches.")
    iterators = {}
    for name, model in models.items():
        model.fit(batches(x, y, batch_size), epochs=1, shuffle=False, verbose=0)
        iterators[name] = repeating_iterator(x, y, batch_size, strategy)
        time_calls(model.train_function, iterators[name], 2 * accum_steps)
    calls = groups * accum_steps
    raw = alternate(
        {name: name for name in models},
        lambda name: time_calls(models[name].train_function, iterators[name], calls),
        rounds,
    )
    results = {}
    for name, runs in raw.items():
        walls = [w for ws, _ in runs for w in ws]
        results[name] = {
            "wall": [statistics.fmean(ws) for ws, _ in runs],
            "cpu": [c / calls for _, c in runs],
            "by_position": [statistics.median(walls[i::accum_steps]) for i in range(accum_steps)],
        }
    return results


# --- fresh processes and memory -----------------------------------------------


def logical_cpus(count):
    """Splits the CPU into ``count`` logical devices; call before TensorFlow starts."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )


def start_child(module, config):
    """Starts ``python -m <module> --child '<json>'`` from the repository root.

    Returns:
        A handle for :func:`child_result`.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--child", json.dumps(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
    )
    return process, module, config


def child_result(handle, timeout=1800):
    """Waits for a child; returns the JSON it printed on its last line of stdout."""
    process, module, config = handle
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    if process.returncode != 0:
        raise RuntimeError(
            f"`python -m {module} --child` failed ({process.returncode}) for {config}:\n"
            f"{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(module, config, timeout=1800):
    """Runs ``python -m <module> --child '<json>'`` to completion; returns its JSON result."""
    return child_result(start_child(module, config), timeout=timeout)


def _status_kb(field):
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1))


def rss_mb():
    """This process's resident set size now, MiB."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb():
    """This process's peak resident set size since the last :func:`reset_peak_rss`, MiB."""
    return _status_kb("VmHWM") / 1024


def reset_peak_rss():
    """Resets the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# --- output -------------------------------------------------------------------


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    sys.stdout.flush()


def save(out, name, payload, plot=None):
    """Writes ``<out>/<name>.json`` and, if ``plot`` is given, ``<out>/<name>.png``.

    ``plot(ax)`` draws on a matplotlib axis (see :func:`save_plot`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**payload, **device_description()}  # what the figures were measured on
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    paths = [out / f"{name}.json"]
    if plot is not None:
        paths.append(save_plot(out, name, plot))
    print("\nwrote " + ", ".join(str(p) for p in paths))


def save_plot(out, name, plot):
    """Draws ``plot(ax)`` on a new figure and writes it to ``<out>/<name>.png``; returns the path.

    Needs no TensorFlow: a script can redraw its plots from a saved JSON file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    plot(ax)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png")
    plt.close(fig)
    return out / f"{name}.png"
