"""Quick start: train with 8-step gradient accumulation and show it equals the big batch.

Trains a small classifier on scikit-learn's bundled handwritten digits (shipped
inside the package, no download) three ways from the same initial weights:

1. plain Keras at batch 8 (what fits in memory),
2. ``GradientAccumulateModel(accum_steps=8)`` at micro-batch 8,
3. plain Keras at batch 64 (the batch we want but, in the story, cannot fit).

Run: ``python examples/quickstart.py`` (``--quick`` for a short run). The last
line is the verdict: accumulation equals plain batch 64 within float32
rounding, or a ``FAIL`` line and exit status 1.
"""

import argparse
import sys

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import numpy as np
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateModel

MICRO_BATCH = 8
ACCUM_STEPS = 8
# The float32 tolerance of the equivalence tests (FLOAT32_ATOL in
# tests/helpers.py): both runs add the same gradients in another order, so
# weights differ by a few float32 roundings, far below this.
TOLERANCE = 1e-6


def build(cls=keras.Model, **kwargs):
    """The same architecture and, thanks to the seed, the same initial weights."""
    keras.utils.set_random_seed(42)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def train(model, x, y, batch_size, epochs, verbose):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=verbose)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs (for CI)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help="largest weight difference from plain batch 64 accepted (default: %(default)s)",
    )
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    print(
        f"Effective batch: {ACCUM_STEPS} micro-batches x {MICRO_BATCH} samples "
        f"= {ACCUM_STEPS * MICRO_BATCH}\n"
    )
    print("GradientAccumulateModel(accum_steps=8), fit(batch_size=8):")
    accumulating = train(
        build(GradientAccumulateModel, accum_steps=ACCUM_STEPS),
        x_train,
        y_train,
        MICRO_BATCH,
        epochs,
        verbose=1,
    )
    # The two references, from the same initial weights, without progress bars.
    print("\nTraining plain Keras at batch 64 (the reference) ...", end=" ", flush=True)
    big = train(build(), x_train, y_train, ACCUM_STEPS * MICRO_BATCH, epochs, verbose=0)
    print("done.\nTraining plain Keras at batch 8 (for contrast) ...", end=" ", flush=True)
    small = train(build(), x_train, y_train, MICRO_BATCH, epochs, verbose=0)
    print("done.")

    micro_steps = epochs * -(-len(x_train) // MICRO_BATCH)
    print(
        f"\nMicro-steps run: {micro_steps}; optimizer updates: "
        f"{int(accumulating.optimizer.iterations.numpy())} "
        f"(plain batch 64: {int(big.optimizer.iterations.numpy())})"
    )

    def gap(a, b):
        return max(float(np.max(np.abs(p - q))) for p, q in zip(a.get_weights(), b.get_weights()))

    diff = gap(accumulating, big)
    print(f"max |weight difference| vs plain batch 64: {diff:.2e}")
    print(f"max |weight difference| vs plain batch 8:  {gap(accumulating, small):.2e}")
    for name, model in [
        ("accumulate 8 x 8", accumulating),
        ("plain batch 64", big),
        ("plain batch 8", small),
    ]:
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"test accuracy, {name:>16}: {accuracy:.4f}")

    same_updates = accumulating.optimizer.iterations.numpy() == big.optimizer.iterations.numpy()
    if diff < args.tolerance and same_updates:
        print(
            "equal to plain batch 64 within float32 rounding: "
            f"max |diff| {diff:.2e} (tolerance {args.tolerance:.0e})"
        )
    else:
        print(
            "FAIL: not equal to plain batch 64: "
            f"max |diff| {diff:.2e} (tolerance {args.tolerance:.0e}), "
            f"updates {'equal' if same_updates else 'differ'}"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
