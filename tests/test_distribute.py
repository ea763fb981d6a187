"""Multi-replica training: two logical CPU devices under MirroredStrategy (fresh process)."""

import json

import keras
import pytest

from tests.helpers import FLOAT16_ATOL, FLOAT32_ATOL, KERAS_VERSION, run_script, run_workers

# One process, one strategy: every optimizer case runs inside the same script.
# The reference is plain Keras on one device at the global batch 2 x 8 x 2 = 32.
MIRRORED_FIT = """
import json
import tensorflow as tf
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
    return json.loads(run_script(MIRRORED_FIT, logical_cpus=2).strip().splitlines()[-1])


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


MIRRORED_MIXED_FLOAT16 = """
import json
import numpy as np
import tensorflow as tf
import keras
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense, make_regression_data, max_abs_diff

keras.mixed_precision.set_global_policy("mixed_float16")
x, y = make_regression_data(num_samples=64)
x[10, 0] = 1e5  # overflows float16 in the first group's first micro-batch
reference = build_dense()
reference.compile(keras.optimizers.Adam(0.01), "mse")
reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), "mse")
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
sums = [np.asarray(v.numpy()) for v in model._accumulator.gradient_sums]
print(json.dumps({
    "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
    "scales": [float(m.optimizer.dynamic_scale.numpy()) for m in (reference, model)],
    # The LossScaleOptimizers' inner optimizers: before Keras 3.9 a
    # LossScaleOptimizer's own `iterations` stays 0.
    "iterations": [int(m.optimizer.inner_optimizer.iterations.numpy()) for m in (reference, model)],
    "sums_finite": bool(all(np.all(np.isfinite(s)) for s in sums)),
}))
"""


@pytest.mark.slow
def test_mirrored_mixed_float16_with_an_overflow_equals_one_device():
    # Under a LossScaleOptimizer a group with an overflowed micro-batch is
    # skipped and its sums (inf/NaN on a replica) must be emptied for the next
    # group: the replica-local reset path, with 2 replicas.
    result = json.loads(run_script(MIRRORED_MIXED_FLOAT16, logical_cpus=2).strip().splitlines()[-1])
    # Each epoch's first group overflows: skipped twice, the scale halved twice.
    assert result["scales"][0] == result["scales"][1] == 2.0**13, result
    assert result["iterations"][0] == result["iterations"][1] == 2, result
    assert result["sums_finite"], result
    assert result["diff"] < FLOAT16_ATOL, result


COUNTED_FIT = """
import json
import tensorflow as tf
import keras
import numpy as np
from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator.distribute import CountingCrossDeviceOps
from tests.helpers import build_dense, make_regression_data, max_abs_diff

x, y = make_regression_data(num_samples=64)
reference = build_dense()
reference.compile(keras.optimizers.Adam(0.01), "mse")
reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
counter = CountingCrossDeviceOps()
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
results = {}
for name, kwargs in [
    ("plain_keras", None),
    ("once_per_update", {"accum_steps": 4}),
    ("every_micro_step", {"accum_steps": 4, "reduce_every_micro_step": True}),
]:
    with strategy.scope():
        if kwargs is None:
            model = build_dense()
        else:
            model = build_dense(GradientAccumulateModel, **kwargs)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # trace
    before = int(counter.reductions.numpy()), int(counter.bytes.numpy())
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    results[name] = {
        "reductions": int(counter.reductions.numpy()) - before[0],
        "bytes": int(counter.bytes.numpy()) - before[1],
        "updates": int(model.optimizer.iterations.numpy()) // 2,
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
    }
