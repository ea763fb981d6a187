"""GradientAccumulateModel: fit(batch_size=b), k-step accumulation == fit(batch_size=k*b)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator._compat import output_loss_trackers
from gradient_accumulator.runner import WHOLE_GROUPS
from tests.helpers import (
    FLOAT16_ATOL,
    FLOAT32_ATOL,
    MICRO_BATCH,
    OPTIMIZERS,
    ROOT,
    BatchLogs,
    GradientNormLogging,
    assert_close,
    build_classifier,
    build_dense,
    build_embedding,
    build_multi_io,
    build_tagger,
    build_two_heads,
    control_flow,
    make_classification_data,
    make_multi_io_data,
    make_padded_sequences,
    make_regression_data,
    make_token_data,
    max_abs_diff,
    numpy_agc,
    shared_reference,
    train_big_batches,
    train_pair,
    unknown_length_dataset,
)

# The optimizers of the equivalence table here (of tests.helpers.OPTIMIZERS).
MODEL_OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop"]

MODES = {
    "graph": {},
    "eager": {"run_eagerly": True},
    "jit": {"jit_compile": True},
    "steps_per_execution": {"steps_per_execution": 3},
}


@pytest.mark.parametrize("accum_steps", [2, 3, 4], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("optimizer", MODEL_OPTIMIZERS, ids=str)
def test_equals_big_batch_for_each_optimizer(optimizer, accum_steps):
    x, y = make_regression_data()
    reference, accumulating = train_pair(
        build_dense, OPTIMIZERS[optimizer], x, y, accum_steps=accum_steps
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    # The weights moved: an equivalence of two untrained models proves nothing.
    assert max_abs_diff(reference.get_weights(), build_dense().get_weights()) > 1e-2


@pytest.mark.parametrize("mode", list(MODES), ids=str)
def test_equals_big_batch_in_every_execution_mode(mode):
    x, y = make_regression_data()
    reference, accumulating = train_pair(
        build_dense, OPTIMIZERS["adam"], x, y, compile_kwargs=MODES[mode]
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


@pytest.mark.parametrize("mode", ["graph", "steps_per_execution"], ids=str)
def test_long_groups_and_a_shorter_last_one_equal_big_batch(mode):
    # Groups of 10 micro-steps and the epoch's shorter last group (here 5)
    # run in one looped function.
    accum_steps = 10
    x, y = make_regression_data(num_samples=MICRO_BATCH * (2 * accum_steps + 5))
    reference, accumulating = train_pair(
        build_dense,
        OPTIMIZERS["adam"],
        x,
        y,
        accum_steps=accum_steps,
        compile_kwargs=MODES[mode] if mode in MODES else {},
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    assert max_abs_diff(reference.get_weights(), build_dense().get_weights()) > 1e-2
    assert int(accumulating.optimizer.iterations.numpy()) == 2 * 3


CLIPPING = {
    "clipnorm": {"clipnorm": 0.05},
    "global_clipnorm": {"global_clipnorm": 0.05},
    "clipvalue": {"clipvalue": 0.01},
}


@pytest.mark.parametrize("clipping", list(CLIPPING), ids=str)
def test_clipping_applies_to_the_accumulated_gradient(clipping):
    x, y = make_regression_data()

    def make_optimizer():
        return keras.optimizers.SGD(0.5, **CLIPPING[clipping])

    reference, accumulating = train_pair(build_dense, make_optimizer, x, y)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    # Clipping each micro-batch instead would give a visibly different result.
    unclipped, _ = train_pair(build_dense, lambda: keras.optimizers.SGD(0.5), x, y, epochs=2)
    assert max_abs_diff(unclipped.get_weights(), reference.get_weights()) > 1e-3


def test_adaptive_gradient_clipping_applies_to_the_accumulated_gradient():
    x, y = make_regression_data(num_samples=64)
    # Reference: one step per big batch, clipped by the numpy formula.
    reference = build_dense()
    optimizer = keras.optimizers.SGD(0.5)
    for start in range(0, 64, 32):
        with tf.GradientTape() as tape:
            prediction = reference(x[start : start + 32])
            loss = keras.ops.mean(keras.ops.square(prediction - y[start : start + 32]))
        weights = reference.trainable_variables
        grads = tape.gradient(loss, weights)
        clipped = [
            numpy_agc(g.numpy(), w.numpy(), 0.02, 1e-3).astype("float32")
            for g, w in zip(grads, weights)
        ]
        # Clipping must bite, or this test would not tell the orders apart.
        assert max(np.abs(c - g.numpy()).max() for c, g in zip(clipped, grads)) > 1e-3
        optimizer.apply(clipped, weights)
    model = build_dense(GradientAccumulateModel, accum_steps=4, use_agc=True, clip_factor=0.02)
    model.compile(keras.optimizers.SGD(0.5), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)
    assert model.get_config()["use_agc"] is True


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"use_agc": 1}, r"`use_agc` must be a boolean. Received: use_agc=1"),
        ({"clip_factor": 0}, r"`clip_factor` must be a float > 0. Received: clip_factor=0"),
        ({"eps": -1e-3}, r"`eps` must be a float > 0. Received: eps=-0.001"),
        (
            {"clip_factor": 0.1},
            r"`clip_factor` only acts with `use_agc=True`.*"
            r"Received: clip_factor=0.1, use_agc=False",
        ),
        ({"eps": 1e-2}, r"`eps` only acts with.*Received: eps=0.01, use_agc=False"),
    ],
    ids=["use_agc", "clip_factor", "eps", "clip_factor_without_agc", "eps_without_agc"],
)
def test_invalid_agc_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_dense(GradientAccumulateModel, accum_steps=2, **kwargs)


def test_learning_rate_schedule_sees_updates_not_micro_steps():
    x, y = make_regression_data()

    def make_optimizer():
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
        return keras.optimizers.SGD(schedule)

    reference, accumulating = train_pair(build_dense, make_optimizer, x, y, epochs=2)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    # 10 micro-batches per epoch in groups of 4, 4, 2: 3 updates per epoch.
    assert int(accumulating.optimizer.iterations.numpy()) == 6
    assert int(reference.optimizer.iterations.numpy()) == 6


def test_ema_averages_once_per_update():
    x, y = make_regression_data()

    def make_optimizer():
        return keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5)

    reference, accumulating = train_pair(build_dense, make_optimizer, x, y)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def test_sample_weight_and_regularizers():
    x, y = make_classification_data()
    sample_weight = np.random.default_rng(2).uniform(0.1, 3.0, size=len(x))
    reference, accumulating = train_pair(
        build_classifier,
        OPTIMIZERS["adam"],
        x,
        y,
        compile_kwargs={"loss": "sparse_categorical_crossentropy"},
        fit_kwargs={"sample_weight": sample_weight},
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def test_class_weight():
    x, y = make_classification_data()
    reference, accumulating = train_pair(
        build_classifier,
        OPTIMIZERS["sgd_momentum"],
        x,
        y,
        compile_kwargs={"loss": "sparse_categorical_crossentropy"},
        fit_kwargs={"class_weight": {0: 0.2, 1: 1.0, 2: 3.0}},
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


def test_multi_input_multi_output_with_loss_weights_and_add_loss():
    x, y = make_multi_io_data()
    reference, accumulating = train_pair(
        build_multi_io,
        OPTIMIZERS["rmsprop"],
        x,
        y,
        compile_kwargs={
            "loss": {"first": "mse", "second": "sparse_categorical_crossentropy"},
            "loss_weights": {"first": 0.3, "second": 2.0},
        },
    )
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


SPARSE_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": OPTIMIZERS["adam"],
}


# Keras's own sparse path against the big batch's defined (dense) update, as
# quoted on docs/troubleshooting.rst ("My Embedding model does not match plain
# Keras"), docs/background.rst and the README; 5% relative, as the figures
# move with TensorFlow's float32 rounding between versions.
KERAS_SPARSE_DIFFERENCE = {
    # One step on a 5-row table, 32 x 12 token ids: how many times the dense
    # step's largest change Keras's sparse step is off by.
    "adam": 8.2,
    "rmsprop": 8.2,
    "adagrad": 0.46,
    # The masked tagger, Adam(0.01), batch 32, 2 updates: max |difference| on
    # the embedding table and on the other weights.
    "tagger_embedding": 0.019,
    "tagger_kernels": 0.013,
}
TROUBLESHOOTING_PAGE = ROOT / "docs" / "troubleshooting.rst"


def _assert_documented_figure(name, measured):
    documented = KERAS_SPARSE_DIFFERENCE[name]
    assert abs(measured - documented) <= 0.05 * documented, (name, measured)
    assert f"{documented:g}" in TROUBLESHOOTING_PAGE.read_text(), (name, documented)


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop", "adagrad"])
def test_keras_sparse_step_differs_from_the_dense_step(optimizer):
    # Keras's Adam, RMSprop and Adagrad square each row of an Embedding's
    # IndexedSlices before summing repeated rows; the dense gradient (the
    # big batch's, and what the wrappers hand the optimizer) sums first.
    table = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    ids = np.random.default_rng(1).integers(0, 5, size=(32, 12))
    updated = {}
    for densify in (False, True):
        variable = keras.Variable(table)
        instance = keras.optimizers.get(optimizer)
        instance.build([variable])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.gather(variable.value, ids) - 1.0))
        grad = tape.gradient(loss, variable.value)
        assert isinstance(grad, tf.IndexedSlices)
        instance.apply([tf.convert_to_tensor(grad) if densify else grad], [variable])
        updated[densify] = variable.numpy()
    dense_step = np.abs(updated[True] - table).max()
    _assert_documented_figure(optimizer, np.abs(updated[False] - updated[True]).max() / dense_step)


class DensifyingModel(GradientNormLogging):
    """Keras's own train step with every gradient densified: the defined update."""

    def gradients(self, grads):
        return [tf.convert_to_tensor(g) for g in grads]


