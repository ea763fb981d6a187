"""Tuning the batch with KerasTuner: ``accum_steps`` as a hyperparameter.

The micro-batch is what fits the device (``choose_micro_batch`` finds it, or you
know it); the batch is a choice of training. So the tuner searches the batch
as ``accum_steps`` at a fixed micro-batch, and the learning rate with it:
each trial's model is a ``GradientAccumulateModel`` whose ``fit`` at the
micro-batch trains as ``fit`` at ``accum_steps`` times it would. A grid search
over three batches and two learning rates on scikit-learn's bundled digits (no
download); prints each trial's batch, learning rate, updates and validation
accuracy, then the best.

Run: ``python examples/tuning.py`` (``--quick`` for a short run). Needs
``keras-tuner`` (``pip install -e ".[kerastuner]"``).
"""

import argparse
import tempfile

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import keras_tuner
from sklearn.datasets import load_digits

from gradient_accumulator import GradientAccumulateModel

MICRO_BATCH = 8  # what fits the device


# --- hypermodel
class AccumulatingClassifier(keras_tuner.HyperModel):
    """A classifier whose batch (``accum_steps`` x ``MICRO_BATCH``) is a hyperparameter.

    ``updates``: per ``(accum_steps, learning_rate)`` trained, the optimizer's updates.
    """

    def __init__(self):
        super().__init__()
        self.updates = {}

    def build(self, hp):
        accum_steps = hp.Choice("accum_steps", [1, 4, 16])
        learning_rate = hp.Choice("learning_rate", [1e-3, 3e-3])
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(10, activation="softmax")(hidden)
        model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    def fit(self, hp, model, *args, **kwargs):
        # Always the micro-batch: the batch is accum_steps times it.
        history = model.fit(*args, batch_size=MICRO_BATCH, **kwargs)
        self.updates[hp.get("accum_steps"), hp.get("learning_rate")] = int(
            model.optimizer.iterations.numpy()
        )
        return history


# --- end of hypermodel


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs")
    args = parser.parse_args()
    epochs = 2 if args.quick else 10

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    train, validation = slice(0, 1400), slice(1400, None)

    with tempfile.TemporaryDirectory() as folder:
        hypermodel = AccumulatingClassifier()
        tuner = keras_tuner.GridSearch(
            hypermodel,
            objective="val_accuracy",
            directory=folder,
            project_name="batch",
            seed=0,
        )
        tuner.search(
            x[train],
            y[train],
            validation_data=(x[validation], y[validation]),
            epochs=epochs,
            shuffle=False,
            verbose=0,
        )
        print(f"micro-batch {MICRO_BATCH}, {epochs} epochs of {len(x[train])} samples")
        print("batch  learning rate  updates  val accuracy")
        trials = sorted(
            tuner.oracle.trials.values(),
            key=lambda t: (
                t.hyperparameters.get("accum_steps"),
                t.hyperparameters.get("learning_rate"),
            ),
        )
        for trial in trials:
            hp = trial.hyperparameters
            updates = hypermodel.updates[hp.get("accum_steps"), hp.get("learning_rate")]
            accuracy = trial.metrics.get_best_value("val_accuracy")
            print(
                f"{MICRO_BATCH * hp.get('accum_steps'):5d}  {hp.get('learning_rate'):13g}  "
                f"{updates:7d}  {accuracy:.4f}"
            )
        best = tuner.get_best_hyperparameters()[0]
        print(
            f"best: batch {MICRO_BATCH * best.get('accum_steps')} (accum_steps "
            f"{best.get('accum_steps')}), learning rate {best.get('learning_rate'):g}"
        )


if __name__ == "__main__":
    main()
