"""Cost of exact accumulation for losses with two normaliser classes.

A parameter-heavy two-head model: Embedding(5000, 256, mask_zero=True) ->
Dense(1024, tanh) -> a per-token tag head (loss masked: divided by the valid
tokens) and a pooled per-sequence head (loss divided by the samples). Two
normaliser classes: the embedding and the trunk Dense are reached by both,
each head by its own.

Compared side by side, same weights, data and seed:

- ``two_classes``: that model, ``GradientAccumulateModel(accum_steps=4)``:
  one gradient per class per micro-step, a second sum for the shared
  variables.
- ``one_class``: the same model whose token head does not see the mask
  (a layer drops it just before the head; the pooling still uses it), so
  both losses are means over samples: one class, today's one-gradient step.
- ``plain``: the two-class model as plain ``keras.Model`` at the same
  micro-batch (one update per batch), for scale.

Memory: the exact bytes of the accumulator's state, and what a sum per class
for *every* variable would cost instead. Time: median over alternating rounds
of the per-round mean time of ``model.train_function`` calls (whole groups),
as ``benchmarks/step_time.py`` (see ``benchmarks._common.step_times``).

Both in graph mode and with ``jit_compile=True``, in one run.

Run: ``python -m benchmarks.normaliser_classes`` (``--quick``: tiny sizes).
"""

import time

import numpy as np

from benchmarks._common import (
    median,
    median_ratio,
    parser,
    print_table,
    ratio_quartiles,
    save,
    step_times,
)

ACCUM_STEPS = 4
VOCABULARY = 5000
EMBEDDING = 256
HIDDEN = 1024
TAGS = 32
LENGTH = 32


def build(cls, one_class, quick, jit_compile=False, **kwargs):
    import keras

    class DropMask(keras.layers.Layer):
        def call(self, inputs):
            # A new tensor: the input one carries the mask as an attribute.
            return keras.ops.multiply(inputs, 1.0)

        def compute_mask(self, inputs, mask=None):
            return None

    keras.utils.set_random_seed(0)
    vocabulary, embedding, hidden_units = (
        (200, 16, 32) if quick else (VOCABULARY, EMBEDDING, HIDDEN)
    )
    inputs = keras.Input((LENGTH,), dtype="int32")
    embedded = keras.layers.Embedding(vocabulary, embedding, mask_zero=True)(inputs)
    hidden = keras.layers.Dense(hidden_units, activation="tanh")(embedded)
    token_input = DropMask()(hidden) if one_class else hidden
    tags = keras.layers.Dense(TAGS, name="tags")(token_input)
    pooled = keras.layers.Dense(1, name="pooled")(keras.layers.GlobalAveragePooling1D()(hidden))
    model = cls(inputs=inputs, outputs=[tags, pooled], **kwargs)
    model.compile(
        keras.optimizers.Adam(1e-3),
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        loss_weights=[1.0, 0.3],
        jit_compile=jit_compile,
    )
    return model


def make_data(samples, vocabulary, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, LENGTH + 1, size=samples)
    valid = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = np.where(valid, rng.integers(1, vocabulary, size=(samples, LENGTH)), 0).astype("int32")
    tags = rng.integers(0, TAGS, size=(samples, LENGTH)).astype("int32")
    scores = rng.normal(size=(samples, 1)).astype("float32")
    return x, (tags, scores)


def accumulator_bytes(model):
    """Exact bytes of the accumulator's state, split into one-class and class extras."""
    accumulator = model._accumulator

    def size(variables):
        return int(sum(np.prod(v.shape) * v.dtype.size for v in variables))

    base = [
        accumulator.micro_step,
        accumulator.weight_sum,
        accumulator.group_reference,
        accumulator.update_count,
        *accumulator.gradient_sums,
    ]
    extra = [v for v in accumulator.state_variables if all(v is not b for b in base)]
    variables = model.trainable_variables
    routing = model._normaliser_classes.routing if accumulator.num_classes > 1 else None
    every = 4 * int(sum(np.prod(v.shape) for v in variables)) * (accumulator.num_classes - 1)
    shared = (
        []
        if routing is None
        else [v.path for v, classes in zip(variables, routing) if len(classes) > 1]
    )
    return {
        "one_class_state_bytes": size(base),
        "class_extra_bytes": size(extra),
        "class_extra_gradient_sum_bytes": size(getattr(accumulator, "class_gradient_sums", [])),
        "a_sum_per_class_for_every_variable_bytes": every,
        "trainable_parameter_bytes": 4 * int(sum(np.prod(v.shape) for v in variables)),
        "variables_with_several_sums": shared,
    }