def test_masked_embedding_tagger_with_adam_equals_the_densified_big_batch():
    x, tags, _ = make_padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = {}
    for name, model, batch_size in (
        ("keras_sparse", build_tagger(), 4 * MICRO_BATCH),
        ("densified", build_tagger(DensifyingModel), 4 * MICRO_BATCH),
        ("accumulating", build_tagger(GradientAccumulateModel, accum_steps=4), MICRO_BATCH),
    ):
        model.compile(keras.optimizers.Adam(0.01), loss)
        model.fit(x, tags, batch_size=batch_size, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 2
        runs[name] = model.get_weights()
    assert_close(runs["densified"], runs["accumulating"], FLOAT32_ATOL)
    sparse, dense = runs["keras_sparse"], runs["densified"]
    _assert_documented_figure("tagger_embedding", np.abs(sparse[0] - dense[0]).max())
    _assert_documented_figure("tagger_kernels", max_abs_diff(sparse[1:], dense[1:]))


@pytest.mark.parametrize("optimizer", list(SPARSE_OPTIMIZERS))
def test_sparse_embedding_gradients_equal_big_batch(optimizer):
    # The Embedding's gradient is tf.IndexedSlices, and every micro-batch
    # repeats token ids. The wrapper scatter-adds them into a dense float32
    # sum and hands the optimizer the dense mean. SGD's reference is plain
    # Keras on the raw IndexedSlices (its sparse update scatter-adds, summing
    # repeats as the dense gradient does); Adam's has its gradients densified
    # (Keras's sparse Adam squares each repeat's slice before summing).
    x, y = make_token_data(72)
    probe = build_embedding()
    with tf.GradientTape() as tape:
        loss = keras.ops.mean(keras.ops.square(probe(x[:MICRO_BATCH]) - y[:MICRO_BATCH]))
    assert isinstance(tape.gradient(loss, probe.trainable_variables)[0], tf.IndexedSlices)
    make = SPARSE_OPTIMIZERS[optimizer]
    if optimizer == "sgd":
        reference = build_embedding()
        reference.compile(make(), "mse")
        reference.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    else:
        reference, _ = train_big_batches(
            build_embedding, make, x, y, 4 * MICRO_BATCH, epochs=2, densify=True
        )
    model = build_embedding(GradientAccumulateModel, accum_steps=4)
    model.compile(make(), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)
    # 9 micro-batches per epoch in groups of 4, 4 and 1: 3 updates per epoch.
    assert int(model.optimizer.iterations.numpy()) == 6
    assert max_abs_diff(reference.get_weights(), build_embedding().get_weights()) > 1e-2


@pytest.mark.parametrize(
    "num_samples, expected_updates",
    [(64, 2), (76, 3), (72, 3), (8, 1)],
    ids=["whole_groups", "short_last_microbatch", "short_group", "one_microbatch"],
)
def test_last_partial_group_is_applied_weighted_by_its_samples(num_samples, expected_updates):
    x, y = make_regression_data(num_samples=num_samples)
    reference, accumulating = train_pair(build_dense, OPTIMIZERS["sgd_momentum"], x, y, epochs=1)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)
    assert int(accumulating.optimizer.iterations.numpy()) == expected_updates
    assert int(accumulating._accumulator.micro_step.numpy()) == 0


def test_partial_group_with_dataset_of_unknown_length():
    x, y = make_regression_data()

    def generator():
        for start in range(0, len(x), MICRO_BATCH):
            yield x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH]

    signature = (
        tf.TensorSpec((None, 5), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    dataset = tf.data.Dataset.from_generator(generator, output_signature=signature)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse")
    reference.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    accumulating = build_dense(GradientAccumulateModel, accum_steps=4)
    accumulating.compile(OPTIMIZERS["adam"](), "mse")
    accumulating.fit(dataset, epochs=2, verbose=0)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT32_ATOL)


class _WeightRecorder(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.snapshots = [self.model.get_weights()]
        self.iterations = []

    def on_train_batch_end(self, batch, logs=None):
        self.snapshots.append(self.model.get_weights())
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))


