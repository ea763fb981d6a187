"""GradientAccumulateOptimizer as a Keras optimizer: every method acts on the inner one or raises.

The numbers are compared with the plain Keras optimizer at ``FLOAT32_ATOL``
(the same update in a different order of float32 sums, a few ulps on values
of magnitude ~1).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import GradientAccumulateOptimizer
from gradient_accumulator._compat import optimizer_own_variables
from tests.helpers import FLOAT32_ATOL, assert_close

ACCUM_STEPS = (1, 3)


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _same(values_a, values_b):
    return len(values_a) == len(values_b) and all(
        np.array_equal(a, b) for a, b in zip(values_a, values_b)
    )


def _variables(*values):
    return [keras.Variable(np.array(v, "float32"), name=f"w{i}") for i, v in enumerate(values)]


def _grads(*values):
    return [tf.constant(np.array(v, "float32")) for v in values]


def _micro_steps(optimizer, grads, variables, accum_steps):
    """One update of ``optimizer``: ``accum_steps`` micro-steps of the same gradients."""
    for _ in range(accum_steps):
        optimizer.apply_gradients(zip(grads, variables))


# ------------------------------------------------------------ the defects --


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
@pytest.mark.parametrize("by", ["var_list", "var_names"])
def test_exclude_from_weight_decay_acts_on_the_inner_optimizer(by, accum_steps):
    # Before: the wrapper's own (unused) exclusion list took it and the inner
    # optimizer decayed every variable (2.0 -> 1.992 below).
    plain_variables = _variables(2.0, 2.0)
    wrapped_variables = _variables(2.0, 2.0)
    plain = keras.optimizers.AdamW(1.0, weight_decay=0.004)
    wrapper = GradientAccumulateOptimizer(
        keras.optimizers.AdamW(1.0, weight_decay=0.004), accum_steps=accum_steps
    )
    for optimizer, variables in ((plain, plain_variables), (wrapper, wrapped_variables)):
        if by == "var_list":
            optimizer.exclude_from_weight_decay(var_list=[variables[1]])
        else:
            optimizer.exclude_from_weight_decay(var_names=["w1"])
    grads = _grads(0.0, 0.0)
    plain.apply_gradients(zip(grads, plain_variables))
    _micro_steps(wrapper, grads, wrapped_variables, accum_steps)
    assert float(wrapped_variables[1].numpy()) == 2.0  # excluded
    assert float(wrapped_variables[0].numpy()) < 2.0  # decayed
    assert_close(_values(wrapped_variables), _values(plain_variables), FLOAT32_ATOL)


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
def test_compile_with_run_eagerly_fits_as_the_big_batch(accum_steps):
    # Keras's eager `fit` calls `scale_loss` before its first `apply` builds
    # the optimizer; before, `scale_loss` refused ("build the optimizer first").
    x = np.random.default_rng(0).normal(size=(24, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(24, 2)).astype("float32")
    model, reference = _dense(), _dense()
    model.compile(
        optimizer=GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=accum_steps),
        loss="mse",
        run_eagerly=True,
    )
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=2 * accum_steps, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * 12 // accum_steps
    assert_close(_values(model.weights), _values(reference.weights), FLOAT32_ATOL)


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "ScheduleFreeAdamW"), reason="Keras without ScheduleFreeAdamW"
)
def test_an_inner_build_that_reads_the_model_runs_where_keras_runs_it():
    # A model without `Input` is built by `fit`'s traced step, which builds the
    # optimizer too: ScheduleFreeAdamW's build copies the model's variables,
    # which outside the step (where the wrapper built it) were uninitialized.
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.zeros((8, 3), "float32")
    weights = []
    for optimizer in (
        GradientAccumulateOptimizer(keras.optimizers.ScheduleFreeAdamW(0.01)),
        keras.optimizers.ScheduleFreeAdamW(0.01),
    ):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Dense(3)])
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        weights.append(_values(model.weights))
    assert_close(weights[0], weights[1], FLOAT32_ATOL)


def test_scale_loss_before_build_weights_the_first_micro_step_by_its_share():
    optimizer = GradientAccumulateOptimizer("sgd", accum_steps=4)
    assert float(optimizer.scale_loss(tf.constant(2.0)).numpy()) == 0.5
    variables = _variables([1.0, 1.0])
    optimizer.apply_gradients(zip(_grads([0.25, 0.25]), variables))
    # The first micro-step's weight was recorded: later ones weigh 1/4 too.
    assert float(optimizer.accumulation_variables[1].numpy()) == 0.25  # weight_sum
    assert float(optimizer.scale_loss(tf.constant(2.0)).numpy()) == 0.5


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
def test_set_weights_sets_the_inner_optimizers_state(accum_steps):
    # Before: `set_weights` set the wrapper's two unused variables and left
    # the inner optimizer's iterations and moments as they were.
    variables = _variables([1.0, 2.0])
    source = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=accum_steps)
    _micro_steps(source, _grads([0.5, -1.0]), variables, accum_steps)
    target = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=accum_steps)
    target.build(variables)
    target.set_weights(source.variables)
    assert int(target.iterations.numpy()) == 1
    assert_close(
        _values(target.inner_optimizer.variables),
        _values(source.inner_optimizer.variables),
        FLOAT32_ATOL,
    )
    # A plain optimizer's state fits the wrapper's, and the other way round.
    plain = keras.optimizers.Adam(0.1)
    plain.build(variables)
    plain.set_weights(target.variables)
    target.set_weights(plain.variables)
    assert_close(_values(plain.variables), _values(source.variables), FLOAT32_ATOL)


def test_set_weights_refuses_another_number_of_weights():
    variables = _variables([1.0, 2.0])
    optimizer = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=2)
    with pytest.raises(ValueError, match=r"You are calling `set_weights\(\)`"):
        optimizer.set_weights([])
    optimizer.build(variables)
    weights = _values(optimizer.variables)
    with pytest.raises(ValueError, match=r"one entry per variable .*: 4\)\. Received: 2 weights"):
        optimizer.set_weights(weights[:2])
    with pytest.raises(ValueError, match=r"Received: 6 weights"):
        optimizer.set_weights(weights + weights[:2])


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
def test_scale_loss_takes_a_python_float(accum_steps):
    # Before: AttributeError: 'float' object has no attribute 'dtype'.
    plain = keras.optimizers.SGD(1.0, loss_scale_factor=1024.0)
    wrapper = GradientAccumulateOptimizer(
        keras.optimizers.SGD(1.0, loss_scale_factor=1024.0), accum_steps=accum_steps
    )
    wrapper.build(_variables([1.0]))
    # The loss scale of the inner optimizer, times the micro-batch's share 1/k.
    scaled = wrapper.scale_loss(1.0)
    assert float(scaled.numpy()) == pytest.approx(float(plain.scale_loss(1.0)) / accum_steps)


@pytest.mark.parametrize("accum_steps", ACCUM_STEPS)
def test_an_explicit_none_gradient_warns_as_keras_does(accum_steps):
    plain_variables, wrapped_variables = _variables([3.0], [4.0]), _variables([3.0], [4.0])
    plain = keras.optimizers.SGD(1.0)
    wrapper = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=accum_steps)
    grads = [_grads([1.0])[0], None]
    with pytest.warns(UserWarning, match="Gradients do not exist for variables") as plain_warned:
        plain.apply_gradients(zip(grads, plain_variables))
    for _ in range(accum_steps):
        with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['w1'\]"):
            wrapper.apply_gradients(zip(grads, wrapped_variables))
    assert "w1" in str(plain_warned[0].message)
    assert_close(_values(wrapped_variables), _values(plain_variables), FLOAT32_ATOL)


def test_a_subset_of_the_variables_gets_no_warning():
    # As in plain Keras: only a `None` the caller passes warns.
    variables = _variables([3.0], [4.0])
    wrapper = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=1)
    wrapper.build(variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper.apply_gradients(zip(_grads([1.0]), variables[:1]))
    assert _same(_values(variables), [np.array([2.0], "float32"), np.array([4.0], "float32")])


# ------------------------------------- the configuration of the update --

FORWARDED = {
    "weight_decay": 0.004,
    "clipnorm": 0.5,
    "clipvalue": 0.25,
    "global_clipnorm": 0.75,
    "use_ema": True,
    "ema_momentum": 0.5,
    "ema_overwrite_frequency": 3,
}


@pytest.mark.parametrize("name", sorted(FORWARDED))
def test_the_update_options_read_and_set_the_inner_optimizers(name):
    inner = keras.optimizers.SGD(1.0, **{name: FORWARDED[name]})
    wrapper = GradientAccumulateOptimizer(inner, accum_steps=2)
    assert getattr(wrapper, name) == FORWARDED[name]
    setattr(wrapper, name, None if name != "use_ema" else False)
    assert getattr(inner, name) == (None if name != "use_ema" else False)


def test_a_clipnorm_set_on_the_wrapper_clips_as_the_inner_optimizers():
    plain_variables, wrapped_variables = _variables([0.0, 0.0]), _variables([0.0, 0.0])
    plain = keras.optimizers.SGD(1.0, clipnorm=1.0)
    wrapper = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0), accum_steps=2)
    wrapper.clipnorm = 1.0
    grads = _grads([3.0, 4.0])
    plain.apply_gradients(zip(grads, plain_variables))
    _micro_steps(wrapper, grads, wrapped_variables, 2)
    assert_close(_values(wrapped_variables), [np.array([-0.6, -0.8])], FLOAT32_ATOL)
    assert_close(_values(wrapped_variables), _values(plain_variables), FLOAT32_ATOL)


def test_an_ema_inner_optimizer_keeps_the_averages():
    # The base class's `build` reads `use_ema`: it must not make a second set
    # of averages on the wrapper (the inner optimizer has them).
    variables = _variables([1.0, 2.0])
    wrapper = GradientAccumulateOptimizer(keras.optimizers.SGD(1.0, use_ema=True), accum_steps=2)
    wrapper.build(variables)
    assert len(optimizer_own_variables(wrapper)) == 2  # iteration, learning_rate
    assert len(wrapper.variables) == len(wrapper.inner_optimizer.variables) == 3


def test_variables_are_the_inner_optimizers():
    variables = _variables([1.0, 2.0])
    wrapper = GradientAccumulateOptimizer(keras.optimizers.Adam(0.1), accum_steps=2)
    wrapper.build(variables)
    assert [id(v) for v in wrapper.variables] == [id(v) for v in wrapper.inner_optimizer.variables]


# -------------------------------------- every public method, classified --


def _pair(accum_steps=1, make=lambda: keras.optimizers.Adam(0.1)):
    """A plain optimizer and a wrapper of its twin, with twin variables."""
    return (make(), _variables([1.0, 2.0])), (
        GradientAccumulateOptimizer(make(), accum_steps=accum_steps),
        _variables([1.0, 2.0]),
    )


def _check_add_variable():
    (plain, _), (wrapper, variables) = _pair()
    wrapper.build(variables)
    created = wrapper.add_variable(shape=(2,), name="extra")
    assert any(v is created for v in wrapper.inner_optimizer.variables)
    assert any(v is created for v in wrapper.variables)


def _check_add_variable_from_reference():
    _, (wrapper, variables) = _pair()
    wrapper.build(variables)
    created = wrapper.add_variable_from_reference(variables[0], name="extra")
    assert created.shape == variables[0].shape
    assert any(v is created for v in wrapper.inner_optimizer.variables)


def _check_add_optimizer_variables():
    _, (wrapper, variables) = _pair()
    wrapper.build(variables)
    created = wrapper.add_optimizer_variables(variables, "extra")
    assert all(any(v is c for v in wrapper.inner_optimizer.variables) for c in created)


def _check_apply(method):
    def check():
        for accum_steps in ACCUM_STEPS:
            (plain, plain_variables), (wrapper, variables) = _pair(accum_steps)
            grads = _grads([0.5, -1.0])
            getattr(plain, method)(*_arguments(method, grads, plain_variables))
            for micro_step in range(accum_steps):
                getattr(wrapper, method)(*_arguments(method, grads, variables))
                if micro_step < accum_steps - 1:
                    assert _same(_values(variables), [np.array([1.0, 2.0], "float32")])
            assert_close(_values(variables), _values(plain_variables), FLOAT32_ATOL)
            assert_close(_values(wrapper.variables), _values(plain.variables), FLOAT32_ATOL)

    return check


def _arguments(method, grads, variables):
    return (list(zip(grads, variables)),) if method == "apply_gradients" else (grads, variables)


def _check_assign(method):
    def check():
        (plain, plain_variables), (wrapper, variables) = _pair()
        getattr(plain, method)(plain_variables[0], tf.constant([0.5, 0.5]))
        getattr(wrapper, method)(variables[0], tf.constant([0.5, 0.5]))
        assert _same(_values(variables), _values(plain_variables))
        assert not _same(_values(variables), [np.array([1.0, 2.0], "float32")])

    return check


def _check_build():
    (plain, plain_variables), (wrapper, variables) = _pair()
    plain.build(plain_variables)
    wrapper.build(variables)
    assert wrapper.built and wrapper.inner_optimizer.built
    assert [v.shape for v in wrapper.variables] == [v.shape for v in plain.variables]


def _check_exclude_from_weight_decay():
    test_exclude_from_weight_decay_acts_on_the_inner_optimizer("var_list", 3)


def _check_finalize_variable_values():
    (plain, plain_variables), (wrapper, variables) = _pair(
        make=lambda: keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.5)
    )
    for grads in (_grads([0.5, -1.0]), _grads([1.0, 1.0])):
        plain.apply_gradients(zip(grads, plain_variables))
        wrapper.apply_gradients(zip(grads, variables))
    before = _values(variables)
    plain.finalize_variable_values(plain_variables)
    wrapper.finalize_variable_values(variables)
    assert not _same(_values(variables), before)  # the averages replaced the weights
    assert_close(_values(variables), _values(plain_variables), FLOAT32_ATOL)


def _check_config():
    _, (wrapper, _) = _pair(accum_steps=3)
    revived = GradientAccumulateOptimizer.from_config(wrapper.get_config())
    assert revived.accum_steps == 3
    assert revived.inner_optimizer.get_config() == wrapper.inner_optimizer.get_config()


def _check_saving():
    # The store of a wrapper restores the inner optimizer's state; a plain
    # optimizer's store fits too (the same variables).
    (plain, plain_variables), (wrapper, variables) = _pair(accum_steps=1)
    grads = _grads([0.5, -1.0])
    plain.apply_gradients(zip(grads, plain_variables))
    wrapper.apply_gradients(zip(grads, variables))
    for source in (wrapper, plain):
        store = {}
        source.save_own_variables(store)
        _, (target, _) = _pair(accum_steps=1)
        target.build(variables)
        target.load_own_variables(store)
        assert int(target.iterations.numpy()) == 1
        assert_close(_values(target.variables), _values(source.variables), FLOAT32_ATOL)


def _check_scale_loss():
    (plain, _), (wrapper, variables) = _pair(
        make=lambda: keras.optimizers.SGD(1.0, loss_scale_factor=8.0)
    )
    wrapper.build(variables)
    assert float(wrapper.scale_loss(tf.constant(3.0))) == float(plain.scale_loss(3.0)) == 24.0


def _check_set_weights():
    (plain, plain_variables), (wrapper, variables) = _pair()
    plain.apply_gradients(zip(_grads([0.5, -1.0]), plain_variables))
    wrapper.build(variables)
    wrapper.set_weights(plain.variables)
    for wrapped, source in zip(wrapper.inner_optimizer.variables, plain.variables, strict=True):
        assert np.array_equal(wrapped.numpy(), source.numpy())
    assert int(wrapper.iterations.numpy()) == 1


def _check_stateless_apply():
    # Keras's TensorFlow optimizers refuse it; so does the wrapper.
    _, (wrapper, variables) = _pair()
    wrapper.build(variables)
    with pytest.raises(ValueError, match="stateless_apply"):
        wrapper.stateless_apply(wrapper.variables, _grads([0.5, -1.0]), variables)


def _check_update_step():
    (plain, plain_variables), (wrapper, variables) = _pair()
    plain.build(plain_variables)
    wrapper.build(variables)
    plain.update_step(_grads([0.5, -1.0])[0], plain_variables[0], 0.1)
    wrapper.update_step(_grads([0.5, -1.0])[0], variables[0], 0.1)
    assert not _same(_values(variables), [np.array([1.0, 2.0], "float32")])
    assert_close(_values(variables), _values(plain_variables), FLOAT32_ATOL)


def _check_iterations():
    _, (wrapper, variables) = _pair(accum_steps=2)
    _micro_steps(wrapper, _grads([0.5, -1.0]), variables, 2)
    assert wrapper.iterations is wrapper.inner_optimizer.iterations
    assert int(wrapper.iterations.numpy()) == 1


def _check_learning_rate():
    _, (wrapper, _) = _pair()
    wrapper.learning_rate = 0.25
    assert float(wrapper.inner_optimizer.learning_rate.numpy()) == 0.25


def _check_variables():
    _, (wrapper, variables) = _pair()
    wrapper.build(variables)
    assert [id(v) for v in wrapper.variables] == [id(v) for v in wrapper.inner_optimizer.variables]


# Every public attribute of `keras.optimizers.Optimizer` -> a check that,
# called on the wrapper, it does what it does on the plain optimizer (on the
# inner optimizer's state) or raises. A new public name in Keras fails
# `test_every_public_method_of_keras_optimizers_is_classified` until it is
# added here.
PUBLIC_METHODS = {
    "add_optimizer_variables": _check_add_optimizer_variables,  # Keras >= 3.10
    "add_variable": _check_add_variable,
    "add_variable_from_reference": _check_add_variable_from_reference,
    "apply": _check_apply("apply"),
    "apply_gradients": _check_apply("apply_gradients"),
    "assign": _check_assign("assign"),
    "assign_add": _check_assign("assign_add"),
    "assign_sub": _check_assign("assign_sub"),
    "build": _check_build,
    "exclude_from_weight_decay": _check_exclude_from_weight_decay,
    "finalize_variable_values": _check_finalize_variable_values,
    "from_config": _check_config,
    "get_config": _check_config,
    "load_own_variables": _check_saving,
    "save_own_variables": _check_saving,
    "scale_loss": _check_scale_loss,
    "set_weights": _check_set_weights,
    "stateless_apply": _check_stateless_apply,
    "update_step": _check_update_step,
    # Properties.
    "iterations": _check_iterations,
    "learning_rate": _check_learning_rate,
    "variables": _check_variables,
}


def _public_names():
    return {name for name in dir(keras.optimizers.Optimizer) if not name.startswith("_")}


def test_every_public_method_of_keras_optimizers_is_classified():
    unclassified = _public_names() - set(PUBLIC_METHODS)
    assert not unclassified, (
        f"Keras {keras.__version__} has public optimizer names the wrapper does not "
        f"classify: {sorted(unclassified)}; add each to PUBLIC_METHODS with a check"
    )


@pytest.mark.parametrize("name", sorted(PUBLIC_METHODS))
def test_each_public_method_acts_on_the_inner_optimizer_or_raises(name):
    if name not in _public_names():
        pytest.skip(f"Keras {keras.__version__} has no Optimizer.{name}")
    PUBLIC_METHODS[name]()
