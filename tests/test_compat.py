"""Every Keras/TensorFlow internal of ``gradient_accumulator._compat`` still means what we use.

A failure here says which private name a new Keras or TensorFlow release
removed or changed: fix ``_compat.py`` (and only it) for that release.
"""

import gc
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import _compat


def _changed(name, what):
    return f"Keras {keras.__version__} / TensorFlow {tf.__version__} changed `{name}`: {what}"


def _nested_model():
    inner_input = keras.Input((3,))
    inner = keras.Model(inner_input, keras.layers.Dense(2, name="inner_dense")(inner_input))
    outer_input = keras.Input((3,))
    return keras.Model(outer_input, keras.layers.Dense(1, name="head")(inner(outer_input)))


def test_sublayers_walks_nested_models():
    model = _nested_model()
    names = [layer.name for layer in _compat.sublayers(model)]
    assert "inner_dense" in names and "head" in names, _changed(
        "Layer._flatten_layers", f"no longer lists nested layers: {names}"
    )
    direct = [layer.name for layer in _compat.sublayers(model, recursive=False)]
    assert "inner_dense" not in direct and "head" in direct, _changed(
        "Layer._flatten_layers(recursive=False)", f"lists {direct}"
    )


def test_functional_is_the_class_of_graph_models():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert isinstance(model, _compat.Functional), _changed(
        "keras.src.models.functional.Functional",
        f"keras.Model(inputs, outputs) is a {type(model).__mro__}",
    )


def test_eager_tensors_are_told_from_symbolic_ones():
    assert _compat.is_eager_tensor(tf.constant(1.0)), _changed(
        "tf.__internal__.EagerTensor", "is not the class of an eager tensor"
    )
    seen = []

    @tf.function
    def traced(x):
        seen.append(_compat.is_eager_tensor(x))
        return x

    traced(tf.constant(1.0))
    assert seen == [False], _changed("tf.__internal__.EagerTensor", "takes a symbolic tensor")


def test_functional_init_arguments_are_keras_s_test():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    for args, kwargs in (((inputs, outputs), {}), ((inputs,), {"outputs": outputs})):
        assert _compat.functional_init_arguments(args, kwargs), _changed(
            "keras.src.models.model.functional_init_arguments", f"refuses {args}, {kwargs}"
        )
    assert not _compat.functional_init_arguments((), {"name": "m"}), _changed(
        "keras.src.models.model.functional_init_arguments", "takes a subclass's arguments"
    )


def test_keras_injects_functional_into_a_model_class_s_ancestors():
    """Why `functional_form` exists: Keras assigns `Functional` into the bases of the class."""

    class Base(keras.Model):
        pass

    class Subclassed(Base):
        def call(self, x):
            return x

    inputs = keras.Input((2,))
    Base(inputs, keras.layers.Dense(1)(inputs))
    assert _compat.Functional in Base.__mro__, _changed(
        "keras.Model.__init__", "no longer injects Functional into a subclass built functionally"
    )
    with pytest.raises(TypeError, match="inputs"):
        Subclassed()
    form = _compat.functional_form(Subclassed)
    assert form.__name__ == "Subclassed" and issubclass(form, _compat.Functional)


def test_loss_tracker_is_the_metric_fit_reports():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean), _changed(
        "Model._loss_tracker", f"is a {type(tracker).__name__}, not a keras.metrics.Mean"
    )
    assert tracker in model.metrics, _changed("Model._loss_tracker", "is not in model.metrics")


def test_creation_strategy_is_none_outside_any_scope():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert _compat.creation_strategy(model) is None, _changed(
        "Model._distribute_strategy", "is set for a model created outside any strategy scope"
    )


def test_overridden_model_hooks_exist_with_their_parameters():
    for name, (since, parameters) in _compat.OVERRIDDEN_MODEL_HOOKS.items():
        if _compat.keras_version() < since:
            continue  # Keras does not call it yet: the override is inert
        hook = getattr(keras.Model, name, None)
        assert hook is not None, _changed(f"keras.Model.{name}", "it no longer exists")
        signature = inspect.signature(hook).parameters
        missing = [p for p in parameters if p not in signature]
        assert not missing, _changed(f"keras.Model.{name}", f"it lost {missing}")


