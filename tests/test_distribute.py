"""Multi-replica training against one device at the global big batch (fresh processes).

MirroredStrategy runs over two logical CPU devices, MultiWorkerMirroredStrategy
as two local worker processes on loopback; each setup is a script of
``tests/scripts/`` that prints its figures, and the tests here assert on them.
The model wrapper's table (:data:`MODEL_CASES`) runs every feature that the
single-device tests of ``tests/test_model.py`` check; the optimizer wrapper's
is in ``tests/test_optimizer.py``.
"""

import os

import keras
import numpy as np
import pytest

from tests.helpers import (
    FLOAT8_KERNEL_RTOL,
    FLOAT8_STATE_RTOL,
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    KERAS_VERSION,
    assert_diff_below,
    run_script_module,
    run_workers,
    script_results,
)

# The reference must have moved this far from the initial weights: an
# equivalence of two untrained models proves nothing.
MOVED = 1e-3

# GradientAccumulateModel under MirroredStrategy (tests/scripts/mirrored_model.py):
# case -> (process, updates, tolerance). Two replicas at the global
# micro-batch 8, accum_steps=4; the reference is plain Keras on one device at
# the global big batch 32 (see each case's docstring in the script for the
# exceptions). 76 samples for 2 epochs give 6 updates: groups of 32, 32 and a
# last, shorter group of 12 (micro-batches of 8 and 4). The cases of one
# process share one strategy; processes keep each run under ~90 s on 2 cores.
MODEL_CASES = {
    "sgd_momentum": ("optimizers", 6, FLOAT32_ATOL),
    "adam": ("optimizers", 6, FLOAT32_ATOL),
    "adamw": ("optimizers", 6, FLOAT32_ATOL),
    "rmsprop": ("optimizers", 6, FLOAT32_ATOL),
    "schedule": ("optimizers", 6, FLOAT32_ATOL),
    "use_ema": ("optimizers", 6, FLOAT32_ATOL),
    "clipnorm": ("optimizers", 6, FLOAT32_ATOL),
    "global_clipnorm": ("optimizers", 6, FLOAT32_ATOL),
    "clipvalue": ("optimizers", 6, FLOAT32_ATOL),
    "use_agc": ("optimizers", 6, FLOAT32_ATOL),
    "sample_weight_regularizers": ("losses", 6, FLOAT32_ATOL),
    "class_weight": ("losses", 6, FLOAT32_ATOL),
    "multi_io": ("losses", 6, FLOAT32_ATOL),
    # One epoch of 72 samples (the last group: one micro-batch of 8) and of
    # 76 (the last group: micro-batches of 8 and 4, split 2 + 2).
    "short_group": ("losses", 3, FLOAT32_ATOL),
    "short_last_micro_batch": ("losses", 3, FLOAT32_ATOL),
    "reduce_every_micro_step": ("losses", 6, FLOAT32_ATOL),
    # Padded sequences; the replicas hold different token counts.
    "masked_tokens": ("losses", 6, FLOAT32_ATOL),
    "summed_tokens": ("losses", 6, FLOAT32_ATOL),
    # A masked per-token head beside a per-sequence head: two classes.
    "two_normalisers": ("losses", 6, FLOAT32_ATOL),
    "sparse_sgd": ("sparse_mixed", 6, FLOAT32_ATOL),
    "sparse_adam": ("sparse_mixed", 6, FLOAT32_ATOL),
    # 64 samples; each epoch's first group overflows and is skipped.
    "mixed_float16": ("sparse_mixed", 2, FLOAT16_ATOL),
    "sparse_mixed_float16": ("sparse_mixed", 6, FLOAT16_ATOL),
    # Keras's default initial scale, 3 epochs of 64 samples.
    "loss_scale": ("sparse_mixed", 6, FLOAT16_ATOL),
    "batchnorm": ("state", 6, FLOAT32_ATOL),
    # 64 samples, one epoch, interrupted, saved, restored, resumed.
    "resume_checkpoint": ("state", 2, FLOAT32_ATOL),
    "resume_save_weights": ("state", 2, FLOAT32_ATOL),
    # Last of its process: it may fail (see the test).
    "steps_per_execution": ("state", 6, FLOAT32_ATOL),
}


