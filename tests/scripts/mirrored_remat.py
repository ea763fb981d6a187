"""Rematerialisation under two replicas against the same training without it.

Run: ``python -m tests.scripts.mirrored_remat`` (MirroredStrategy over 2
logical CPUs).

The ConvNet of ``tests/test_remat.py`` (BatchNormalization, GELU, two
Dropouts, a layer that adds a loss), built in the strategy's scope under
``keras.RematScope(mode="full")`` and without it, trained at the global
micro-batch 8 (4 per replica) with ``accum_steps`` 4 and 1; the replicas'
shards come from different distributions (the second replica's rows of each
global micro-batch scaled by 3). Prints per ``accum_steps``: ``diff`` (max
|difference| over every variable: weights, BatchNormalization's statistics,
seed states), ``moved`` (the reference's distance from the initial weights),
``updates`` of each, and ``traces`` of each (a marked layer's: with
rematerialisation, more, as the backward pass traces it again).
"""

import keras
import numpy as np
import tensorflow as tf

from tests.helpers import max_abs_diff
from tests.scripts import GLOBAL_MICRO_BATCH, MICRO_BATCH, REPLICAS, print_results, split_cpu
from tests.scripts import updates as updates_of
from tests.test_remat import MODES, Traced, conv_net, image_data, train


def main():
    devices = split_cpu(REPLICAS)
    strategy = tf.distribute.MirroredStrategy(devices)
    x, y = image_data(64)
    second = (np.arange(len(x)) % GLOBAL_MICRO_BATCH) >= MICRO_BATCH
    x[second] *= 3.0
    results = {}
    for accum_steps in (4, 1):
        models, traces = {}, {}
        for name, remat in (("reference", None), ("remat", MODES["full"])):
            Traced.traces = 0
            with strategy.scope():
                models[name] = train(
                    conv_net(remat=remat, accum_steps=accum_steps), x, y, GLOBAL_MICRO_BATCH
                )
            traces[name] = Traced.traces
        with strategy.scope():
            initial = conv_net(accum_steps=accum_steps)
        results[str(accum_steps)] = {
            "diff": max_abs_diff(models["reference"].variables, models["remat"].variables),
            "moved": max_abs_diff(
                models["reference"].trainable_variables, initial.trainable_variables
            ),
            "updates": [updates_of(m.optimizer) for m in models.values()],
            "traces": traces,
        }
        keras.backend.clear_session()
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main()
