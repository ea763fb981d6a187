"""What ``micro_batch_size="auto"`` does on a GPU where the stated batch does not fit.

One command, under 8 minutes on one GPU (a budget, not measured here: the
project's machines have no GPU; see "Sizes" below). For each model:

- **largest plain batch**: plain Keras (``keras.Model``, AdamW) trained at a
  start batch, doubled while it fits (halved while it does not), each try in
  a fresh process, so that an out-of-memory error does not poison the next
  try; a try that raises ``ResourceExhaustedError``, or whose process fails
  (a GPU library's allocation failure), does not fit;
- **plain**: that largest batch's time per sample and the device's peak
  memory, from the try that found it (two steps of warm-up, then timed
  steps);
- **auto**: ``GradientAccumulateModel(micro_batch_size="auto")`` at a stated
  batch ``--factor`` (4) times the largest plain batch, which does not fit:
  the first ``fit`` of one update settles (the micro-batch chosen, the
  fall-backs of ``model.micro_batch_changes``, its seconds), then
  ``--updates`` (3) updates are timed: time per sample and peak memory once
  settled, and History's ``micro_batch_size``;
- **built-in**: Keras's own accumulation,
  ``AdamW(gradient_accumulation_steps=k)``, at the micro-batch the mode chose
  and ``k`` = stated batch / micro-batch, the same samples per update:
  one update of warm-up, then ``--updates`` timed.

Each run is a fresh process (forked from a server that has imported
TensorFlow and initialised no device: its devices and allocator are its
own, without the imports' seconds); the peak is TensorFlow's allocator's
(``tf.config.experimental.get_memory_info(device)["peak"]`` after
``reset_memory_stats``, at the end of the warm-up: the timed steps' peak), in
MiB. All three use AdamW(1e-4) and the same seed. Models: ResNet-50
(``keras.applications.ResNet50(weights=None)``, 224x224x3, 1000 classes) and
a GPT-2-small sized causal LM built from its configuration with keras_hub
(``GPT2Backbone``: vocabulary 50257, 12 layers, 12 heads, hidden 768,
intermediate 3072; ``GPT2CausalLM(preprocessor=None)``, sequences of 512
tokens), trained on synthetic data (a pool of samples, repeated), nothing
downloaded.

``--jit-compile auto`` (the default) trains under XLA if the mode accepts
``jit_compile=True`` (a tiny model in the mode, compiled with it, is fitted
once on the device; the library refuses it with a ``ValueError`` when
training starts) and in graph mode otherwise, recording ``"xla": false`` and
the refusal; ``on`` requires XLA (a refusal stops the run before it
measures), ``off`` is graph mode. All three ways of training use the mode
decided.

Sizes: start batches 64 (ResNet-50) and 4 (GPT-2), at most 4096 and 512,
float32. The 8 minutes are an estimate, not a measurement: on a 16-80 GB GPU
the doubling should take two to five tries per model, each a process of
perhaps 20-40 s (build, tracing, a few steps), then the "auto" and built-in
runs, whose fall-backs each add TensorFlow's allocator wait (about 10 s).
``--models``, ``--factor`` and ``--updates`` trim a run.

``--quick`` (for CI, on the CPU, figures meaningless): tiny models named as
such (a small residual convolutional net standing in for ResNet-50, 32x32x3,
10 classes; a GPT-2 backbone of 2 layers, hidden 64, vocabulary 1000,
sequences of 32), and a simulated memory limit instead of a real one: a
layer on the outputs raises ``ResourceExhaustedError`` at once above 8
samples (``benchmarks.auto_micro_batch``'s; a real error on a capped CPU
allocator waits 10 s per failed try). The two models' processes run side by
side. ``--cap-mib N`` instead caps oneDNN's CPU allocator at ``N`` MiB
(``TF_ENABLE_ONEDNN_OPTS=1``, ``TF_MKL_ALLOC_MAX_BYTES``) for real
out-of-memory errors on a CPU (the simulated limit is then left out): slow
(each failed try waits 10 s; ``--quick --cap-mib 4 --models gpt2``: 2
fall-backs, 95 s on 2 shared cores) and fragile: with TensorFlow 2.21 the
small CNN's process crashes (segmentation fault) at batch 32 under a 10 MiB
cap instead of raising (plain Keras as well), which counts as a try that
does not fit but ends the "auto" run.

Run: ``python -m benchmarks.gpu_check`` (``--device gpu`` to refuse a
machine without one). Prints a table and writes ``gpu_check.json`` (the
device's name, TensorFlow's and Keras's versions, every figure) and
``gpu_check.png``.
"""

