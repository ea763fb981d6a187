"""A contrastive loss with ``coupled_loss``: its time, memory and retrieval quality.

Cost: a CLIP-like dual encoder whose activations dominate (an image tower of
two 3x3 convolutions of 32 channels on 32x32x3 inputs, pooled, and a text
tower of one hidden Dense layer of 512 units on 128 features, each ending in
64 unit-normalised dimensions), symmetric InfoNCE over the batch (temperature
0.05), Adam, micro-batch 16, ``accum_steps`` 1, 4, 16 and 64. Configurations:

- ``big batch``: plain Keras at batch ``k * b`` (what ``coupled`` equals);
- ``coupled``: ``GradientAccumulateModel(accum_steps=k,
  coupled_loss="replica")`` at micro-batch ``b``;
- ``plain accumulation``: the same without ``coupled_loss`` (each
  micro-batch's loss on its own: the wrong objective; its cost is what
  exactness is measured against);
- ``micro-batch``: plain Keras at batch ``b`` (no accumulation).

Time per sample: in one process per ``k``, the configurations take turns
round after round (the first rotates), each fitting two groups and at least
1024 samples per turn after a warm-up ``fit`` (excluded), 9 rounds; medians
over rounds of per-round ratios to the big batch, for wall time and for the
process's CPU time (user and system, every thread: the work done, which
moves less with others' load on a shared machine). Memory: each configuration
``fit`` in a fresh process; TensorFlow's allocator peak during ``fit`` above
what was in use before it (on a CPU it counts tensors of 256 KiB and more;
the script sets ``TF_ENABLE_ONEDNN_OPTS=1`` unless it is set, without which
TensorFlow keeps no CPU statistics) and the process's peak RSS above its
idle RSS.

Quality: a small dual encoder (two towers of Dense 64 relu then 32
unit-normalised dimensions) on synthetic retrieval pairs (a query and its
candidate are two noisy nonlinear views of one 16-dimensional latent vector),
trained for the same number of Adam updates at batch ``b = 8`` (no
accumulation), at ``k * b = 128`` by plain accumulation, by ``coupled_loss``,
and by plain Keras at the big batch; recall@1 on 1000 held-out pairs (is a
query's nearest candidate among the 1000 its own?), over three initial seeds.

Run: ``python -m benchmarks.coupled`` (``--parts cost`` or ``quality`` for
one; ``--quick`` for CI: tiny sizes, figures meaningless). Writes
``coupled.json`` and ``coupled.png`` (time per sample and peak memory
against ``accum_steps``).
"""

import json
import os
import sys
import time
import warnings

from benchmarks._common import (
    MIB,
    alternate,
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
    timed,
    training_device,
)

BIG, COUPLED, NAIVE, MICRO = "big batch", "coupled", "plain accumulation", "micro-batch"
CONFIGURATIONS = (BIG, COUPLED, NAIVE, MICRO)
MODULE = "benchmarks.coupled"

COST = {
    "micro_batch": 16,
    "accum_steps": (1, 4, 16, 64),
    "size": 32,
    "rounds": 9,
    "turn_samples": 1024,
}
QUICK_COST = {
    "micro_batch": 4,
    "accum_steps": (2,),
    "size": 8,
    "rounds": 1,
    "turn_samples": 8,
    "quick": True,
}
QUALITY = {"micro_batch": 8, "accum_steps": 16, "updates": 300, "seeds": (0, 1, 2), "test": 1000}
QUICK_QUALITY = {"micro_batch": 4, "accum_steps": 2, "updates": 3, "seeds": (0,), "test": 50}


def info_nce(temperature):
    """Symmetric InfoNCE over the batch, per sample; ``y_pred`` is ``[query, candidate]``."""
    import keras
    from keras import ops

    def loss(y_true, y_pred):
        query, candidate = ops.split(y_pred, 2, axis=-1)
        logits = ops.matmul(query, ops.transpose(candidate)) / temperature
        labels = ops.arange(ops.shape(query)[0])
        forward = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        backward = keras.losses.sparse_categorical_crossentropy(
            labels, ops.transpose(logits), from_logits=True
        )
        return (forward + backward) / 2

    return loss