def test_weights_bit_identical_on_non_update_micro_steps():
    # The per-micro-step path (train_on_batch; fit with data of unknown
    # length): weights move only at the group's last micro-step.
    x, y = make_regression_data(num_samples=64)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    snapshots, iterations = [model.get_weights()], []
    for start in range(0, 64, MICRO_BATCH):
        model.train_on_batch(x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
        snapshots.append(model.get_weights())
        iterations.append(int(model.optimizer.iterations.numpy()))
    for step in range(8):
        before, after = snapshots[step], snapshots[step + 1]
        updated = any(not np.array_equal(a, b) for a, b in zip(before, after))
        assert updated == (step % 4 == 3), f"micro-step {step}"
    assert iterations == [0, 0, 0, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_fit_calls_the_batch_callbacks_once_per_update(steps_per_execution):
    # As for the big batch: one call of on_train_batch_end per update (per
    # `steps_per_execution` updates), whose `batch` counts micro-batches.
    x, y = make_regression_data()  # 10 micro-batches: groups of 4, 4 and 2
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse", steps_per_execution=steps_per_execution)
    recorder = _WeightRecorder()
    batches = []
    seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0, callbacks=[recorder, seen])
    per_call = 4 * steps_per_execution
    assert recorder.iterations == {1: [1, 2, 3], 2: [2, 3]}[steps_per_execution]
    # Keras reports each call's last micro-batch (from 3.11 on; its first before).
    last = [min(b + per_call - 1, 9) for b in range(0, 10, per_call)]
    first = list(range(0, 10, per_call))
    assert [min(b, 9) for b in batches] in (last, first)
    assert model.steps_per_execution == steps_per_execution  # the user's value, kept


def test_accumulators_are_not_model_weights():
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    plain = build_dense()
    model.compile("adam", "mse")
    assert [w.shape for w in model.get_weights()] == [w.shape for w in plain.get_weights()]
    assert len(model.weights) == len(plain.weights)
    assert len(model.non_trainable_weights) == 0


def test_accum_steps_one_is_plain_training():
    x, y = make_regression_data()
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse")
    reference.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    model = build_dense(GradientAccumulateModel, accum_steps=1)
    model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 20


# --------------------------------------------------------------------------
# group_step: a whole group in one traced call, nothing decided at run time
# (fit does not use it yet: the one-call-per-update issue builds it in).
# --------------------------------------------------------------------------


def _groups(arrays, micro_batch, accum_steps):
    """The epoch's groups of micro-batches: ``accum_steps`` each, the last one shorter."""
    starts = list(range(0, len(arrays[0]), micro_batch))
    batches = [tuple(a[s : s + micro_batch] for a in arrays) for s in starts]
    return [batches[g : g + accum_steps] for g in range(0, len(batches), accum_steps)]


def _train_by_groups(model, arrays, accum_steps, epochs=2, jit_compile=False):
    """Trains ``model`` one ``group_step`` call per group; returns the traced function."""
    model.make_train_function()  # builds the optimizer and the sums, as fit does
    strategy = model.distribute_strategy

    @tf.function(jit_compile=jit_compile)
    def one_group(batches):
        return strategy.run(model.group_step, args=(batches,))

    for _ in range(epochs):
        for group in _groups(arrays, MICRO_BATCH, accum_steps):
            one_group(group)
    return one_group


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "jit"])
def test_group_step_equals_big_batch_with_no_conditional_around_the_update(jit_compile):
    x, y = make_regression_data()  # 10 micro-batches: groups of 4, 4 and 2
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse")
    reference.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    one_group = _train_by_groups(model, (x, y), 4, jit_compile=jit_compile)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert int(model._accumulator.micro_step.numpy()) == 0
    # The group's function has no conditional but, outside XLA, the update's
    # division's (skipped where every divisor is 1, once per update); the
    # per-micro-step train function has the update's.
    group = _groups((x, y), MICRO_BATCH, 4)[0]
    graph = one_group.get_concrete_function(group).graph
    assert len(control_flow(graph)) == (0 if jit_compile else 1)
    assert control_flow(graph, model._accumulator) == []
    per_micro_step = tf.function(model.train_step).get_concrete_function(group[0])
    assert control_flow(per_micro_step.graph, model._accumulator)


def _adds_before(op, sums):
    """The names of the in-place adds into ``sums`` (captured handles' names) ``op`` waits for."""
    found, seen, stack = set(), set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name in seen:
                continue
            seen.add(parent.name)
            if parent.type == "AssignAddVariableOp" and parent.inputs[0].op.name in sums:
                found.add(parent.name)
            stack.append(parent)
    return found


def _captured_names(graph, variables):
    handles = {id(v.handle) for v in variables}
    return {inside.op.name for outside, inside in graph.captures if id(outside) in handles}


def test_a_group_runs_its_micro_steps_one_after_the_other():
    # The weights do not change inside a group, so nothing but the group
    # function orders its micro-steps: TensorFlow ran their forward passes
    # side by side, holding several micro-batches' activations (MobileNetV2
    # at 128 px, accum_steps=8: plain batch 128's peak RSS). Each micro-step's
    # batch is read after the previous micro-step's adds into the sums: in
    # fit's loop (its batch fetched under a dependency on the marker the
    # previous iteration carries) and in group_step (unrolled).
    x, y = make_regression_data()
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    variables = len(model._accumulator.gradient_sums)

    (group,) = model._runner.compiled(WHOLE_GROUPS)._list_all_concrete_functions()
    (loop,) = [op for op in group.graph.get_operations() if op.type in ("While", "StatelessWhile")]
    body = group.graph._functions[loop.get_attr("body").name].graph
    (fetch,) = [op for op in body.get_operations() if op.type == "IteratorGetNext"]
    (carried,) = [i for i, t in enumerate(body.inputs) if t.op in fetch.control_inputs]
    sums = _captured_names(body, model._accumulator.gradient_sums)
    assert len(_adds_before(body.outputs[carried].op, sums)) == variables

    one_group = _train_by_groups(model, (x, y), 4)
    group = _groups((x, y), MICRO_BATCH, 4)[0]
    graph = one_group.get_concrete_function(group).graph
    sums = _captured_names(graph, model._accumulator.gradient_sums)
    first_layer = [op for op in graph.get_operations() if op.type == "MatMul"]
    # The first MatMul of each micro-step's forward pass (4 micro-steps).
    forwards = first_layer[:: len(first_layer) // 4][:4]
    assert [len(_adds_before(op, sums)) for op in forwards] == [
        0,
        variables,
        2 * variables,
        3 * variables,
    ]


def test_fit_under_xla_compiles_the_update_apart_from_the_micro_steps():
    # One XLA program for a micro-step that also updated held its gradients,
    # the sums and the optimizer's temporaries at once: 2.6x the sums above
    # plain fit in peak RSS on benchmarks/memory.py's MLP, 0.12x apart. Every
    # micro-step runs one program that only adds; the update is another.
    x, y = make_regression_data()  # 10 micro-batches: groups of 4, 4 and 2
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse", jit_compile=True)
    reference.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse", jit_compile=True)
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 6

    optimizer_handles = {id(v.value.handle) for v in model.optimizer.variables}

    def optimizer_captures(function):
        return [
            sum(1 for outside, _ in concrete.graph.captures if id(outside) in optimizer_handles)
            for concrete in function._list_all_concrete_functions()
        ]

    adding, last, update = model._runner.compiled("xla")
    assert last is adding  # one program for every place in every group
    assert optimizer_captures(adding) == [0]
    (update_captures,) = optimizer_captures(update)
    assert update_captures > 0


def test_group_step_weighs_tokens_and_keeps_batchnorm_statistics():
    # A masked token loss (micro-batches with different token counts) and an
    # AccumBatchNormalization layer whose moving statistics must be the
    # group's, as in the per-micro-step path.
    x, tags, _ = make_padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build_tagger()
    reference.compile(keras.optimizers.SGD(0.5), loss)
    reference.fit(x, tags, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False, verbose=0)
    model = build_tagger(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.5), loss)
    _train_by_groups(model, (x, tags), 4)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)

    from gradient_accumulator import AccumBatchNormalization

    features = np.random.default_rng(2).normal(3.0, 2.0, size=(40, 5)).astype("float32")
    inputs = keras.Input((5,))
    normalized = AccumBatchNormalization(accum_steps=4, momentum=0.0, name="bn")(inputs)
    model = GradientAccumulateModel(
        accum_steps=4, inputs=inputs, outputs=keras.layers.Dense(1)(normalized)
    )
    model.compile(keras.optimizers.SGD(0.1), "mse")
    targets = np.zeros((40, 1), "float32")
    _train_by_groups(model, (features[:32], targets[:32]), 4, epochs=1)
    bn = model.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), features[:32].mean(0), rtol=2e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), features[:32].var(0), rtol=2e-6)


# --------------------------------------------------------------------------
# Functional twins of Keras's trainer_test.py fit/evaluate cases (which build
# a subclassed model, so Keras's suite run through the wrapper never reaches
# them): each data form Keras's fit takes, in each execution mode, with sample
# weights; the wrapper at k against plain Keras at batch k * b.
# --------------------------------------------------------------------------

DATA_FORMS = ("arrays", "dataset", "generator", "py_dataset")