import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import sys
import tempfile
import threading
import time
import traceback

from benchmarks._common import (
    MIB,
    device_description,
    print_table,
    save,
    training_device,
)
from benchmarks._common import (
    parser as common_parser,
)

MODELS = ("resnet50", "gpt2")
JIT_CHOICES = ("auto", "on", "off")
LEARNING_RATE = 1e-4
POOL = 64  # synthetic samples, repeated

FULL = {
    "resnet50": {"start": 64, "max": 4096, "image": 224, "classes": 1000},
    "gpt2": {
        "start": 4,
        "max": 512,
        "vocabulary": 50257,
        "layers": 12,
        "heads": 12,
        "hidden": 768,
        "intermediate": 3072,
        "sequence": 512,
    },
}
QUICK = {
    "resnet50": {"start": 8, "max": 64, "image": 32, "classes": 10, "stand_in": True},
    "gpt2": {
        "start": 8,
        "max": 64,
        "vocabulary": 1000,
        "layers": 2,
        "heads": 2,
        "hidden": 64,
        "intermediate": 128,
        "sequence": 32,
    },
}
QUICK_LIMIT = 8  # samples: the simulated memory limit of --quick
PLAIN_STEPS = 5  # timed steps of each plain try that fits (2 in --quick)
UPDATES = 3
QUICK_UPDATES = 1
FACTOR = 4

NAMES = {"resnet50": "ResNet-50", "gpt2": "GPT-2 small"}
QUICK_NAMES = {"resnet50": "small residual CNN (stand-in for ResNet-50)", "gpt2": "tiny GPT-2"}


# --- in the child processes ---------------------------------------------------


def describe(model, setup):
    if model == "resnet50":
        s = setup["image"]
        kind = "small residual CNN" if setup.get("stand_in") else "ResNet-50"
        return f"{kind}, {s}x{s}x3, {setup['classes']} classes"
    return (
        f"GPT-2: {setup['layers']} layers, {setup['heads']} heads, hidden {setup['hidden']}, "
        f"intermediate {setup['intermediate']}, vocabulary {setup['vocabulary']}, "
        f"sequences of {setup['sequence']}"
    )


def small_resnet(setup):
    """The stand-in for ResNet-50 in ``--quick``: a stem and two residual blocks."""
    import keras

    s = setup["image"]
    inputs = keras.Input((s, s, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(x))
    for _ in range(2):
        y = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
        y = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(y))
        y = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(setup["classes"], activation="softmax")(x)


def network(model, setup, limit):
    """``(inputs, outputs, loss)`` of fresh layers, seeded; ``limit``: the simulated one."""
    import keras

    keras.utils.set_random_seed(0)
    if model == "resnet50":
        if setup.get("stand_in"):
            inputs, outputs = small_resnet(setup)
        else:
            s = setup["image"]
            base = keras.applications.ResNet50(
                weights=None, input_shape=(s, s, 3), classes=setup["classes"]
            )
            inputs, outputs = base.input, base.output
        loss = keras.losses.SparseCategoricalCrossentropy()
    else:
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=setup["vocabulary"],
            num_layers=setup["layers"],
            num_heads=setup["heads"],
            hidden_dim=setup["hidden"],
            intermediate_dim=setup["intermediate"],
            max_sequence_length=setup["sequence"],
        )
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        inputs, outputs = lm.input, lm.output  # the logits
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if limit:
        from benchmarks.auto_micro_batch import out_of_memory_above

        outputs = out_of_memory_above(limit)(outputs)
    return inputs, outputs, loss


