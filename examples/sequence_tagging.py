"""Sequence tagging on padded sequences: token-level losses equal the big batch.

A tagger (``Embedding(mask_zero=True)`` -> ``Dense`` per token) learns to tag
synthetic padded sequences of 1 to 20 tokens with a per-token
``SparseCategoricalCrossentropy``. Keras divides that loss by the number of
valid (unpadded) tokens of its batch, so the big batch weighs each
micro-batch by its token count, not its sample count. Trained from the same
initial weights three ways:

1. plain Keras at batch 32 (the reference),
2. ``GradientAccumulateModel(accum_steps=4)`` at micro-batch 8,
3. ``GradientAccumulateOptimizer(accum_steps=4)`` in a ``tf.function`` custom
   loop at micro-batch 8, which counts each micro-batch's valid tokens and
   passes them to ``optimizer.scale_loss(loss, normaliser=tokens)``,
4. plain Keras at micro-batch 8 with Keras's own
   ``gradient_accumulation_steps=4`` (weights micro-batches by samples).

Run: ``python examples/sequence_tagging.py`` (``--quick`` for a short run).
Prints each run's max |weight difference| from the reference and the size of
the reference's own change, then a verdict line (``FAIL`` and exit status 1
if the accumulating model is not within float32 rounding).
"""

import argparse
import sys

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
)

VOCABULARY = 50
LENGTH = 20
TAGS = 5
MICRO_BATCH = 8
ACCUM_STEPS = 4
TOLERANCE = 1e-6  # float32, as in the tests (FLOAT32_ATOL)


def make_data(num_samples, seed=0):
    """Sequences of 1-20 tokens (0 pads); a token's tag is its id mod 5, 10% noise."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, LENGTH + 1, size=num_samples)
    valid = np.arange(LENGTH)[None, :] < lengths[:, None]
    x = np.where(valid, rng.integers(1, VOCABULARY, size=(num_samples, LENGTH)), 0)
    tags = np.where(rng.uniform(size=x.shape) < 0.1, rng.integers(0, TAGS, size=x.shape), x % TAGS)
    return x.astype("int32"), tags.astype("int32")


def build(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((LENGTH,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 16, mask_zero=True)(inputs)
    hidden = keras.layers.Dense(32, activation="relu")(embedded)
    return cls(inputs=inputs, outputs=keras.layers.Dense(TAGS)(hidden), **kwargs)


def train(model, x, y, batch_size, epochs, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def train_custom_loop(x, y, epochs, learning_rate):
    """A tf.function loop: one micro-batch per call, its token count as the normaliser."""
    model = build()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = GradientAccumulateOptimizer(
        keras.optimizers.SGD(learning_rate), accum_steps=ACCUM_STEPS
    )
    optimizer.build(model.trainable_variables)

    @tf.function
    def micro_step(tokens, tags):
        with tf.GradientTape() as tape:
            # Keras's loss: a mean over this micro-batch's valid tokens.
            loss = loss_fn(tags, model(tokens, training=True))
            valid_tokens = tf.reduce_sum(tf.cast(tokens != 0, "float32"))
            scaled = optimizer.scale_loss(loss, normaliser=valid_tokens)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(epochs):
        for start in range(0, len(x), MICRO_BATCH):
            micro_step(x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
    return model


def gap(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a.get_weights(), b.get_weights()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (for CI)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = parser.parse_args()
    epochs, num_samples = (1, 256) if args.quick else (3, 1024)
    x, y = make_data(num_samples)
    # Plain SGD: its sparse Embedding update sums repeated rows exactly as
    # the accumulated dense gradient does (Keras's sparse Adam does not).
    learning_rate = 0.2

    big = train(
        build(), x, y, ACCUM_STEPS * MICRO_BATCH, epochs, keras.optimizers.SGD(learning_rate)
    )
    accumulating = train(
        build(GradientAccumulateModel, accum_steps=ACCUM_STEPS),
        x,
        y,
        MICRO_BATCH,
        epochs,
        keras.optimizers.SGD(learning_rate),
    )
    custom_loop = train_custom_loop(x, y, epochs, learning_rate)
    builtin = train(
        build(),
        x,
        y,
        MICRO_BATCH,
        epochs,
        keras.optimizers.SGD(learning_rate, gradient_accumulation_steps=ACCUM_STEPS),
    )
    diff = gap(accumulating, big)
    print(f"{num_samples} sequences of 1-{LENGTH} tokens, {epochs} epoch(s), SGD({learning_rate})")
    print(
        f"reference: plain Keras, batch {ACCUM_STEPS * MICRO_BATCH}; "
        f"its weights moved by {gap(big, build()):.2e}"
    )
    print(
        f"GradientAccumulateModel(accum_steps={ACCUM_STEPS}), batch {MICRO_BATCH}: "
        f"max |diff| {diff:.2e}"
    )
    loop_diff = gap(custom_loop, big)
    print(
        f"GradientAccumulateOptimizer, custom loop, batch {MICRO_BATCH}: max |diff| {loop_diff:.2e}"
    )
    print(
        f"Keras gradient_accumulation_steps={ACCUM_STEPS}, batch {MICRO_BATCH}:      "
        f"max |diff| {gap(builtin, big):.2e}"
    )
    x_test, y_test = make_data(512, seed=1)
    print(f"test loss (accumulating): {accumulating.evaluate(x_test, y_test, verbose=0):.4f}")
    diff = max(diff, loop_diff)
    if diff < args.tolerance:
        print(
            f"equal to plain batch {ACCUM_STEPS * MICRO_BATCH} within float32 rounding: "
            f"max |diff| {diff:.2e} (tolerance {args.tolerance:.0e})"
        )
    else:
        print(
            f"FAIL: not equal to plain batch {ACCUM_STEPS * MICRO_BATCH}: max |diff| {diff:.2e} "
            f"(tolerance {args.tolerance:.0e})"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
