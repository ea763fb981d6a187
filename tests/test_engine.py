"""The accumulation engine: what a micro-step costs in the traced graph."""

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator.engine import GradientAccumulator


def _ops_using(graph, variable):
    """Types of the top-level ops of ``graph`` that take ``variable``'s handle."""
    handle = variable.value.handle
    internal = [inside for outside, inside in graph.captures if outside is handle]
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
