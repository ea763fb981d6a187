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
from gradient_accumulator.runner import MICRO_STEPS, SPLIT_BATCHES, WHOLE_GROUPS
from tests.helpers import (
    FLOAT32_ATOL,
    KERAS_VERSION,
    OPTIMIZERS,
    assert_close,
    assert_diff_below,
    build_dense,
    make_regression_data,
    run_script_module,
    script_results,
    shared_reference,
)

MICRO = 2
# accum_steps -> (whole groups an epoch, epochs): the largest one epoch of one.
ACCUM_STEPS = {1: (2, 2), 4: (2, 1), 33: (2, 2), 128: (2, 2), 1024: (1, 1)}
MODES = {"graph": False, "jit": True}
# The data: arrays (steps_per_execution 1, 3 or 9), or a generator (unknown
# length, micro-step by micro-step whatever steps_per_execution).
DATA = {"arrays": ("arrays", 1), "spe3": ("arrays", 3), "spe9": ("arrays", 9)}
DATA["unknown_length"] = ("generator", 1)
# (accum_steps, mode, data): each accum_steps in both modes on arrays, and
# the other data where the modes and lengths differ (accum_steps 4 with
# steps_per_execution 9, and 33 or more under XLA, failed before the runner).
FIT_CASES = [
    *[(k, mode, "arrays") for k in (1, 33, 128, 1024) for mode in MODES],
    (1, "graph", "unknown_length"),
    (1, "jit", "spe3"),
    (4, "jit", "spe9"),
    (33, "jit", "spe3"),
    (33, "graph", "unknown_length"),
    (33, "jit", "unknown_length"),
    (128, "graph", "spe3"),
    (128, "jit", "unknown_length"),
    (1024, "graph", "unknown_length"),
]


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
    """Plain Keras's weights after ``fit`` at batch ``MICRO * accum_steps`` (once per process)."""

    def train():
        reference = build_dense()
        reference.compile(OPTIMIZERS["adam"](), "mse", jit_compile=jit_compile)
        reference.fit(x, y, batch_size=MICRO * accum_steps, epochs=epochs, shuffle=False, verbose=0)
        return reference.get_weights()

    return shared_reference((x.tobytes(), y.tobytes(), accum_steps, epochs, jit_compile), train)


