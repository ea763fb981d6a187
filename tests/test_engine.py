"""The accumulation engine: what a micro-step costs in the traced graph, and its update rules."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel, GradientAccumulateOptimizer, update
from gradient_accumulator.engine import GradientAccumulator, load_state, save_state
from tests.helpers import (
    FLOAT8_KERNEL_RTOL,
    FLOAT8_STATE_RTOL,
    build_float8,
    conditional_branch,
    control_flow,
    float8_differences,
    make_float8_data,
)


def _step(accumulator, grads, weight, is_update_step, optimizer, variables):
    """One micro-step of one normaliser class: the add, then the update if due."""
    update.step(accumulator, [grads], [weight], is_update_step, optimizer, variables)


def _captured(graph, variable):
    """``graph``'s internal tensors for ``variable``'s captured handle."""
    return [inside for outside, inside in graph.captures if outside is variable.handle]


def _ops_using(graph, variable):
    """Types of the top-level ops of ``graph`` that take ``variable``'s handle."""
    internal = _captured(graph, variable)
    return sorted(
        op.type for op in graph.get_operations() if any(t is i for t in op.inputs for i in internal)
    )


def test_a_micro_step_is_one_in_place_add_per_variable():
    # Keras's `Variable.assign_add` is `assign(self + value)`: a read, a new
    # tensor of the variable's size and an assignment, every micro-step. The
    # engine must use TensorFlow's in-place AssignAddVariableOp instead, and
    # touch the sums nowhere else outside the update's conditional.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    accumulator = GradientAccumulator(4, model.trainable_variables)
    grads = [np.ones(v.shape, "float32") for v in model.trainable_variables]

    @tf.function
    def micro_step(grads, is_update_step):
        _step(accumulator, grads, 1.0, is_update_step, optimizer, model.trainable_variables)

    graph = micro_step.get_concrete_function(grads, tf.constant(False)).graph
    for acc in accumulator.gradient_sums:
        assert _ops_using(graph, acc) == ["AssignAddVariableOp", "If"], acc.name

    micro_step(grads, tf.constant(False))
    micro_step(grads, tf.constant(False))
    for acc, grad in zip(accumulator.gradient_sums, grads):
        np.testing.assert_array_equal(acc.numpy(), 2 * grad)


def _accumulator_with_sums(values):
    variables = [keras.Variable(np.zeros_like(v)) for v in values]
    accumulator = GradientAccumulator(2, variables)
    for acc, value in zip(accumulator.gradient_sums, values):
        acc.assign(value)
    accumulator.weight_sum.assign(2.0)
    accumulator.micro_step.assign(1)
    return accumulator


def test_reset_zeroes_the_sums_in_place():
    # New zero tensors would give the sums fresh buffers at every update,
    # which cost ~100 MB more peak memory on MobileNetV2
    # (benchmarks/memory.py): reset only adds in place.
    values = [np.array([1.5, -2.0, 3e38], "float32"), np.full((2, 2), -7.25, "float32")]
    accumulator = _accumulator_with_sums(values)
    reset = tf.function(accumulator.reset)
    graph = reset.get_concrete_function().graph
    for acc in accumulator.gradient_sums:
        assert _ops_using(graph, acc) == ["AssignAddVariableOp", "ReadVariableOp"], acc.name
    reset()
    for acc in accumulator.gradient_sums:
        np.testing.assert_array_equal(acc.numpy(), np.zeros(acc.shape))
    assert float(accumulator.weight_sum.numpy()) == 0.0
    assert int(accumulator.micro_step.numpy()) == 0


def test_reset_after_a_non_finite_gradient_overwrites_when_checking():
    # Under a LossScaleOptimizer the update with an overflowed gradient is
    # skipped and training goes on: the next group must start from zeros,
    # which s + (-s) does not give for inf or NaN.
    values = [np.array([np.inf, 1.0], "float32"), np.array([np.nan, -np.inf], "float32")]
    accumulator = _accumulator_with_sums(values)
    tf.function(lambda: accumulator.reset(check_finite=True))()
    for acc in accumulator.gradient_sums:
        np.testing.assert_array_equal(acc.numpy(), np.zeros(acc.shape))
    finite = _accumulator_with_sums([np.array([1.0, -3.0], "float32")])
    tf.function(lambda: finite.reset(check_finite=True))()
    np.testing.assert_array_equal(finite.gradient_sums[0].numpy(), [0.0, 0.0])