def clip_encoder(size, seed=0):
    """``(inputs, output)`` of the cost's dual encoder (see the module docstring)."""
    import keras

    keras.utils.set_random_seed(seed)
    image = keras.Input((size, size, 3))
    hidden = image
    for _ in range(2):
        hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    image_embedding = keras.layers.UnitNormalization()(keras.layers.Dense(64)(hidden))
    text = keras.Input((128,))
    hidden = keras.layers.Dense(512, activation="relu")(text)
    text_embedding = keras.layers.UnitNormalization()(keras.layers.Dense(64)(hidden))
    pair = keras.layers.Concatenate()([image_embedding, text_embedding])
    return [image, text], pair


def retrieval_encoder(seed):
    """``(inputs, output)`` of the quality's small dual encoder."""
    import keras

    keras.utils.set_random_seed(seed)

    def tower(inputs):
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        return keras.layers.UnitNormalization()(keras.layers.Dense(32)(hidden))

    query, candidate = keras.Input((64,)), keras.Input((64,))
    return [query, candidate], keras.layers.Concatenate()([tower(query), tower(candidate)])


def compiled(configuration, inputs, output, accum_steps, temperature):
    """One of :data:`CONFIGURATIONS`, compiled with Adam(1e-3)."""
    import keras

    from gradient_accumulator import GradientAccumulateModel

    if configuration in (BIG, MICRO):
        model = keras.Model(inputs, output)
    else:
        coupled_loss = "replica" if configuration == COUPLED else None
        model = GradientAccumulateModel(
            accum_steps=accum_steps, coupled_loss=coupled_loss, inputs=inputs, outputs=output
        )
    model.compile(keras.optimizers.Adam(1e-3), info_nce(temperature))
    return model


def batch_size(configuration, micro_batch, accum_steps):
    return micro_batch * accum_steps if configuration == BIG else micro_batch


