"""Rematerialisation (``keras.RematScope``): peak memory against the micro-batch, and its time.

A model built under ``keras.RematScope`` and wrapped in
``GradientAccumulateModel(accum_steps=4)`` recomputes the activations of the
layers the scope marked in the backward pass of ``fit`` (Keras's own
rematerialisation fails on TensorFlow; importing the package replaces it:
``gradient_accumulator.remat``). What is compared, each against
the same model built from the same seed without the scope ("none"):

- a deep MLP: 20 Dense layers of width 1024 with GELU (21.0 M parameters),
  grouped into 5 blocks of 4, each block a ``keras.Sequential`` of Dense
  layers made outside the scope;

  - ``blocks``: each Sequential made inside ``RematScope(mode="full")``, so
    each block is one checkpoint (its 4 layers recomputed together);
  - ``activations``: the Dense layers made inside
    ``RematScope(mode="activations")`` (their GELU recomputed);

- MobileNetV2 (alpha 1.0, 96x96, 10 classes, ``weights=None``);

  - ``blocks``: the model cut into its stem, its 17 inverted-residual blocks
    (each from its input to its ``*_add``, or ``*_project_BN`` where it has no
    residual) and its head, each a functional sub-model over the same layers;
    the block sub-models made inside ``RematScope(mode="full")``: one
    checkpoint per block;
  - ``full``: ``keras.applications.MobileNetV2`` built inside
    ``RematScope(mode="full")``: every layer its own checkpoint;
  - ``list_of_layers``: built inside ``RematScope(mode="list_of_layers")``
    naming every ``block_*_add`` and ``*_project_BN`` layer.

Memory: TensorFlow's allocator of the training device
(``tf.config.experimental.get_memory_info``; on a CPU oneDNN's, on by
default), one FRESH process per point: data, model, compile and the
optimizer's variables made, then the allocator's current bytes (*idle*: the
weights, accumulators, Adam's slots and the data), ``reset_memory_stats``, a
``fit`` of two updates (8 micro-batches); the figure is the allocator's
peak during ``fit`` minus idle (the tensors training adds: activations,
gradients, temporaries), at every micro-batch, graph mode, and for the MLP at
its largest micro-batch under XLA too. The process's peak RSS over its idle
RSS is in the JSON file beside it. The plot draws it against the
micro-batch; its horizontal line is the largest measured ratio of
micro-batches "with remat in the memory without": the line is none's figure
at a micro-batch, and the largest micro-batch with ``blocks`` under it is
named. (MobileNetV2 ``full`` and ``list_of_layers`` are measured at one
micro-batch only.)

Time per sample, with remat over without, at one micro-batch per model (MLP
128, MobileNetV2 16), graph mode: the configurations in one process, each
warmed up by an epoch (tracing), then taking turns, one epoch each per round
(``--rounds``); medians over rounds of per-round ratios, wall and process CPU
time. The CPU time is the steadier: an epoch's wall time on a CPU sits near
one of two values whatever the configuration (see ``fit_time``), and moves
with other work on the machine. The goals
(issue 56, item 3): ``blocks`` at most 0.60 of none's memory at the
largest micro-batch, at most 1.4x its time per sample.

MobileNetV2 is not measured under XLA: on a 2-core CPU its first ``fit``
(the compile) took 51 s without remat and 97 s with ``blocks``, and 8
micro-batches 20 s and 41 s (2.6 s in graph mode); its peak over idle at
micro-batch 16 was 260 MiB without remat, 131 MiB with ``blocks`` (one run).

Run: ``python -m benchmarks.remat`` (about 14 minutes on 2 cores: 28 fresh
processes, then the timing rounds; ``--quick`` for CI: a tiny MLP and a
two-block MobileNetV2-like ConvNet, every configuration in one process, one
round, figures meaningless). Writes ``remat.json`` and ``remat.png``.
"""

import contextlib
import json
import re
import sys
import time

from benchmarks._common import (
    LIBRARY,
    MIB,
    alternate,
    classification_data,
    compiled,
    median,
    median_ratio,
    parser,
    peak_rss_mb,
    print_table,
    ratio_quartiles,
    reset_peak_rss,
    rss_mb,
    run_child,
    save,
    training_device,
)

