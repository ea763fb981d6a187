"""Per-micro-step cost of AccumBatchNormalization against Keras BatchNormalization.

The same small CNN (six conv-BN-ReLU blocks, 32x32 inputs, same seed, data
and steps) inside ``GradientAccumulateModel(accum_steps=4)``, once with Keras
``BatchNormalization`` and once with ``AccumBatchNormalization(accum_steps=4)``
(moving statistics of the whole accumulated batch, updated once per update):

1. one device, graph mode and XLA (``jit_compile=True``): time per micro-step,
   AccumBatchNormalization / Keras BN (goal <= 1.03), with the update
   micro-step and the accumulate-only ones apart;
2. ``MirroredStrategy`` on two logical CPUs, in a fresh process of its own:
   ``synchronized=True`` (global statistics, one all-gather per BN call)
   against ``synchronized=False``, for both layers.

Timing as in ``benchmarks/step_time.py``: warm-up (tracing) excluded, whole
groups of ``train_function`` calls per turn, configurations alternating
round after round, medians over rounds of per-round ratios.

Run: ``python -m benchmarks.bn_overhead`` (``--quick`` for CI: graph mode,
one narrow block, few rounds; figures meaningless).
"""

import json

import numpy as np

from benchmarks._common import (
    child_result,
    classification_data,
    logical_cpus,
    median,
    median_ratio,
    parser,
    print_table,
    ratio_quartiles,
    run_child,
    save,
    start_child,
    step_times,
)

ACCUM_STEPS = 4
REPLICAS = 2
KERAS_BN = "keras_bn"
ACCUM_BN = "accum_bn"
LAYER_NAMES = {KERAS_BN: "Keras BatchNormalization", ACCUM_BN: "AccumBatchNormalization"}


