"""choose_micro_batch under MirroredStrategy (2 logical CPUs): the batch is global.

Run: ``python -m tests.scripts.mirrored_micro_batch``. Prints one results line
(see ``tests/scripts/__init__.py``):

- ``peaks``: each tried global micro-batch's allocator peak (bytes);
- ``choice``: ``[micro_batch, accum_steps, tried micro-batches]`` for a budget
  between the peaks of 4 and 8;
- ``diff`` / ``moved``: max |weight difference| of that split trained under the
  strategy from plain Keras at the global batch on one device, and how far the
  reference moved from its initial weights;
- ``too_small`` / ``odd_batch``: the errors for a budget nothing fits and for a
  batch that the replicas do not divide.
"""

import math

import keras
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, choose_micro_batch
from gradient_accumulator.micro_batch import _memory_devices, _try
from tests.helpers import build_wide_conv, make_image_data, max_abs_diff
from tests.scripts import REPLICAS, print_results, split_cpu

BATCH = 16


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    x, y = make_image_data(2 * BATCH)

    def build(accum_steps):
        with strategy.scope():
            model = build_wide_conv(GradientAccumulateModel, accum_steps=accum_steps)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    data = (x[:BATCH], y[:BATCH], None)
    peaks = {m: _try(build, BATCH // m, m, data, _memory_devices())[0] for m in (8, 4)}
    budget = int(math.sqrt(peaks[4] * peaks[8]))
    choice = choose_micro_batch(build, x, y, batch_size=BATCH, memory_budget=budget, verbose=0)

    model = build(choice.accum_steps)
    model.fit(x, y, batch_size=choice.micro_batch, shuffle=False, verbose=0)
    reference = build_wide_conv()
    initial = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)

    errors = {}
    for name, batch_size, memory_budget in (("too_small", 4, 1), ("odd_batch", 9, "1 GiB")):
        try:
            choose_micro_batch(build, x, y, batch_size=batch_size, memory_budget=memory_budget)
        except ValueError as raised:
            errors[name] = str(raised)
    tries = choice.tries
    print_results(
        {
            "peaks": peaks,
            "choice": [choice.micro_batch, choice.accum_steps, [t.micro_batch for t in tries]],
            "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
            "moved": max_abs_diff(reference.get_weights(), initial),
            **errors,
        }
    )


if __name__ == "__main__":
    main()