class _BatchesDataset(keras.utils.PyDataset):
    def __init__(self, arrays, batch_size):
        super().__init__()
        self.arrays, self.batch_size = arrays, batch_size

    def __len__(self):
        return -(-len(self.arrays[0]) // self.batch_size)

    def __getitem__(self, index):
        start = index * self.batch_size
        return tuple(a[start : start + self.batch_size] for a in self.arrays)


def _fit_data(form, arrays, batch_size):
    """``fit``'s keyword arguments for ``arrays = (x, y, sample_weight)`` in ``form``."""
    steps = -(-len(arrays[0]) // batch_size)
    if form == "arrays":
        x, y, sample_weight = arrays
        return {"x": x, "y": y, "sample_weight": sample_weight, "batch_size": batch_size}
    if form == "dataset":
        return {"x": tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)}
    if form == "generator":

        def batches():
            dataset = _BatchesDataset(arrays, batch_size)
            while True:
                yield from (dataset[i] for i in range(len(dataset)))

        return {"x": batches(), "steps_per_epoch": steps}
    return {"x": _BatchesDataset(arrays, batch_size)}


@pytest.mark.parametrize(
    "form,mode,accum_steps",
    [(form, "graph", k) for form in DATA_FORMS for k in (1, 2)]
    # (Not a generator with steps_per_execution: Keras runs its epochs in
    # whole executions, 12 of the 10 steps_per_epoch here, plain models too.)
    + [("arrays", mode, 2) for mode in MODES if mode != "graph"]
    + [("generator", mode, 2) for mode in ("eager", "jit")],
    ids=lambda value: str(value),
)
def test_trainer_cases_on_a_functional_wrapper(form, mode, accum_steps):
    x, y = make_regression_data()
    sample_weight = np.random.default_rng(1).uniform(0.5, 2.0, len(x)).astype("float32")
    arrays = (x, y, sample_weight)

    def fit(model, batch_size, compile_kwargs):
        model.compile(OPTIMIZERS["adam"](), "mse", metrics=["mae"], **compile_kwargs)
        history = model.fit(
            **_fit_data(form, arrays, batch_size), epochs=2, shuffle=False, verbose=0
        )
        evaluated = model.evaluate(x, y, sample_weight=sample_weight, verbose=0, return_dict=True)
        return {
            "weights": model.get_weights(),
            "history": history.history,
            "loss": evaluated["loss"],
            "iterations": int(model.optimizer.iterations.numpy()),
            "predicted": model.predict(x, verbose=0),
        }

    # The reference: plain Keras in graph mode, shared by the modes (Keras <
    # 3.7 runs a steps_per_execution epoch whose steps it does not divide one
    # step too many: 12 updates of 10 batches here).
    reference = shared_reference(
        (*(a.tobytes() for a in arrays), form, accum_steps),
        lambda: fit(build_dense(), accum_steps * MICRO_BATCH, {}),
    )
    model = build_dense(GradientAccumulateModel, accum_steps=accum_steps)
    run = fit(model, MICRO_BATCH, MODES[mode])
    assert_close(reference["weights"], run["weights"], FLOAT32_ATOL)
    assert set(run["history"]) == {"loss", "mae"} and len(run["history"]["loss"]) == 2
    assert abs(reference["loss"] - run["loss"]) < FLOAT32_ATOL
    assert run["iterations"] == reference["iterations"]
    np.testing.assert_allclose(reference["predicted"], run["predicted"], atol=FLOAT32_ATOL)


def test_fit_with_none_for_a_required_input_raises_as_keras_does():
    # Keras's `test_required_none_raises_in_fit`: the wrapper looked up the
    # batch size before the forward pass, and the StopIteration it raised
    # ended fit's loop as if the data had run out (no error, 0 steps).
    errors = []
    for model in (build_dense(), build_dense(GradientAccumulateModel, accum_steps=2)):
        model.compile("sgd", "mse")
        with pytest.raises(Exception) as raised:
            model.fit(None, np.ones((4, 1), "float32"), verbose=0)
        errors.append((raised.type, str(raised.value).splitlines()[-1]))
    # The wrapper's is raised inside its traced group function, whose trace
    # Keras prints before the same message.
    assert errors[1][0] is errors[0][0] and errors[1][1].endswith(errors[0][1])


def test_fit_traces_without_autograph_as_keras_does():
    # Keras's `fit` traces `train_step` without AutoGraph (do_not_convert):
    # a tensor used as a Python bool in `call` raises there. The wrapper's
    # train functions are traced the same way (they converted the model's
    # code before, and raised the same error framed as AutoGraph's "in user
    # code"); not converting also makes their traces faster.
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")

    class Branching(keras.layers.Layer):
        def call(self, inputs):
            if keras.ops.sum(inputs) > 0:
                return inputs
            return -inputs

        def compute_output_shape(self, input_shape):
            return input_shape

    errors = []
    for cls, arguments in ((keras.Model, {}), (GradientAccumulateModel, {"accum_steps": 2})):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1)(Branching()(inputs))
        model = cls(inputs=inputs, outputs=outputs, **arguments)
        model.compile("sgd", "mse")
        with pytest.raises(tf.errors.OperatorNotAllowedInGraphError) as raised:
            model.fit(x, y, batch_size=2, verbose=0)
        errors.append(str(raised.value).splitlines()[0])
    assert errors[1] == errors[0] == "Exception encountered when calling Branching.call().", errors


def test_fit_callbacks_evaluate_predict_and_summary():
    x, y = make_regression_data()
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(OPTIMIZERS["adam"](), "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, validation_data=(x, y), verbose=0)
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae"}
    assert history.history["loss"][1] < history.history["loss"][0]
    before = model.get_weights()
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    assert max_abs_diff(before, model.get_weights()) == 0.0
    lines = []
    model.summary(print_fn=lambda line, **_: lines.append(line))
    assert any("hidden" in line for line in lines)


def test_reported_loss_is_the_unweighted_micro_batch_loss():
    x, y = make_regression_data(num_samples=64)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    history = model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    expected = float(np.mean((model.predict(x, verbose=0) - y) ** 2))
    assert abs(history.history["loss"][0] - expected) < 1e-5


def test_changing_trainable_flags_needs_a_recompile():
    x, y = make_regression_data()
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)
    model.get_layer("hidden").trainable = False
    model.compile(OPTIMIZERS["adam"](), "mse")
    frozen = model.get_layer("hidden").get_weights()
    model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)
    assert max_abs_diff(frozen, model.get_layer("hidden").get_weights()) == 0.0
    assert len(model._accumulator.gradient_sums) == 2


def test_changing_trainable_flags_without_a_recompile_is_refused():
    # Keras would keep the train function traced for the old variables and
    # go on training the frozen layer without a word.
    x, y = make_regression_data()
    model = build_dense(GradientAccumulateModel, accum_steps=2)
    model.compile(OPTIMIZERS["adam"](), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)
    model.get_layer("hidden").trainable = False
    frozen = model.get_layer("hidden").get_weights()
    with pytest.raises(
        RuntimeError,
        match=r"trainable variables of model .* changed .* call `compile\(\)` again.*"
        r"Received: 2 trainable variables, the train function was built for 4",
    ):
        model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)
    assert max_abs_diff(frozen, model.get_layer("hidden").get_weights()) == 0.0


def test_mixed_float16_equals_big_batch(mixed_float16):
    x, y = make_regression_data()
    reference, accumulating = train_pair(build_dense, OPTIMIZERS["adam"], x, y)
    assert isinstance(accumulating.optimizer, keras.optimizers.LossScaleOptimizer)
    assert all(v.dtype == "float32" for v in accumulating._accumulator.gradient_sums)
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT16_ATOL)
    assert float(reference.optimizer.dynamic_scale.numpy()) == float(
        accumulating.optimizer.dynamic_scale.numpy()
    )


