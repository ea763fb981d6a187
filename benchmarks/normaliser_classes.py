"""Cost of exact accumulation for losses with two normaliser classes (prototype).

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

Run: ``python -m benchmarks.normaliser_classes`` (``--quick``: tiny sizes;
``--jit``: XLA-compiled steps).
"""

import time

import numpy as np

from benchmarks._common import median, median_ratio, parser, ratio_quartiles, step_times

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


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jit", action="store_true")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=16)
    args = p.parse_args()
    import keras

    from gradient_accumulator import GradientAccumulateModel

    quick = args.quick
    rounds = 2 if quick else args.rounds
    micro_batch = args.micro_batch
    x, y = make_data(2 * ACCUM_STEPS * micro_batch, 200 if quick else VOCABULARY)
    jit = args.jit

    models, discovery_s = {}, {}
    for name, one_class in (("two_classes", False), ("one_class", True)):
        model = build(GradientAccumulateModel, one_class, quick, jit, accum_steps=ACCUM_STEPS)
        start = time.perf_counter()
        model._discover_normaliser_classes((x[:micro_batch], tuple(t[:micro_batch] for t in y)))
        discovery_s[name] = time.perf_counter() - start
        models[name] = model
    models["plain"] = build(keras.Model, False, quick, jit)
    assert models["two_classes"]._accumulator.num_classes == 2
    assert models["one_class"]._accumulator.num_classes == 1

    memory = {name: accumulator_bytes(models[name]) for name in ("two_classes", "one_class")}
    times = step_times(models, x, y, micro_batch, ACCUM_STEPS, rounds, args.groups)
    wall = {name: 1e3 * median(t["wall"]) for name, t in times.items()}
    cpu = {name: 1e3 * median(t["cpu"]) for name, t in times.items()}
    two, one = times["two_classes"], times["one_class"]
    print(f"mode: {'jit' if jit else 'graph'}; micro-batch {micro_batch} x {LENGTH} tokens; "
          f"accum_steps {ACCUM_STEPS}; {rounds} rounds x {args.groups} groups")
    for name in ("two_classes", "one_class"):
        m = memory[name]
        print(
            f"{name}: accumulator state {m['one_class_state_bytes']} B + class extras "
            f"{m['class_extra_bytes']} B (gradient sums {m['class_extra_gradient_sum_bytes']} B); "
            f"a sum per class for every variable would add {m['a_sum_per_class_for_every_variable_bytes']} B; "
            f"several sums: {m['variables_with_several_sums']}; discovery pass {discovery_s[name]:.2f} s"
        )
    for name in models:
        by_position = ", ".join(f"{1e3 * v:.2f}" for v in times[name]["by_position"])
        print(f"{name}: median {wall[name]:.2f} ms/micro-step wall, {cpu[name]:.2f} ms cpu; "
              f"by position in group [{by_position}] ms")
    q1, q3 = ratio_quartiles(two["wall"], one["wall"])
    print(
        f"two_classes / one_class: wall {median_ratio(two['wall'], one['wall']):.3f} "
        f"(quartiles {q1:.3f}-{q3:.3f}), cpu {median_ratio(two['cpu'], one['cpu']):.3f}; "
        f"accumulate-only steps {np.median(two['by_position'][:-1]) / np.median(one['by_position'][:-1]):.3f}, "
        f"update step {two['by_position'][-1] / one['by_position'][-1]:.3f}"
    )
    print(
        f"one_class / plain: wall {median_ratio(one['wall'], times['plain']['wall']):.3f}; "
        f"two_classes / plain: wall {median_ratio(two['wall'], times['plain']['wall']):.3f}"
    )


if __name__ == "__main__":
    main()
