"""micro_batch_size="auto" against a real out-of-memory error: TensorFlow's CPU allocator capped.

Run: ``TF_ENABLE_ONEDNN_OPTS=1 TF_MKL_ALLOC_MAX_BYTES=<bytes> python -m
tests.scripts.auto_micro_batch_oom`` (the test sets both: oneDNN's pooled CPU
allocator, ``mklcpu``, then refuses what passes the cap, as a GPU's memory
does, after its 10 s wait for memory to be freed). Each sample costs 32 KiB
of activations per hidden layer: under the test's cap a batch of 512 does
not fit and a quarter of it does. Prints one results line (see
``tests/scripts/__init__.py``):

- the weights after two updates of batch 512, saved to ``PATH.npz``;
- ``changes``: the micro-batch changes ``[update, old, new]``;
- ``in_use``: the allocator's bytes in use before the first group, after
  it, and after each of ``EXTRA_FAILURES`` more failed tries (the whole
  batch tried again once settled): a failed try gives its memory back;
- ``peaks``: the allocator's peak in each of those tries;
- ``after_failures``: max |weight change| over those failed tries (0).

Arguments: ``[reference] PATH``; ``reference`` saves the weights of plain
Keras at batch 512 (run without the cap).
"""

import sys

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import max_abs_diff
from tests.scripts import print_results

BATCH = 512
WIDTH = 8192
EXTRA_FAILURES = 2
DEVICE = "/device:CPU:0"


def build(cls=keras.Model, jit_compile=False, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    hidden = keras.layers.Dense(8, activation="relu")(hidden)
    model = cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile)
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * BATCH, 16)).astype("float32")
    return x, np.tanh(x[:, :1] * x[:, 1:2]).astype("float32")


def in_use():
    return tf.config.experimental.get_memory_info(DEVICE)["current"]


def main():
    x, y = data()
    path = sys.argv[-1]
    if sys.argv[1] == "reference":
        model = build()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        np.savez(path, *model.get_weights())
        print_results({})
        return
    jit_compile = sys.argv[1] == "xla"
    model = build(GradientAccumulateModel, jit_compile=jit_compile, micro_batch_size="auto")
    used = [in_use()]
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    used.append(in_use())
    settled = model.get_weights()
    # The whole batch again, as the first group tried it: out of memory.
    runner = model._runner
    batch = (tf.constant(x[BATCH:]), tf.constant(y[BATCH:]))
    peaks = []
    for _ in range(EXTRA_FAILURES):
        tf.config.experimental.reset_memory_stats(DEVICE)
        try:
            runner.auto._micro_steps(runner.split_group_functions()[0], batch, 1, BATCH)
        except tf.errors.ResourceExhaustedError:
            pass
        peaks.append(tf.config.experimental.get_memory_info(DEVICE)["peak"])
        used.append(in_use())
    after_failures = max_abs_diff(settled, model.get_weights())
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    np.savez(path, *model.get_weights())
    print_results(
        {
            "changes": [[c.update, c.old, c.new] for c in model.micro_batch_changes],
            "in_use": used,
            "peaks": peaks,
            "after_failures": after_failures,
        }
    )


if __name__ == "__main__":
    main()
