"""The gradient noise scale under MirroredStrategy (2 logical CPUs) against its closed form.

Run: ``python -m tests.scripts.mirrored_noise_scale``. The regression of
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

import keras
import tensorflow as tf

from tests.helpers import mean_and_error, noise_closed_form, noise_regression
from tests.scripts import print_results, split_cpu

REPLICAS = 2
UPDATES = 400


def main():
    devices = split_cpu(REPLICAS)
    strategy = tf.distribute.MirroredStrategy(devices)
    trace, signal = noise_closed_form()
    results = {"replicas": strategy.num_replicas_in_sync, "trace": trace, "signal": signal}
    cases = (("k4", 4, "all", 1), ("k1", 1, "all", 1), ("k4_last", 4, "last", 1))
    for case, accum_steps, measured, every in (*cases, ("k4_every4", 4, "all", 4)):
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
            "measured": len(logs[::every]),
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
    main()
