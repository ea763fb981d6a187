"""Scripts the tests run in fresh processes (strategies, logical devices, worker clusters).

A process can split its CPU into logical devices, or join a
MultiWorkerMirroredStrategy cluster, only once and only before TensorFlow has
initialised its devices, so every test that needs one runs a module of this
package from the repository root, as ``python -m tests.scripts.<name> [args]``
would (``tests.helpers.run_script_module`` and ``tests.helpers.run_workers``;
forked from the script host, :mod:`tests.scripts._host`, whose imports are
done and whose TensorFlow is not initialised). Each
script prints its figures as one JSON line starting with :data:`RESULTS`
(``tests.helpers.script_results`` reads it back), and the test asserts on
them. Importing TensorFlow, Keras and the package does not initialise the
devices; a script calls :func:`split_cpu` (or creates its
MultiWorkerMirroredStrategy) first in ``main()``, before anything else runs.
"""

import json

RESULTS = "RESULTS "


# The geometry of the MirroredStrategy scripts: two replicas at the global
# micro-batch 8, 4 micro-steps per update, a global big batch of 32.
REPLICAS = 2
MICRO_BATCH = 4  # per replica
GLOBAL_MICRO_BATCH = REPLICAS * MICRO_BATCH
ACCUM_STEPS = 4
BIG_BATCH = ACCUM_STEPS * GLOBAL_MICRO_BATCH


def updates(optimizer):
    """Updates made, by the innermost optimizer (a LossScaleOptimizer's own
    counter stays 0 before Keras 3.9)."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return int(optimizer.iterations.numpy())


def values(variables):
    """The variables' values as numpy arrays."""
    import numpy as np

    return [np.asarray(v) for v in variables]


def split_cpu(count):
    """Splits the CPU into ``count`` logical devices, ``/cpu:0`` to ``/cpu:{count-1}``.

    Call before any other TensorFlow use in the process: TensorFlow refuses
    once its devices are initialised.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )
    return [f"/cpu:{index}" for index in range(count)]


def print_results(results):
    """Prints ``results`` (JSON-serialisable) as the script's one results line."""
    print(RESULTS + json.dumps(results), flush=True)