MODULE = "benchmarks.remat"
ACCUM_STEPS = 4
NONE = "none"
BLOCKS = "blocks"
MEMORY_GOAL = 0.60  # at least 40% less
TIME_GOAL = 1.4

# Per model: its size (`spec`), the micro-batches of the memory sweep and the
# variants swept; the variants measured at one micro-batch only (`probe`,
# at `probe_batch`); the micro-batch of the XLA points (the swept variants),
# or None; the timed variants, their micro-batch, the groups per epoch and
# the rounds.
FULL = {
    "mlp": {
        "spec": {"width": 1024, "layers": 20, "block": 4},
        "micro_batches": [32, 64, 128, 256, 512],
        "sweep": [NONE, BLOCKS, "activations"],
        "probe": [],
        "probe_batch": None,
        "xla_batch": 512,
        "time_variants": [NONE, BLOCKS, "activations"],
        "time_batch": 128,
        "time_groups": 4,
        "rounds": 7,
    },
    "mobilenetv2": {
        "spec": {"size": 96, "alpha": 1.0},
        "micro_batches": [4, 8, 16, 32],
        "sweep": [NONE, BLOCKS],
        "probe": ["full", "list_of_layers"],
        "probe_batch": 16,
        "xla_batch": None,  # minutes per compile on a CPU; see the module doc
        "time_variants": [NONE, BLOCKS, "full", "list_of_layers"],
        "time_batch": 16,
        "time_groups": 2,
        "rounds": 5,
    },
}
QUICK = {
    "mlp": {
        **FULL["mlp"],
        "spec": {"width": 32, "layers": 8, "block": 4},
        "micro_batches": [4],
        "xla_batch": None,
        "time_batch": 4,
        "time_groups": 1,
        "rounds": 1,
    },
    "mini_mobilenetv2": {
        **FULL["mobilenetv2"],
        "spec": {"size": 16},
        "micro_batches": [2],
        "probe_batch": 2,
        "time_variants": [NONE, BLOCKS],
        "time_batch": 2,
        "time_groups": 1,
        "rounds": 1,
    },
}


# --- models ---------------------------------------------------------------------


def scope(mode, **kwargs):
    import keras

    return keras.RematScope(mode=mode, **kwargs) if mode else contextlib.nullcontext()


