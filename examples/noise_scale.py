"""The gradient noise scale while training: how big a batch still pays.

Trains the quick start's classifier on scikit-learn's bundled handwritten
digits (no download) with ``GradientAccumulateModel(accum_steps=8,
noise_scale=True)`` at micro-batch 8 (a batch of 64), and prints, per epoch,
the loss and the noise scale ``B_simple`` (McCandlish et al. 2018) that
``fit`` logged at the epoch's last update: the batch beyond which a bigger
batch buys proportionally fewer steps. It grows as training goes on (the
gradient's signal shrinks faster than its noise), the usual pattern: a batch
that is large for the first epochs becomes small for the later ones.

Run: ``python examples/noise_scale.py`` (``--quick`` for a short run).
"""

import argparse

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import numpy as np
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateModel

MICRO_BATCH = 8
ACCUM_STEPS = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs")
    args = parser.parse_args()
    epochs = 4 if args.quick else 20

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")

    keras.utils.set_random_seed(42)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    model = GradientAccumulateModel(
        accum_steps=ACCUM_STEPS, noise_scale=True, inputs=inputs, outputs=outputs
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs, verbose=0)

    batch = MICRO_BATCH * ACCUM_STEPS
    print(f"batch {batch} (accum_steps {ACCUM_STEPS} x micro-batch {MICRO_BATCH}), Adam")
    print("epoch  loss    noise scale B_simple")
    for epoch, (loss, scale) in enumerate(
        zip(history.history["loss"], history.history["noise_scale"]), start=1
    ):
        print(f"{epoch:5d}  {loss:.4f}  {scale:8.1f}")
    scales = np.array(history.history["noise_scale"])
    print(
        f"noise scale: {scales[0]:.1f} after the first epoch, {scales[-1]:.1f} after the last "
        f"(the batch is {batch})"
    )


if __name__ == "__main__":
    main()
