"""The gradient noise scale under MirroredStrategy (2 logical CPUs) against its closed form.

Run: ``python -m tests.scripts.mirrored_noise_scale``. The regression of
``tests/test_noise_scale.py`` (``tests.helpers.noise_regression``) at the
global micro-batch 8 (4 per replica: each replica's micro-batch is a small
batch), ``accum_steps`` 4 and 1 (two replicas still give two small batches
per update), and 4 measuring the group's last micro-batch only
(``noise_scale_micro_batches="last"``: each replica's last, two small
batches per update), 400 updates each. Prints one results line, per case: the mean
and standard error of each update's ``noise_scale_trace`` and
``noise_scale_signal``, and the closed form.
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
    for case, accum_steps, measured in (("k4", 4, "all"), ("k1", 1, "all"), ("k4_last", 4, "last")):
        _, logs = noise_regression(
            accum_steps, 8, UPDATES, strategy=strategy, noise_scale_micro_batches=measured
        )
        results[case] = {
            "updates": len(logs),
            **{
                key: mean_and_error([entry[f"noise_scale_{key}"] for entry in logs])
                for key in ("trace", "signal")
            },
        }
        keras.backend.clear_session()
    print_results(results)


if __name__ == "__main__":
    main()
