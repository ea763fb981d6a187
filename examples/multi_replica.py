"""Multi-replica training: GradientAccumulateModel under MirroredStrategy, two CPU replicas.

Splits this machine's CPU into two logical devices so that the multi-replica
code path runs anywhere, trains the digits classifier with 4-step accumulation
under ``tf.distribute.MirroredStrategy``, and compares with plain Keras on one
device at the effective batch. Each update all-reduces the accumulated
gradient once; micro-steps in between communicate nothing.

The same code runs on several GPUs or several machines; see the comments at
``strategy = ...`` below.

Run: ``python examples/multi_replica.py`` (``--quick`` for a short run).
"""

import argparse

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import tensorflow as tf

# --- devices --------------------------------------------------------------
# Two logical CPU devices stand in for two GPUs. TensorFlow accepts this only
# before it has initialised its devices, so it comes before any other
# TensorFlow or Keras use. On a machine with GPUs, leave it out.
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
# --- end of devices -------------------------------------------------------

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from gradient_accumulator import GradientAccumulateModel  # noqa: E402

MICRO_BATCH_PER_REPLICA = 8
ACCUM_STEPS = 4


def build(cls=keras.Model, **kwargs):
    """The same architecture and, thanks to the seed, the same initial weights."""
    keras.utils.set_random_seed(42)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs (for CI)")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    # --- strategy ---------------------------------------------------------
    # Here: the two logical CPUs. On one machine with several GPUs:
    #
    #     strategy = tf.distribute.MirroredStrategy()  # every visible GPU
    #
    # On several machines: start this same script on every machine, each
    # with a TF_CONFIG environment variable that lists all workers and says
    # which one it is (index 0 is the chief), e.g. on the second machine:
    #
    #     TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
    #                 "task": {"type": "worker", "index": 1}}'
    #
    # and create, in place of the line below and before any other TensorFlow
    # work (so, at the top of the script, instead of the logical devices),
    #
    #     strategy = tf.distribute.MultiWorkerMirroredStrategy()
    #
    # Nothing else in this script changes.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    replicas = strategy.num_replicas_in_sync
    # fit's batch_size is the global micro-batch, split across the replicas.
    global_micro_batch = MICRO_BATCH_PER_REPLICA * replicas
    with strategy.scope():
        model = build(GradientAccumulateModel, accum_steps=ACCUM_STEPS)
        compile_model(model)
    # --- end of strategy --------------------------------------------------

    print(
        f"Replicas: {replicas}; micro-batch: {MICRO_BATCH_PER_REPLICA} per replica, "
        f"{global_micro_batch} in all; effective batch: {ACCUM_STEPS} x "
        f"{global_micro_batch} = {ACCUM_STEPS * global_micro_batch}\n"
    )
    print(f"GradientAccumulateModel(accum_steps={ACCUM_STEPS}) under MirroredStrategy:")
    # --- fit --------------------------------------------------------------
    model.fit(
        x_train, y_train, batch_size=global_micro_batch, epochs=epochs, shuffle=False, verbose=1
    )
    # --- end of fit -------------------------------------------------------

    # The reference: plain Keras, one device, the effective batch.
    reference = build()
    compile_model(reference)
    reference.fit(
        x_train,
        y_train,
        batch_size=ACCUM_STEPS * global_micro_batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )

    micro_steps = epochs * -(-len(x_train) // global_micro_batch)
    print(
        f"\nMicro-steps run: {micro_steps}; optimizer updates (= gradient all-reduces): "
        f"{int(model.optimizer.iterations.numpy())} "
        f"(plain batch {ACCUM_STEPS * global_micro_batch} on one device: "
        f"{int(reference.optimizer.iterations.numpy())})"
    )
    gap = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights())
    )
    print(f"max |weight difference| vs one device at the effective batch: {gap:.2e}")
    for name, trained in [("2 replicas, accumulating", model), ("one device, plain", reference)]:
        _, accuracy = trained.evaluate(x_test, y_test, verbose=0)
        print(f"test accuracy, {name:>24}: {accuracy:.4f}")


if __name__ == "__main__":
    main()
