"""Peak memory of one training configuration, measured in a fresh process.

``measure(config)`` starts ``python -m benchmarks._memory --child '<json>'``,
which imports TensorFlow, makes the data, builds and compiles the model,
records its resident set size (RSS) -- the *baseline*, an idle process ready
to train -- then resets the kernel's peak-RSS mark and fits. The figures:

- ``peak_mb``: the process's peak RSS during ``fit`` (``VmHWM`` after the
  reset; what ``getrusage(RUSAGE_SELF).ru_maxrss`` reports after it), the
  absolute;
- ``extra_mb = peak_mb - baseline_mb``: what training adds to the idle
  process (activations, gradients, optimizer slots, the traced graph, the
  data pipeline's buffers);
- ``tf_peak_mb`` / ``tf_extra_mb``: the same from TensorFlow's allocator of
  the training device (tensors only; no graph, no Python, no C allocator
  slack), which says where an RSS difference comes from; on a GPU
  (``--device gpu``) it is the GPU's memory, the one that runs out there;
- ``per_step``: RSS, peak RSS and allocator figures after every step, to see
  when the peak happens (the first step also traces; RSS levels off after a
  few steps, so every configuration runs at least 16).

One process per configuration: allocators keep what they freed, so a second
configuration in the same process would start from the first one's
high-water mark.
"""

import json
import sys
import time

from benchmarks._common import (
    KERAS_BUILTIN,
    LIBRARY,
    MIB,
    PLAIN,
    compiled,
    dense_model,
    device_description,
    mobilenetv2,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    run_child,
    trainable_parameters,
    training_device,
)

MODULE = "benchmarks._memory"


def measure(configs, fresh=True, timeout=1800):
    """Runs configurations in fresh processes; returns their figures (see module doc).

    Args:
        configs: List of dicts, each with ``model`` (``{"kind":
            "mobilenetv2", "size", "alpha"}``, ``{"kind": "mlp", "features",
            "width"}`` or ``{"kind": "dense"}``), ``jit`` (optional,
            ``jit_compile``),
            ``flavour`` (``"plain"``, ``"keras_builtin"``, ``"library"``),
            ``batch`` (samples per ``fit`` batch), ``accum_steps``,
            ``samples`` (distinct samples, the same for every configuration
            compared, so all see the same data, repeated as needed) and
            ``steps`` (``fit`` batches; enough for RSS to level off, which
            takes a few steps, and a whole number of groups).
        fresh: Boolean. ``True``: one process per configuration, in the
            order given (the measurement). ``False``: all in one process, one
            after the other, for ``--quick`` (exercises the same code in a
            fraction of the time; the figures then mean nothing).

    Returns:
        One result dict per configuration, in order.
    """
    if not fresh:
        return run_child(MODULE, configs, timeout=timeout)
    return [run_child(MODULE, [config], timeout=timeout)[0] for config in configs]


def _build(spec):
    if spec["kind"] == "mobilenetv2":
        return mobilenetv2(size=spec["size"], alpha=spec["alpha"]), (spec["size"],) * 2 + (3,)
    if spec["kind"] == "mlp":
        # Parameter-dominated: MLP features-width-width-10 (1024-4096-4096-10: 21.0 M).
        features, width = spec["features"], spec["width"]
        return dense_model(features=features, width=width), (features,)
    return dense_model(), (256,)


def _tf_memory_mb(device):
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info(device)
    return info["current"] / MIB, info["peak"] / MIB


def child(config):
    start = time.perf_counter()
    import keras
    import numpy as np
    import tensorflow as tf

    rss_imports = rss_mb()
    device = training_device()
    (inputs, outputs), shape = _build(config["model"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(config["samples"], *shape)).astype("float32")
    y = rng.integers(0, 10, size=(config["samples"],)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(config["batch"]).repeat()
    del x, y
    flavour = config["flavour"]
    if flavour not in (PLAIN, KERAS_BUILTIN, LIBRARY):
        raise ValueError(f"Unknown flavour {flavour!r}")
    model = compiled(
        flavour, inputs, outputs, config["accum_steps"], jit_compile=config.get("jit", False)
    )
    params = trainable_parameters(model)

    per_step = []
    # The first group traces and compiles every function the steps use (with
    # XLA, the compiler's own memory is part of the peak): the steady peak is
    # the peak RSS of the steps after it, the mark reset once it is done.
    first_group = config["accum_steps"]
    steady = {}

    class Record(keras.callbacks.Callback):
        # Called once per micro-batch (plain, built-in) or once per group
        # (the library's fit); `batch` is the call's last micro-batch.
        def on_train_batch_end(self, batch, logs=None):
            figures = (rss_mb(), peak_rss_mb(), *_tf_memory_mb(device))
            per_step.append([round(v, 1) for v in figures])
            if batch + 1 >= first_group and resettable and not steady:
                steady["rss_at_reset_mb"] = rss_mb()
                steady["peak_at_reset_mb"] = per_step[-1][1]
                reset_peak_rss()

    import gc

    gc.collect()
    baseline = rss_mb()
    tf_baseline, _ = _tf_memory_mb(device)
    try:
        reset_peak_rss()
        resettable = True
    except OSError:  # not Linux, or not allowed: the peak then spans the whole life
        resettable = False
    tf.config.experimental.reset_memory_stats(device)
    model.fit(dataset, epochs=1, steps_per_epoch=config["steps"], verbose=0, callbacks=[Record()])
    peak = peak_rss_mb()  # since the reset after the first group, if any
    overall = max(peak, steady["peak_at_reset_mb"]) if steady else peak
    tf_current, tf_peak = _tf_memory_mb(device)
    import resource

    return {
        **config,
        **device_description(),
        "params": params,
        "accumulator_mb": 4 * params / MIB,
        "steps": len(per_step),
        "updates": int(model.optimizer.iterations.numpy()),
        "rss_after_imports_mb": rss_imports,
        "baseline_mb": baseline,
        "peak_mb": overall,
        "extra_mb": overall - baseline,
        "steady_peak_mb": peak,
        "steady_extra_mb": peak - baseline,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_reset_at_baseline": resettable,
        "tf_baseline_mb": tf_baseline,
        "tf_peak_mb": tf_peak,
        "tf_extra_mb": tf_peak - tf_baseline,
        "tf_after_fit_mb": tf_current,
        "per_step": per_step,
        "seconds": time.perf_counter() - start,
    }


def _children(configs):
    import keras

    results = []
    for config in configs:
        keras.backend.clear_session()
        results.append(child(config))
    return results


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit(f"usage: python -m {MODULE} --child '<json list of configs>'")
    print(json.dumps(_children(json.loads(sys.argv[2]))))