@pytest.mark.parametrize(
    "accum_steps, mode, data", FIT_CASES, ids=[f"k{k}-{m}-{d}" for k, m, d in FIT_CASES]
)
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
    assert_close(reference, model.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize(
    "accum_steps, mode, steps_per_execution",
    [(1, "jit", 1), (33, "graph", 1), (128, "jit", 1), (4, "graph", 3)],
    ids=["k1-jit", "k33-graph", "k128-jit", "k4-graph-spe3"],
)
def test_train_on_batch_equals_the_big_batch(accum_steps, mode, steps_per_execution):
    # train_on_batch is one micro-batch whatever steps_per_execution (a
    # model compiled for fit with steps_per_execution=3 crashed here).
    x, y = make_regression_data(_samples(accum_steps))
    reference = _reference(x, y, accum_steps, 1, MODES[mode])
    model = build_dense(GradientAccumulateModel, accum_steps=accum_steps)
    model.compile(
        OPTIMIZERS["adam"](),
        "mse",
        jit_compile=MODES[mode],
        steps_per_execution=steps_per_execution,
    )
    for xb, yb in _micro_batches(x, y):
        model.train_on_batch(xb, yb)
    model.apply_accumulated_gradients()  # the shorter last group
    assert int(model.optimizer.iterations.numpy()) == 3
    assert_close(reference, model.get_weights(), FLOAT32_ATOL)


OPTIMIZER_CASES = [(1, "jit", 3), (33, "jit", 3), (128, "graph", 1), (128, "jit", 1)]


@pytest.mark.parametrize(
    "accum_steps, mode, steps_per_execution",
    OPTIMIZER_CASES,
    ids=[f"k{k}-{m}-spe{n}" for k, m, n in OPTIMIZER_CASES],
)
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
    assert_close(reference, model.get_weights(), FLOAT32_ATOL)


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
        (group,) = model._runner.compiled(WHOLE_GROUPS)._list_all_concrete_functions()
        graph = group.graph
        operations = list(graph.get_operations())
        for function in graph._functions.values():
            operations += function.graph.get_operations()
        fetches = [op for op in operations if op.type == "IteratorGetNext"]
        assert len(fetches) == 2
        sizes[accum_steps] = len(operations)
    assert sizes[4] == sizes[64]


def test_each_case_s_function_is_read_through_the_accessor():
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(OPTIMIZERS["sgd_momentum"](), "mse")
    runner = model._runner
    assert runner.compiled(MICRO_STEPS) is None and runner.compiled(WHOLE_GROUPS) is None
    x, y = make_regression_data(8)
    model.train_on_batch(x[:4], y[:4])  # one micro-step: Keras's train function
    assert runner.compiled(MICRO_STEPS) is not None
    model.apply_accumulated_gradients()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # known length
    assert runner.compiled(WHOLE_GROUPS) is not None
    auto = build_dense(GradientAccumulateModel, micro_batch_size="auto")
    auto.compile(OPTIMIZERS["sgd_momentum"](), "mse")
    auto.fit(x, y, batch_size=8, epochs=1, verbose=0)
    group, end = auto._runner.compiled(SPLIT_BATCHES, measures=False)  # no noise scale
    assert group is not None and end is not None


@pytest.mark.parametrize("mode", list(MODES))
def test_one_update_per_group_on_data_of_unknown_length(mode):
    # What the wrapper is compared with: plain Keras (3.3.3 and 3.15.1
    # measured) ends every epoch of unknown length with one more optimizer
    # step of zero gradients in graph mode, none under XLA; the wrapper makes
    # one update per group in both.
    x, y = make_regression_data(_samples(4))
    plain = build_dense()
    plain.compile(OPTIMIZERS["adam"](), "mse", jit_compile=MODES[mode])
    plain.fit(_unknown_length(x, y), epochs=2, verbose=0)
    micro_batches = len(range(0, len(x), MICRO))
    extra = int(plain.optimizer.iterations.numpy()) - 2 * micro_batches
    assert extra in (0, 2)  # none, or one an epoch
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse", jit_compile=MODES[mode])
    model.fit(_unknown_length(x, y), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * 3


class _BatchEnds(keras.callbacks.Callback):
    """Counts the batch-end hooks, and the micro-steps pending at each."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.pending = []

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        accumulator = getattr(self.model, "_accumulator", None)
        if accumulator is not None:
            self.pending.append(int(accumulator.micro_step.numpy()))


@pytest.mark.parametrize("data", ["arrays", "unknown_length"])
def test_batch_hooks_run_once_per_update(tmp_path, data):
    # docs/faq.rst. With the model wrapper the batch hooks run once per
    # update, with no micro-step pending: a ModelCheckpoint (or
    # BackupAndRestore) with an integer save_freq saves between groups. It
    # adds up the batch indices the hooks receive, which count micro-batches.
    # On data of unknown length the epoch's last hooks come before its
    # shorter group's update, which the epoch's end applies.
    # With the optimizer wrapper in plain fit, the hooks run once per
    # micro-step.
    x, y = make_regression_data(_samples(4))  # groups of 4, 4 and 2 micro-batches
    source = (x, y) if data == "arrays" else (_unknown_length(x, y), None)
    batch_size = MICRO if data == "arrays" else None
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    ends = _BatchEnds()
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "model-{epoch}-{batch}.weights.h5"), save_freq=8, save_weights_only=True
    )
    model.fit(*source, batch_size=batch_size, epochs=2, verbose=0, callbacks=[ends, checkpoint])
    assert ends.count == int(model.optimizer.iterations.numpy()) == 6
    last = [0, 0, 0] if data == "arrays" else [0, 0, 2]  # micro-steps pending
    assert ends.pending == last * 2
    assert list(tmp_path.glob("*.weights.h5"))  # it saved

    plain = build_dense()
    plain.compile(GradientAccumulateOptimizer(OPTIMIZERS["adam"](), accum_steps=4), "mse")
    ends = _BatchEnds()
    plain.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0, callbacks=[ends])
    assert ends.count == len(range(0, len(x), MICRO))  # micro-steps


# Under MirroredStrategy (two logical CPUs, tests/scripts/mirrored_runner.py;
# jit_compile is refused there, tests/test_distribute.py): the cases of one
# fresh process against one device at the global big batch.
MIRRORED_CASES = {
    # Two whole groups and a shorter one.
    "model-k1-spe3": 3,
    "model-k33-spe1": 3,
    "model-k33-unknown_length": 3,
    "model-k128-spe3": 3,
    "model-k128-unknown_length": 3,
    "optimizer-k33": 3,  # three whole groups
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
    if case.startswith("optimizer-") and KERAS_VERSION < (3, 8):
        # The optimizer wrapper left unbuilt trained (Keras < 3.5 builds it
        # in the traced step) and counted its updates; its weights are plain
        # Keras's, whose fit sums the replicas' mean losses before 3.8.
        pytest.skip("Keras < 3.8: fit under a strategy sums the replicas' mean losses")
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)
    if case.startswith("model-"):
        # The logged gradient_norm: the global big batch's gradient norm.
        assert result["norm_rdiff"] < 1e-5, result


def test_a_micro_batch_s_path_through_the_package_stays_within_its_bound():
    """The package functions on one micro-batch's way to the inner apply (fit, graph, one device).

    ``tests/scripts/call_path.py`` lists them (``--verbose``): at most 12
    (Keras's own ``train_step`` reaches ``apply`` in 7 to 9 calls), in 6
    modules, and no call from a module up to one that imports it (a layer
    that calls back into its caller's). Was 19 in 6 modules with 3 calls
    back up before the group's end was written once (issue 57).
    """
    from tests.scripts.call_path import measure

    figures = measure("model", "known", "graph")
    assert set(figures["points"]) == {"forward", "loss", "gradient", "add", "apply"}
    assert len(figures["path"]) <= 12, figures["path"]
    assert len(figures["modules"]) <= 6, figures["modules"]
    assert figures["calls_back_up"] == [], figures["calls_back_up"]


def test_no_module_or_class_outgrows_its_bound():
    """No package module over 700 lines, no class over 500 (``tests/scripts/sizes.py``)."""
    from tests.scripts.sizes import measure

    sizes = measure()
    long_modules = {name: m["lines"] for name, m in sizes["modules"].items() if m["lines"] > 700}
    long_classes = {name: size for name, size in sizes["classes"].items() if size > 500}
    assert long_modules == {}, long_modules
    assert long_classes == {}, long_classes
