"""The group runner: every accum_steps in every mode equals the big batch.

Each case trains ``GradientAccumulateModel`` at micro-batch 2 and plain Keras
at batch ``2 * accum_steps`` on the same data (arrays, no shuffling), and
compares the weights (float32: :data:`~tests.helpers.FLOAT32_ATOL`) and the
update count. The data make each epoch end with a shorter group whose last
micro-batch is shorter still (sizes differ). Before the runner, ``fit`` under
``jit_compile=True`` unrolled a group's fetches and failed from
``accum_steps * steps_per_execution > 32`` on ("An unusually high number of
`tf.data.Iterator.get_next()` calls was detected").
"""

import keras
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer
from gradient_accumulator.runner import MICRO_STEPS, WHOLE_GROUPS
from tests.helpers import (
    FLOAT32_ATOL,
    OPTIMIZERS,
    assert_close,
    assert_diff_below,
    build_dense,
    make_regression_data,
    run_script_module,
    script_results,
)

MICRO = 2
# accum_steps -> (whole groups an epoch, epochs): the largest one epoch of one.
ACCUM_STEPS = {1: (2, 2), 33: (2, 2), 128: (2, 2), 1024: (1, 1)}
MODES = {"graph": False, "jit": True}


def _samples(accum_steps, groups=2):
    """``groups`` whole groups, then a shorter one: a full micro-batch and a single sample.

    With ``accum_steps=1``, groups of one micro-batch: the last one a single sample.
    """
    return MICRO * (groups * accum_steps) + (MICRO + 1 if accum_steps > 1 else 1)


def _micro_batches(x, y):
    """A generator of micro-batches: data of unknown length for ``fit``."""
    for start in range(0, len(x), MICRO):
        yield x[start : start + MICRO], y[start : start + MICRO]


def _unknown_length(x, y):
    spec = (tf.TensorSpec((None, x.shape[1]), "float32"), tf.TensorSpec((None, 1), "float32"))
    dataset = tf.data.Dataset.from_generator(lambda: _micro_batches(x, y), output_signature=spec)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    return dataset


def _reference(x, y, accum_steps, epochs, jit_compile):
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse", jit_compile=jit_compile)
    reference.fit(x, y, batch_size=MICRO * accum_steps, epochs=epochs, shuffle=False, verbose=0)
    return reference