def test_the_overwrite_holds_no_constant_zeros():
    # Zeros of a known shape in the reset's (mostly untaken) overwrite branch
    # were folded into constants, held by the graph for good: one 4 MiB sum's
    # size here (sums of one shape shared one). TensorFlow's CPU allocator
    # counts the bytes in use.
    accumulator = _accumulator_with_sums([np.ones((1024, 1024), "float32")] * 4)
    reset = tf.function(lambda: accumulator.reset(check_finite=True))

    def in_use():
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    # Sums set from one array may share a buffer, which their first in-place
    # write would copy (4 MiB that are not the reset's): written once first.
    for acc in accumulator.gradient_sums:
        acc.assign_add(tf.zeros(acc.shape))
    before = in_use()
    reset()
    reset()
    assert in_use() - before < 2**20
    for acc in accumulator.gradient_sums:
        np.testing.assert_array_equal(acc.numpy(), np.zeros(acc.shape))


def _branch_inputs(graph, variable=None, branch="then_branch"):
    """``graph``'s one conditional's ``branch``, and its inputs that are ``variable``'s handle."""
    (cond,) = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    handles = [] if variable is None else _captured(graph, variable)
    return conditional_branch(graph, cond, branch, handles)


def test_the_sums_are_emptied_after_the_optimizer_writes_the_variables():
    # Emptying the sums beside the optimizer's update added the reset's
    # temporaries to the optimizer's: on benchmarks/memory.py's MLP the
    # update's allocator peak was 512-592 MiB, 480-512 once the reset waits.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    accumulator = GradientAccumulator(2, variables)
    grads = [np.ones(v.shape, "float32") for v in variables]

    @tf.function
    def micro_step(grads, is_update_step):
        _step(accumulator, grads, 1.0, is_update_step, optimizer, variables)

    graph = micro_step.get_concrete_function(grads, tf.constant(True)).graph
    model_reads = set()
    for variable in variables:
        branch, inputs = _branch_inputs(graph, variable)
        model_reads |= {
            op.name
            for op in branch.get_operations()
            if op.type == "ReadVariableOp" and any(op.inputs[0] is t for t in inputs)
        }
    for acc in accumulator.gradient_sums:
        branch, inputs = _branch_inputs(graph, acc)
        writes = [
            op
            for op in branch.get_operations()
            if op.type == "AssignAddVariableOp" and any(op.inputs[0] is t for t in inputs)
        ]
        assert len(writes) == 1, acc.name  # the reset's s + (-s)
        # The reset's read of the sum (the first op of its negation) waits
        # for reads of the model's variables made after the optimizer's writes
        # (and for the sum's own write, the group's mean written into it by
        # the division's conditional).
        read = writes[0].inputs[1].op.inputs[0].op
        assert read.type == "ReadVariableOp", read.type
        own = {
            op.name
            for op in read.control_inputs
            if op.type in ("AssignVariableOp", "If", "StatelessIf")
            and any(u is t for u in op.inputs for t in inputs)
        }
        waits_for = {op.name for op in read.control_inputs} - own
        assert waits_for and waits_for <= model_reads, (acc.name, waits_for)


