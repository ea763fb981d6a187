"""Multi-replica smoke test: two logical CPU devices under MirroredStrategy (fresh process)."""

import json

import pytest

from tests.helpers import FLOAT32_ATOL, run_script

MIRRORED_FIT = """
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
import keras
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense, make_regression_data, max_abs_diff

x, y = make_regression_data(num_samples=64)
reference = build_dense()
reference.compile(keras.optimizers.Adam(0.01), "mse")
reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), "mse")
# 2 replicas x micro-batch 8 x 2 micro-steps = the reference's batch of 32.
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
print(json.dumps({
    "replicas": strategy.num_replicas_in_sync,
    "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
    "iterations": int(model.optimizer.iterations.numpy()),
}))
"""


@pytest.mark.slow
def test_mirrored_strategy_two_replicas_equals_big_batch():
    result = json.loads(run_script(MIRRORED_FIT).strip().splitlines()[-1])
    assert result["replicas"] == 2
    assert result["iterations"] == 4
    assert result["diff"] < FLOAT32_ATOL, result