def dataset(model, setup, batch, steps):
    """``steps`` batches of ``batch`` synthetic samples (a pool of :data:`POOL`, repeated)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if model == "resnet50":
        s = setup["image"]
        x = rng.normal(size=(POOL, s, s, 3)).astype("float32")
        y = rng.integers(0, setup["classes"], size=(POOL,)).astype("int32")
    else:
        tokens = rng.integers(0, setup["vocabulary"], size=(POOL, setup["sequence"] + 1))
        tokens = tokens.astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
        y = tokens[:, 1:]
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return data.batch(batch, drop_remainder=True).take(steps).prefetch(2)


def build(config, flavour, jit_compile, accumulation_steps=None):
    import keras

    from gradient_accumulator import GradientAccumulateModel

    inputs, outputs, loss = network(config["model"], config["setup"], config["limit"])
    if flavour == "auto":
        model = GradientAccumulateModel(micro_batch_size="auto", inputs=inputs, outputs=outputs)
    else:
        model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.AdamW(
        LEARNING_RATE, gradient_accumulation_steps=accumulation_steps
    )
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    return model


def _reason(error):
    """The line of an error that says what ran out (TensorFlow's "OOM when ..."), shortened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "OOM" in line or "out of memory" in line.lower():
            return line[:300]
    return (lines[-1] if lines else type(error).__name__)[:300]


class Peak:
    """The device allocator's peak since :meth:`reset`, in MiB (``None`` if not reported)."""

    def __init__(self):
        self.device = training_device()

    def reset(self):
        import tensorflow as tf

        try:
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, tf.errors.OpError):
            pass

    def mib(self):
        import tensorflow as tf

        try:
            return tf.config.experimental.get_memory_info(self.device)["peak"] / MIB
        except (ValueError, tf.errors.OpError):
            return None