def test_each_mean_is_written_into_its_sum_one_variable_after_the_other():
    # With one replica the optimizer reads each mean from its sum, which the
    # mean replaces, and the means are computed one after the other: they
    # cost one variable's buffer at a time beside the optimizer's temporaries
    # (benchmarks/memory.py's MLP: the update's allocator peak above the idle
    # process went from 191.5 MiB, every mean a tensor of its own, to 128).
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(5), keras.layers.Dense(2)]
    )
    variables = model.trainable_variables
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build(variables)
    accumulator = GradientAccumulator(2, variables)
    grads = [np.full(v.shape, 3.0, "float32") for v in variables]
    before = [v.numpy() for v in variables]

    @tf.function
    def update(grads):
        _step(accumulator, grads, 2.0, True, optimizer, variables)

    update(grads)
    # The group's weight is 2.0: each mean is 3.0 / 2.0.
    for variable, start in zip(variables, before):
        np.testing.assert_allclose(variable.numpy(), start - 1.5, rtol=0, atol=1e-6)
    for acc in accumulator.gradient_sums:
        np.testing.assert_array_equal(acc.numpy(), 0.0)
    outer = update.get_concrete_function(grads).graph
    # The division is a conditional's branch (the other, where every divisor
    # is 1, divides nothing and writes no sum of a single class).
    graph, _ = _branch_inputs(outer, branch="else_branch")
    divisions = [op for op in graph.get_operations() if op.type == "DivNoNan"]
    assert len(divisions) == len(variables)
    undivided, _ = _branch_inputs(outer)
    assert not [op.type for op in undivided.get_operations() if "Variable" in op.type]

    def handles_in(acc):
        return _branch_inputs(outer, acc, branch="else_branch")[1]

    writes = {
        op.inputs[1].op.name: op for op in graph.get_operations() if op.type == "AssignVariableOp"
    }
    previous = None
    for acc, division in zip(accumulator.gradient_sums, divisions):
        read = division.inputs[0].op
        assert read.type == "ReadVariableOp"
        handles = handles_in(acc)
        assert any(read.inputs[0] is t for t in handles), acc.name
        # The mean replaces the sum ...
        assert any(writes[division.name].inputs[0] is t for t in handles), acc.name
        # ... after the previous variable's mean was written.
        if previous is not None:
            waits_for = [
                op.inputs[0] for op in read.control_inputs if op.type == "AssignVariableOp"
            ]
            assert any(any(handle is t for t in handles_in(previous)) for handle in waits_for), (
                acc.name,
                [op.name for op in read.control_inputs],
            )
        previous = acc


def test_a_decision_known_when_traced_puts_no_conditional_around_the_update():
    # A function that runs a whole group knows each micro-step's place: the
    # accumulating micro-steps only add in place, the last one updates,
    # with no conditional around it.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    variables = model.trainable_variables
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build(variables)
    accumulator = GradientAccumulator(2, variables)
    grads = [np.ones(v.shape, "float32") for v in variables]
    before = [v.numpy() for v in variables]

    @tf.function
    def group(grads):
        for index in range(2):
            micro = accumulator.micro_step_at(index, 2)
            _step(accumulator, grads, 0.5, micro.is_update_step, optimizer, variables)

    graph = group.get_concrete_function(grads).graph
    # The update is not conditional: the optimizer's count moves in the
    # graph itself. The one conditional, once per update, skips the division
    # where every divisor is 1; it writes the sums and nothing else.
    assert "AssignVariableOp" in _ops_using(graph, optimizer.iterations)
    assert len(control_flow(graph)) == 1
    assert control_flow(graph, accumulator) == []
    accumulating = (
        tf.function(lambda grads: _step(accumulator, grads, 0.5, False, optimizer, variables))
        .get_concrete_function(grads)
        .graph
    )
    for acc in accumulator.gradient_sums:
        assert _ops_using(accumulating, acc) == ["AssignAddVariableOp"], acc.name
    group([g / 2 for g in grads])  # gradients of loss / 2, each micro-step
    # Their weighted mean is the gradient: one SGD step of 1.0.
    for variable, value, grad in zip(variables, before, grads):
        np.testing.assert_allclose(variable.numpy(), value - grad, rtol=1e-6)
    assert int(accumulator.micro_step.numpy()) == 0
    assert int(optimizer.iterations.numpy()) == 1


def test_one_normaliser_class_is_the_one_entry_case_of_several():
    # One class: every variable sums into its one sum, no further state; a
    # routing of two classes adds a divisor, a reference and a sum for each
    # variable both reach; going back to one class drops them again. The
    # state of one class is a prefix of that of several (files stay readable).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    variables = model.trainable_variables
    accumulator = GradientAccumulator(2, variables)
    assert accumulator.num_classes == 1
    assert accumulator.routing == ((0,),) * len(variables)
    one_class_state = [id(v) for v in accumulator.state_variables]
    assert len(one_class_state) == 4 + len(variables)

    accumulator.configure_classes([(0, 1), (0, 1), (1,), (1,)], variables)
    assert accumulator.num_classes == 2
    assert len(accumulator.class_gradient_sums) == 2  # the first layer's two variables
    assert [id(v) for v in accumulator.state_variables][: len(one_class_state)] == one_class_state
    assert len(accumulator.state_variables) == len(one_class_state) + 1 + 1 + 2

    accumulator.configure_classes(None, variables)
    assert accumulator.num_classes == 1
    assert [id(v) for v in accumulator.state_variables] == one_class_state


