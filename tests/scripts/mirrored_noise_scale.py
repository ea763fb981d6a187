"""The gradient noise scale under MirroredStrategy (2 logical CPUs): every update's estimates.

Run: ``python -m tests.scripts.mirrored_noise_scale`` (MirroredStrategy over 2
logical CPUs), or ``python -m tests.scripts.mirrored_noise_scale multi_worker``
on every worker of a cluster described by ``TF_CONFIG``
(``tests.helpers.run_workers``; MultiWorkerMirroredStrategy, one CPU replica
each: the cases ``k4`` and ``k4_every4`` only). The regression of
``tests/test_noise_scale.py`` (``tests.helpers.noise_regression``, SGD(0) from
zero weights) at the global micro-batch 8 (4 per replica: each replica's
micro-batch is a small batch), ``accum_steps`` 4 and 1 (two replicas still
give two small batches per update), 4 measuring the group's last micro-batch
only (``noise_scale_micro_batches="last"``: each replica's last, two small
batches per update), and 4 measuring one update in 4 (``noise_scale_every=4``:
the runner counts the updates in Python), 9 updates each. Prints one results
line: per case, each update's logged ``noise_scale_trace`` and
``noise_scale_signal`` (the test computes numpy's from the data).
"""

import sys

import keras
import tensorflow as tf

from tests.helpers import noise_regression
from tests.scripts import print_results, split_cpu

REPLICAS = 2
UPDATES = 9


def main(kind="mirrored"):
    if kind == "multi_worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    results = {"replicas": strategy.num_replicas_in_sync, "updates": UPDATES}
    cases = [("k4", 4, "all", 1), ("k1", 1, "all", 1), ("k4_last", 4, "last", 1)]
    cases.append(("k4_every4", 4, "all", 4))
    if kind == "multi_worker":
        cases = [cases[0], cases[-1]]
    for case, accum_steps, measured, every in cases:
        _, logs = noise_regression(
            accum_steps,
            8,
            UPDATES,
            strategy=strategy,
            noise_scale_micro_batches=measured,
            noise_scale_every=every,
        )
        keys = ("noise_scale_trace", "noise_scale_signal")
        results[case] = [{key: entry[key] for key in keys} for entry in logs]
        keras.backend.clear_session()
    print_results(results)


if __name__ == "__main__":
    main(*sys.argv[1:])