@pytest.mark.parametrize("accum_steps", [2, 4, 16], ids=["k2", "k4", "k16"])
def test_mixed_float16_loss_scale_follows_the_big_batch(mixed_float16, accum_steps):
    """Keras's default initial scale: every micro-batch's loss is scaled by its share.

    Without it a micro-batch's float16 backward pass holds ``accum_steps``
    times the big batch's per-sample gradients and overflows first: a group
    is lost and the scale halved (issue 17). Adam's epsilon is raised from
    1e-7 so that float16 rounding of gradient components near zero is not
    divided by their own magnitude (it would be, as much, between two plain
    runs that only sum in another order).
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")

    def build(cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        return cls(inputs=inputs, outputs=keras.layers.Dense(1)(hidden), **kwargs)

    reference, accumulating = train_pair(
        build,
        lambda: keras.optimizers.Adam(0.01, epsilon=1e-4),
        x,
        y,
        accum_steps=accum_steps,
        micro_batch=32 // accum_steps,
        epochs=3,
    )
    for optimizer in (reference.optimizer, accumulating.optimizer):
        assert float(optimizer.dynamic_scale.numpy()) == 32768.0
        # LossScaleOptimizer forwards `iterations` to its inner optimizer from Keras 3.9 on.
        assert int(optimizer.inner_optimizer.iterations.numpy()) == 6
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT16_ATOL)


def test_mixed_float16_non_finite_micro_batch_skips_the_update(mixed_float16):
    x, y = make_regression_data(num_samples=64)
    x[10, 0] = 1e5  # overflows float16: micro-batch 1 of the first group.
    recorder = _WeightRecorder()
    reference = build_dense()
    reference.compile(OPTIMIZERS["adam"](), "mse")
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    accumulating = build_dense(GradientAccumulateModel, accum_steps=4)
    accumulating.compile(OPTIMIZERS["adam"](), "mse")
    accumulating.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0, callbacks=[recorder])
    initial = recorder.snapshots[0]
    # First group: skipped, weights untouched, the scale halved once.
    assert max_abs_diff(initial, recorder.snapshots[1]) == 0.0
    assert recorder.iterations[0] == 0
    # Second group: applied, as the big batch's second step.
    # LossScaleOptimizer forwards `iterations` to its inner optimizer from Keras 3.9 on.
    assert int(accumulating.optimizer.inner_optimizer.iterations.numpy()) == 1
    assert float(accumulating.optimizer.dynamic_scale.numpy()) == float(
        reference.optimizer.dynamic_scale.numpy()
    )
    assert float(accumulating.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert_close(reference.get_weights(), accumulating.get_weights(), FLOAT16_ATOL)
    # No poisoned accumulator is left behind.
    for acc in accumulating._accumulator.gradient_sums:
        assert np.all(np.isfinite(acc.numpy()))


def _stop_inside_a_group(model, x, y, micro_steps):
    """The first ``micro_steps`` micro-batches, one ``train_on_batch`` each: a run that stops."""
    for start in range(0, micro_steps * MICRO_BATCH, MICRO_BATCH):
        model.train_on_batch(x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])


def test_checkpoint_resume_in_the_middle_of_a_group(tmp_path):
    x, y = make_regression_data(num_samples=64)
    uninterrupted = build_dense(GradientAccumulateModel, accum_steps=4)
    uninterrupted.compile(OPTIMIZERS["adam"](), "mse")
    uninterrupted.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)

    first = build_dense(GradientAccumulateModel, accum_steps=4)
    first.compile(OPTIMIZERS["adam"](), "mse")
    _stop_inside_a_group(first, x, y, micro_steps=6)
    assert int(first._accumulator.micro_step.numpy()) == 2
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "ckpt"))

    resumed = build_dense(GradientAccumulateModel, accum_steps=4, seed=7)
    resumed.compile(OPTIMIZERS["adam"](), "mse")
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        path
    ).assert_existing_objects_matched()
    assert int(resumed._accumulator.micro_step.numpy()) == 2
    resumed.fit(x[48:], y[48:], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_close(uninterrupted.get_weights(), resumed.get_weights(), FLOAT32_ATOL)
    assert int(resumed.optimizer.iterations.numpy()) == 2


def test_save_weights_holds_the_accumulation_state(tmp_path):
    x, y = make_regression_data(num_samples=64)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    _stop_inside_a_group(model, x, y, micro_steps=2)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    other = build_dense(GradientAccumulateModel, accum_steps=4, seed=3)
    other.compile(OPTIMIZERS["adam"](), "mse")
    other.optimizer.build(other.trainable_variables)
    other.load_weights(path)
    for a, b in zip(model._accumulator.state_variables, other._accumulator.state_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(other._accumulator.micro_step.numpy()) == 2
    assert max_abs_diff(model.get_weights(), other.get_weights()) == 0.0


SAVE_FORMATS = {
    "weights": lambda model, path: model.save_weights(path + ".weights.h5") or path + ".weights.h5",
    "keras": lambda model, path: model.save(path + ".keras") or path + ".keras",
}


@pytest.mark.parametrize("save_format", list(SAVE_FORMATS), ids=str)
def test_a_file_saved_in_a_group_loads_into_the_plain_model_and_back(tmp_path, save_format):
    x, y = make_regression_data(num_samples=64)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    _stop_inside_a_group(model, x, y, micro_steps=2)
    assert int(model._accumulator.micro_step.numpy()) == 2
    saved = SAVE_FORMATS[save_format](model, str(tmp_path / "wrapped"))
    # The plain model of the same graph reads the weights and leaves the
    # accumulation state's entry alone.
    plain = build_dense(seed=3)
    plain.load_weights(saved)
    assert max_abs_diff(model.get_weights(), plain.get_weights()) == 0.0
    # Its own file loads into a wrapper: the same weights, no group pending.
    resaved = SAVE_FORMATS[save_format](plain, str(tmp_path / "plain"))
    back = build_dense(GradientAccumulateModel, accum_steps=4, seed=5)
    back.compile(OPTIMIZERS["adam"](), "mse")
    back.fit(x[:16], y[:16], batch_size=MICRO_BATCH, shuffle=False, verbose=0)  # a group
    _stop_inside_a_group(back, x, y, micro_steps=1)  # and one micro-step of the next
    back.load_weights(resaved)
    assert max_abs_diff(model.get_weights(), back.get_weights()) == 0.0
    assert int(back._accumulator.micro_step.numpy()) == 0
    assert all(not np.any(v.numpy()) for v in back._accumulator.gradient_sums)


def test_loading_weights_of_another_graph_raises_keras_s_error(tmp_path):
    # The message names the layer that differs, as plain Keras's does, not
    # the gradient sum that would not fit either.
    errors = []
    for cls, kwargs in ((keras.Model, {}), (GradientAccumulateModel, {"accum_steps": 2})):
        saved = str(tmp_path / f"{cls.__name__}.weights.h5")
        build_dense(cls, **kwargs).save_weights(saved)
        other = build_dense(cls, features=3, **kwargs)
        with pytest.raises(ValueError) as raised:
            other.load_weights(saved)
        errors.append(str(raised.value))
    assert "hidden" in errors[0] and "accumulator" not in errors[1]
    assert errors[1].split("\n")[-1] == errors[0].split("\n")[-1]


def test_backup_and_restore_resumes_to_the_uninterrupted_result(tmp_path):
    x, y = make_regression_data()
    uninterrupted = build_dense(GradientAccumulateModel, accum_steps=4)
    uninterrupted.compile(OPTIMIZERS["adam"](), "mse")
    uninterrupted.fit(x, y, batch_size=MICRO_BATCH, epochs=3, shuffle=False, verbose=0)

    class InterruptInEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch >= 4:  # after the second group of epoch 2
                raise KeyboardInterrupt

    backup = str(tmp_path / "backup")
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(OPTIMIZERS["adam"](), "mse")
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            x,
            y,
            batch_size=MICRO_BATCH,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), InterruptInEpoch()],
        )
    resumed = build_dense(GradientAccumulateModel, accum_steps=4, seed=5)
    resumed.compile(OPTIMIZERS["adam"](), "mse")
    resumed.fit(
        x,
        y,
        batch_size=MICRO_BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert_close(uninterrupted.get_weights(), resumed.get_weights(), FLOAT32_ATOL)
    assert int(resumed.optimizer.iterations.numpy()) == 9


def test_keras_file_round_trip_without_custom_objects(tmp_path):
    x, y = make_regression_data()
    model = build_dense(GradientAccumulateModel, accum_steps=3)
    model.compile(OPTIMIZERS["adamw"](), "mse")
    model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GradientAccumulateModel)
    assert loaded.accum_steps == 3
    assert max_abs_diff(model.get_weights(), loaded.get_weights()) == 0.0
    np.testing.assert_allclose(model.predict(x, verbose=0), loaded.predict(x, verbose=0), atol=0)
    # Training continues identically (optimizer state and accumulators loaded).
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_close(model.get_weights(), loaded.get_weights(), FLOAT32_ATOL)


def test_a_legacy_h5_file_loads_with_custom_objects(tmp_path):
    # Keras's legacy `.h5` loader finds the class by its bare name (as for
    # any Model subclass); the saving guide says to pass it.
    model = build_dense(GradientAccumulateModel, accum_steps=3)
    model.compile(OPTIMIZERS["adam"](), "mse")
    path = str(tmp_path / "model.h5")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"GradientAccumulateModel": GradientAccumulateModel}, compile=False
    )
    assert isinstance(loaded, GradientAccumulateModel) and loaded.accum_steps == 3
    assert max_abs_diff(model.get_weights(), loaded.get_weights()) == 0.0


def test_get_config_has_accum_steps():
    model = build_dense(GradientAccumulateModel, accum_steps=5)
    config = model.get_config()
    assert config["accum_steps"] == 5
    clone = GradientAccumulateModel.from_config(config)
    assert clone.accum_steps == 5


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True, None, 4.0])
def test_invalid_accum_steps_is_refused(bad):
    with pytest.raises(
        ValueError, match=rf"`accum_steps` must be an integer >= 1\. Received: accum_steps={bad!r}"
    ):
        build_dense(GradientAccumulateModel, accum_steps=bad)


def test_optimizer_that_accumulates_itself_is_refused():
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=2)
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps=2.*accum_steps=4.*Keep one.*Received: optimizer=Adam",
    ):
        model.compile(optimizer, "mse")


def test_optimizer_wrapper_inside_the_model_is_refused():
    from gradient_accumulator import GradientAccumulateOptimizer

    model = build_dense(GradientAccumulateModel, accum_steps=4)
    with pytest.raises(ValueError, match=r"accum_steps=2\).*Keep one.*inner_optimizer"):
        model.compile(GradientAccumulateOptimizer("adam", accum_steps=2), "mse")


def test_apply_accumulated_gradients_after_train_on_batch():
    x, y = make_regression_data(num_samples=24)
    reference = build_dense()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.train_on_batch(x, y)
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    for start in range(0, 24, MICRO_BATCH):
        model.train_on_batch(x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
    assert int(model.optimizer.iterations.numpy()) == 0
    model.apply_accumulated_gradients()
    model.apply_accumulated_gradients()  # Nothing pending: a no-op.
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


def test_batchnorm_accum_steps_changed_after_construction_is_refused_at_fit():
    from gradient_accumulator import AccumBatchNormalization

    inputs = keras.Input((5,))
    hidden = AccumBatchNormalization(accum_steps=4, name="bn")(keras.layers.Dense(4)(inputs))
    model = GradientAccumulateModel(
        accum_steps=4, inputs=inputs, outputs=keras.layers.Dense(1)(hidden)
    )
    model.get_layer("bn").accum_steps = 2  # what construction could not see
    model.compile("sgd", "mse")
    x, y = make_regression_data(num_samples=16)
    with pytest.raises(
        ValueError,
        match=r"Layer 'bn' has `accum_steps=2` and model .* has `accum_steps=4`.*"
        r"replace_batchnorm_layers\(model, accum_steps=4\)",
    ):
        model.fit(x, y, batch_size=4, verbose=0)


# Keyword arguments that Keras's functional constructor would drop without a
# word: each must be refused, naming it, what to do and the value received.
UNKNOWN_KEYWORDS = {
    "agc_of_the_old_readme": (
        dict(agc=True),
        r"does not take `agc`: enable adaptive gradient clipping with `use_agc=True`.*"
        r"Received: agc=True",
    ),
    "typo_accum_step": (
        dict(accum_step=8),
        r"does not take an argument `accum_step`\. Did you mean `accum_steps`\?.*"
        r"Received: accum_step=8",
    ),
    "typo_use_acg": (
        dict(use_acg=True),
        r"Did you mean `use_agc`\?.*Received: use_acg=True",
    ),
    "mixed_precision_of_0.5": (
        dict(mixed_precision=True),
        r"does not take `mixed_precision`: .*set_global_policy\('mixed_float16'\).*"
        r"Received: mixed_precision=True",
    ),
    "experimental_distributed_support_of_0.5": (
        dict(experimental_distributed_support=True),
        r"needs no flag: create and compile the model inside `strategy.scope\(\)`.*"
        r"Received: experimental_distributed_support=True",
    ),
    "unrelated": (dict(foo=1), r"does not take an argument `foo`\. Its arguments are: .*"),
}


@pytest.mark.parametrize("case", list(UNKNOWN_KEYWORDS))
def test_unknown_keyword_arguments_are_refused(case):
    kwargs, message = UNKNOWN_KEYWORDS[case]
    with pytest.raises(ValueError, match=message):
        build_dense(GradientAccumulateModel, accum_steps=2, **kwargs)


def test_keras_model_arguments_pass_through():
    model = build_dense(GradientAccumulateModel, accum_steps=2, name="named", trainable=False)
    assert model.name == "named" and not model.trainable and model.accum_steps == 2


def test_batchnorm_with_other_accum_steps_is_refused_at_construction():
    from gradient_accumulator import AccumBatchNormalization

    inputs = keras.Input((5,))
    hidden = AccumBatchNormalization(accum_steps=2, name="bn")(keras.layers.Dense(4)(inputs))
    with pytest.raises(ValueError, match=r"Layer 'bn' has `accum_steps=2`.*`accum_steps=4`"):
        GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=keras.layers.Dense(1)(hidden))


def _logged(model, x, y, batch_size, sample_weight=None, loss="mse", metrics=("mae",), **compiled):
    model.compile(OPTIMIZERS["adam"](), loss, metrics=list(metrics), **compiled)
    logs = BatchLogs()
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[logs],
    )
    return logs.batches, history.history


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_logs_per_update_and_history_equal_the_big_batch_s(mode, weighted):
    # 10 micro-batches an epoch: groups of 4, 4 and a shorter 2. Each update's
    # logs (the loss and the metrics, running means over the epoch's
    # updates) and the History equal plain Keras's at the big batch, whose
    # batches are the groups; sample weights whose micro-batches' sums differ.
    x, y = make_regression_data(10 * MICRO_BATCH)
    weights = None
    if weighted:
        weights = np.random.default_rng(1).uniform(0.1, 3.0, len(x)).astype("float32")
    reference = _logged(build_dense(), x, y, 4 * MICRO_BATCH, weights, **MODES[mode])
    model = build_dense(GradientAccumulateModel, accum_steps=4)
    logged = _logged(model, x, y, MICRO_BATCH, weights, **MODES[mode])
    assert len(logged[0]) == len(reference[0]) == 6
    for update, (expected, got) in enumerate(zip(reference[0], logged[0])):
        assert set(got) == set(expected) == {"loss", "mae"}
        for key in expected:
            assert abs(got[key] - expected[key]) <= 1e-6 * abs(expected[key]), (update, key)
    for key, values in reference[1].items():
        np.testing.assert_allclose(logged[1][key], values, rtol=1e-6, err_msg=key)


# Losses whose divisor is not the micro-batch's samples: the masked tagger's
# token mean, a sum over samples, and two heads of two normalisers (tokens and
# sequences). Plain Keras logs each batch's loss weighted by its samples: the
# big batch's token mean (or sum), not the samples' mean of its micro-batches'.
def _token_logs_case(case, cls, **kwargs):
    """``(model, loss, x, y)`` of a logged-loss case; ``cls`` builds the model."""
    x, tags, _ = make_padded_sequences(10 * MICRO_BATCH)
    tokens = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if case == "tokens":
        return build_tagger(cls, **kwargs), tokens, x, tags
    if case == "sum":
        # A sum over the big batch's samples: a step 32 times a mean's.
        x, y = make_regression_data(10 * MICRO_BATCH)
        sum_loss = keras.losses.MeanSquaredError(reduction="sum")
        return build_dense(cls, **kwargs), sum_loss, x, y
    # Two heads, two normalisers: valid tokens and sequences. Keras logs
    # each head's loss too; it counts a batch in their means as one sample
    # where the batch's size is unknown when traced (a shorter last batch):
    # the epoch holds whole big batches, which it counts by their samples.
    x, tags = x[: 8 * MICRO_BATCH], tags[: 8 * MICRO_BATCH]
    second = np.random.default_rng(2).normal(size=(len(x), 1)).astype("float32")
    model = build_two_heads(cls, pooled_head=True, **kwargs)
    return model, [tokens, "mse"], x, (tags, second)


@pytest.mark.parametrize("mode", ["graph", "jit", "steps_per_execution"])
@pytest.mark.parametrize("case", ["tokens", "sum", "two_normalisers"])
def test_logged_loss_of_other_divisors_equals_the_big_batch_s(case, mode):
    # 10 micro-batches an epoch (groups of 4, 4 and 2; 8 for two heads), two epochs: each
    # update's logged loss and the History are plain Keras's at the big
    # batch (the weights too: SGD, whose sparse Embedding update is the
    # dense one). Before issue 42 the masked tagger logged 1.608022 against
    # 1.608463 at its first update.
    compiled = {"jit_compile": mode == "jit"}
    if mode == "steps_per_execution":
        # A multiple of plain Keras's epoch (Keras < 3.7 fails otherwise).
        compiled["steps_per_execution"] = 2 if case == "two_normalisers" else 3
    runs = []
    for cls, batch_size, kwargs in (
        (keras.Model, 4 * MICRO_BATCH, {}),
        (GradientAccumulateModel, MICRO_BATCH, {"accum_steps": 4}),
    ):
        model, loss, x, y = _token_logs_case(case, cls, **kwargs)
        rate = 0.05 / (4 * MICRO_BATCH) if case == "sum" else 0.05
        model.compile(keras.optimizers.SGD(rate), loss, **compiled)
        logs = BatchLogs()
        history = model.fit(
            x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, callbacks=[logs]
        )
        runs.append((logs.batches, history.history, model.get_weights()))
    (expected_logs, expected_history, reference), (logged, history, weights) = runs
    assert_close(reference, weights, FLOAT32_ATOL)
    updates = 4 if case == "two_normalisers" else 6
    assert len(logged) == len(expected_logs) == (updates if mode != "steps_per_execution" else 2)
    for update, (expected, got) in enumerate(zip(expected_logs, logged)):
        assert set(got) == set(expected)
        for key in expected:
            assert abs(got[key] - expected[key]) <= 1e-6 * abs(expected[key]), (update, key)
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize(
    "accum_steps, micro_batch, mode",
    [(64, 2, "graph"), (64, 2, "jit"), (128, 1, "graph"), (4, MICRO_BATCH, "mixed_float16")],
    ids=["k64-graph", "k64-jit", "k128-b1-graph", "k4-mixed_float16"],
)
def test_logged_token_loss_at_the_limits_equals_the_big_batch_s(
    accum_steps, micro_batch, mode, request
):
    # The masked tagger's token mean at accum_steps 64 and 128 (micro-batches
    # of 1 or 2 sequences of 1-12 tokens: the token counts differ most), and
    # under mixed_float16 (a float16 forward pass, a loss-scaled gradient).
    # An epoch of one whole group and half a group, two epochs: each update's
    # logged loss and the History are plain Keras's at the big batch.
    if mode == "mixed_float16":
        request.getfixturevalue("mixed_float16")
    big = accum_steps * micro_batch
    x, tags, _ = make_padded_sequences(big + big // 2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = []
    for cls, batch_size, kwargs in (
        (keras.Model, big, {}),
        (GradientAccumulateModel, micro_batch, {"accum_steps": accum_steps}),
    ):
        model = build_tagger(cls, **kwargs)
        model.compile(keras.optimizers.SGD(0.05), loss, jit_compile=mode == "jit")
        logs = BatchLogs()
        history = model.fit(
            x, tags, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, callbacks=[logs]
        )
        runs.append((logs.batches, history.history, model.get_weights()))
    (expected_logs, expected_history, reference), (logged, history, weights) = runs
    # float16's forward pass: the same per-sample float16 products in both,
    # summed in float32; the tolerance is float16's where it runs.
    rtol, atol = (FLOAT16_ATOL, FLOAT16_ATOL) if mode == "mixed_float16" else (1e-6, FLOAT32_ATOL)
    assert_close(reference, weights, atol)
    assert len(logged) == len(expected_logs) == 4
    for update, (expected, got) in enumerate(zip(expected_logs, logged)):
        assert abs(got["loss"] - expected["loss"]) <= rtol * abs(expected["loss"]), update
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=rtol)


def test_logged_token_loss_on_data_of_unknown_length_equals_the_big_batch_s():
    # The micro-steps case (one micro-step per call, the update decided at
    # run time): 8 micro-batches, two whole groups; each group's last
    # micro-step logs the group's token mean as the big batch's.
    x, tags, _ = make_padded_sequences(8 * MICRO_BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build_tagger()
    reference.compile(keras.optimizers.SGD(0.05), loss)
    expected = reference.fit(x, tags, batch_size=4 * MICRO_BATCH, shuffle=False, verbose=0)
    model = build_tagger(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.05), loss)
    history = model.fit(unknown_length_dataset(x, tags, MICRO_BATCH), verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    assert_close(reference.get_weights(), model.get_weights(), FLOAT32_ATOL)


def test_a_group_cut_short_ends_the_outputs_logged_losses_too():
    # Data of unknown length, 6 micro-batches: a group of 4, then one of 2
    # that the epoch's end applies. That end corrects every loss tracker,
    # the outputs' included (before issue 57 only the loss's): with the
    # weights held (SGD at rate 0), each tracker then holds its groups'
    # losses (a token mean, a sequence mean), weighted by their samples.
    x, tags, _ = make_padded_sequences(6 * MICRO_BATCH)
    second = np.random.default_rng(2).normal(size=(len(x), 1)).astype("float32")
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    model = build_two_heads(GradientAccumulateModel, pooled_head=True, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.0), losses)
    data = tf.data.Dataset.from_tensor_slices((x, (tags, second))).batch(MICRO_BATCH)
    model.fit(data.filter(lambda *_: True), epochs=1, verbose=0)
    assert int(model._accumulator.micro_step.numpy()) == 0  # the short group applied
    after = {key: float(value) for key, value in model.get_metrics_result().items()}
    plain = build_two_heads(pooled_head=True)
    plain.compile(keras.optimizers.SGD(0.0), losses)
    groups = [slice(0, 4 * MICRO_BATCH), slice(4 * MICRO_BATCH, 6 * MICRO_BATCH)]
    per_group = [
        plain.evaluate(x[g], (tags[g], second[g]), batch_size=len(x), verbose=0, return_dict=True)
        for g in groups
    ]
    expected = {key: (2 * per_group[0][key] + per_group[1][key]) / 3 for key in per_group[0]}
    # Keras logs each output's loss from about 3.9 on (3.3.3 the total only).
    output_keys = [key for key in expected if key.endswith("_loss")]
    assert len(output_keys) == len(output_loss_trackers(model)), expected
    for key in ["loss", *output_keys]:
        assert abs(after[key] - expected[key]) <= 1e-5 * abs(expected[key]), (key, after)


def test_train_on_batch_logs_each_micro_batch_and_at_the_update_the_group():
    # A call that only adds returns what plain Keras's train_on_batch returns
    # for that micro-batch (its token mean where Keras resets the metrics at
    # each call, as recent Keras does; the running mean since the last reset
    # in older Keras, 3.10 among them), the call that updates the group's
    # (the big batch's).
    x, tags, _ = make_padded_sequences(4 * MICRO_BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    micro_batches = [
        (x[i : i + MICRO_BATCH], tags[i : i + MICRO_BATCH]) for i in range(0, len(x), MICRO_BATCH)
    ]
    probe = build_tagger()
    probe.compile(keras.optimizers.SGD(0.0), loss)  # plain Keras, weights left alone
    plain = [float(probe.train_on_batch(*batch)) for batch in micro_batches]
    big = float(probe.evaluate(x, tags, batch_size=len(x), verbose=0))
    means = [float(probe.evaluate(*batch, verbose=0)) for batch in micro_batches]
    model = build_tagger(GradientAccumulateModel, accum_steps=4)
    model.compile(keras.optimizers.SGD(0.05), loss)
    returned = [float(model.train_on_batch(*batch)) for batch in micro_batches]
    np.testing.assert_allclose(returned[:3], plain[:3], rtol=1e-6)
    np.testing.assert_allclose(returned[3], big, rtol=1e-6)
    assert abs(big - np.mean(means)) > 1e-4  # the group's loss is not its micro-batches' mean
    assert int(model.optimizer.iterations.numpy()) == 1


GRADIENT_NORM_CASES = ["graph", "jit", "unknown_length", "mixed_float16", "global_clipnorm"]


@pytest.mark.parametrize("case", GRADIENT_NORM_CASES)
def test_gradient_norm_is_the_big_batch_s(case, request):
    # Per update, `gradient_norm` is the global norm of the big batch's
    # gradient (numpy, from a plain loop at the big batch with the same
    # optimizer), unscaled under mixed_float16, before global_clipnorm
    # clips it; 10 micro-batches an epoch: groups of 4, 4 and 2.
    if case == "mixed_float16":
        request.getfixturevalue("mixed_float16")
    x, y = make_regression_data(10 * MICRO_BATCH)
    norms = []

    def record(grads, variables):
        norms.append(np.sqrt(sum(float(np.sum(np.square(np.asarray(g)))) for g in grads)))
        return grads

    def make_optimizer():
        if case == "global_clipnorm":
            return keras.optimizers.Adam(0.01, global_clipnorm=0.05)
        return OPTIMIZERS["adam"]()

    reference, _ = train_big_batches(
        build_dense, make_optimizer, x, y, 4 * MICRO_BATCH, epochs=2, clip=record
    )
    model = build_dense(GradientAccumulateModel, accum_steps=4, gradient_norm=True)
    model.compile(make_optimizer(), "mse", jit_compile=case == "jit")
    logs = BatchLogs()
    if case == "unknown_length":
        data = unknown_length_dataset(x, y, MICRO_BATCH)
        history = model.fit(data, epochs=2, verbose=0, callbacks=[logs])
    else:
        history = model.fit(
            x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[logs]
        )
    tolerance = 2e-3 if case == "mixed_float16" else 1e-5
    atol = FLOAT16_ATOL if case == "mixed_float16" else FLOAT32_ATOL
    assert_close(reference.get_weights(), model.get_weights(), atol)
    logged = [entry["gradient_norm"] for entry in logs.batches]
    if case == "unknown_length":
        # The epoch's last group, cut short by the data, updates at the
        # epoch's end, after the epoch's last batch hooks: those (and the
        # History) show the update before it.
        assert len(logged) == len(norms) == 6
        expected = [norms[0], norms[1], norms[1], norms[3], norms[4], norms[4]]
        np.testing.assert_allclose(logged, expected, rtol=tolerance)
        np.testing.assert_allclose(history.history["gradient_norm"], expected[2::3], rtol=tolerance)
    else:
        assert len(logged) == len(norms) == 6
        np.testing.assert_allclose(logged, norms, rtol=tolerance)
        np.testing.assert_allclose(
            history.history["gradient_norm"], [norms[2], norms[5]], rtol=tolerance
        )
    if case == "global_clipnorm":
        assert min(norms) > 0.05  # every update clipped: the log is the norm before it


# --------------------------------------------------------------------------
# A subclass's own steps: `train_step` refused on every path, the others run
# --------------------------------------------------------------------------


class OwnTrainStep(GradientAccumulateModel):
    """A subclass with a training step of its own (Keras's custom-`fit` pattern)."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {**logs, "extra": 1.0}


class InheritedOwnTrainStep(OwnTrainStep):
    pass


@pytest.mark.parametrize("path", ["arrays", "dataset", "unknown_length", "train_on_batch"])
@pytest.mark.parametrize("cls", [OwnTrainStep, InheritedOwnTrainStep])
def test_an_overridden_train_step_is_refused_on_every_path(path, cls):
    """Never run on some paths and skipped on others: refused before training, by name."""
    x, y = make_regression_data(32)
    model = build_dense(cls, accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    message = (
        r"Model '.*' overrides `train_step` \(in class OwnTrainStep\).*Override "
        r"`compute_loss`.*GradientAccumulateOptimizer`. Received: OwnTrainStep.train_step"
    )
    with pytest.raises(ValueError, match=message):
        if path == "arrays":
            model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0)
        elif path == "dataset":
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH), verbose=0)
        elif path == "unknown_length":
            model.fit(unknown_length_dataset(x, y, MICRO_BATCH), epochs=1, verbose=0)
        else:
            model.train_on_batch(x[:MICRO_BATCH], y[:MICRO_BATCH])
    assert max_abs_diff(model.get_weights(), before) == 0.0


