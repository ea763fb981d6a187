"""A GradientAccumulateModel created outside the strategy scope, compiled inside it.

Run: ``python -m tests.scripts.mirrored_outside_scope``. Prints the
``ValueError`` that ``compile`` raises, as ``{"error": "..."}`` on the results
line (see ``tests/scripts/__init__.py``); ``None`` if it raised nothing.
"""

import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense
from tests.scripts import print_results, split_cpu


def main():
    strategy = tf.distribute.MirroredStrategy(split_cpu(2))
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    error = None
    try:
        with strategy.scope():
            model.compile("sgd", "mse")
    except ValueError as raised:
        error = str(raised)
    print_results({"error": error})


if __name__ == "__main__":
    main()
