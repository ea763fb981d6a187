"""Every accum_steps under MirroredStrategy (2 logical CPUs) against one device.

Run: ``python -m tests.scripts.mirrored_runner CASE [CASE ...]`` (the cases of
:data:`CASES`, ``<wrapper>-k<accum_steps>-<data>``).

Each case trains at the global micro-batch 4 (2 samples per replica) under
one MirroredStrategy over two replicas, and plain Keras on one device at the
global big batch ``4 * accum_steps`` (same initial weights, same data order,
Adam). The model wrapper's data: two whole groups and a shorter one, whose
last micro-batch holds 2 samples (one per replica), as arrays
(``steps_per_execution`` 1 or 3) or as a generator of unknown length. The
optimizer wrapper (plain Keras ``fit``): three whole groups of arrays.
``spectral_normalization``: a layer that writes its state in every training
call (see the case). Prints one results line (see ``tests/scripts/__init__.py``), per case:
``diff`` (max |weight difference|), ``updates`` and ``reference_updates``,
``moved`` (the reference's distance from the initial weights); the model
wrapper's cases also ``norm_rdiff``, the relative difference of the epoch's
logged ``gradient_norm`` from the big batch's gradient norm of that update.
"""

import sys

import keras
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.helpers import (
    OPTIMIZERS,
    GradientNormLogging,
    build_dense,
    make_regression_data,
    max_abs_diff,
)
from tests.scripts import print_results, split_cpu, updates

REPLICAS = 2
GLOBAL_MICRO_BATCH = 4


def _micro_batches(x, y):
    for start in range(0, len(x), GLOBAL_MICRO_BATCH):
        yield x[start : start + GLOBAL_MICRO_BATCH], y[start : start + GLOBAL_MICRO_BATCH]


def _reference(x, y, accum_steps, norms=None):
    """Plain Keras at the global big batch; each update's gradient norm appended to ``norms``."""
    reference = build_dense(GradientNormLogging)
    reference.compile(OPTIMIZERS["adam"](), "mse")
    batch = GLOBAL_MICRO_BATCH * accum_steps
    norms = [] if norms is None else norms
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: norms.append(float(logs["gradient_norm"]))
    )
    reference.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return reference


def _figures(reference, model):
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "updates": updates(model.optimizer),
        "reference_updates": updates(reference.optimizer),
        "moved": max_abs_diff(reference.get_weights(), build_dense().get_weights()),
    }


def model_case(accum_steps, data):
    def case(strategy):
        samples = GLOBAL_MICRO_BATCH * 2 * accum_steps + (GLOBAL_MICRO_BATCH + 2)
        if accum_steps == 1:
            samples = GLOBAL_MICRO_BATCH * 2 + 2
        x, y = make_regression_data(samples)
        norms = []
        reference = _reference(x, y, accum_steps, norms)
        steps_per_execution = 3 if data == "spe3" else 1
        with strategy.scope():
            model = build_dense(
                GradientAccumulateModel, accum_steps=accum_steps, gradient_norm=True
            )
            model.compile(OPTIMIZERS["adam"](), "mse", steps_per_execution=steps_per_execution)
        if data == "unknown_length":
            spec = (tf.TensorSpec((None, 5), "float32"), tf.TensorSpec((None, 1), "float32"))
            dataset = tf.data.Dataset.from_generator(
                lambda: _micro_batches(x, y), output_signature=spec
            )
            history = model.fit(dataset, epochs=1, verbose=0)
            # The group cut short by the data updates after the epoch's logs.
            expected = norms[-2]
        else:
            history = model.fit(
                x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=1, shuffle=False, verbose=0
            )
            expected = norms[-1]
        logged = history.history["gradient_norm"][-1]
        return {**_figures(reference, model), "norm_rdiff": abs(logged - expected) / expected}

    return case


def optimizer_case(accum_steps):
    def case(strategy):
        x, y = make_regression_data(GLOBAL_MICRO_BATCH * accum_steps * 3)
        reference = _reference(x, y, accum_steps)
        with strategy.scope():
            model = build_dense()
            optimizer = GradientAccumulateOptimizer(OPTIMIZERS["adam"](), accum_steps=accum_steps)
            model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
        return _figures(reference, model)

    return case


def spectral_case(strategy):
    """A ``SpectralNormalization`` layer (it writes its kernel in every
    training call), accum_steps 4, two whole groups and a shorter one."""

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        hidden = keras.layers.SpectralNormalization(keras.layers.Dense(16, activation="tanh"))
        return cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden(inputs)), **kwargs)

    x, y = make_regression_data(GLOBAL_MICRO_BATCH * 8 + GLOBAL_MICRO_BATCH + 2)
    reference = build()
    reference.compile(OPTIMIZERS["adam"](), "mse")
    reference.fit(x, y, batch_size=GLOBAL_MICRO_BATCH * 4, shuffle=False, verbose=0)
    with strategy.scope():
        model = build(GradientAccumulateModel, accum_steps=4)
        model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, shuffle=False, verbose=0)
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "updates": updates(model.optimizer),
        "reference_updates": updates(reference.optimizer),
        "moved": max_abs_diff(reference.get_weights(), build().get_weights()),
    }


CASES = {
    **{
        f"model-k{k}-{data}": model_case(k, data)
        for k in (1, 33, 128)
        for data in ("spe1", "spe3", "unknown_length")
    },
    **{f"optimizer-k{k}": optimizer_case(k) for k in (33, 128)},
    "spectral_normalization": spectral_case,
}


def main(*names):
    devices = split_cpu(REPLICAS)
    strategy = tf.distribute.MirroredStrategy(devices)
    results = {}
    for name in names:
        results[name] = CASES[name](strategy)
        keras.backend.clear_session()
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main(*sys.argv[1:])