@pytest.fixture(scope="module")
def mirrored_model(tmp_path_factory):
    """``mirrored_model(process)``: the results of one process of :data:`MODEL_CASES`, run once."""
    runs = {}

    def results(process):
        if process not in runs:
            cases = [case for case, (where, *_) in MODEL_CASES.items() if where == process]
            workdir = tmp_path_factory.mktemp(f"mirrored_model_{process}")
            stdout = run_script_module("mirrored_model", [workdir, *cases])
            runs[process] = script_results(stdout)
            assert runs[process]["replicas"] == 2
        return runs[process]["results"]

    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_mirrored_two_replicas_equals_one_device_big_batch(mirrored_model, case):
    process, updates, atol = MODEL_CASES[case]
    result = mirrored_model(process)[case]
    # Trains even where plain Keras's own fit fails under the strategy
    # (steps_per_execution > 1 with Keras 3.8 to 3.15: a placeholder of its
    # while loop over the distributed iterator is never fed; `keras_error`;
    # docs/guides/distributed.rst): `fit` runs its own calls per group.
    assert "error" not in result, result
    assert result["updates"] == result["reference_updates"] == updates, result
    assert result["moved"] > MOVED, result
    if "classes" in result:  # Each normaliser class summed on its own.
        assert result["classes"] == 2, result
    if "logged_diff" in result:
        # Each epoch's logged losses (History) are the replicas' groups',
        # each replica's group its own big batch (token means, sums, each
        # output's), relative to numpy-free Keras losses of the reference's
        # weights; float32 sums in another order.
        assert result["logged_diff"] < 1e-5, result
    if "unclipped_gap" in result:  # Clipping must bite.
        assert result["unclipped_gap"] > MOVED, result
    assert result["state_diff"] < atol, result
    assert_diff_below(result["diff"], atol, result)


@pytest.mark.slow
def test_jit_compile_over_replicas_is_refused_before_training(tmp_path):
    # XLA compiles one device's program: plain Keras's `fit` fails at its
    # first step under MirroredStrategy (TensorFlow 2.21: "Trying to access
    # resource ..."; Keras 3.3.3: "We failed to lift variable creations out
    # of this tf.function"); the wrapper refuses it, naming it.
    stdout = run_script_module("mirrored_model", [tmp_path, "jit_compile"])
    result = script_results(stdout)["results"]["jit_compile"]
    assert result["error"].startswith("ValueError: `jit_compile=True` with 2 replicas"), result
    assert result["keras_error"] is not None, result


@pytest.mark.slow
def test_mirrored_mixed_float16_with_an_overflow_equals_one_device(mirrored_model):
    # Under a LossScaleOptimizer a group with an overflowed micro-batch (on
    # one replica) is skipped on both, and its sums (inf/NaN on a replica)
    # are emptied for the next group: the replica-local reset path.
    result = mirrored_model("sparse_mixed")["mixed_float16"]
    # Each epoch's first group overflows: skipped twice, the scale halved twice.
    assert result["scales"][0] == result["scales"][1] == 2.0**13, result
    assert result["sums_finite"], result
    assert_diff_below(result["diff"], FLOAT16_ATOL, result)


@pytest.mark.slow
def test_mirrored_mixed_float16_loss_scale_follows_the_big_batch(mirrored_model):
    result = mirrored_model("sparse_mixed")["loss_scale"]
    assert result["scales"] == [32768.0, 32768.0], result
    assert_diff_below(result["diff"], FLOAT16_ATOL, result)


@pytest.mark.slow
def test_mirrored_sparse_gradients_under_mixed_float16_keep_the_loss_scale(mirrored_model):
    result = mirrored_model("sparse_mixed")["sparse_mixed_float16"]
    assert result["scales"][0] == result["scales"][1], result
    assert_diff_below(result["diff"], FLOAT16_ATOL, result)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sparse_sgd", "sparse_adam"])