def test_a_state_saved_without_the_classes_routing_loads_as_one_class():
    # Files written before the routing was saved for every accumulator hold
    # the one-class state only.
    values = [np.full((3, 4), 2.0, "float32"), np.full((4,), 3.0, "float32")]
    saved = _accumulator_with_sums(values)
    store = {}
    save_state(saved, store)
    assert "accumulator_classes" in store
    del store["accumulator_classes"]
    variables = [keras.Variable(np.zeros_like(v)) for v in values]
    loaded = GradientAccumulator(2, variables)
    load_state(loaded, store, "model", variables)
    assert loaded.num_classes == 1
    assert int(loaded.micro_step.numpy()) == 1
    for acc, value in zip(loaded.gradient_sums, values):
        np.testing.assert_array_equal(acc.numpy(), value)


# ------------------------------------------------ overwrite_with_gradient --


def _marked(value):
    variable = keras.Variable(np.asarray(value, "float32"))
    variable.overwrite_with_gradient = True
    return variable


def test_overwrite_with_gradient_variables_take_the_group_maximum():
    # Keras assigns such a variable its "gradient" (a float8 layer's new scale
    # or amax history): the group's is the elementwise maximum, over its
    # micro-steps and over normaliser classes, never divided, never given to
    # the gradient transform; the other variables get the mean. Reference:
    # numpy's maximum (the values go below 0, where Keras's built-in, which
    # starts its maximum at 0, would not give it).
    marked, plain = _marked([0.0, 0.0, 0.0]), keras.Variable(np.zeros(3, "float32"))
    variables = [marked, plain]
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build(variables)
    accumulator = GradientAccumulator(
        3, variables, gradient_transform=lambda grads, _: [g if g is None else 2 * g for g in grads]
    )
    accumulator.configure_classes([(0, 1), (0,)], variables)
    steps = [
        [[-3.0, 5.0, -2.0], [1.0, 2.0, 3.0]],
        [[-1.0, 0.5, -4.0], [3.0, 2.0, 1.0]],
        [[-2.0, 7.0, -3.0], [2.0, 2.0, 2.0]],
    ]
    second_class = np.array([-5.0, 6.0, -2.5], "float32")
    for index, (mark, grad) in enumerate(steps):
        ends = index == len(steps) - 1
        class_grads = [[np.float32(mark), np.float32(grad)], [second_class, None]]
        update.step(accumulator, class_grads, [1.0, 1.0], ends, optimizer, variables)
        if not ends:
            np.testing.assert_array_equal(marked.numpy(), np.zeros(3))
    maximum = np.max([*(np.float32(mark) for mark, _ in steps), second_class], axis=0)
    np.testing.assert_array_equal(marked.numpy(), maximum)  # [-1, 7, -2]
    mean = np.mean([grad for _, grad in steps], axis=0)
    np.testing.assert_allclose(plain.numpy(), -2 * mean, rtol=1e-6)
    # The next group starts its maximum anew, not from the last one's.
    for index, mark in enumerate(([-9.0, -9.0, -9.0], [-8.0, -9.5, -7.0], [-9.0, -9.0, -9.0])):
        class_grads = [[np.float32(mark), np.zeros(3, "float32")], [np.float32(mark), None]]
        update.step(accumulator, class_grads, [1.0, 1.0], index == 2, optimizer, variables)
    np.testing.assert_array_equal(marked.numpy(), [-8.0, -9.0, -7.0])


def test_the_maximum_matches_keras_gradient_accumulation():
    # Keras's own `gradient_accumulation_steps` keeps the maximum of
    # non-negative values (amax histories and scales are): the same group
    # through the engine gives Keras's value.
    # (A plain variable beside it: Keras 3.3 refuses to apply gradients to
    # overwritten variables only.)
    grads = [np.float32([0.5, 4.0]), np.float32([2.0, 1.0]), np.float32([1.5, 3.0])]
    keras_variables = [_marked([9.0, 9.0]), keras.Variable(np.zeros(2, "float32"))]
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=3)
    for grad in grads:
        builtin.apply([grad, grad], keras_variables)
    variables = [_marked([9.0, 9.0]), keras.Variable(np.zeros(2, "float32"))]
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build(variables)
    accumulator = GradientAccumulator(3, variables)
    for index, grad in enumerate(grads):
        _step(accumulator, [grad, grad], 1.0, index == 2, optimizer, variables)
    np.testing.assert_array_equal(variables[0].numpy(), keras_variables[0].numpy())
    np.testing.assert_array_equal(variables[0].numpy(), [2.0, 4.0])
    np.testing.assert_allclose(variables[1].numpy(), keras_variables[1].numpy(), rtol=1e-6)


