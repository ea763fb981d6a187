"""BN in a pretrained network: swap MobileNetV2's BatchNormalization layers, train accumulating.

MobileNetV2 has 52 ``BatchNormalization`` layers. Trained with gradient
accumulation, plain BN would move its statistics on every micro-batch, with
the statistics of that micro-batch. ``replace_batchnorm_layers`` returns a
copy of the network in which every BN layer is an ``AccumBatchNormalization``
with the same weights and moving statistics (so the copy predicts exactly what
the original does), whose moving statistics follow the accumulated batch and
move once per update. After training, ``restore_batchnorm_layers`` hands the
trained network over as plain Keras (Keras's own BatchNormalization layers,
no wrapper): its ``.keras`` file loads where this package is not installed.

Hermetic: ``weights=None`` and synthetic images, no download. The BN layers
are given non-trivial statistics to stand in for pretrained ones; with real
ImageNet weights pass ``weights="imagenet"`` (input 96 to 224 pixels) and skip
``pretend_pretrained``.

Run: ``python examples/mobilenetv2_bn_swap.py`` (``--quick``: 32x32 inputs, a
short run for CI).
"""

import argparse
import tempfile
from pathlib import Path

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import numpy as np

from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from gradient_accumulator.utils import replace_batchnorm_layers, restore_batchnorm_layers

MICRO_BATCH = 8
ACCUM_STEPS = 4
CLASSES = 4


def synthetic_images(num_samples, size, seed):
    """Noisy images whose class sets the mean colour: learnable, no download."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, num_samples)
    colours = np.linspace(-1.0, 1.0, CLASSES * 3).reshape(CLASSES, 1, 1, 3)
    images = colours[labels] + rng.normal(0.0, 1.0, (num_samples, size, size, 3))
    return images.astype("float32"), labels


def pretend_pretrained(model, seed=0):
    """Gives every BN layer the kind of weights a pretrained network has."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, variance = layer.get_weights()
            layer.set_weights(
                [
                    rng.uniform(0.5, 1.5, gamma.shape),
                    rng.normal(0.0, 0.2, beta.shape),
                    rng.normal(0.0, 0.5, mean.shape),
                    rng.uniform(0.5, 2.0, variance.shape),
                ]
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32x32 inputs, 2 epochs (for CI)")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    size = 32 if args.quick else 96
    epochs = 2 if args.quick else args.epochs
    num_train = 128 if args.quick else 2048
    x_train, y_train = synthetic_images(num_train, size, seed=1)
    x_test, y_test = synthetic_images(64, size, seed=2)

    keras.utils.set_random_seed(0)
    # --- swap ---------------------------------------------------------------
    base = keras.applications.MobileNetV2(
        input_shape=(size, size, 3), alpha=0.35, weights=None, classes=CLASSES
    )
    pretend_pretrained(base)  # with weights="imagenet": not needed
    swapped = replace_batchnorm_layers(base, accum_steps=ACCUM_STEPS)
    model = GradientAccumulateModel(
        accum_steps=ACCUM_STEPS, inputs=swapped.input, outputs=swapped.output
    )
    # --- end of swap --------------------------------------------------------

    def count(cls, network):
        return sum(type(layer) is cls for layer in network.layers)

    print(
        f"BatchNormalization layers: {count(keras.layers.BatchNormalization, base)} in the "
        f"original, {count(AccumBatchNormalization, model)} AccumBatchNormalization "
        f"(and {count(keras.layers.BatchNormalization, model)} BatchNormalization) after the swap"
    )
    before = base.predict(x_test, verbose=0)
    after = model.predict(x_test, verbose=0)
    print(f"max |inference output difference| after the swap: {np.max(np.abs(before - after)):.1e}")
    print(
        f"Effective batch: {ACCUM_STEPS} micro-batches x {MICRO_BATCH} samples "
        f"= {ACCUM_STEPS * MICRO_BATCH}; input {size}x{size}\n"
    )

    # --- train --------------------------------------------------------------
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=MICRO_BATCH, epochs=epochs, verbose=1)
    # --- end of train -------------------------------------------------------

    micro_steps = epochs * -(-num_train // MICRO_BATCH)
    print(
        f"\nMicro-steps run: {micro_steps}; optimizer updates: "
        f"{int(model.optimizer.iterations.numpy())}"
    )
    # Every AccumBatchNormalization moved its statistics on those updates only,
    # and nothing is left pending at the end of fit.
    pending = max(
        float(np.max(layer.pending_count.numpy()))
        for layer in model.layers
        if isinstance(layer, AccumBatchNormalization)
    )
    print(f"samples left pending in the BN layers after fit: {int(pending)}")
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss: {loss:.4f}; test accuracy (moving statistics): {accuracy:.4f}")

    # --- hand over -----------------------------------------------------------
    plain = restore_batchnorm_layers(model)  # Keras's own layers, no wrapper
    with tempfile.TemporaryDirectory() as folder:
        plain.save(Path(folder) / "mobilenetv2.keras")  # loads without gradient_accumulator
        loaded = keras.saving.load_model(Path(folder) / "mobilenetv2.keras")
    # --- end of hand over ----------------------------------------------------
    print(
        f"\nHanded over as plain Keras: {type(plain).__name__}, "
        f"{count(keras.layers.BatchNormalization, plain)} BatchNormalization, "
        f"{count(AccumBatchNormalization, plain)} AccumBatchNormalization"
    )
    handed = np.max(np.abs(model.predict(x_test, verbose=0) - loaded.predict(x_test, verbose=0)))
    print(f"max |inference output difference| of the reloaded plain model: {handed:.1e}")


if __name__ == "__main__":
    main()