def test_mirrored_sparse_gradients_leave_untouched_rows(mirrored_model, case):
    # The update hands the optimizer the dense sum of the table: rows that no
    # replica touched get a zero gradient, which SGD and Adam (moments 0)
    # turn into no change at all.
    result = mirrored_model("sparse_mixed")[case]
    assert result["untouched_moved"] == 0.0, result
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.mark.slow
def test_mirrored_synchronized_batchnorm_has_the_global_batch_statistics(mirrored_model):
    # Moving statistics of every replica's copy against numpy's (float64) of
    # the global accumulated batches; relative error, floor 1, so the float32
    # tolerance applies to O(1) statistics.
    result = mirrored_model("state")["batchnorm"]
    assert result["stats_diff"] < FLOAT32_ATOL, result
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["checkpoint", "save_weights"])
def test_mirrored_resume_in_the_middle_of_a_group(mirrored_model, how):
    result = mirrored_model("state")[f"resume_{how}"]
    assert result["micro_step"] == 2, result  # restored two micro-steps into the group
    assert result["uninterrupted_diff"] < FLOAT32_ATOL, result
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.fixture(scope="module")
def counted():
    return script_results(run_script_module("mirrored_counted"))


@pytest.mark.slow
def test_gradients_cross_replicas_once_per_update(counted):
    # 64 samples at a global micro-batch of 16 (8 per replica): 4 micro-steps.
    results, params = counted["results"], counted["params"]["build_dense"]
    once = results["once_per_update"]
    assert once["updates"] == 1
    assert once["reductions"] == 1
    assert once["bytes"] == 4 * params + 4  # float32 sums and the weight sum
    assert_diff_below(once["diff"], FLOAT32_ATOL)
    every = results["every_micro_step"]
    assert every["reductions"] == 4
    assert_diff_below(every["diff"], FLOAT32_ATOL)
    # Plain Keras all-reduces every step (here: every update); Keras 3.3 and
    # 3.4 do not all-reduce the gradients at all (the replicas drift apart).
    if KERAS_VERSION >= (3, 5):
        assert results["plain_keras"]["reductions"] == 4


@pytest.mark.slow
def test_sparse_gradients_cross_replicas_as_the_dense_table(counted):
    # An Embedding's update all-reduces the dense sum of its whole table,
    # whichever rows the micro-batches touched: 4 bytes per table entry.
    sparse = counted["results"]["sparse_once_per_update"]
    assert sparse["updates"] == 1
    assert sparse["reductions"] == 1
    assert sparse["bytes"] == 4 * counted["params"]["build_embedding"] + 4
    assert_diff_below(sparse["diff"], FLOAT32_ATOL)


@pytest.fixture(scope="module")
def mirrored_float8():
    return script_results(run_script_module("mirrored_float8"))


@pytest.mark.slow
@pytest.mark.parametrize("configuration", ["model", "model_every_micro_step", "optimizer"])
def test_mirrored_float8_state_is_the_one_device_big_batch_s(mirrored_float8, configuration):
    # tests/scripts/mirrored_float8.py: a float8 MLP, two replicas whose
    # shards have different amax. The scales and amax histories take the
    # maximum across replicas (a sum would double the replicas' amax), and
    # it rides in the update's one batched reduction (3 updates, 3
    # reductions; 12 when every micro-step reduces).
    assert mirrored_float8["replicas"] == 2
    if configuration == "optimizer" and KERAS_VERSION < (3, 8):
        # As in tests/test_optimizer.py's mirrored `fit_` cases.
        pytest.skip("Keras < 3.8: fit under a strategy sums the replicas' mean losses")
    result = mirrored_float8["results"][configuration]
    assert result["updates"] == mirrored_float8["reference_updates"] == 3, result
    every_micro_step = configuration == "model_every_micro_step"
    assert result["reductions"] == (12 if every_micro_step else 3), result
    assert result["state"] < FLOAT8_STATE_RTOL, result
    assert result["kernel"] < FLOAT8_KERNEL_RTOL, result


# Two workers on loopback, one CPU replica each (tests/scripts/multi_worker.py).
MULTI_WORKER_CASES = ["sgd_clipnorm", "adam", "adamw", "schedule", "sparse_sgd", "sparse_adam"]


@pytest.fixture(scope="module")
def multi_worker_results():
    return [script_results(out) for _, out, _ in run_workers("multi_worker")]