def test_keras_reduces_train_logs_with_reduce_per_replica():
    # `_compat.reduce_replica_logs` is Keras's own reduction of a train
    # step's per-replica logs.
    from keras.src.backend.tensorflow import trainer

    assert callable(getattr(trainer, "reduce_per_replica", None)), _changed(
        "keras.src.backend.tensorflow.trainer.reduce_per_replica", "it no longer exists"
    )
    strategy = tf.distribute.get_strategy()
    logs = _compat.reduce_replica_logs({"loss": tf.constant(2.0)}, strategy)
    assert float(logs["loss"]) == 2.0


def test_optimizer_internals():
    variables = [keras.Variable(np.ones((2,), "float32")), keras.Variable(np.ones((3,), "float32"))]
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(variables)
    built = _compat.optimizer_variables_in_build_order(optimizer)
    assert [id(v) for v in built] == [id(v) for v in variables], _changed(
        "Optimizer._trainable_variables", "is not the build list"
    )
    assert _compat.optimizer_variable_index(optimizer, variables[1]) == 1, _changed(
        "Optimizer._get_variable_index", "does not give the build position"
    )
    with pytest.raises(ValueError):
        _compat.check_optimizer_knows(optimizer, [keras.Variable(np.ones((2,), "float32"))])
    own = _compat.optimizer_own_variables(optimizer)
    assert any(v is optimizer.iterations for v in own), _changed(
        "Optimizer._variables", "no longer holds `iterations`"
    )
    method = getattr(optimizer, _compat.OPTIMIZER_ALL_REDUCE_METHOD, None)
    assert callable(method), _changed(
        f"Optimizer.{_compat.OPTIMIZER_ALL_REDUCE_METHOD}",
        "it no longer exists, so gradients_already_reduced() would not stop the all-reduce",
    )
    assert list(inspect.signature(method).parameters) == ["grads_and_vars"], _changed(
        f"Optimizer.{_compat.OPTIMIZER_ALL_REDUCE_METHOD}",
        f"its parameters are {list(inspect.signature(method).parameters)}",
    )


def test_all_reduce_method_is_what_apply_calls():
    # If Keras stopped calling it from `apply`, replacing it would silently
    # leave the second all-reduce in place: check that apply goes through it.
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build([variable])
    calls = []

    def record(grads_and_vars):
        calls.append(len(grads_and_vars))
        return grads_and_vars

    _compat.replace_optimizer_all_reduce(optimizer, record)
    optimizer.apply([tf.ones((2,))], [variable])
    assert calls == [1], _changed(
        f"Optimizer.{_compat.OPTIMIZER_ALL_REDUCE_METHOD}", "`apply` no longer calls it"
    )
    _compat.replace_optimizer_all_reduce(optimizer, None)
    optimizer.apply([tf.ones((2,))], [variable])
    assert calls == [1]  # Keras's own again


def test_batchnorm_reduction_axes_are_every_axis_but_the_channels():
    layer = keras.layers.BatchNormalization(axis=1)
    layer.build((2, 3, 4, 5))
    assert list(_compat.batchnorm_reduction_axes(layer)) == [0, 2, 3], _changed(
        "BatchNormalization._reduction_axes", "it no longer lists the reduced axes"
    )


@pytest.mark.skipif(not _compat.builds_before_first_trace(), reason="Keras < 3.5: not used")
def test_first_batch_of_the_epoch_iterator_fit_makes():
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    x = np.arange(12, dtype="float32").reshape(6, 2)
    iterator = TFEpochIterator(
        x=x, batch_size=4, shuffle=False, distribute_strategy=tf.distribute.get_strategy()
    )
    batch = _compat.first_batch(iterator)
    np.testing.assert_array_equal(np.asarray(keras.tree.flatten(batch)[0]), x[:4])


def test_scatter_add_in_place_sums_duplicate_rows_into_the_variable():
    variable = tf.Variable(np.zeros((3, 2), "float32"))
    slices = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([0, 2, 0]), tf.constant([3, 2]))
    _compat.scatter_add_in_place(variable, slices)
    np.testing.assert_array_equal(variable.numpy(), [[2, 2], [0, 0], [1, 1]])