# The wrappers on a float8-quantized model (see tests.helpers.build_float8)
# against plain Keras at the big batch (4 x 8), one epoch of 3 updates.
FLOAT8_WRAPPERS = ["model", "optimizer"]


def _float8_pair(wrapper):
    x, y = make_float8_data()
    reference = build_float8()
    reference.compile(keras.optimizers.Adam(0.01), "mse")
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    if wrapper == "model":
        model = build_float8(GradientAccumulateModel, accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    else:
        model = build_float8()
        optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=4)
        model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return reference, model


@pytest.mark.parametrize("wrapper", FLOAT8_WRAPPERS)
def test_float8_scales_and_amax_histories_are_the_big_batch_s(wrapper):
    reference, model = _float8_pair(wrapper)
    differences = float8_differences(reference, model)
    assert int(model.optimizer.iterations.numpy()) == 3
    marked = [w for w in reference.weights if getattr(w, "overwrite_with_gradient", False)]
    assert len(marked) == 12  # 2 layers x (inputs, kernel, outputs' gradient) x (scale, history)
    assert differences["state"] < FLOAT8_STATE_RTOL, differences
    assert differences["kernel"] < FLOAT8_KERNEL_RTOL, differences
    # The amax histories moved: 3 updates wrote 3 entries, not all the same.
    history = np.asarray(reference.layers[1].inputs_amax_history)
    assert np.count_nonzero(history) == 3 and len(set(history[history > 0])) == 3, history


# ----------------------------------------- what the wrappers rely on, directly --


def _sgd_accumulator(shapes, accum_steps=3):
    """An accumulator over zero variables and SGD(1): an update subtracts the mean."""
    variables = [keras.Variable(np.zeros(shape, "float32")) for shape in shapes]
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build(variables)
    return GradientAccumulator(accum_steps, variables), variables, optimizer


def test_accumulate_adds_weighted_dense_and_sparse_gradients_and_their_divisors():
    # Each micro-step adds its gradients (dense, or IndexedSlices whose
    # duplicate rows sum) and its divisor; a variable without a gradient
    # keeps its sum; nothing moves the variables before the update.
    accumulator, variables, optimizer = _sgd_accumulator([(3, 2), (2,)])
    rng = np.random.default_rng(0)
    dense = [rng.normal(size=(3, 2)).astype("float32") for _ in range(2)]
    values = tf.constant(rng.normal(size=(3, 2)).astype("float32"))
    rows = tf.IndexedSlices(values, tf.constant([2, 0, 2]), tf.constant([3, 2]))
    expected = dense[0] + dense[1] + tf.convert_to_tensor(rows).numpy()
    bias = rng.normal(size=(2,)).astype("float32")

    step = tf.function(
        lambda grads, divisor: _step(accumulator, grads, divisor, False, optimizer, variables)
    )
    step([dense[0], bias], 4.0)
    step([dense[1], None], 2.0)
    step([rows, None], 1.5)
    np.testing.assert_allclose(accumulator.gradient_sums[0].numpy(), expected, rtol=1e-6)
    np.testing.assert_array_equal(accumulator.gradient_sums[1].numpy(), bias)
    assert float(accumulator.weight_sum.numpy()) == 7.5
    assert int(accumulator.micro_step.numpy()) == 3
    for variable in variables:
        np.testing.assert_array_equal(variable.numpy(), np.zeros(variable.shape))