@pytest.mark.slow
@pytest.mark.parametrize("case", MULTI_WORKER_CASES)
@pytest.mark.parametrize("wrapper", ["fit", "loop"])
def test_multi_worker_equals_one_device_big_batch(multi_worker_results, wrapper, case):
    for worker in multi_worker_results:
        assert worker["replicas"] == 2
        result = worker["results"][f"{wrapper}_{case}"]
        assert result["updates"] == 4, result
        assert result["moved"] > MOVED, result
        assert_diff_below(result["diff"], FLOAT32_ATOL, (wrapper, case, result))


@pytest.mark.slow
def test_multi_worker_two_normaliser_classes_equal_one_device_big_batch(multi_worker_results):
    for worker in multi_worker_results:
        result = worker["results"]["fit_two_normalisers"]
        assert result["classes"] == 2, result
        assert result["updates"] == 4, result
        assert result["moved"] > MOVED, result
        assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.mark.slow
def test_multi_worker_shorter_last_group_equals_one_device_big_batch(multi_worker_results):
    # fit's looped group (the epoch's shorter last one) across two workers.
    for worker in multi_worker_results:
        result = worker["results"]["fit_shorter_last_group"]
        assert result["updates"] == 4, result
        assert result["moved"] > MOVED, result
        assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.mark.slow
def test_multi_worker_resumes_with_backup_and_restore(tmp_path):
    # Both workers stop in the middle of an accumulation group in epoch 2;
    # restarted with BackupAndRestore they end where an uninterrupted run
    # (one device, global batch) does: the interrupted epoch is re-run from
    # the backup taken at the end of epoch 1, nothing applied twice or lost.
    interrupted = run_workers("multi_worker_resume", args=("interrupt", tmp_path), check=False)
    assert [code for code, _, _ in interrupted] == [3, 3]
    for _, out, _ in run_workers("multi_worker_resume", args=("resume", tmp_path)):
        result = script_results(out)
        # 8 micro-steps of 2 x 4 samples per epoch: 2 updates per epoch.
        assert result["updates"] == 6
        assert_diff_below(result["diff"], FLOAT32_ATOL, result)


@pytest.mark.slow
def test_model_created_outside_the_strategy_scope_is_refused():
    error = script_results(run_script_module("mirrored_outside_scope"))["error"]
    assert error is not None
    assert error.startswith("Model '")
    assert "was created outside any strategy scope" in error
    assert "inside `with strategy.scope():`" in error


@pytest.mark.slow
def test_average_batchnorm_statistics_across_replicas():
    result = script_results(run_script_module("mirrored_unsynchronized_bn"))
    assert result["layers"] == 1
    assert result["before_gap"] > 4.0  # each replica saw its own shard
    assert result["after_gap"] == 0.0
    assert result["after_vs_mean"] < 1e-6
    # Equal shards: the average of the moving means is the global one.
    assert result["vs_global"] < 1e-5


# AccumBatchNormalization (not synchronized) under a strategy: at every update
# the replicas' pending statistics are merged exactly, so every replica's
# moving statistics are numpy's on the global accumulated batch
# (tests/scripts/mirrored_batchnorm_statistics.py). float32 statistics of
# O(10) data against float64 numpy: relative 1e-6.
BATCHNORM_RTOL = 1e-6


def _assert_every_copy_is(copies, expected, rtol=BATCHNORM_RTOL):
    for name, key in (("moving_mean", "mean"), ("moving_variance", "variance")):
        for replica, copy in enumerate(copies[name]):
            np.testing.assert_allclose(
                copy, expected[key], rtol=rtol, atol=rtol, err_msg=f"{name} of replica {replica}"
            )


@pytest.fixture(scope="module")
def batchnorm_replicas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batchnorm")
    return script_results(run_script_module("mirrored_batchnorm_statistics", args=(folder,)))


@pytest.mark.slow
def test_shards_of_different_means_give_every_replica_the_global_statistics(batchnorm_replicas):
    shards = batchnorm_replicas["shards"]
    assert batchnorm_replicas["replicas"] == 2
    # Mean 0, variance 25 on both replicas (the spread between shards included).
    _assert_every_copy_is(shards["accum_bn"], shards["expected"])
    assert shards["expected"]["variance"] == [25.0] * 3
    # Keras's BatchNormalization, unaveraged: each copy its own shard's.
    assert [m[0] for m in shards["keras_bn"]["moving_mean"]] == [-5.0, 5.0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["equal_shards", "unequal_shards", "last_group", "on_its_own"])
