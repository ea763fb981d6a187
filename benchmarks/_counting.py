"""A cross-device ops that counts the batched reductions a strategy runs (a measuring tool).

Used by ``benchmarks/communication.py`` and by the tests that count the
library's all-reduces (``tests/scripts/mirrored_counted.py``,
``tests/scripts/mirrored_float8.py``); not part of the package.
"""

import tensorflow as tf


class CountingCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Counts the batched cross-replica reductions that actually run.

    A diagnostic for ``tf.distribute.MirroredStrategy(devices,
    cross_device_ops=CountingCrossDeviceOps())``: every
    ``batch_reduce_to``/``all_reduce`` of the strategy (gradients included)
    passes through it, and the counters are variables incremented by the
    reduction itself, so they count reductions that executed, not the ones
    traced (a reduction inside a conditional that did not run is not counted).

    Attributes:
        reductions: int64 variable, batched reductions run so far.
        bytes: int64 variable, bytes of one replica's values summed over them.
    """

    def __init__(self):
        super().__init__()
        with tf.init_scope():
            self.reductions = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        size = 0
        for value, _ in value_destination_pairs:
            first = value.values[0] if hasattr(value, "values") else value
            size += first.shape.num_elements() * first.dtype.size
        with tf.control_dependencies([self.reductions.assign_add(1), self.bytes.assign_add(size)]):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