def small_cnn(norm, widths, seed=0):
    """Conv-BN-ReLU blocks of ``widths`` filters; ``norm()`` makes each block's BN layer."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for filters, stride in zip(widths, (1, 1, 2, 1, 2, 1)):
        x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        x = norm()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(10, activation="softmax")(x)


def build(layer, widths, synchronized=False, jit_compile=False):
    import keras

    from benchmarks._common import LIBRARY, compiled
    from gradient_accumulator import AccumBatchNormalization

    def norm():
        if layer == ACCUM_BN:
            return AccumBatchNormalization(accum_steps=ACCUM_STEPS, synchronized=synchronized)
        return keras.layers.BatchNormalization(synchronized=synchronized)

    return compiled(LIBRARY, *small_cnn(norm, widths), ACCUM_STEPS, jit_compile=jit_compile)


def sizes(quick):
    if quick:
        return {"widths": (8,), "micro_batch": 8, "rounds": 2, "groups": 1}
    return {"widths": (32, 32, 64, 64, 128, 128), "micro_batch": 32, "rounds": 25, "groups": 2}


def single_device(quick):
    s = sizes(quick)
    x, y = classification_data(2 * ACCUM_STEPS * s["micro_batch"], (32, 32, 3))
    records = []
    for mode in ["graph"] if quick else ["graph", "jit"]:
        models = {
            layer: build(layer, s["widths"], jit_compile=mode == "jit")
            for layer in (KERAS_BN, ACCUM_BN)
        }
        times = step_times(models, x, y, s["micro_batch"], ACCUM_STEPS, s["rounds"], s["groups"])
        keras_step = median(times[KERAS_BN]["by_position"])
        position = times[ACCUM_BN]["by_position"]
        records.append(
            {
                "mode": mode,
                "keras_bn_ms_per_micro_step": 1e3 * median(times[KERAS_BN]["wall"]),
                "accum_bn_ms_per_micro_step": 1e3 * median(times[ACCUM_BN]["wall"]),
                "accum_over_keras": median_ratio(times[ACCUM_BN]["wall"], times[KERAS_BN]["wall"]),
                "accum_over_keras_quartiles": ratio_quartiles(
                    times[ACCUM_BN]["wall"], times[KERAS_BN]["wall"]
                ),
                "accum_over_keras_cpu": median_ratio(
                    times[ACCUM_BN]["cpu"], times[KERAS_BN]["cpu"]
                ),
                "accumulate_only_over_keras": median(position[:-1]) / keras_step,
                "update_step_over_keras": position[-1] / keras_step,
                "rounds": s["rounds"],
                "micro_steps_per_round": s["groups"] * ACCUM_STEPS,
            }
        )
        r = records[-1]
        print(f"one device, {mode}: AccumBN / Keras BN {r['accum_over_keras']:.3f}", flush=True)
    return records


def mirrored_child(quick):
    """Runs in a fresh process: two logical CPUs, synchronized vs not, both layers."""
    logical_cpus(REPLICAS)
    import tensorflow as tf

    s = sizes(quick)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    global_batch = REPLICAS * s["micro_batch"] // 2  # the same global batch as on one device
    x, y = classification_data(2 * ACCUM_STEPS * global_batch, (32, 32, 3))
    models = {}
    for layer in (KERAS_BN, ACCUM_BN):
        for synchronized in (False, True):
            with strategy.scope():
                models[f"{layer}/{synchronized}"] = build(layer, s["widths"], synchronized)
    times = step_times(
        models, x, y, global_batch, ACCUM_STEPS, s["rounds"], s["groups"], strategy=strategy
    )
    return {
        "replicas": strategy.num_replicas_in_sync,
        "global_micro_batch": global_batch,
        "rounds": s["rounds"],
        "ms_per_micro_step": {name: 1e3 * median(t["wall"]) for name, t in times.items()},
        "synchronized_over_not": {
            layer: median_ratio(times[f"{layer}/True"]["wall"], times[f"{layer}/False"]["wall"])
            for layer in (KERAS_BN, ACCUM_BN)
        },
        "accum_over_keras": {
            str(synchronized): median_ratio(
                times[f"{ACCUM_BN}/{synchronized}"]["wall"],
                times[f"{KERAS_BN}/{synchronized}"]["wall"],
            )
            for synchronized in (False, True)
        },
    }


def main():
    p = parser(
        __doc__.splitlines()[0],
        cpu_only="its MirroredStrategy part splits the CPU into logical devices",
    )
    p.add_argument("--child", help="internal: run the MirroredStrategy part with this JSON")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(mirrored_child(json.loads(args.child)["quick"])))
        return
    quick = args.quick
    s = sizes(quick)
    if quick:
        # Figures are meaningless in --quick: overlap the two processes' start-up.
        child = start_child("benchmarks.bn_overhead", {"quick": quick})
        records = single_device(quick)
        mirrored = child_result(child)
    else:  # one process at a time, so that neither slows the other
        records = single_device(quick)
        mirrored = run_child("benchmarks.bn_overhead", {"quick": quick})

    print_table(
        f"time per micro-step, AccumBatchNormalization(accum_steps={ACCUM_STEPS}) vs Keras "
        f"BatchNormalization in GradientAccumulateModel({ACCUM_STEPS}); small CNN "
        f"({len(s['widths'])} BN layers, widths {s['widths']}), micro-batch "
        f"{s['micro_batch']}, one device; median of {s['rounds']} alternating rounds. "
        "Goal: AccumBN / Keras BN <= 1.03",
        [
            "mode",
            "Keras BN ms",
            "AccumBN ms",
            "AccumBN / Keras BN wall (cpu)",
            "quartiles",
            "accumulate-only",
            "update step",
        ],
        [
            [
                r["mode"],
                f"{r['keras_bn_ms_per_micro_step']:.2f}",
                f"{r['accum_bn_ms_per_micro_step']:.2f}",
                f"{r['accum_over_keras']:.3f} ({r['accum_over_keras_cpu']:.3f})",
                "{:.2f}-{:.2f}".format(*r["accum_over_keras_quartiles"]),
                f"{r['accumulate_only_over_keras']:.3f}",
                f"{r['update_step_over_keras']:.3f}",
            ]
            for r in records
        ],
    )
    ms = mirrored["ms_per_micro_step"]
    print_table(
        f"MirroredStrategy, {mirrored['replicas']} logical CPUs (fresh process), global "
        f"micro-batch {mirrored['global_micro_batch']}, graph mode; median of "
        f"{mirrored['rounds']} alternating rounds",
        ["layer", "not synchronized ms", "synchronized ms", "synchronized / not"],
        [
            [
                LAYER_NAMES[layer],
                f"{ms[f'{layer}/False']:.2f}",
                f"{ms[f'{layer}/True']:.2f}",
                f"{mirrored['synchronized_over_not'][layer]:.3f}",
            ]
            for layer in (KERAS_BN, ACCUM_BN)
        ],
    )
    print(
        "AccumBN / Keras BN under MirroredStrategy: "
        f"not synchronized {mirrored['accum_over_keras']['False']:.3f}, "
        f"synchronized {mirrored['accum_over_keras']['True']:.3f}"
    )

    def plot(ax):
        labels = [f"one device\n{r['mode']}" for r in records] + [
            "2 replicas\nnot synced",
            "2 replicas\nsynchronized",
        ]
        values = [r["accum_over_keras"] for r in records] + [
            mirrored["accum_over_keras"]["False"],
            mirrored["accum_over_keras"]["True"],
        ]
        ax.bar(np.arange(len(values)), values, 0.6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.03, color="gray", linewidth=0.8, linestyle="--", label="goal 1.03")
        ax.set_xticks(np.arange(len(values)), labels, fontsize="small")
        ax.set_ylabel("time per micro-step, AccumBN / Keras BN")
        ax.set_title(f"AccumBatchNormalization overhead (k={ACCUM_STEPS})")
        ax.legend()

    save(
        args.out,
        "bn_overhead" + ("_quick" if quick else ""),
        {
            "accum_steps": ACCUM_STEPS,
            "quick": quick,
            "widths": s["widths"],
            "micro_batch": s["micro_batch"],
            "goal": "accum_over_keras <= 1.03",
            "single_device": records,
            "mirrored": mirrored,
        },
        plot,
    )


if __name__ == "__main__":
    main()