def measure(mode, quick, rounds, groups, micro_batch):
    """One mode's figures: memory of both accumulators and side-by-side step times."""
    import keras

    from gradient_accumulator import GradientAccumulateModel

    jit = mode == "jit"
    x, y = make_data(2 * ACCUM_STEPS * micro_batch, 200 if quick else VOCABULARY)
    models, discovery_s = {}, {}
    for name, one_class in (("two_classes", False), ("one_class", True)):
        model = build(GradientAccumulateModel, one_class, quick, jit, accum_steps=ACCUM_STEPS)
        spec = (x[:micro_batch], tuple(t[:micro_batch] for t in y))
        start = time.perf_counter()
        # What `fit` does before its first trace (a traced, never-run pass).
        model._discover_normaliser_classes(keras.tree.map_structure(lambda t: tf_spec(t), spec))
        discovery_s[name] = time.perf_counter() - start
        models[name] = model
    models["plain"] = build(keras.Model, False, quick, jit)
    assert models["two_classes"]._accumulator.num_classes == 2
    assert models["one_class"]._accumulator.num_classes == 1
    memory = {name: accumulator_bytes(models[name]) for name in ("two_classes", "one_class")}
    times = step_times(models, x, y, micro_batch, ACCUM_STEPS, rounds, groups)
    two, one, plain = times["two_classes"], times["one_class"], times["plain"]
    q1, q3 = ratio_quartiles(two["wall"], one["wall"])
    return {
        "mode": mode,
        "memory": memory,
        "discovery_s": discovery_s,
        "ms_per_micro_step": {name: 1e3 * median(t["wall"]) for name, t in times.items()},
        "two_over_one_class": median_ratio(two["wall"], one["wall"]),
        "two_over_one_class_quartiles": [q1, q3],
        "two_over_one_class_cpu": median_ratio(two["cpu"], one["cpu"]),
        "accumulate_only_two_over_one": float(
            np.median(two["by_position"][:-1]) / np.median(one["by_position"][:-1])
        ),
        "update_step_two_over_one": float(two["by_position"][-1] / one["by_position"][-1]),
        "one_class_over_plain": median_ratio(one["wall"], plain["wall"]),
        "two_classes_over_plain": median_ratio(two["wall"], plain["wall"]),
    }


def tf_spec(value):
    import tensorflow as tf

    return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16)
    args = p.parse_args()
    quick = args.quick
    rounds = 2 if quick else args.rounds
    micro_batch = 4 if quick else args.micro_batch
    records = [measure(mode, quick, rounds, args.groups, micro_batch) for mode in ("graph", "jit")]

    memory = records[0]["memory"]
    print(
        f"micro-batch {micro_batch} x {LENGTH} tokens; accum_steps {ACCUM_STEPS}; "
        f"{rounds} alternating rounds x {args.groups} groups"
    )
    print_table(
        "Accumulator state (bytes)",
        ["model", "one-class state", "class extras", "of which sums", "a sum per class for all"],
        [
            [
                name,
                memory[name]["one_class_state_bytes"],
                memory[name]["class_extra_bytes"],
                memory[name]["class_extra_gradient_sum_bytes"],
                memory[name]["a_sum_per_class_for_every_variable_bytes"],
            ]
            for name in ("two_classes", "one_class")
        ],
    )
    print(f"variables with several sums: {memory['two_classes']['variables_with_several_sums']}")
    print_table(
        "Time per micro-step (median of rounds)",
        [
            "mode",
            "plain ms",
            "one class ms",
            "two classes ms",
            "two / one",
            "accumulate-only",
            "update step",
            "two / plain",
        ],
        [
            [
                r["mode"],
                f"{r['ms_per_micro_step']['plain']:.2f}",
                f"{r['ms_per_micro_step']['one_class']:.2f}",
                f"{r['ms_per_micro_step']['two_classes']:.2f}",
                f"{r['two_over_one_class']:.3f}",
                f"{r['accumulate_only_two_over_one']:.3f}",
                f"{r['update_step_two_over_one']:.3f}",
                f"{r['two_classes_over_plain']:.3f}",
            ]
            for r in records
        ],
    )

    def plot(ax):
        labels = [r["mode"] for r in records]
        index = np.arange(len(records))
        ax.bar(index - 0.2, [r["one_class_over_plain"] for r in records], 0.4, label="one class")
        ax.bar(
            index + 0.2, [r["two_classes_over_plain"] for r in records], 0.4, label="two classes"
        )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(index, labels)
        ax.set_ylabel("time per micro-step / plain Keras")
        ax.set_title(f"Two normaliser classes vs one (k={ACCUM_STEPS})")
        ax.legend()

    save(
        args.out,
        "normaliser_classes" + ("_quick" if quick else ""),
        {
            "accum_steps": ACCUM_STEPS,
            "micro_batch": micro_batch,
            "quick": quick,
            "rounds": rounds,
            "results": records,
        },
        plot,
    )


if __name__ == "__main__":
    main()