params = sum(int(np.prod(w.shape)) for w in reference.trainable_weights)
print(json.dumps({"params": params, "results": results}))
"""


@pytest.fixture(scope="module")
def counted():
    return json.loads(run_script(COUNTED_FIT, logical_cpus=2).strip().splitlines()[-1])


@pytest.mark.slow
def test_gradients_cross_replicas_once_per_update(counted):
    # 64 samples at a global micro-batch of 16 (8 per replica): 4 micro-steps.
    results, params = counted["results"], counted["params"]
    once = results["once_per_update"]
    assert once["updates"] == 1
    assert once["reductions"] == 1
    assert once["bytes"] == 4 * params + 4  # float32 sums and the weight sum
    assert once["diff"] < FLOAT32_ATOL
    every = results["every_micro_step"]
    assert every["reductions"] == 4
    assert every["diff"] < FLOAT32_ATOL
    # Plain Keras all-reduces every step (here: every update); Keras 3.3 and
    # 3.4 do not all-reduce the gradients at all (the replicas drift apart).
    if KERAS_VERSION >= (3, 5):
        assert results["plain_keras"]["reductions"] == 4


# Two workers on loopback, one CPU replica each. The reference is computed in
# each worker on one device (default strategy) at the global batch.
MULTI_WORKER = """
import json
import sys
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras
from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from tests.helpers import build_dense, make_regression_data, max_abs_diff

OPTIMIZERS = {
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=0.05),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, 1, 0.5)),
}
x, y = make_regression_data(num_samples=64)
results = {}
for name, make in OPTIMIZERS.items():
    reference = build_dense()
    reference.compile(make(), "mse")
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    # fit: 2 workers x micro-batch 8 x 2 micro-steps = 32.
    with strategy.scope():
        model = build_dense(GradientAccumulateModel, accum_steps=2)
        model.compile(make(), "mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    results["fit_" + name] = {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "updates": int(model.optimizer.iterations.numpy()),
    }
    # Custom loop with the optimizer wrapper: 2 workers x 4 x 4 micro-steps.
    with strategy.scope():
        model = build_dense()
        optimizer = GradientAccumulateOptimizer(make(), accum_steps=4)
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    dataset = dataset.with_options(options)

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            # Each worker takes its half of the global micro-batch of 8.
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            xb, yb = xb[index * 4 : index * 4 + 4], yb[index * 4 : index * 4 + 4]
            with tf.GradientTape() as tape:
                per_sample = keras.losses.mean_squared_error(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=8)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step, args=(xb, yb))

    for _ in range(2):
        for xb, yb in dataset:
            step(xb, yb)
    results["loop_" + name] = {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "updates": int(optimizer.iterations.numpy()),
    }
print(json.dumps({"replicas": strategy.num_replicas_in_sync, "results": results}))
"""


@pytest.fixture(scope="module")
def multi_worker_results():
    runs = run_workers(MULTI_WORKER)
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sgd_clipnorm", "adam", "adamw", "schedule"])
@pytest.mark.parametrize("wrapper", ["fit", "loop"])
def test_multi_worker_equals_one_device_big_batch(multi_worker_results, wrapper, case):
    for worker in multi_worker_results:
        assert worker["replicas"] == 2
        result = worker["results"][f"{wrapper}_{case}"]
        assert result["updates"] == 4
        assert result["diff"] < FLOAT32_ATOL, (wrapper, case, result)


# Fault tolerance: both workers stop in the middle of an accumulation group in
# epoch 2; restarted with BackupAndRestore they end where an uninterrupted run
# (one device, global batch) does: the interrupted epoch is re-run from the
# backup taken at the end of epoch 1, nothing applied twice or lost.
RESUMABLE = """
import json
import sys
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense, make_regression_data, max_abs_diff

mode, backup = sys.argv[1], sys.argv[2]
index = strategy.cluster_resolver.task_id
x, y = make_regression_data(num_samples=64)


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if mode == "interrupt" and self.epoch == 1 and batch == 2:
            raise SystemExit(3)