def cost_data(samples, size, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    images = rng.normal(size=(samples, size, size, 3)).astype("float32")
    texts = rng.normal(size=(samples, 128)).astype("float32")
    return [images, texts], np.zeros((samples, 1), "float32")


def fit_quietly(model, x, y, batch, **kwargs):
    # Plain accumulation of a coupled loss warns at its first fit (the point
    # of the comparison): not the user's output here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, **kwargs)


# --- cost: time side by side, memory in fresh processes -------------------------


def time_per_sample(setup, accum_steps):
    """Seconds per sample of each configuration at ``accum_steps``, per round."""
    b = setup["micro_batch"]
    group = accum_steps * b
    # Whole groups a turn: two, and at least `turn_samples` samples.
    samples = group * max(2, -(-setup["turn_samples"] // group))
    x, y = cost_data(samples, setup["size"])
    models = {}
    for name in CONFIGURATIONS:
        models[name] = compiled(name, *clip_encoder(setup["size"]), accum_steps, 0.05)
        fit_quietly(models[name], x, y, batch_size(name, b, accum_steps))  # warm-up: traces

    def run_once(name):
        cpu = time.process_time()
        wall = timed(lambda: fit_quietly(models[name], x, y, batch_size(name, b, accum_steps)))
        return wall / samples, (time.process_time() - cpu) / samples

    raw = alternate({name: name for name in CONFIGURATIONS}, run_once, setup["rounds"])
    wall = {name: [w for w, _ in runs] for name, runs in raw.items()}
    cpu = {name: [c for _, c in runs] for name, runs in raw.items()}
    return wall, cpu


def memory_child(config):
    """One configuration's ``fit`` in this (fresh) process: its peaks, MiB."""
    import tensorflow as tf

    setup, name, accum_steps = config["setup"], config["configuration"], config["accum_steps"]
    b = setup["micro_batch"]
    x, y = cost_data(2 * accum_steps * b, setup["size"])
    model = compiled(name, *clip_encoder(setup["size"]), accum_steps, 0.05)
    batch = batch_size(name, b, accum_steps)
    fit_quietly(model, x, y, batch)  # traces; its peak is not the step's
    device = training_device()
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    idle = rss_mb()
    reset_peak_rss()
    fit_quietly(model, x, y, batch)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return {"tf_peak_mb": (peak - before) / MIB, "rss_extra_mb": peak_rss_mb() - idle}


def cost(setup):
    results = []
    fresh = not setup.get("quick")  # --quick: memory in this process (figures meaningless)
    for accum_steps in setup["accum_steps"]:
        rounds, cpu = time_per_sample(setup, accum_steps)
        memory = {}
        for name in CONFIGURATIONS:
            config = {"setup": setup, "configuration": name, "accum_steps": accum_steps}
            memory[name] = run_child(MODULE, config) if fresh else memory_child(config)
        big = rounds[BIG]
        results.append(
            {
                "accum_steps": accum_steps,
                "batch": setup["micro_batch"] * accum_steps,
                "big_batch_ms_per_sample": 1000 * median(big),
                "over_big_batch": {n: median_ratio(rounds[n], big) for n in CONFIGURATIONS},
                "over_big_batch_quartiles": {
                    n: ratio_quartiles(rounds[n], big) for n in CONFIGURATIONS
                },
                "seconds_per_sample": rounds,
                "cpu_over_big_batch": {n: median_ratio(cpu[n], cpu[BIG]) for n in CONFIGURATIONS},
                "cpu_seconds_per_sample": cpu,
                "memory": memory,
                "rounds": setup["rounds"],
            }
        )
        print_cost(results[-1:], setup)
    return results


def print_cost(results, setup):
    rows = []
    for r in results:
        for name in CONFIGURATIONS:
            q1, q3 = r["over_big_batch_quartiles"][name]
            rows.append(
                [
                    r["accum_steps"],
                    r["batch"],
                    name,
                    f"{r['over_big_batch'][name]:.2f} [{q1:.2f}, {q3:.2f}]",
                    f"{r['cpu_over_big_batch'][name]:.2f}",
                    f"{r['memory'][name]['tf_peak_mb']:.1f}",
                    f"{r['memory'][name]['rss_extra_mb']:.1f}",
                ]
            )
    print_table(
        f"cost (micro-batch {setup['micro_batch']}; time per sample over the big batch's: "
        f"median [quartiles] of {setup['rounds']} rounds; peaks of fit above before it, MiB)",
        [
            "k",
            "k*b",
            "configuration",
            "time/sample vs big",
            "CPU time vs big",
            "allocator peak",
            "RSS peak",
        ],
        rows,
    )


# --- quality --------------------------------------------------------------------


def retrieval_data(samples, seed):
    """``samples`` pairs: two noisy nonlinear 64-dimensional views of one latent vector."""
    import numpy as np

    maps = np.random.default_rng(1234)  # the task: the same for every split
    a, c = (maps.normal(size=(16, 64)).astype("float32") / 4 for _ in range(2))
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(samples, 16)).astype("float32")
    noise = rng.normal(size=(2, samples, 64)).astype("float32")
    return np.tanh(latent @ a) + 0.5 * noise[0], np.tanh(latent @ c) + 0.5 * noise[1]


def recall_at_1(model, queries, candidates):
    import numpy as np

    pair = model.predict([queries, candidates], batch_size=len(queries), verbose=0)
    query, candidate = np.split(pair, 2, axis=-1)
    return float(np.mean(np.argmax(query @ candidate.T, axis=1) == np.arange(len(query))))


def quality(setup):
    import numpy as np

    b, k, updates = setup["micro_batch"], setup["accum_steps"], setup["updates"]
    train = retrieval_data(updates * k * b, seed=1)
    test = retrieval_data(setup["test"], seed=2)
    results = {name: {"recall_at_1": []} for name in (MICRO, NAIVE, COUPLED, BIG)}
    coupled_vs_big = []
    for seed in setup["seeds"]:
        weights = {}
        for name in results:
            model = compiled(name, *retrieval_encoder(seed), k, 0.1)
            samples = updates * (b if name == MICRO else k * b)
            x = [train[0][:samples], train[1][:samples]]
            fit_quietly(model, x, np.zeros((samples, 1), "float32"), batch_size(name, b, k))
            assert int(model.optimizer.iterations.numpy()) == updates
            results[name]["recall_at_1"].append(recall_at_1(model, *test))
            weights[name] = model.get_weights()
        coupled_vs_big.append(
            max(float(np.max(np.abs(c - g))) for c, g in zip(weights[COUPLED], weights[BIG]))
        )
    for r in results.values():
        r["mean"] = float(np.mean(r["recall_at_1"]))
    payload = {**setup, "results": results, "coupled_vs_big_batch_max_weight_diff": coupled_vs_big}
    print_table(
        f"recall@1 among {setup['test']} held-out pairs after {updates} Adam updates "
        f"(seeds {list(setup['seeds'])}; chance {1 / setup['test']:.3f})",
        ["training", "batch", "recall@1 mean", "per seed"],
        [
            [
                name,
                b if name == MICRO else k * b,
                f"{r['mean']:.3f}",
                " ".join(f"{v:.3f}" for v in r["recall_at_1"]),
            ]
            for name, r in results.items()
        ],
    )
    print(
        "coupled against the big batch, max |weight difference| at the end, per seed: "
        + " ".join(f"{d:.1e}" for d in coupled_vs_big)
    )
    return payload


def plot(cost_results):
    def draw(ax):
        ks = [r["accum_steps"] for r in cost_results]
        for name, marker in zip(CONFIGURATIONS, "osx^"):
            ax.plot(
                ks,
                [r["memory"][name]["tf_peak_mb"] for r in cost_results],
                marker=marker,
                label=f"{name} (peak MiB)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accum_steps k (micro-batch b fixed; big batch k*b)")
        ax.set_ylabel("allocator peak of fit, MiB")
        twin = ax.twinx()
        twin.plot(
            ks,
            [r["over_big_batch"][COUPLED] for r in cost_results],
            "k--",
            label="coupled time/sample over big batch",
        )
        twin.set_ylabel("time per sample, coupled / big batch")
        twin.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
        ax.set_title("coupled_loss: memory and time against accum_steps")

    return draw


def main():
    # TensorFlow keeps no CPU allocator statistics without oneDNN, which it
    # turns on by default on some CPUs only; read when TensorFlow is imported
    # (here and in the fresh processes, which inherit it).
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="cost,quality", help="comma-separated: cost,quality")
    args = p.parse_args()
    parts = args.parts.split(",")
    for part in parts:
        if part not in ("cost", "quality"):
            p.error(f"`--parts`: unknown name {part!r}; the names are cost, quality")
    payload = {"quick": args.quick, "parts": parts}
    cost_setup = QUICK_COST if args.quick else COST
    if "cost" in parts:
        payload.update(
            micro_batch=cost_setup["micro_batch"],
            accum_steps=list(cost_setup["accum_steps"]),
            results=cost(cost_setup),
        )
        print_cost(payload["results"], cost_setup)
    if "quality" in parts:
        payload["quality"] = quality(QUICK_QUALITY if args.quick else QUALITY)
    name = "coupled_quick" if args.quick else "coupled"
    save(args.out, name, payload, plot(payload["results"]) if "results" in payload else None)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(memory_child(json.loads(sys.argv[2]))))
    else:
        main()