def timed_fit(model, data, samples, peak):
    """``fit`` once on ``data`` (``samples`` in all), peak reset first: seconds per sample, MiB."""
    peak.reset()
    start = time.perf_counter()
    history = model.fit(data, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    return {"seconds_per_sample": seconds / samples, "peak_mib": peak.mib()}, history


def trainable_parameters(model):
    import numpy as np

    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def child_plain(config):
    """One try of plain Keras at ``batch``: fits or not; if it fits, its time and peak."""
    import tensorflow as tf

    model_name, setup, batch = config["model"], config["setup"], config["batch"]
    peak = Peak()
    model = build(config, "plain", config["jit_compile"])
    try:
        model.fit(dataset(model_name, setup, batch, 2), epochs=1, verbose=0)  # traces
        steps = config["steps"]
        figures, _ = timed_fit(model, dataset(model_name, setup, batch, steps), steps * batch, peak)
    except tf.errors.ResourceExhaustedError as error:
        return {"batch": batch, "fits": False, "reason": _reason(error)}
    return {
        "batch": batch,
        "fits": True,
        **figures,
        "trainable_parameters": trainable_parameters(model),
    }


def child_auto(config):
    """The mode at the stated ``batch``: what it settles on, then its time and peak."""
    model_name, setup, batch, updates = (
        config["model"],
        config["setup"],
        config["batch"],
        config["updates"],
    )
    peak = Peak()
    model = build(config, "auto", config["jit_compile"])
    start = time.perf_counter()
    first = model.fit(dataset(model_name, setup, batch, 1), epochs=1, verbose=0)
    first_seconds = time.perf_counter() - start
    settled = model.micro_batch_changes[:]
    figures, history = timed_fit(
        model, dataset(model_name, setup, batch, updates), updates * batch, peak
    )
    return {
        "batch": batch,
        "micro_batch": int(history.history["micro_batch_size"][-1]),
        "changes": [
            {"update": c.update, "old": c.old, "new": c.new, "reason": c.reason[:300]}
            for c in settled
        ],
        "changes_after_settling": len(model.micro_batch_changes) - len(settled),
        "history_micro_batch_size": [
            int(v) for v in first.history["micro_batch_size"] + history.history["micro_batch_size"]
        ],
        "first_fit_seconds": first_seconds,
        **figures,
    }


def child_builtin(config):
    """Keras's ``gradient_accumulation_steps`` at the micro-batch the mode chose."""
    model_name, setup = config["model"], config["setup"]
    micro, k, updates = config["micro_batch"], config["accum_steps"], config["updates"]
    peak = Peak()
    model = build(config, "builtin", config["jit_compile"], accumulation_steps=k)
    model.fit(dataset(model_name, setup, micro, k), epochs=1, verbose=0)  # one update, traced
    figures, _ = timed_fit(
        model, dataset(model_name, setup, micro, updates * k), updates * k * micro, peak
    )
    return {"micro_batch": micro, "accum_steps": k, **figures}


def xla_check():
    """Whether the mode accepts ``jit_compile=True`` here: ``(accepted, refusal)``.

    A tiny model in the mode, compiled with it, fitted once; the library
    refuses it (a ``ValueError`` naming ``micro_batch_size='auto'`` and
    ``jit_compile``) when training starts.
    """
    import keras
    import numpy as np

    from gradient_accumulator import GradientAccumulateModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = GradientAccumulateModel(
        micro_batch_size="auto", inputs=inputs, outputs=keras.layers.Dense(1)(inputs)
    )
    model.compile(optimizer=keras.optimizers.AdamW(LEARNING_RATE), loss="mse", jit_compile=True)
    x = np.ones((4, 4), "float32")
    try:
        model.fit(x, x[:, :1], batch_size=4, verbose=0)
    except ValueError as error:
        message = str(error)
        if "micro_batch_size='auto'" in message and "jit_compile" in message:
            return False, message
        raise
    return True, None


def child(config):
    task = config["task"]
    if task == "xla_check":
        accepted, refusal = xla_check()
        return {"accepted": accepted, "refusal": refusal}
    return {"plain": child_plain, "auto": child_auto, "builtin": child_builtin}[task](config)


# --- in the parent ------------------------------------------------------------


_PRELOAD = [
    "tensorflow",
    "keras",
    "keras_hub",
    "gradient_accumulator",
    "benchmarks.auto_micro_batch",
]
_forkserver = None


def _processes():
    """The multiprocessing context whose children are forked from a server that imported TensorFlow.

    The server, a process of its own started on first use with this
    process's environment, imports TensorFlow, Keras, keras_hub and the
    package, which initialises no device (as ``tests/scripts/_host.py``
    does): each child is still a fresh process for TensorFlow (its devices,
    its allocator, nothing of an earlier out-of-memory error), without the
    imports' seconds.
    """
    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(_PRELOAD)
        multiprocessing.forkserver.ensure_running()  # imports while this process goes on
    return _forkserver


def _child_main(config, connection, log):
    """In the child: its outputs into ``log``; sends ``("ok", result)`` or ``("error", line)``."""
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    try:
        connection.send(("ok", child(config)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, whatever it is
        traceback.print_exc()
        connection.send(("error", f"{type(error).__name__}: {_reason(error)}"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_fresh(config, timeout=1800):
    """Runs ``config`` in a fresh process: ``(result, None)``, or ``(None, error line)``.

    A process that dies (a GPU library's allocation failure can abort it)
    reports its exit code and the last line it wrote.
    """
    processes = _processes()
    receive, send = processes.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "child.log")
        process = processes.Process(target=_child_main, args=(config, send, log), daemon=True)
        process.start()
        send.close()
        reply = None
        try:
            if not receive.poll(timeout):
                process.kill()
                process.join()
                raise TimeoutError(f"{config['task']} ran longer than {timeout} s: {config}")
            reply = receive.recv()
        except EOFError:  # it died without a reply
            pass
        process.join()
        if reply is not None:  # a result, or the error that ended the child
            return (reply[1], None) if reply[0] == "ok" else (None, reply[1])
        lines = []
        if os.path.exists(log):  # not if it died before its first line
            with open(log, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
    oom = [line for line in lines if "OOM" in line or "out of memory" in line.lower()]
    last = (oom or lines or ["no output"])[-1][:300]
    return None, f"the process ended with exit code {process.exitcode}: {last}"


def say(model, text):
    print(f"[{time.strftime('%H:%M:%S')}] {model}: {text}", flush=True)


def largest_plain_batch(base, setup, steps):
    """Doubles the batch from the start while it fits, or halves it while it does not.

    Returns:
        ``(probes, fitting, failed)``: every try's result, the largest that
        fits (``None`` if none down to 1 does), and whether any failed (if
        not, the doubling stopped at the setup's ``max``).
    """
    probes, batch, fitting, failed = [], setup["start"], None, False
    while 1 <= batch <= setup["max"]:
        start = time.perf_counter()
        result, error = run_fresh({**base, "task": "plain", "batch": batch, "steps": steps})
        if result is None:
            result = {"batch": batch, "fits": False, "reason": error}
        result["process_seconds"] = time.perf_counter() - start
        probes.append(result)
        if result["fits"]:
            ms = 1000 * result["seconds_per_sample"]
            say(base["model"], f"plain batch {batch} fits ({ms:.3f} ms/sample)")
            fitting = result
            if failed:
                break  # halved down from a failure: the largest
            batch *= 2
        else:
            say(base["model"], f"plain batch {batch} does not fit: {result['reason']}")
            failed = True
            if fitting is not None:
                break  # doubled up from a fit: the one before is the largest
            batch //= 2
    return probes, fitting, failed


def check_model(model, setup, args, jit_compile, limit):
    """Every figure of one model (the parent's side: fresh processes in turn)."""
    base = {"model": model, "setup": setup, "jit_compile": jit_compile, "limit": limit}
    quick = args.quick
    record = {
        "model": model,
        "name": (QUICK_NAMES if quick else NAMES)[model],
        "description": describe(model, setup),
    }
    started = time.perf_counter()
    probes, plain, failed = largest_plain_batch(base, setup, 2 if quick else PLAIN_STEPS)
    record["probes"] = probes
    if plain is None:
        record["error"] = "no batch of plain Keras fits, down to 1"
        return record
    largest = plain["batch"]
    record.update(
        largest_plain_batch=largest,
        largest_plain_batch_is_the_cap=not failed,
        trainable_parameters=plain["trainable_parameters"],
        plain={"batch": largest, **{k: plain[k] for k in ("seconds_per_sample", "peak_mib")}},
    )
    stated = args.factor * largest
    say(model, f"micro_batch_size='auto' at stated batch {stated}")
    auto, error = run_fresh({**base, "task": "auto", "batch": stated, "updates": args.updates})
    if auto is None:
        record["auto"] = {"batch": stated, "error": error}
        say(model, f"auto failed: {error}")
        return record
    record["auto"] = auto
    per_sample = plain["seconds_per_sample"]
    record["auto_over_plain"] = auto["seconds_per_sample"] / per_sample
    say(
        model,
        f"auto settled at micro-batch {auto['micro_batch']} after "
        f"{len(auto['changes'])} fall-back(s) "
        f"({1000 * auto['seconds_per_sample']:.2f} ms/sample)",
    )
    micro = auto["micro_batch"]
    k = stated // micro
    say(model, f"Keras built-in accumulation: micro-batch {micro}, {k} steps")
    builtin, error = run_fresh(
        {**base, "task": "builtin", "micro_batch": micro, "accum_steps": k, "updates": args.updates}
    )
    record["builtin"] = builtin if builtin is not None else {"micro_batch": micro, "error": error}
    if builtin is not None:
        record["builtin_over_plain"] = builtin["seconds_per_sample"] / per_sample
        record["auto_over_builtin"] = auto["seconds_per_sample"] / builtin["seconds_per_sample"]
    record["seconds"] = time.perf_counter() - started
    return record


def decide_xla(asked, simulated_limit):
    """What ``--jit-compile asked`` comes to, for the JSON's top level.

    ``xla``: whether the runs train under XLA; ``xla_accepted``: whether
    the mode accepted ``jit_compile=True`` (``None``: not asked, ``off``);
    ``xla_refusal``: the library's message if not; ``xla_note``: why XLA is
    not used although accepted (``--quick``'s simulated limit).
    """
    decision = {"xla": False, "xla_accepted": None, "xla_refusal": None, "xla_note": None}
    if asked == "off":
        return decision
    if training_device() == "CPU:0":
        accepted, refusal = xla_check()  # no GPU memory to keep free for the children
    else:
        result, error = run_fresh({"task": "xla_check"})
        if result is None:
            sys.exit(f"The XLA check failed: {error}")
        accepted, refusal = result["accepted"], result["refusal"]
    decision.update(xla_accepted=accepted, xla_refusal=refusal)
    if not accepted:
        if asked == "on":
            sys.exit(f"`--jit-compile on`: the mode refuses jit_compile=True here: {refusal}")
        return decision
    if simulated_limit:
        note = (
            "--quick's simulated limit is a tf.py_function, which XLA cannot compile: "
            "graph mode (--cap-mib N for real out-of-memory errors instead)"
        )
        if asked == "on":
            sys.exit(f"`--jit-compile on`: {note}")
        decision["xla_note"] = note
        return decision
    decision["xla"] = True
    return decision


def versions():
    import keras
    import tensorflow as tf

    import gradient_accumulator

    try:
        import keras_hub
    except ImportError:  # --models resnet50
        keras_hub = None
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_hub": getattr(keras_hub, "__version__", None),
        "gradient_accumulator": getattr(gradient_accumulator, "__version__", None),
        "python": platform.python_version(),
    }


def ms(value):
    return "-" if value is None else f"{1000 * value:.3f}"


def mib(value):
    return "-" if value is None else f"{value:.0f}"


def table(records, payload, device):
    rows = []
    for r in records:
        plain, auto, builtin = r.get("plain"), r.get("auto"), r.get("builtin")
        if plain:
            capped = " (the cap)" if r["largest_plain_batch_is_the_cap"] else ""
            rows.append(
                [
                    r["name"],
                    "plain Keras, largest batch" + capped,
                    plain["batch"],
                    "-",
                    ms(plain["seconds_per_sample"]),
                    "1.00",
                    mib(plain["peak_mib"]),
                    f"{len(r['probes'])} tries",
                ]
            )
        if auto and "error" not in auto:
            changes = ", ".join(f"{c['old']}->{c['new']}" for c in auto["changes"]) or "none"
            rows.append(
                [
                    r["name"],
                    "micro_batch_size='auto'",
                    auto["batch"],
                    auto["micro_batch"],
                    ms(auto["seconds_per_sample"]),
                    f"{r['auto_over_plain']:.2f}" if "auto_over_plain" in r else "-",
                    mib(auto["peak_mib"]),
                    f"fall-backs {changes}; first fit {auto['first_fit_seconds']:.0f} s",
                ]
            )
        elif auto:
            rows.append([r["name"], "micro_batch_size='auto'", auto["batch"], "-"] + ["-"] * 3)
            rows[-1].append(f"failed: {auto['error']}")
        if builtin and "error" not in builtin:
            rows.append(
                [
                    r["name"],
                    f"Keras built-in, {builtin['accum_steps']} steps",
                    builtin["accum_steps"] * builtin["micro_batch"],
                    builtin["micro_batch"],
                    ms(builtin["seconds_per_sample"]),
                    f"{r['builtin_over_plain']:.2f}",
                    mib(builtin["peak_mib"]),
                    "",
                ]
            )
        elif builtin:
            rows.append([r["name"], "Keras built-in", "-", builtin["micro_batch"]] + ["-"] * 3)
            rows[-1].append(f"failed: {builtin['error']}")
        if "error" in r:
            rows.append([r["name"], r["error"], "-", "-", "-", "-", "-", ""])
    mode = "XLA" if payload["xla"] else "graph mode"
    if payload["xla_refusal"]:
        mode += " (XLA refused by the mode)"
    elif payload["xla_note"]:
        mode += " (XLA accepted by the mode; not with --quick's simulated limit)"
    print_table(
        f"{device}, {mode}; TensorFlow {payload['versions']['tensorflow']}, "
        f"Keras {payload['versions']['keras']}; stated batch = {payload['factor']} x the largest "
        f"plain batch; {payload['updates']} updates timed"
        + ("; --quick: figures meaningless" if payload["quick"] else ""),
        ["model", "run", "batch", "micro-batch", "ms/sample", "/ plain", "peak MiB", "notes"],
        rows,
    )


def plot_for(records):
    def plot(ax):
        runs = [
            ("plain", "plain, largest batch"),
            ("auto", "'auto'"),
            ("builtin", "Keras built-in"),
        ]
        width = 0.8 / len(runs)
        for i, (key, label) in enumerate(runs):
            heights = []
            for r in records:
                run = r.get(key) or {}
                heights.append(
                    run["seconds_per_sample"] / r["plain"]["seconds_per_sample"]
                    if "seconds_per_sample" in run
                    else 0.0
                )
            positions = [j + (i - 1) * width for j in range(len(records))]
            bars = ax.bar(positions, heights, width, label=label)
            for bar, r in zip(bars, records):
                peak = (r.get(key) or {}).get("peak_mib")
                if peak is not None:
                    ax.annotate(
                        f"{peak:.0f} MiB",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(
            range(len(records)),
            [
                f"{r['name']}\nplain {r['largest_plain_batch']}, stated "
                f"{(r.get('auto') or {}).get('batch', '-')}, "
                f"micro {(r.get('auto') or {}).get('micro_batch', '-')}"
                for r in records
            ],
            fontsize=7,
        )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("time per sample / plain Keras's")
        ax.set_title("stated batch that does not fit; labels: peak memory", fontsize=9)
        ax.legend(fontsize=8)

    return plot


def parse_args():
    p = common_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--jit-compile",
        choices=JIT_CHOICES,
        default="auto",
        help="auto: XLA if the mode accepts jit_compile=True, else graph mode; on: XLA or stop",
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated: {','.join(MODELS)}"
    )
    p.add_argument(
        "--factor", type=int, default=FACTOR, help="stated batch = factor x largest plain batch"
    )
    p.add_argument(
        "--updates",
        type=int,
        help=f"updates timed once settled (default {UPDATES}; {QUICK_UPDATES} with --quick)",
    )
    p.add_argument(
        "--cap-mib",
        type=int,
        help="cap oneDNN's CPU allocator at this many MiB (real out-of-memory errors on a CPU)",
    )
    args = p.parse_args()
    models = args.models.split(",")
    for name in models:
        if name not in MODELS:
            p.error(f"`--models`: unknown name {name!r}; the names are {', '.join(MODELS)}")
    if "gpt2" in models and importlib.util.find_spec("keras_hub") is None:
        p.error('`gpt2` needs keras-hub: pip install -e ".[kerashub]" (or --models resnet50)')
    if args.factor < 2 or (args.updates is not None and args.updates < 1):
        p.error("`--factor` must be at least 2 and `--updates` at least 1.")
    return args, models


def main():
    args, models = parse_args()
    if args.cap_mib is not None:
        # Read by TensorFlow when it starts: the children inherit it.
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"
        os.environ["TF_MKL_ALLOC_MAX_BYTES"] = str(args.cap_mib * MIB)
    device = training_device()
    if device == "CPU:0" and not args.quick:
        print("note: no GPU; the full sizes take hours on a CPU (--quick: tiny ones)", flush=True)
    if args.updates is None:
        args.updates = QUICK_UPDATES if args.quick else UPDATES
    setups = QUICK if args.quick else FULL
    limit = QUICK_LIMIT if args.quick and args.cap_mib is None else None
    _processes()  # the children's server starts its imports now
    decision = decide_xla(args.jit_compile, limit)
    jit_compile = decision["xla"]
    if decision["xla_refusal"]:
        print(f"graph mode: the mode refuses XLA: {decision['xla_refusal']}", flush=True)
    else:
        print(f"{'XLA' if jit_compile else 'graph mode'}", decision["xla_note"] or "", flush=True)

    if args.quick:
        # Figures are meaningless in --quick: the models' processes run side by side.
        records, errors = {}, []

        def check(model):
            try:
                records[model] = check_model(model, setups[model], args, jit_compile, limit)
            except BaseException as error:  # noqa: BLE001 - raised below, in this thread
                errors.append(error)

        threads = [threading.Thread(target=check, args=(m,)) for m in models]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        results = [records[m] for m in models]
    else:  # one process at a time: each has the device to itself
        results = [check_model(m, setups[m], args, jit_compile, limit) for m in models]

    description = device_description()  # the GPU's name, or the CPU's from /proc/cpuinfo
    payload = {
        "quick": args.quick,
        "jit_compile_asked": args.jit_compile,
        **decision,
        "factor": args.factor,
        "updates": args.updates,
        "simulated_limit": limit,
        "cap_mib": args.cap_mib,
        "versions": versions(),
        "results": results,
    }
    table(results, payload, f"{description['device_name']} ({description['device']})")
    name = "gpu_check_quick" if args.quick else "gpu_check"
    save(args.out, name, payload, plot=plot_for([r for r in results if r.get("plain")]))
    failed = [r["model"] for r in results if "error" in r or "error" in r.get("auto", {})]
    failed += [r["model"] for r in results if "error" in (r.get("builtin") or {})]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see the JSON)")


if __name__ == "__main__":
    main()