with strategy.scope():
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.Adam(0.01), "mse")
model.fit(
    x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
    callbacks=[keras.callbacks.BackupAndRestore(f"{backup}/worker{index}"), Interrupt()],
)
reference = build_dense()
reference.compile(keras.optimizers.Adam(0.01), "mse")
reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
print(json.dumps({
    "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
    "updates": int(model.optimizer.iterations.numpy()),
}))
"""


@pytest.mark.slow
def test_multi_worker_resumes_with_backup_and_restore(tmp_path):
    interrupted = run_workers(RESUMABLE, args=("interrupt", tmp_path), check=False)
    assert [code for code, _, _ in interrupted] == [3, 3]
    for _, out, _ in run_workers(RESUMABLE, args=("resume", tmp_path)):
        result = json.loads(out.strip().splitlines()[-1])
        # 8 micro-steps of 2 x 4 samples per epoch: 2 updates per epoch.
        assert result["updates"] == 6
        assert result["diff"] < FLOAT32_ATOL, result


OUTSIDE_SCOPE = """
import tensorflow as tf
from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense

model = build_dense(GradientAccumulateModel, accum_steps=2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
try:
    with strategy.scope():
        model.compile("sgd", "mse")
except ValueError as error:
    print("ValueError:", error)
"""


@pytest.mark.slow
def test_model_created_outside_the_strategy_scope_is_refused():
    out = run_script(OUTSIDE_SCOPE, logical_cpus=2)
    assert "ValueError: Model 'functional" in out or "ValueError: Model '" in out
    assert "was created outside any strategy scope" in out
    assert "inside `with strategy.scope():`" in out


UNSYNCHRONIZED_BN = """
import json
import tensorflow as tf
import keras
import numpy as np
from gradient_accumulator import AccumBatchNormalization, GradientAccumulateModel
from gradient_accumulator.distribute import average_batchnorm_statistics

rng = np.random.default_rng(0)
# The two replicas' shards have different means: replica 0 gets the first
# half of every global micro-batch of 8, replica 1 the second half.
x = rng.normal(size=(64, 3)).astype("float32")
x[np.arange(64) % 8 >= 4] += 5.0
y = rng.normal(size=(64, 1)).astype("float32")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    normalized = AccumBatchNormalization(accum_steps=2, momentum=0.0, name="bn")(inputs)
    model = GradientAccumulateModel(
        accum_steps=2, inputs=inputs, outputs=keras.layers.Dense(1)(normalized)
    )
    model.compile(keras.optimizers.SGD(0.0), "mse")
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
bn = model.get_layer("bn")
per_replica = [v.numpy() for v in strategy.experimental_local_results(bn.moving_mean.value)]
averaged = average_batchnorm_statistics(model)
after = [v.numpy() for v in strategy.experimental_local_results(bn.moving_mean.value)]
print(json.dumps({
    "layers": averaged,
    "before_gap": float(np.abs(per_replica[0] - per_replica[1]).max()),
    "after_gap": float(np.abs(after[0] - after[1]).max()),
    "after_vs_mean": float(np.abs(after[0] - (per_replica[0] + per_replica[1]) / 2).max()),
    # Last group = the last 16 samples; momentum 0 keeps only its statistics.
    "vs_global": float(np.abs(after[0] - x[48:].mean(axis=0)).max()),
}))
"""


@pytest.mark.slow
def test_average_batchnorm_statistics_across_replicas():
    result = json.loads(run_script(UNSYNCHRONIZED_BN, logical_cpus=2).strip().splitlines()[-1])
    assert result["layers"] == 1
    assert result["before_gap"] > 4.0  # each replica saw its own shard
    assert result["after_gap"] == 0.0
    assert result["after_vs_mean"] < 1e-6
    # Equal shards: the average of the moving means is the global one.
    assert result["vs_global"] < 1e-5


def test_average_batchnorm_statistics_refuses_what_is_not_a_model():
    from gradient_accumulator import average_batchnorm_statistics

    with pytest.raises(
        ValueError, match=r"`model` must be a Keras model.*Received: model=.* of type Dense"
    ):
        average_batchnorm_statistics(keras.layers.Dense(1))