# Data of unknown length runs micro-step by micro-step, whatever steps_per_execution.
DATA = {
    "arrays-spe1": ("arrays", 1),
    "arrays-spe3": ("arrays", 3),
    "unknown_length": ("generator", 1),
}


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("accum_steps", list(ACCUM_STEPS), ids=lambda k: f"k{k}")
def test_fit_equals_the_big_batch_for_every_accum_steps(accum_steps, mode, data):
    groups, epochs = ACCUM_STEPS[accum_steps]
    data, steps_per_execution = DATA[data]
    x, y = make_regression_data(_samples(accum_steps, groups))
    reference = _reference(x, y, accum_steps, epochs, MODES[mode])
    model = build_dense(GradientAccumulateModel, accum_steps=accum_steps)
    model.compile(
        OPTIMIZERS["adam"](),
        "mse",
        jit_compile=MODES[mode],
        steps_per_execution=steps_per_execution,
    )
    cases = []

    class Case(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            cases.append(model._runner.case())

    source = (x, y) if data == "arrays" else (_unknown_length(x, y), None)
    model.fit(
        *source,
        batch_size=MICRO if data == "arrays" else None,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[Case()],
    )
    assert set(cases) == {WHOLE_GROUPS if data == "arrays" else MICRO_STEPS}
    assert int(model.optimizer.iterations.numpy()) == epochs * (groups + 1)
    assert int(model._accumulator.micro_step.numpy()) == 0
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("accum_steps", [1, 33, 128], ids=lambda k: f"k{k}")
def test_train_on_batch_equals_the_big_batch(accum_steps, mode):
    x, y = make_regression_data(_samples(accum_steps))
    reference = _reference(x, y, accum_steps, 1, MODES[mode])
    model = build_dense(GradientAccumulateModel, accum_steps=accum_steps)
    model.compile(OPTIMIZERS["adam"](), "mse", jit_compile=MODES[mode])
    for xb, yb in _micro_batches(x, y):
        model.train_on_batch(xb, yb)
    model.apply_accumulated_gradients()  # the shorter last group
    assert int(model.optimizer.iterations.numpy()) == 3
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("steps_per_execution", [1, 3], ids=["spe1", "spe3"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("accum_steps", [1, 33, 128], ids=lambda k: f"k{k}")
def test_optimizer_wrapper_in_fit_equals_the_big_batch(accum_steps, mode, steps_per_execution):
    # Plain Keras's fit with the optimizer wrapper: equal micro-batches (the
    # wrapper averages micro-steps), three groups.
    x, y = make_regression_data(MICRO * accum_steps * 3)
    reference = _reference(x, y, accum_steps, 1, MODES[mode])
    model = build_dense()
    optimizer = GradientAccumulateOptimizer(OPTIMIZERS["adam"](), accum_steps=accum_steps)
    model.compile(
        optimizer, "mse", jit_compile=MODES[mode], steps_per_execution=steps_per_execution
    )
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 3
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


def test_a_group_is_one_program_whatever_its_length():
    # The whole-groups function is traced once, for every group length; a
    # micro-step appears twice in it (in the loop, and last) whatever
    # accum_steps, with one fetch each.
    sizes = {}
    for accum_steps in (4, 64):
        x, y = make_regression_data(_samples(accum_steps))
        model = build_dense(GradientAccumulateModel, accum_steps=accum_steps)
        model.compile(OPTIMIZERS["adam"](), "mse")
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
        (group,) = model._runner._functions["group"]._list_all_concrete_functions()
        graph = group.graph
        operations = list(graph.get_operations())
        for function in graph._functions.values():
            operations += function.graph.get_operations()
        fetches = [op for op in operations if op.type == "IteratorGetNext"]
        assert len(fetches) == 2
        sizes[accum_steps] = len(operations)
    assert sizes[4] == sizes[64]


def test_keras_counts_an_extra_update_on_data_of_unknown_length():
    # What the wrapper is compared with: Keras 3.15 ends every epoch of
    # unknown length with one more optimizer step of zero gradients (Adam
    # then still moves the weights); the wrapper updates once per group.
    x, y = make_regression_data(_samples(4))
    plain = build_dense()
    plain.compile(OPTIMIZERS["adam"](), "mse")
    plain.fit(_unknown_length(x, y), epochs=2, verbose=0)
    micro_batches = len(range(0, len(x), MICRO))
    extra = int(plain.optimizer.iterations.numpy()) - 2 * micro_batches
    assert extra == 2
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(_unknown_length(x, y), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * 3


# Under MirroredStrategy (two logical CPUs, tests/scripts/mirrored_runner.py;
# jit_compile is refused there, tests/test_distribute.py): the cases of one
# fresh process against one device at the global big batch.
MIRRORED_CASES = {
    **{
        f"model-k{k}-{data}": 3  # two whole groups and a shorter one
        for k in (1, 33, 128)
        for data in ("spe1", "spe3", "unknown_length")
    },
    "optimizer-k33": 3,  # three whole groups
    "optimizer-k128": 3,
    # tests/test_state_writes.py: written once per update, on two replicas too.
    "spectral_normalization": 3,
}


@pytest.fixture(scope="module")
def mirrored_results():
    stdout = run_script_module("mirrored_runner", list(MIRRORED_CASES), timeout=900)
    results = script_results(stdout)
    assert results["replicas"] == 2
    return results["results"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MIRRORED_CASES))
def test_mirrored_every_accum_steps_equals_one_device(mirrored_results, case):
    result = mirrored_results[case]
    assert result["updates"] == result["reference_updates"] == MIRRORED_CASES[case], result
    assert result["moved"] > 1e-3, result
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)