def test_merged_statistics_equal_numpy_on_the_global_batch(batchnorm_replicas, case):
    result = batchnorm_replicas[case]
    _assert_every_copy_is(result, result["expected"])
    if case == "unequal_shards":
        assert result["counts"][0] < result["counts"][1] / 4  # replicas' counts differ
    if case == "last_group":
        assert result["updates"] == 3  # groups of 16, 16 and 8 samples


@pytest.mark.slow
def test_checkpoint_and_validation_see_the_merged_statistics(batchnorm_replicas):
    shards = batchnorm_replicas["shards"]
    checkpoint = shards["checkpoint"]
    _assert_every_copy_is({name: [checkpoint[name]] for name in checkpoint}, shards["expected"])
    # Validation during fit: the loss of one device holding the global statistics.
    if not shards["keras_validation_is_right"]:
        pytest.skip(f"Keras {keras.__version__} reports val_loss wrongly under MirroredStrategy")
    np.testing.assert_allclose(
        shards["val_loss"], shards["one_device_val_loss"], rtol=BATCHNORM_RTOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("owner", ["gradient_accumulate_model", "plain_model_with_callback"])
def test_keras_batchnorm_copies_are_averaged(batchnorm_replicas, owner):
    # The average of -5 and +5; its variance misses the spread between the
    # replicas' means (0, not 25): the documented caveat of averaging.
    copies = batchnorm_replicas["keras_bn_averaged"][owner]
    _assert_every_copy_is(copies, {"mean": [0.0] * 3, "variance": [0.0] * 3})


@pytest.mark.slow
def test_two_workers_merge_their_statistics():
    for _, stdout, _ in run_workers("multi_worker_batchnorm_statistics"):
        result = script_results(stdout)
        assert result["replicas"] == 2
        for case in ("fit", "on_its_own"):
            copies = {name: [result[case][name]] for name in result[case]}
            _assert_every_copy_is(copies, {"mean": [0.0] * 3, "variance": [25.0] * 3})


def test_average_batchnorm_statistics_refuses_what_is_not_a_model():
    from gradient_accumulator import average_batchnorm_statistics

    with pytest.raises(
        ValueError, match=r"`model` must be a Keras model.*Received: model=.* of type Dense"
    ):
        average_batchnorm_statistics(keras.layers.Dense(1))


@pytest.mark.slow
def test_the_script_host_reports_a_failed_run_and_stops_a_run_past_its_timeout(
    monkeypatch,
):
    # tests/scripts/_host.py forks every script of this module: a run that
    # fails is reported with its status and its stderr, and a run past its
    # timeout is killed and raised as subprocess.run would. The folder of a
    # run's outputs is removed however the run ends.
    import subprocess
    import tempfile

    from tests import helpers
    from tests.helpers import _start_script

    hosted = os.environ.get("GA_TESTS_NO_SCRIPT_HOST") != "1"
    if hosted:
        folders, make_folder = [], tempfile.mkdtemp

        def mkdtemp(**kwargs):
            folders.append(make_folder(**kwargs))
            return folders[-1]

        monkeypatch.setattr(helpers.tempfile, "mkdtemp", mkdtemp)

    code, out, err = _start_script("tests.scripts.no_such_script", [], {})(60)
    assert (code, out) == (1, ""), (code, out, err)
    assert "No module named tests.scripts.no_such_script" in err, err
    # A run's stdin is /dev/null, not the host's requests: json.tool reads
    # nothing and fails at once (reading the requests, it would wait).
    code, _, err = _start_script("json.tool", [], {})(60)
    assert code == 1 and "Expecting value" in err, (code, err)
    # http.server serves until killed (port 0: any free port).
    with pytest.raises(subprocess.TimeoutExpired):
        _start_script("http.server", ["0", "--bind", "127.0.0.1"], {})(2)
    # A run stopped before it was waited for (run_workers's other workers,
    # once one has failed).
    _start_script("http.server", ["0", "--bind", "127.0.0.1"], {}).stop()
    if hosted:
        assert len(folders) == 4, folders
        assert not [folder for folder in folders if os.path.exists(folder)]