class OwnEvaluationSteps(GradientAccumulateModel):
    """``test_step`` and ``predict_step`` of a subclass's own: Keras runs them."""

    def test_step(self, data):
        logs = super().test_step(data)
        return {**logs, "own_test_step": 1.0}

    def predict_step(self, data):
        return super().predict_step(data) * 0.0 + 7.0


def test_overridden_test_and_predict_steps_run():
    x, y = make_regression_data(32)
    model = build_dense(OwnEvaluationSteps, accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, validation_data=(x, y), verbose=0)
    assert history.history["val_own_test_step"] == [1.0]
    assert model.evaluate(x, y, return_dict=True, verbose=0)["own_test_step"] == 1.0
    np.testing.assert_array_equal(model.predict(x, verbose=0), np.full((32, 1), 7.0, "float32"))


class SubclassedWrapper(GradientAccumulateModel):
    """A wrapper written the subclassing way: its layers as attributes, its own ``call``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def test_functional_and_subclassed_wrappers_in_one_process():
    """A functional wrapper leaves the class as it is: a subclass written the other way still works.

    Keras assigns ``Functional`` into the bases of a model class built from
    inputs and outputs (and of its ancestors); the wrapper's functional
    instances are of a form of their own (``_compat.functional_form``).
    Both train as the big batch, and the functional one saves and loads.
    """
    x, y = make_regression_data(64)
    functional = build_dense(GradientAccumulateModel, accum_steps=4)
    assert type(functional).__name__ == "GradientAccumulateModel"
    assert GradientAccumulateModel.__bases__ == (keras.Model,)
    keras.utils.set_random_seed(0)
    subclassed = SubclassedWrapper(accum_steps=4)
    subclassed(x[:1])  # builds its layers
    reference = build_dense()
    subclassed.set_weights(reference.get_weights())
    for model, batch_size in ((reference, 32), (functional, 8), (subclassed, 8)):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    assert_close(functional.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    assert_close(subclassed.get_weights(), reference.get_weights(), FLOAT32_ATOL)
    config = functional.get_config()
    restored = GradientAccumulateModel.from_config(config)
    assert restored.accum_steps == 4 and type(restored) is type(functional)
