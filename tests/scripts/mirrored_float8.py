"""Float8 layers under MirroredStrategy (2 logical CPUs) against one device's big batch.

Run: ``python -m tests.scripts.mirrored_float8``. The strategy's reductions go
through ``benchmarks._counting.CountingCrossDeviceOps``. Every
configuration trains the float8 MLP of ``tests.helpers.build_float8`` for one
epoch of 96 samples at the global micro-batch 8 (4 per replica), 4
micro-steps per update (3 updates), on inputs whose rows' magnitudes differ
(so the replicas' amax differ):

- ``model``: ``GradientAccumulateModel(accum_steps=4)``;
- ``model_every_micro_step``: the same with ``reduce_every_micro_step=True``;
- ``optimizer``: a plain ``keras.Model`` compiled with
  ``GradientAccumulateOptimizer(Adam, accum_steps=4)``.

The reference is plain Keras on one device at the global big batch 32, same
initial weights and data order. Prints one results line (see
``tests/scripts/__init__.py``): per configuration ``state``, ``kernel`` and
``bias`` (``tests.helpers.float8_differences``), ``updates``, and
``reductions``, the batched cross-replica reductions that ran in the epoch.
"""

import keras
import tensorflow as tf

from benchmarks._counting import CountingCrossDeviceOps
from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.helpers import build_float8, float8_differences, make_float8_data
from tests.scripts import (
    ACCUM_STEPS,
    BIG_BATCH,
    GLOBAL_MICRO_BATCH,
    REPLICAS,
    print_results,
    split_cpu,
    updates,
)


def adam():
    return keras.optimizers.Adam(0.01)


def model_case(**kwargs):
    def build():
        model = build_float8(GradientAccumulateModel, accum_steps=ACCUM_STEPS, **kwargs)
        model.compile(adam(), "mse")
        return model

    return build


def optimizer_case():
    model = build_float8()
    model.compile(GradientAccumulateOptimizer(adam(), accum_steps=ACCUM_STEPS), "mse")
    return model


CONFIGURATIONS = {
    "model": model_case(),
    "model_every_micro_step": model_case(reduce_every_micro_step=True),
    "optimizer": optimizer_case,
}


def main():
    devices = split_cpu(REPLICAS)
    counter = CountingCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=counter)
    x, y = make_float8_data()
    reference = build_float8()
    reference.compile(adam(), "mse")
    reference.fit(x, y, batch_size=BIG_BATCH, shuffle=False, verbose=0)
    results = {}
    for name, build in CONFIGURATIONS.items():
        with strategy.scope():
            model = build()
        before = int(counter.reductions.numpy())
        model.fit(x, y, batch_size=GLOBAL_MICRO_BATCH, shuffle=False, verbose=0)
        results[name] = {
            **float8_differences(reference, model),
            "updates": updates(model.optimizer),
            "reductions": int(counter.reductions.numpy()) - before,
        }
        keras.backend.clear_session()
    print_results(
        {
            "replicas": strategy.num_replicas_in_sync,
            "reference_updates": updates(reference.optimizer),
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
