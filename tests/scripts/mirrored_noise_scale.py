"""The gradient noise scale under MirroredStrategy (2 logical CPUs) against its closed form.

Run: ``python -m tests.scripts.mirrored_noise_scale`` (MirroredStrategy over 2
logical CPUs), or ``python -m tests.scripts.mirrored_noise_scale multi_worker``
on every worker of a cluster described by ``TF_CONFIG``
(``tests.helpers.run_workers``; MultiWorkerMirroredStrategy, one CPU replica
each: the cases ``k4`` and ``k4_every4`` only). The regression of
``tests/test_noise_scale.py`` (``tests.helpers.noise_regression``) at the
global micro-batch 8 (4 per replica: each replica's micro-batch is a small
batch), ``accum_steps`` 4 and 1 (two replicas still give two small batches
per update), and 4 measuring the group's last micro-batch only
(``noise_scale_micro_batches="last"``: each replica's last, two small
batches per update), and 4 measuring one update in 4 (``noise_scale_every=4``:
the runner counts the updates in Python), 400 updates each. Prints one results
line, per case: the mean and standard error of each measured update's
``noise_scale_trace`` and ``noise_scale_signal``, whether the updates between
measured ones logged the previous figures, and the closed form.
"""

import sys

import keras
import tensorflow as tf

from tests.helpers import mean_and_error, noise_closed_form, noise_regression
from tests.scripts import print_results, split_cpu

REPLICAS = 2
UPDATES = 400


def main(kind="mirrored"):
    if kind == "multi_worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    trace, signal = noise_closed_form()
    results = {"replicas": strategy.num_replicas_in_sync, "trace": trace, "signal": signal}
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
        results[case] = {
            "updates": len(logs),
            # Updates whose estimates moved: the measured ones (their data
            # differ, so their estimates do).
            "measured": sum(
                i == 0 or entry["noise_scale_trace"] != logs[i - 1]["noise_scale_trace"]
                for i, entry in enumerate(logs)
            ),
            "others_repeat": all(
                entry[key] == logs[i - i % every][key]
                for i, entry in enumerate(logs)
                for key in keys
            ),
            **{
                key: mean_and_error([entry[f"noise_scale_{key}"] for entry in logs[::every]])
                for key in ("trace", "signal")
            },
        }
        keras.backend.clear_session()
    print_results(results)


if __name__ == "__main__":
    main(*sys.argv[1:])