@pytest.mark.skipif(_compat.builds_before_first_trace(), reason="Keras >= 3.5")
def test_compiled_metrics_of_old_keras_are_built_outside_the_trace():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    assert not model._compile_metrics.built
    _compat.build_compiled_metrics_outside_trace(model, tf.zeros((1, 1)), tf.zeros((1, 1)))
    assert model._compile_metrics.built, _changed("Model._compile_metrics", "it did not build")


def test_tensorflow_internals():
    assert _compat.strategy_supports_no_merge_call() is True, _changed(
        "tf.__internal__.distribute.strategy_supports_no_merge_call",
        "the default strategy no longer supports collectives without merge_call",
    )
    # Checked on the class: a MultiWorkerMirroredStrategy made here would
    # configure this process's collectives for the rest of the run (the
    # multi-worker tests call it on a real cluster).
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        CollectiveAllReduceExtended,
    )

    assert callable(getattr(CollectiveAllReduceExtended, "_in_multi_worker_mode", None)), _changed(
        "MultiWorkerMirroredStrategy.extended._in_multi_worker_mode", "it no longer exists"
    )


def test_per_replica_values_are_what_strategies_hand_their_replicas():
    # `coupled_loss` hands each replica its own cached tensors through
    # strategy.run (tests/scripts/mirrored_coupled.py runs it on two).
    from tensorflow.python.distribute.values import DistributedValues

    first, second = tf.constant([1.0]), tf.constant([2.0])
    value = _compat.per_replica([first, second])
    assert isinstance(value, DistributedValues), _changed(
        "tensorflow.python.distribute.values.PerReplica", "it is no DistributedValues"
    )
    assert value.values == (first, second)


def test_xla_compilation_is_seen_while_tracing():
    seen = []

    def body(x):
        seen.append(_compat.in_xla_compilation())
        return x + 1

    inner = tf.function(body)
    tf.function(body, jit_compile=True)(tf.constant(1.0))
    tf.function(body)(tf.constant(1.0))
    tf.function(lambda x: inner(x), jit_compile=True)(tf.constant(2.0))
    assert seen == [True, False, True], _changed(
        "control_flow_util.GraphOrParentsInXlaContext",
        f"tracing with jit_compile, without it, and a function inside one: {seen}",
    )
    assert _compat.in_xla_compilation() is False


def test_a_loss_scale_optimizer_is_found_building_its_inner_optimizer():
    found = []

    class Probe(keras.optimizers.SGD):
        def build(self, var_list):
            found.append(_compat.loss_scale_optimizer_building(self))
            super().build(var_list)

    probe = Probe()
    outer = keras.optimizers.LossScaleOptimizer(probe)
    outer.build([keras.Variable(np.zeros(2, "float32"))])
    probe.build([keras.Variable(np.zeros(2, "float32"))])  # not from a LossScaleOptimizer
    assert found == [outer, None]


def test_loss_scale_optimizer_applying_is_found_from_its_first_apply():
    # Keras's LossScaleOptimizer builds its inner optimizer from its first
    # `apply`; built on its own, it is not applying.
    found = []

    class Probe(keras.optimizers.SGD):
        def build(self, var_list):
            found.append(_compat.loss_scale_optimizer_applying(outers[-1]))
            super().build(var_list)

    variables = [keras.Variable(np.zeros(2, "float32"))]
    outers = [keras.optimizers.LossScaleOptimizer(Probe())]
    outers[-1].apply([np.ones(2, "float32")], variables)
    outers.append(keras.optimizers.LossScaleOptimizer(Probe()))
    outers[-1].build(variables)
    assert found == [True, False]