def test_the_update_hands_each_class_s_sum_over_its_divisor_then_empties_the_group():
    # Two normaliser classes: the first variable is reached by both, the
    # second by class 1 only. The update's gradient is sum_c G_c / W_c, a
    # class with divisor 0 contributes 0 (not NaN), and the group is empty
    # after it.
    accumulator, variables, optimizer = _sgd_accumulator([(2,), (2,)], accum_steps=2)
    accumulator.configure_classes([(0, 1), (1,)], variables)
    g = {
        (0, 0): np.array([1.0, 2.0], "float32"),
        (1, 0): np.array([0.5, -1.0], "float32"),
        (1, 1): np.array([3.0, 4.0], "float32"),
    }

    @tf.function
    def micro_step(class_grads, divisors, is_update_step):
        update.step(accumulator, class_grads, divisors, is_update_step, optimizer, variables)

    micro_step([[g[0, 0], None], [g[1, 0], g[1, 1]]], [2.0, 0.0], tf.constant(False))
    micro_step([[g[0, 0], None], [g[1, 0], g[1, 1]]], [2.0, 0.0], tf.constant(True))
    # Class 1's divisor is 0: only class 0 moves the first variable; the
    # second, reached by class 1 alone, gets a zero gradient.
    np.testing.assert_allclose(variables[0].numpy(), -(2 * g[0, 0]) / 4.0, rtol=1e-6)
    np.testing.assert_array_equal(variables[1].numpy(), [0.0, 0.0])
    assert int(optimizer.iterations.numpy()) == 1
    assert int(accumulator.micro_step.numpy()) == 0
    for total in [accumulator.weight_sum, *accumulator.class_weight_sums]:
        assert float(total.numpy()) == 0.0
    for acc in [*accumulator.gradient_sums, *accumulator.class_gradient_sums]:
        np.testing.assert_array_equal(acc.numpy(), np.zeros(acc.shape))


# With 0.5 before it, a group divisor one float32 step below 1.
_BELOW_HALF = float(np.nextafter(np.float32(1), np.float32(0)) - np.float32(0.5))


@pytest.mark.parametrize("classes", [1, 2])
@pytest.mark.parametrize("second_divisor", [0.5, _BELOW_HALF], ids=["exactly-1", "below-1"])
def test_the_division_is_skipped_only_where_every_divisor_is_exactly_1(classes, second_divisor):
    # Where the group's divisors are all exactly 1 (micro-batches weighed by
    # their share of the group) the update skips the division: dividing by 1
    # gives the same bits. One ULP below 1 must divide: the expected update
    # is computed in float32 by numpy, and differs from the undivided sum.
    accumulator, variables, optimizer = _sgd_accumulator([(4,)], accum_steps=2)
    if classes == 2:
        accumulator.configure_classes([(0, 1)], variables)
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(2, classes, 4)).astype("float32") / 3

    @tf.function
    def micro_step(class_grads, divisors, is_update_step):
        update.step(accumulator, class_grads, divisors, is_update_step, optimizer, variables)

    micro_step([[g] for g in grads[0]], [0.5] * classes, tf.constant(False))
    micro_step([[g] for g in grads[1]], [second_divisor] * classes, tf.constant(True))
    divisor = np.float32(0.5) + np.float32(second_divisor)
    sums = grads[0] + grads[1]
    expected = -functools.reduce(np.add, list(sums / divisor))
    np.testing.assert_array_equal(variables[0].numpy(), expected)
    undivided = -functools.reduce(np.add, list(sums))
    assert (divisor == 1) == (second_divisor == 0.5)
    assert (divisor == 1) == np.array_equal(expected, undivided)


@pytest.mark.parametrize("accum_steps", [*range(1, 10), 16, 32, 64, 128, 10, 12])
def test_equal_micro_batches_divisor_is_exactly_1_for_the_documented_accum_steps(accum_steps):
    # The docs say the update skips the division for equal micro-batches
    # when accum_steps is 1 to 9 or a power of two, and not always otherwise:
    # the group's divisor is the float32 sum of the micro-steps' shares.
    accumulator, variables, optimizer = _sgd_accumulator([(2,)], accum_steps=accum_steps)
    grads = [np.zeros((2,), "float32")]

    @tf.function
    def micro_step(index):
        micro = accumulator.micro_step_at(index, accum_steps, ends_group=False)
        share = accumulator.share(16.0, 16.0, micro)
        _step(accumulator, grads, share, False, optimizer, variables)

    for index in range(accum_steps):
        micro_step(tf.constant(index))
    exact = accum_steps <= 9 or accum_steps & (accum_steps - 1) == 0
    assert (float(accumulator.weight_sum.numpy()) == 1.0) == exact


