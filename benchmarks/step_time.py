"""Per-micro-step time of accumulation relative to plain training at the same micro-batch.

Compares, at the same micro-batch size and model: plain Keras training (one
optimizer update per micro-batch), Keras's built-in
``optimizer(gradient_accumulation_steps=k)`` and ``GradientAccumulateModel(k)``.
Configurations alternate within each round; the figure is the median over
rounds of time(accumulation) / time(plain). Tracing is excluded (a warm-up fit
per configuration).

Run: ``python -m benchmarks.step_time`` (``--quick`` for CI).
"""

import keras
import numpy as np

from benchmarks._common import alternate, median_ratio, parser, print_table, save, timed
from gradient_accumulator import GradientAccumulateModel

ACCUM_STEPS = 4


def build_model(kind, quick):
    keras.utils.set_random_seed(0)
    if kind == "mobilenetv2":
        size = 32 if quick else 64
        base = keras.applications.MobileNetV2(
            input_shape=(size, size, 3), alpha=0.35, weights=None, classes=10
        )
        return base.input, base.output, (size, size, 3), 10
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    return inputs, outputs, (256,), 10


def make(kind, flavour, jit, quick):
    inputs, outputs, _, _ = build_model(kind, quick)
    if flavour == "library":
        model = GradientAccumulateModel(accum_steps=ACCUM_STEPS, inputs=inputs, outputs=outputs)
        optimizer = keras.optimizers.Adam(1e-3)
    else:
        model = keras.Model(inputs, outputs)
        steps = ACCUM_STEPS if flavour == "keras_builtin" else None
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps)
    model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=jit)
    return model


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    quick = args.quick
    micro_batch = 4 if quick else 16
    steps = 8 if quick else 48
    repeats = 2 if quick else 7
    rows, payload = [], []
    for kind in ["dense", "mobilenetv2"]:
        for jit in [False, True]:
            _, _, shape, classes = build_model(kind, quick)
            rng = np.random.default_rng(0)
            x = rng.normal(size=(micro_batch * steps, *shape)).astype("float32")
            y = rng.integers(0, classes, size=(micro_batch * steps,))
            models = {
                flavour: make(kind, flavour, jit, quick)
                for flavour in ["plain", "keras_builtin", "library"]
            }
            for model in models.values():  # warm-up: trace and compile
                model.fit(x, y, batch_size=micro_batch, epochs=1, verbose=0)

            def run_once(model, x=x, y=y):
                return (
                    timed(lambda: model.fit(x, y, batch_size=micro_batch, epochs=1, verbose=0))
                    / steps
                )

            times = alternate(models, run_once, repeats)
            builtin = median_ratio(times["keras_builtin"], times["plain"])
            library = median_ratio(times["library"], times["plain"])
            plain_ms = 1e3 * float(np.median(times["plain"]))
            mode = "jit" if jit else "graph"
            rows.append([kind, mode, f"{plain_ms:.2f}", f"{builtin:.3f}", f"{library:.3f}"])
            payload.append(
                {
                    "model": kind,
                    "mode": mode,
                    "plain_ms_per_micro_step": plain_ms,
                    "keras_builtin_over_plain": builtin,
                    "library_over_plain": library,
                    "times": times,
                }
            )
    print_table(
        f"time per micro-step relative to plain training (accum_steps={ACCUM_STEPS}, "
        f"micro-batch {micro_batch}, Adam, median of {repeats} alternating rounds "
        f"of {steps} micro-steps)",
        ["model", "mode", "plain ms/step", "keras built-in / plain", "library / plain"],
        rows,
    )

    def plot(ax):
        labels = [f"{r['model']}\n{r['mode']}" for r in payload]
        xs = np.arange(len(labels))
        ax.bar(
            xs - 0.2, [r["keras_builtin_over_plain"] for r in payload], 0.4, label="Keras built-in"
        )
        ax.bar(
            xs + 0.2, [r["library_over_plain"] for r in payload], 0.4, label="gradient_accumulator"
        )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(xs, labels)
        ax.set_ylabel("time per micro-step / plain")
        ax.set_title(f"Accumulation overhead (k={ACCUM_STEPS})")
        ax.legend()

    save(
        args.out,
        "step_time" + ("_quick" if quick else ""),
        {
            "accum_steps": ACCUM_STEPS,
            "micro_batch": micro_batch,
            "steps": steps,
            "repeats": repeats,
            "results": payload,
        },
        plot,
    )


if __name__ == "__main__":
    main()