def test_a_stand_in_takes_a_loss_scale_optimizer_s_scale_and_calls():
    # The attributes read from a built LossScaleOptimizer, and the calls it
    # hands over: its scale is the returned optimizer's.
    variables = [keras.Variable(np.ones(2, "float32"))]
    outer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=8.0)
    outer.build(variables)
    calls = []
    inner = keras.optimizers.SGD(1.0)
    inner.build(variables)
    scaler = _compat.stand_in_for_loss_scale_optimizer(
        outer, lambda loss: calls.append("scale_loss"), lambda *a: calls.append("apply"), inner
    )
    outer.scale_loss(1.0)
    outer.apply_gradients([(np.ones(2, "float32"), variables[0])])
    assert calls == ["scale_loss", "apply"]
    assert float(scaler.scale_loss(1.0)) == 8.0
    scaler.apply([np.full(2, np.inf, "float32")], variables)  # skipped: the scale halves
    assert float(outer.dynamic_scale.numpy()) == 4.0
    scaler.apply([np.full(2, 4.0, "float32")], variables)  # unscaled: 1
    np.testing.assert_allclose(variables[0].numpy(), [0.0, 0.0])


def test_loss_reductions_are_recorded_with_what_keras_combined():
    y_pred = keras.ops.ones((2, 3, 1))
    y_pred._keras_mask = keras.ops.convert_to_tensor([[True, True, False], [True, False, False]])
    loss_fn = keras.losses.MeanAbsoluteError(reduction="sum")
    with _compat.recorded_loss_reductions() as records:
        loss_fn(keras.ops.zeros((2, 3, 1)), y_pred, sample_weight=None)
    assert len(records) == 1
    values, sample_weight, mask, reduction, loss = records[0]
    assert tuple(values.shape) == (2, 3) and sample_weight is None and reduction == "sum"
    assert np.asarray(mask).tolist() == [[True, True, False], [True, False, False]]
    loss_fn(keras.ops.zeros((2, 3, 1)), keras.ops.ones((2, 3, 1)))  # outside: not recorded
    assert len(records) == 1


def test_keras_saving_walks_keras_saveable_attributes():
    # The model wrapper's accumulation state has its own entry in weights
    # files through an attribute holding a `_compat.KerasSaveable`.
    assert issubclass(keras.layers.Layer, _compat.KerasSaveable), _changed(
        "keras.src.saving.keras_saveable.KerasSaveable", "layers no longer derive from it"
    )


def test_custom_gradients_dropped_frees_a_traced_step_s_variables():
    # TensorFlow's registry of custom gradients holds every traced function
    # that used one, and so its variables (tensorflow/tensorflow#97697).
    from tensorflow.python.framework import ops as tf_ops

    assert hasattr(tf_ops, "_gradient_registry"), _changed(
        "tensorflow.python.framework.ops._gradient_registry", "it is gone"
    )

    @tf.custom_gradient
    def doubled(x):
        return 2.0 * x, lambda upstream: 2.0 * upstream

    def traced_step():
        variable = tf.Variable(tf.zeros([2**22]))  # 16 MiB

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(doubled(variable))
            variable.assign_add(tape.gradient(loss, variable))

        step()

    def memory():
        gc.collect()
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    # Within 1 MiB: tensors of earlier tests may be freed meanwhile.
    before = memory()
    traced_step()
    kept = _changed("tf.custom_gradient", "traced functions no longer kept: drop the workaround")
    assert memory() - before > 15 * 2**20, kept  # what the context manager is for
    before = memory()
    with _compat.custom_gradients_dropped():
        traced_step()
    assert memory() - before < 2**20


def test_layer_state_internals():
    # state_writes: the seed generators' states, the variables a layer holds
    # untracked, and a variable's stored value inside an autocast call.
    inputs = keras.Input((3, 4), batch_size=2)
    dropout = keras.layers.Dropout(0.5)
    rnn = keras.layers.SimpleRNN(2, stateful=True)
    model = keras.Model(inputs, rnn(dropout(inputs)))
    states = _compat.seed_generator_states(model)
    assert any(state is dropout.seed_generator.state for state in states), _changed(
        "Layer._seed_generators", "no longer lists a layer's SeedGenerator objects"
    )
    assert _compat.is_variable(rnn.states[0]), _changed("keras.src.backend.Variable", "moved")
    assert not _compat.is_variable(tf.zeros(()))

    seen = {}

    class Reads(keras.layers.Layer):
        def build(self, input_shape):
            self.stored = self.add_weight(shape=(), initializer="ones", trainable=False)

        def call(self, x):
            seen["autocast"] = self.stored.value.dtype
            seen["raw"] = _compat.raw_value(self.stored).dtype
            return x

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        Reads()(keras.ops.ones((1, 2)))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert seen["autocast"] == tf.float16  # what `raw_value` must avoid
    assert seen["raw"] == tf.float32, _changed("Variable._value", "no longer the stored value")
    stored = keras.Variable(1.0)
    assert isinstance(_compat.tf_variable(stored), tf.Variable), _changed(
        "Variable._value", "no longer a TensorFlow variable"
    )
    plain = tf.Variable(1.0)
    assert _compat.tf_variable(plain) is plain


