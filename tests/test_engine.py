"""The accumulation engine: what a micro-step costs in the traced graph."""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator.engine import GradientAccumulator


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
        accumulator.step(grads, 1.0, is_update_step, optimizer, model.trainable_variables)

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


def _branch_inputs(graph, variable):
    """The update conditional's taken branch, and its inputs that are ``variable``'s handle."""
    internal = _captured(graph, variable)
    (cond,) = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    branch = graph._get_function(cond.get_attr("then_branch").name).graph
    # The If op's inputs after the condition are the branch's inputs, in order.
    outer = cond.inputs[1:]
    inputs = [branch.inputs[k] for k, t in enumerate(outer) if any(t is i for i in internal)]
    return branch, inputs


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
        accumulator.step(grads, 1.0, is_update_step, optimizer, variables)

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
        # (and for the sum's own write, the group's mean written into it).
        read = writes[0].inputs[1].op.inputs[0].op
        assert read.type == "ReadVariableOp", read.type
        own = {
            op.name
            for op in read.control_inputs
            if op.type == "AssignVariableOp" and any(op.inputs[0] is t for t in inputs)
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
        accumulator.step(grads, 2.0, True, optimizer, variables)

    update(grads)
    # The group's weight is 2.0: each mean is 3.0 / 2.0.
    for variable, start in zip(variables, before):
        np.testing.assert_allclose(variable.numpy(), start - 1.5, rtol=0, atol=1e-6)
    for acc in accumulator.gradient_sums:
        np.testing.assert_array_equal(acc.numpy(), 0.0)
    graph = update.get_concrete_function(grads).graph
    divisions = [op for op in graph.get_operations() if op.type == "DivNoNan"]
    assert len(divisions) == len(variables)
    writes = {
        op.inputs[1].op.name: op for op in graph.get_operations() if op.type == "AssignVariableOp"
    }
    previous = None
    for acc, division in zip(accumulator.gradient_sums, divisions):
        read = division.inputs[0].op
        assert read.type == "ReadVariableOp"
        handles = _captured(graph, acc)
        assert any(read.inputs[0] is t for t in handles), acc.name
        # The mean replaces the sum ...
        assert any(writes[division.name].inputs[0] is t for t in handles), acc.name
        # ... after the previous variable's mean was written and read back.
        if previous is not None:
            waits_for = []
            for op in read.control_inputs:
                while op.type == "Identity":
                    op = op.inputs[0].op
                if op.type == "ReadVariableOp":
                    waits_for.append(op.inputs[0])
            assert any(
                any(handle is t for t in _captured(graph, previous)) for handle in waits_for
            ), (acc.name, [op.name for op in read.control_inputs])
        previous = acc


def test_a_decision_known_when_traced_needs_no_conditional():
    # A function that runs a whole group knows each micro-step's place: the
    # accumulating micro-steps only add in place, the last one updates,
    # with no conditional in the graph.
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
            accumulator.step(grads, 0.5, micro.is_update_step, optimizer, variables)

    graph = group.get_concrete_function(grads).graph
    assert not [op.type for op in graph.get_operations() if "If" in op.type or "Case" in op.type]
    accumulating = tf.function(
        lambda grads: accumulator.step(grads, 0.5, False, optimizer, variables)
    ).get_concrete_function(grads).graph
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
    saved.save_state(store)
    assert "accumulator_classes" in store
    del store["accumulator_classes"]
    variables = [keras.Variable(np.zeros_like(v)) for v in values]
    loaded = GradientAccumulator(2, variables)
    loaded.load_state(store, "model", variables)
    assert loaded.num_classes == 1
    assert int(loaded.micro_step.numpy()) == 1
    for acc, value in zip(loaded.gradient_sums, values):
        np.testing.assert_array_equal(acc.numpy(), value)