def _step_function(accumulator, variables, optimizer):
    @tf.function
    def step(grads, is_update_step):
        _step(accumulator, grads, 1.0, is_update_step, optimizer, variables)

    return step


def test_a_group_saved_mid_way_and_restored_ends_as_the_uninterrupted_one():
    # save_state / load_state (what `.keras` files, save_weights and
    # checkpoints carry): a fresh accumulator restored after two of three
    # micro-steps makes the same update as the one that never stopped.
    rng = np.random.default_rng(1)
    grads = [[rng.normal(size=(3, 2)).astype("float32")] for _ in range(3)]
    runs = {}
    for interrupted in (False, True):
        accumulator, variables, optimizer = _sgd_accumulator([(3, 2)])
        step = _step_function(accumulator, variables, optimizer)
        step(grads[0], tf.constant(False))
        step(grads[1], tf.constant(False))
        if interrupted:
            store = {}
            save_state(accumulator, store)
            accumulator = GradientAccumulator(3, variables)
            load_state(accumulator, store, "model", variables)
            assert int(accumulator.micro_step.numpy()) == 2
            step = _step_function(accumulator, variables, optimizer)
        step(grads[2], tf.constant(True))
        runs[interrupted] = variables[0].numpy()
    np.testing.assert_array_equal(runs[True], runs[False])
    np.testing.assert_allclose(runs[False], -sum(g[0] for g in grads) / 3.0, rtol=1e-6)


def test_weigh_makes_each_class_s_weight_in_one_place():
    # weighting.weigh_classes gives each class's objective with its
    # normaliser and capacity (pure); the accumulator turns them into the
    # micro-batch's weight N_i / (C_1 * K): a mean class's objective times
    # it, its divisor it; a sum (no normaliser) weight 1, divisor 1 at the
    # group's first micro-step and 0 after; a class without terms, divisor 0.
    variables = [tf.Variable([0.0, 0.0])]
    accumulator = GradientAccumulator(2, variables)
    accumulator.configure_classes([(0, 1, 2)], variables)
    classes = [
        (tf.constant(2.0), tf.constant(3.0), tf.constant(4.0), 1.0),
        (tf.constant(5.0), None, None, 0.5),
        (None, None, None, 1.0),
    ]
    first = accumulator.weigh(classes, accumulator.micro_step_at(0, 2))
    # C_1 * K = 4 * 2 = 8: the weight is 3 / 8.
    assert [float(d) for _, d, _ in first] == [3 / 8, 1.0, 0.0]
    assert float(first[0][0]) == 2.0 * 3 / 8 and float(first[1][0]) == 5.0
    assert first[2][0] is None and [s for _, _, s in first] == [1.0, 0.5, 1.0]
    second_classes = [(tf.constant(2.0), tf.constant(2.0), tf.constant(4.0), 1.0), *classes[1:]]
    second = accumulator.weigh(second_classes, accumulator.micro_step_at(1, 2))
    # The group's reference stays the first micro-batch's: 2 / 8.
    assert [float(d) for _, d, _ in second] == [2 / 8, 0.0, 0.0]


def test_writes_returned_lists_the_writes_that_read_and_make_writes_make():
    # A program that must write no variable (XLA's micro-step of
    # micro_batch_size="auto") lists the accumulator's writes; `read` sees
    # them, `make_writes` makes them after, the sparse add as a scatter.
    from gradient_accumulator.writes import make_writes, read, write, writes_returned

    counter, sums = tf.Variable(1.0), tf.Variable(tf.zeros((4,)))
    with writes_returned() as writes:
        write(counter, "assign", tf.constant(5.0))
        write(counter, "add", tf.constant(2.0))
        write(sums, "scatter_add", tf.IndexedSlices(tf.constant([1.0, 3.0]), tf.constant([2, 2])))
        assert float(read(counter)) == 7.0
        np.testing.assert_array_equal(read(sums).numpy(), [0.0, 0.0, 4.0, 0.0])
    assert float(counter.numpy()) == 1.0 and not sums.numpy().any()
    assert [kind for _, kind, _ in writes] == ["assign", "add", "scatter_add"]
    make_writes(writes)
    assert float(counter.numpy()) == 7.0
    np.testing.assert_array_equal(sums.numpy(), [0.0, 0.0, 4.0, 0.0])
    write(counter, "add", tf.constant(1.0))  # outside: made at once
    assert float(counter.numpy()) == 8.0