def test_stateless_scope_writes_lists_what_the_scope_caught():
    written, untouched = keras.Variable(1.0), keras.Variable(2.0)
    with keras.StatelessScope() as scope:
        written.assign(3.0)
    caught = _compat.stateless_scope_writes(scope)
    assert list(caught) == [id(written)], _changed(
        "StatelessScope.state_mapping", f"holds {list(caught)}, not the written variable's id"
    )
    assert float(caught[id(written)]) == 3.0 and id(untouched) not in caught
    assert float(written.numpy()) == 1.0


@pytest.mark.skipif(
    not hasattr(keras, "RematScope"), reason="Keras < 3.9 has no rematerialisation to replace"
)
def test_backend_remat_is_what_remat_scope_calls():
    calls = []

    def spy(f):
        calls.append(f)
        return f

    with keras.RematScope(mode="full"):
        layer = keras.layers.Dense(2)
    with _compat.backend_remat(spy):
        layer(np.ones((1, 3), "float32"))
        keras.remat(lambda x: x)
    assert len(calls) == 2, _changed(
        "keras.src.backend.tensorflow.core.remat",
        "RematScope or keras.remat no longer call it when a marked layer is called",
    )
    assert _compat.keras_rematerialises()


@pytest.mark.skipif(not hasattr(keras, "RematScope"), reason="used by rematerialisation only")
def test_call_context_carries_training_and_autocast():
    seen = {}

    class Inner(keras.layers.Layer):
        def call(self, x, training=None):
            seen["context"] = _compat.call_context()
            seen["training"] = training
            return x

    class Outer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def call(self, x):
            return self.inner(x)

    Outer()(np.ones((1, 2), "float32"), training=True)
    context = seen["context"]
    assert set(context) == {"current_call_ctx", "autocast_scope"}
    assert getattr(context["current_call_ctx"], "training", None) is True, _changed(
        "global_state 'current_call_ctx'", "no longer holds the call's `training`"
    )

    class Probe(keras.layers.Layer):
        def call(self, x):
            with _compat.call_context_of(context):
                return Inner()(x)

    seen.clear()
    Probe()(np.ones((1, 2), "float32"))
    assert seen["training"] is True, _changed(
        "global_state 'current_call_ctx'", "set again, it no longer passes `training` on"
    )


@pytest.mark.skipif(not hasattr(keras, "RematScope"), reason="used by rematerialisation only")
def test_leaf_writes_scope_and_loss_owners():
    variable = keras.Variable(np.ones(2, "float32"))
    other = keras.Variable(np.zeros(2, "float32"))
    start = tf.constant([2.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(start)
        with _compat.LeafWritesScope([(variable, start)], {id(variable)}) as scope:
            variable.assign(variable * 3.0)
            other.assign(tf.ones(2))
            read = variable.value
        loss = tf.reduce_sum(read)
    assert np.allclose(read, [6.0, 6.0]), _changed("StatelessScope.add_update", f"read {read}")
    assert np.allclose(tape.gradient(loss, start), [1.0, 1.0]), _changed(
        "StatelessScope.add_update", "a write's value no longer goes through it"
    )
    assert scope.foreign == [other]
    with _compat.no_autocast():
        pass

    class AddsLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(tf.reduce_sum(x))
            return x

    outer = keras.Sequential([keras.Input((2,)), AddsLoss(name="adds")])
    with keras.StatelessScope(collect_losses=True) as scope:
        outer(np.ones((1, 2), "float32"))
    owners = _compat.loss_owners(outer, scope.losses)
    assert [owner.name for owner in owners] == ["adds"], _changed(
        "Layer._loss_ids", "no longer records the losses a layer adds in a stateless scope"
    )
