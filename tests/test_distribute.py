"""Multi-replica training: two logical CPU devices under MirroredStrategy (fresh process)."""

import json

import pytest

from tests.helpers import FLOAT32_ATOL, run_script

# One process, one strategy: every optimizer case runs inside the same script.
# The reference is plain Keras on one device at the global batch 2 x 8 x 2 = 32.
MIRRORED_FIT = """
import json
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense, make_regression_data, max_abs_diff

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, 1, 0.5)),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05),
}
x, y = make_regression_data(num_samples=72)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
results = {}
for name, make in OPTIMIZERS.items():
    reference = build_dense()
    reference.compile(make(), "mse")
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = build_dense(GradientAccumulateModel, accum_steps=2)
        model.compile(make(), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    results[name] = {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "iterations": int(model.optimizer.iterations.numpy()),
        "moved": max_abs_diff(reference.get_weights(), build_dense().get_weights()),
    }
print(json.dumps({"replicas": strategy.num_replicas_in_sync, "results": results}))
"""


@pytest.fixture(scope="module")
def mirrored_results():
    return json.loads(run_script(MIRRORED_FIT).strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer", ["sgd", "adam", "adamw", "schedule", "clipnorm", "global_clipnorm"]
)
def test_mirrored_two_replicas_equals_one_device_big_batch(mirrored_results, optimizer):
    assert mirrored_results["replicas"] == 2
    result = mirrored_results["results"][optimizer]
    # 72 samples: groups of 32, 32 and a last group of 8 (one micro-step of
    # 4 + 4 samples) per epoch, as the reference's batches of 32, 32, 8.
    assert result["iterations"] == 6
    assert result["moved"] > 1e-3
    assert result["diff"] < FLOAT32_ATOL, result
