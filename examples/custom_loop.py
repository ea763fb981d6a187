"""Custom training loop: GradientAccumulateOptimizer updates once every `accum_steps` calls.

Trains a small classifier on scikit-learn's bundled handwritten digits (no
download) with a hand-written ``tf.function`` train step, twice from the same
initial weights:

1. micro-batches of 8 through ``GradientAccumulateOptimizer(Adam, accum_steps=8)``,
2. plain Adam on batches of 64 (the reference: the batch we want),

and shows that both end with the same weights: each update of the wrapper is
one Adam step on the concatenated 64 samples.

Run: ``python examples/custom_loop.py`` (``--quick`` for a short run).
"""

import argparse

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateOptimizer

MICRO_BATCH = 8
ACCUM_STEPS = 8
# 24 groups of 64: every group holds ACCUM_STEPS equal micro-batches (see the
# note on unequal micro-batches at the end of `train`).
NUM_TRAIN = 24 * MICRO_BATCH * ACCUM_STEPS


def build_model():
    """The same architecture and, thanks to the seed, the same initial weights."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def train(model, optimizer, dataset, epochs):
    """A plain custom loop; only its last lines know about accumulation."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy()  # mean over the batch
    # Create the optimizer's state (and the accumulators) eagerly, before the
    # first traced step.
    optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        # A micro-step: adds `grads` to the sums; every ACCUM_STEPS-th call
        # applies their mean with the inner optimizer.
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(epochs):
        losses = [float(train_step(x, y)) for x, y in dataset]
        print(f"epoch {epoch + 1}: mean loss per batch {np.mean(losses):.4f}")
    # Applies a group left unfinished (micro-steps not a multiple of
    # accum_steps); a no-op here, where every group is complete. The wrapper
    # weights micro-batches equally: give them equal sizes (drop_remainder),
    # or see the optimizer guide for unequal ones.
    if isinstance(optimizer, GradientAccumulateOptimizer):
        optimizer.apply_accumulated_gradients()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs (for CI)")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, y_train = x[:NUM_TRAIN], y[:NUM_TRAIN]
    x_test, y_test = x[NUM_TRAIN:], y[NUM_TRAIN:]

    def batches(size):
        return tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(
            size, drop_remainder=True
        )

    print(
        f"Effective batch: {ACCUM_STEPS} micro-batches x {MICRO_BATCH} samples "
        f"= {ACCUM_STEPS * MICRO_BATCH}\n"
    )
    # --- the optimizer ----------------------------------------------------
    optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(1e-3), accum_steps=ACCUM_STEPS)
    # --- end of the optimizer ---------------------------------------------
    print("GradientAccumulateOptimizer(Adam, accum_steps=8), micro-batches of 8:")
    accumulating = train(build_model(), optimizer, batches(MICRO_BATCH), epochs)

    print("\nplain Adam, batches of 64 (reference):")
    reference_optimizer = keras.optimizers.Adam(1e-3)
    reference = train(
        build_model(), reference_optimizer, batches(MICRO_BATCH * ACCUM_STEPS), epochs
    )

    micro_steps = epochs * (NUM_TRAIN // MICRO_BATCH)
    print(
        f"\nMicro-steps run: {micro_steps}; optimizer updates: {int(optimizer.iterations.numpy())} "
        f"(plain batch 64: {int(reference_optimizer.iterations.numpy())})"
    )
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(accumulating.get_weights(), reference.get_weights())
    )
    print(f"max |weight difference| vs plain batch 64: {gap:.2e}")
    for name, model in [("accumulate 8 x 8", accumulating), ("plain batch 64", reference)]:
        predictions = np.argmax(model.predict(x_test, verbose=0), axis=-1)
        print(f"test accuracy, {name:>16}: {np.mean(predictions == y_test):.4f}")


if __name__ == "__main__":
    main()