def mlp(variant, width, layers, block, seed=0):
    """``inputs, outputs, input shape`` of the deep MLP (see the module doc) for ``variant``."""
    import keras

    if variant not in (NONE, BLOCKS, "activations"):
        raise ValueError(f"Unknown MLP variant {variant!r}")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((width,))
    x = inputs
    for _ in range(layers // block):
        with scope("activations" if variant == "activations" else None):
            dense = [keras.layers.Dense(width, activation="gelu") for _ in range(block)]
        # Called outside the scope: the Sequential's own functional graph,
        # made when it is built, is no checkpoint of its own.
        with scope("full" if variant == BLOCKS else None):
            sequential = keras.Sequential(dense)
        x = sequential(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return inputs, outputs, (width,)


def mini_mobilenetv2(size):
    """Two inverted-residual blocks named as in MobileNetV2, for ``--quick``."""
    import keras
    from keras import layers

    inputs = keras.Input((size, size, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="Conv1")(inputs)
    x = layers.BatchNormalization(name="bn_Conv1")(x)
    x = layers.ReLU(6.0, name="Conv1_relu")(x)
    for i in (1, 2):
        y = layers.Conv2D(48, 1, use_bias=False, name=f"block_{i}_expand")(x)
        y = layers.BatchNormalization(name=f"block_{i}_expand_BN")(y)
        y = layers.ReLU(6.0, name=f"block_{i}_expand_relu")(y)
        y = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"block_{i}_depthwise")(
            y
        )
        y = layers.BatchNormalization(name=f"block_{i}_depthwise_BN")(y)
        y = layers.ReLU(6.0, name=f"block_{i}_depthwise_relu")(y)
        y = layers.Conv2D(8, 1, use_bias=False, name=f"block_{i}_project")(y)
        y = layers.BatchNormalization(name=f"block_{i}_project_BN")(y)
        x = layers.Add(name=f"block_{i}_add")([x, y])
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs)


_PROJECT = re.compile(r"^(expanded_conv|block_\d+)_project_BN$")


def block_ends(model):
    """The names of the layers that end MobileNetV2's blocks, in order.

    A block ends at its ``<block>_add`` (the residual sum) or, without one,
    at its ``<block>_project_BN``.
    """
    names = {layer.name for layer in model.layers}
    ends = []
    for layer in model.layers:
        match = _PROJECT.match(layer.name)
        if match:
            add = f"{match.group(1)}_add"
            ends.append(add if add in names else layer.name)
    return ends


def checkpointed_blocks(model):
    """``model`` cut into a stem, one sub-model per block (made in ``RematScope("full")``), a head.

    The sub-models are functional models over ``model``'s own layers and
    tensors, so the weights are ``model``'s; each block is one checkpoint:
    only its input is kept for the backward pass, its inside recomputed.
    """
    import keras

    start = model.get_layer("Conv1_relu").output
    blocks = []
    with keras.RematScope(mode="full"):
        previous = start
        for name in block_ends(model):
            end = model.get_layer(name).output
            blocks.append(keras.Model(previous, end, name=f"checkpoint_{name}"))
            previous = end
    stem = keras.Model(model.input, start, name="stem")
    head = keras.Model(previous, model.output, name="head")
    inputs = keras.Input(model.input.shape[1:])
    x = stem(inputs)
    for block in blocks:
        x = block(x)
    return inputs, head(x)


def mobilenet(variant, size, alpha=None, seed=0):
    """``inputs, outputs, input shape`` of MobileNetV2 for ``variant`` (no alpha: the mini one)."""
    import keras

    keras.utils.set_random_seed(seed)
    if variant in (NONE, BLOCKS):
        remat = scope(None)
    elif variant == "full":
        remat = scope("full")
    elif variant == "list_of_layers":
        # Every name MobileNetV2 (or the mini one) might have; absent ones match nothing.
        names = [f"block_{i}_add" for i in range(1, 17)]
        names += ["expanded_conv_project_BN"] + [f"block_{i}_project_BN" for i in range(1, 17)]
        remat = scope("list_of_layers", layer_names=names)
    else:
        raise ValueError(f"Unknown MobileNetV2 variant {variant!r}")
    with remat:
        if alpha is None:
            model = mini_mobilenetv2(size)
        else:
            model = keras.applications.MobileNetV2(
                input_shape=(size, size, 3), alpha=alpha, weights=None, classes=10
            )
    shape = (size, size, 3)
    if variant == BLOCKS:
        return (*checkpointed_blocks(model), shape)
    return model.input, model.output, shape


def build(model, variant, spec):
    if model == "mlp":
        return mlp(variant, **spec)
    if model in ("mobilenetv2", "mini_mobilenetv2"):
        return mobilenet(variant, **spec)
    raise ValueError(f"Unknown model {model!r}")


def compiled_model(model, variant, spec, jit=False):
    """``(GradientAccumulateModel(accum_steps=4) compiled with Adam, input shape)``."""
    inputs, outputs, shape = build(model, variant, spec)
    return compiled(LIBRARY, inputs, outputs, ACCUM_STEPS, jit_compile=jit), shape


# --- memory: one fresh process per point -------------------------------------


def child(config):
    """One memory point (see the module doc): its figures."""
    import gc

    import tensorflow as tf

    start = time.perf_counter()
    device = training_device()
    model, shape = compiled_model(config["model"], config["variant"], config["spec"], config["jit"])
    batch = config["micro_batch"]
    x, y = classification_data(ACCUM_STEPS * batch, shape)  # one group's, repeated
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    del x, y
    # Adam's slots now, not in the first update: the same with and without remat.
    model.optimizer.build(model.trainable_variables)
    gc.collect()
    idle_rss = rss_mb()
    idle = tf.config.experimental.get_memory_info(device)["current"] / MIB
    try:
        reset_peak_rss()
        resettable = True
    except OSError:  # not Linux: the RSS peak spans the process's life
        resettable = False
    tf.config.experimental.reset_memory_stats(device)
    history = model.fit(dataset, epochs=1, steps_per_epoch=config["steps"], verbose=0)
    peak = tf.config.experimental.get_memory_info(device)["peak"] / MIB
    peak_rss = peak_rss_mb()
    return {
        **config,
        "device": device,
        "tf_idle_mb": idle,
        "tf_peak_mb": peak,
        "tf_extra_mb": peak - idle,
        "rss_idle_mb": idle_rss,
        "rss_extra_mb": peak_rss - idle_rss,
        "peak_rss_reset_at_idle": resettable,
        "updates": int(model.optimizer.iterations.numpy()),
        "last_loss": float(history.history["loss"][-1]),
        "seconds": time.perf_counter() - start,
    }


def _children(configs):
    import keras

    results = []
    for config in configs:
        keras.backend.clear_session()
        results.append(child(config))
        r = results[-1]
        print(
            f"  {r['model']} {r['variant']} micro-batch {r['micro_batch']} "
            f"{'XLA' if r['jit'] else 'graph'}: {r['tf_extra_mb']:.1f} MiB ({r['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    return results


def memory_configs(plan):
    configs = []
    for name, setup in plan.items():
        common = {"model": name, "spec": setup["spec"], "steps": 2 * ACCUM_STEPS}
        for batch in setup["micro_batches"]:
            for variant in setup["sweep"]:
                configs.append({**common, "variant": variant, "micro_batch": batch, "jit": False})
        for variant in setup["probe"]:
            batch = setup["probe_batch"]
            configs.append({**common, "variant": variant, "micro_batch": batch, "jit": False})
        if setup["xla_batch"]:
            for variant in setup["sweep"]:
                batch = setup["xla_batch"]
                configs.append({**common, "variant": variant, "micro_batch": batch, "jit": True})
    return configs


def with_ratios(results):
    """Each point's ``tf_extra_mb`` over none's at the same model, mode and micro-batch."""
    nones = {
        (r["model"], r["jit"], r["micro_batch"]): r["tf_extra_mb"]
        for r in results
        if r["variant"] == NONE
    }
    for r in results:
        none = nones.get((r["model"], r["jit"], r["micro_batch"]))
        r["mode"] = "jit" if r["jit"] else "graph"
        r["over_none"] = r["tf_extra_mb"] / none if none and none > 0 else None
    return results


def fits(results, model, variant=BLOCKS):
    """Where ``variant`` fits a larger micro-batch in the memory none needs at a smaller one.

    Returns:
        ``{"none_micro_batch", "none_mb", "micro_batch", "extra_mb", "factor"}``:
        the measured pair (graph mode) of the largest ratio of micro-batches
        ``variant``'s over none's with ``variant``'s figure at most none's
        (ties: the larger micro-batches), or ``None`` if none is.
    """
    points = {
        (r["variant"], r["micro_batch"]): r["tf_extra_mb"]
        for r in results
        if r["model"] == model and not r["jit"]
    }
    best = None
    for (name, b), none_mb in sorted(points.items()):
        if name != NONE:
            continue
        for (other, c), mb in sorted(points.items()):
            if other == variant and c >= b and mb <= none_mb:
                pair = (c / b, b)
                if best is None or pair >= best[0]:
                    best = (pair, {"none_micro_batch": b, "none_mb": none_mb})
                    best[1].update(micro_batch=c, extra_mb=mb, factor=c / b)
    return None if best is None else best[1]


# --- time: side by side in one process -----------------------------------------


def time_model(name, setup):
    """Per-sample time of each variant over none's: alternating epochs, medians of ratios."""
    batch = setup["time_batch"]
    variants = setup["time_variants"]
    models, shape = {}, None
    for variant in variants:
        models[variant], shape = compiled_model(name, variant, setup["spec"])
    samples = setup["time_groups"] * ACCUM_STEPS * batch
    x, y = classification_data(samples, shape)

    def epoch(model):
        wall, cpu = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return (time.perf_counter() - wall) / samples, (time.process_time() - cpu) / samples

    first = {variant: epoch(model)[0] * samples for variant, model in models.items()}
    runs = alternate(models, epoch, setup["rounds"])
    wall = {v: [w for w, _ in rs] for v, rs in runs.items()}
    cpu = {v: [c for _, c in rs] for v, rs in runs.items()}
    record = {
        "model": name,
        "micro_batch": batch,
        "accum_steps": ACCUM_STEPS,
        "samples_per_epoch": samples,
        "rounds": setup["rounds"],
        "none_ms_per_sample": 1e3 * median(wall[NONE]),
        "none_cpu_ms_per_sample": 1e3 * median(cpu[NONE]),
        "first_epoch_seconds": first,
        "seconds_per_sample": wall,
        "cpu_seconds_per_sample": cpu,
        "over_none": {},
    }
    for variant in variants[1:]:
        record["over_none"][variant] = {
            "wall": median_ratio(wall[variant], wall[NONE]),
            "wall_quartiles": ratio_quartiles(wall[variant], wall[NONE]),
            "cpu": median_ratio(cpu[variant], cpu[NONE]),
            "cpu_quartiles": ratio_quartiles(cpu[variant], cpu[NONE]),
        }
    return record


# --- output --------------------------------------------------------------------


def _ratio(value):
    return "n/a" if value is None else f"{value:.2f}"


def print_memory(results, plan, how):
    for name, setup in plan.items():
        variants = setup["sweep"] + setup["probe"]
        for jit in (False, True):
            points = {
                (r["variant"], r["micro_batch"]): r
                for r in results
                if r["model"] == name and r["jit"] == jit
            }
            if not points:
                continue
            rows = []
            for batch in sorted({b for _, b in points}):
                row = [batch, f"{points[(NONE, batch)]['tf_idle_mb']:.0f}"]
                for variant in variants:
                    r = points.get((variant, batch))
                    row.append("" if r is None else f"{r['tf_extra_mb']:.1f}")
                    if variant != NONE:
                        row.append("" if r is None else _ratio(r["over_none"]))
                rows.append(row)
            header = ["micro-batch", "idle MiB"]
            for variant in variants:
                header += [f"{variant} MiB"] + ([] if variant == NONE else [f"{variant} / none"])
            print_table(
                f"{name}, {'XLA' if jit else 'graph mode'}: TensorFlow allocator peak during fit "
                f"- idle (MiB), GradientAccumulateModel(accum_steps={ACCUM_STEPS}), "
                f"{setup['spec']}; {how}",
                header,
                rows,
            )
        fit = fits(results, name)
        if fit:
            print(
                f"{name}: {BLOCKS} at micro-batch {fit['micro_batch']} "
                f"({fit['extra_mb']:.1f} MiB) fits in what none needs at {fit['none_micro_batch']} "
                f"({fit['none_mb']:.1f} MiB): {fit['factor']:.0f}x the micro-batch"
            )


def print_time(records):
    rows = []
    for record in records:
        for variant, r in record["over_none"].items():
            rows.append(
                [
                    record["model"],
                    record["micro_batch"],
                    f"{record['none_ms_per_sample']:.2f}",
                    variant,
                    f"{r['wall']:.2f}",
                    "{:.2f}-{:.2f}".format(*r["wall_quartiles"]),
                    f"{r['cpu']:.2f}",
                    "{:.2f}-{:.2f}".format(*r["cpu_quartiles"]),
                    record["rounds"],
                ]
            )
    print_table(
        "time per sample, with remat over none (graph mode, one epoch each per round, "
        "taking turns; medians of per-round ratios)",
        [
            "model",
            "micro-batch",
            "none ms/sample",
            "variant",
            "wall / none",
            "quartiles",
            "CPU / none",
            "quartiles",
            "rounds",
        ],
        rows,
    )


def goals(results, records, plan):
    verdicts = {}
    for name, setup in plan.items():
        largest = max(setup["micro_batches"])
        point = next(
            r
            for r in results
            if r["model"] == name
            and r["variant"] == BLOCKS
            and not r["jit"]
            and r["micro_batch"] == largest
        )
        timing = next(r for r in records if r["model"] == name)["over_none"][BLOCKS]
        verdicts[name] = {
            "memory_micro_batch": largest,
            "memory_over_none": point["over_none"],
            "memory_met": point["over_none"] is not None and point["over_none"] <= MEMORY_GOAL,
            "time_over_none": timing["wall"],
            "time_cpu_over_none": timing["cpu"],
            "time_met": max(timing["wall"], timing["cpu"]) <= TIME_GOAL,
        }
        v = verdicts[name]
        print(
            f"goal ({name}, {BLOCKS}): memory at micro-batch {largest} "
            f"{_ratio(v['memory_over_none'])} of none's <= {MEMORY_GOAL:.2f}: "
            f"{'met' if v['memory_met'] else 'NOT met'}; time per sample "
            f"{v['time_over_none']:.2f}x wall, {v['time_cpu_over_none']:.2f}x CPU <= "
            f"{TIME_GOAL}x: {'met' if v['time_met'] else 'NOT met'}"
        )
    return verdicts


def plot(out, stem, payload):
    """``<stem>.png``: peak over idle against the micro-batch, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, plan = payload["results"], payload["setups"]
    fig, axes = plt.subplots(1, len(plan), figsize=(6.0 * len(plan), 4.4), dpi=120)
    styles = {NONE: "o-", BLOCKS: "s-", "activations": "^--", "full": "D", "list_of_layers": "v"}
    labels = {
        NONE: "without remat",
        "activations": 'activations: RematScope("activations")',
        "full": 'full: RematScope("full"), every layer',
        "list_of_layers": "list_of_layers: *_add, *_project_BN",
    }
    blocks = {
        "mlp": 'blocks: RematScope("full") per Sequential of 4',
        "mobilenetv2": 'blocks: RematScope("full") per block sub-model',
        "mini_mobilenetv2": 'blocks: RematScope("full") per block sub-model',
    }
    for ax, (name, setup) in zip(axes, plan.items()):
        for variant in setup["sweep"] + setup["probe"]:
            points = sorted(
                (r["micro_batch"], r["tf_extra_mb"])
                for r in results
                if r["model"] == name and r["variant"] == variant and not r["jit"]
            )
            label = blocks[name] if variant == BLOCKS else labels[variant]
            ax.plot(*zip(*points), styles[variant], label=label)
        fit = payload["fits"].get(name)
        if fit:
            ax.axhline(
                fit["none_mb"],
                color="gray",
                linewidth=0.8,
                linestyle=":",
                label=f"without remat at {fit['none_micro_batch']}: {BLOCKS} fits "
                f"{fit['micro_batch']} ({fit['factor']:.0f}x)",
            )
        batches = setup["micro_batches"]
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("TF allocator peak during fit - idle (MiB)")
        ax.set_title(f"{name}, accum_steps={ACCUM_STEPS}, graph mode", fontsize="medium")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = f"{out}/{stem}.png"
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="timing rounds (default: 7 for the MLP, 5 else)")
    args = p.parse_args()
    quick = args.quick
    plan = {name: dict(setup) for name, setup in (QUICK if quick else FULL).items()}
    if args.rounds:
        for setup in plan.values():
            setup["rounds"] = args.rounds
    configs = memory_configs(plan)
    if quick:
        results = run_child(MODULE, configs)
        how = "all in one process (--quick: figures meaningless)"
    else:
        results = [run_child(MODULE, [config])[0] for config in configs]
        how = "one fresh process per point"
    with_ratios(results)
    print_memory(results, plan, how)
    records = [time_model(name, setup) for name, setup in plan.items()]
    print_time(records)
    verdicts = goals(results, records, plan)
    stem = "remat" + ("_quick" if quick else "")
    payload = {
        "quick": quick,
        "accum_steps": ACCUM_STEPS,
        "setups": plan,
        "memory_goal": MEMORY_GOAL,
        "time_goal": TIME_GOAL,
        "results": results,
        "fits": {name: fits(results, name) for name in plan},
        "time": records,
        "goals": verdicts,
    }
    save(args.out, stem, payload)
    plot(args.out, stem, payload)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_children(json.loads(sys.argv[2]))))
    else:
        main()
