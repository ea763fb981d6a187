"""Keras's own optimizer tests, every optimizer they build a ``GradientAccumulateOptimizer``.

Each test case of Keras's optimizer test modules (``keras/src/optimizers/*_test.py``)
runs unmodified, in two modes:

- ``k1``: every optimizer the test builds (``Adam(...)``, ``optimizers.get``,
  ``from_config``) is ``GradientAccumulateOptimizer(that_optimizer, accum_steps=1)``:
  the wrapper must pass everything the optimizer passes.
- ``k2`` and ``k3``: the wrapper has ``accum_steps=k`` and each call of its
  ``apply`` (so of ``apply_gradients``, and of ``fit``'s step) is made ``k``
  times with the same gradients, the ``k`` micro-steps of one group whose
  mean is that gradient: the update after them must be the optimizer's one
  step, so the test's golden values hold after every group. It is checked
  in between too (eagerly): after each of the first ``k - 1`` micro-steps,
  the variables and every variable of the inner optimizer are bit-identical
  to what they were before the group, and after the ``k``-th the group is
  empty again. A micro-batch's ``scale_loss`` weight is given to each of
  the ``k`` micro-steps (the ``k`` micro-batches all had that loss).

Composite optimizers (``LossScaleOptimizer``, ``MultiOptimizer``) are Keras's
own and are not wrapped: the optimizers inside them are (what
``model.compile`` builds under ``mixed_float16``:
``LossScaleOptimizer(GradientAccumulateOptimizer(...))``). The optimizers
that ``GradientAccumulateOptimizer.from_config`` deserializes are not wrapped
again (the wrapper refuses to accumulate twice).

Tests that fail for a reason inherent to a wrapper (a class of its own with a
config of its own, Keras's private attributes read on the optimizer) are
listed in ``INHERENT_FAILURES`` (every mode) and
``INHERENT_FAILURES_WHEN_ACCUMULATING`` (``k2``, ``k3``) with the reason and
run as strict expected failures: a listed test that starts passing fails here
too. Cases for another
backend skip as they do in Keras.

Keras ships its tests in the wheel from 3.15 on; with an older Keras this
module collects nothing but one skipped placeholder.
"""

import contextlib
import functools
import importlib
import importlib.util
import threading
import unittest
from unittest import mock

import keras
import numpy as np
import pytest

from gradient_accumulator import GradientAccumulateOptimizer
from tests.helpers import install_keras_test_cases

# Keras's suites: out of the fast tier (``pytest --fast``, tests/conftest.py).
pytestmark = pytest.mark.keras_suite

KERAS_TEST_MODULES = tuple(
    f"keras.src.optimizers.{name}_test"
    for name in (
        "adadelta",
        "adafactor",
        "adagrad",
        "adam",
        "adamax",
        "adamw",
        "ftrl",
        "lamb",
        "lion",
        "loss_scale_optimizer",
        "multi_optimizer",
        "muon",
        "nadam",
        "optimizer",
        "optimizer_sparse",
        "rmsprop",
        "schedule_free_adamw",
        "sgd",
    )
)

# accum_steps, and how many times each `apply` is repeated (the same number).
MODES = {"k1": 1, "k2": 2, "k3": 3}

# Optimizers that hold others: not wrapped (the ones they hold are).
_COMPOSITES = ("LossScaleOptimizer", "MultiOptimizer")

# "<module>::<class>::<test>" -> why a wrapper cannot pass it, in every mode
# (strict: a listed test that passes fails the run).
_M = "keras.src.optimizers."
_PRIVATE = (
    "reads a private attribute of the inner optimizer's class on the optimizer "
    "(`{}`): the wrapper has its own class; it is "
    "`optimizer.inner_optimizer.{}`"
)
_EMA = _PRIVATE.format("_model_variables_moving_average", "_model_variables_moving_average")
_KERAS_ACCUMULATION = (
    "Keras's own `gradient_accumulation_steps`: the wrapper refuses an optimizer that "
    "accumulates itself (two accumulations would multiply the batch; "
    "tests/test_optimizer.py checks the message)"
)
_IDENTITY = "{}: the wrapper is a class of its own (`optimizer.inner_optimizer` is the {})"
_SPARSE = (
    "checks that the optimizer updates only the rows of an IndexedSlices gradient "
    "(mocking `Variable.assign*`, which the accumulation state uses too): the wrapper "
    "sums into a dense float32 sum and hands the inner optimizer the dense mean, "
    "the step of the densified big-batch gradient (documented; "
    "tests/test_optimizer.py::test_sparse_gradients_equal_densified_big_batch)"
)
INHERENT_FAILURES = {
    **{
        f"{_M}adam_test::AdamTest::{test}": _EMA
        for test in ("test_ema", "test_ema_overwrite_frequency")
    },
    **{
        f"{_M}optimizer_test::OptimizerTest::{test}": _EMA
        for test in ("test_ema", "test_ema_with_model_fit")
    },
    f"{_M}multi_optimizer_test::MultiOptimizerTest::test_swap_ema_weights_with_multi_optimizer": (
        _EMA
    ),
    f"{_M}nadam_test::NadamTest::test_build_with_empty_var_list": _PRIVATE.format(
        "_u_product", "_u_product"
    ),
    f"{_M}muon_test::MuonTest::test_Newton_Schulz": _PRIVATE.format(
        "zeropower_via_newtonschulz5", "zeropower_via_newtonschulz5"
    ),
    f"{_M}muon_test::MuonTest::test_lr_adjust_2d": _PRIVATE.format("lr_adjust", "lr_adjust"),
    f"{_M}muon_test::MuonTest::test_lr_adjust_none": _PRIVATE.format("lr_adjust", "lr_adjust"),
    f"{_M}muon_test::MuonTest::test_should_use_adamw": _PRIVATE.format(
        "_should_use_adamw", "_should_use_adamw"
    ),
    f"{_M}muon_test::MuonTest::test_adamw_weight_decay": (
        "calls `_apply_weight_decay` on the optimizer, Muon's override of a private "
        "method (with `adam_weight_decay`): the wrapper's is the base class's (the "
        "inner optimizer applies Muon's own at its update)"
    ),
    f"{_M}optimizer_test::OptimizerTest::test_get_method": _IDENTITY.format(
        "checks `isinstance(optimizers.get('sgd'), SGD)`", "SGD"
    ),
    f"{_M}optimizer_test::OptimizerTest::test_optimizer_auto_naming": _IDENTITY.format(
        "checks the optimizers' automatic names ('adam', 'adam_1')",
        "optimizer with that name; the wrapper's is 'gradient_accumulate_optimizer'",
    ),
    f"{_M}multi_optimizer_test::MultiOptimizerTest::test_serialization": _IDENTITY.format(
        "checks the class name in the sub-optimizers' configs", "optimizer of that class"
    ),
    f"{_M}multi_optimizer_test::MultiOptimizerTest::"
    "test_tensorboard_logging_with_multi_optimizer": (
        _IDENTITY.format(
            "TensorBoard logs each sub-optimizer's learning rate under its class name "
            "('learning_rate_SGD')",
            "optimizer of that class",
        )
    ),
    f"{_M}optimizer_test::OptimizerTest::test_gradient_accumulation": _KERAS_ACCUMULATION,
    f"{_M}optimizer_test::OptimizerTest::"
    "test_overwrite_with_gradient_with_gradient_accumulation": _KERAS_ACCUMULATION,
    **{
        f"{_M}optimizer_test::OptimizerTest::test_gradient_accumulation_with_weigth_decay{i}": (
            _KERAS_ACCUMULATION
        )
        for i in range(11)
    },
    **{
        f"{_M}optimizer_sparse_test::OptimizerSparseTest::test_sparse_gradients_{name}": _SPARSE
        for name in (
            "adadelta",
            "adafactor",
            "adagrad",
            "adam",
            "adam_amsgrad",
            "adamax",
            "adamw",
            "adamw_amsgrad",
            "ftrl",
            "lion",
            "loss_scale_optimizer_sgd",
            "nadam",
            "rmsprop",
            "rmsprop_momentum",
            "rmsprop_momentum_centered",
            "scatter_update",
            "sgd",
            "sgd_momentum",
            "sgd_momentum_nesterov",
        )
    },
}

# The same, in the modes that accumulate (k > 1) only.
INHERENT_FAILURES_WHEN_ACCUMULATING = {
    f"{_M}optimizer_test::OptimizerTest::test_static_loss_scaling": (
        "checks `scale_loss(1.0) == loss_scale_factor`: with accum_steps=k the wrapper "
        "also weights the micro-batch's loss by its share of the group, 1/k (documented; "
        "the update is the same), so it returns loss_scale_factor / k"
    ),
    **{
        f"{_M}loss_scale_optimizer_test::LossScaleOptimizerTest::{test}": (
            "reads the dynamic scale as `scale_loss(1.0)` after the test's applies: the "
            "wrapper inside the LossScaleOptimizer takes its role (its `scale_loss` is the "
            "wrapper's), which also weights the micro-batch's loss by its share of the "
            "group, 1/k, so it returns the scale / k (the scale itself is the golden one: "
            "12.5 and 16 read for 25 and 32 with k=2, 8.33 and 10.67 with k=3)"
        )
        for test in ("test_downscaling_stateful", "test_upscaling_stateful")
    },
}


class _Harness(threading.local):
    accum_steps = 1
    active = False  # True during a test of this module: optimizers are wrapped
    unwrapped = 0  # > 0 while building optimizers that must stay as they are


_harness = _Harness()


@contextlib.contextmanager
def _unwrapped():
    _harness.unwrapped += 1
    try:
        yield
    finally:
        _harness.unwrapped -= 1


def _is_composite(cls):
    return issubclass(cls, GradientAccumulateOptimizer) or any(
        base.__name__ in _COMPOSITES for base in cls.__mro__
    )


def _wrapping_new(cls, *args, **kwargs):
    # `Optimizer.__new__` during a test of this module: an optimizer class's
    # call returns the wrapper. Python runs `__init__` only on an instance of
    # the class called, so the inner optimizer is initialised here, once.
    # Outside these tests it is `object.__new__` (see `_install_wrapping_new`).
    from keras.src.optimizers.optimizer import Optimizer

    optimizer = object.__new__(cls)
    # `Optimizer` itself: Keras's reference object (saving compares with it),
    # never trained; a wrapper returned for it would be initialised again.
    if not _harness.active or _harness.unwrapped or cls is Optimizer or _is_composite(cls):
        return optimizer
    optimizer.__init__(*args, **kwargs)
    return GradientAccumulateOptimizer(optimizer, accum_steps=_harness.accum_steps)


def _install_wrapping_new():
    """Sets ``_wrapping_new`` as ``Optimizer.__new__`` for the rest of the process.

    Installed once and left in place (inactive outside this module's tests):
    deleting a ``__new__`` set on a class, as ``mock.patch`` does when the
    test ends, leaves CPython's constructor slot of the class calling
    ``object.__new__`` with the constructor's arguments, which then fails in
    every later test that builds an optimizer.
    """
    from keras.src.optimizers.optimizer import Optimizer

    current = Optimizer.__dict__.get("__new__")
    if current is None or current.__func__ is not _wrapping_new:
        Optimizer.__new__ = staticmethod(_wrapping_new)


def _deactivate():
    _harness.active = False


def _from_config_unwrapped(original):
    def from_config(cls, config, custom_objects=None):
        with _unwrapped():
            return original.__func__(cls, config, custom_objects=custom_objects)

    return classmethod(from_config)


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _repeating_apply(original, accum_steps):
    """``apply`` made ``accum_steps`` micro-steps of the same gradients, checked in between."""

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        eager = _executing_eagerly()
        weights = [] if trainable_variables is None else list(trainable_variables)
        weights_before = _values(weights) if eager else None
        state_before = _values(self.inner_optimizer.variables) if eager and self.built else None
        if self._accumulator is not None:
            pending = keras.ops.convert_to_tensor(self._accumulator.pending_weight)
        else:
            # Unbuilt: a `scale_loss` before the build gave the first micro-step
            # 1 / accum_steps, which its build records (-1: no weight).
            pending = 1.0 / accum_steps if self._scaled_before_build else -1.0
        for micro_step in range(accum_steps):
            if micro_step > 0:
                # The micro-batch's `scale_loss` weight, for each micro-step.
                self._accumulator.pending_weight.assign(pending)
            original(self, grads, trainable_variables)
            if not eager or micro_step == accum_steps - 1:
                continue
            if state_before is None:  # built by this micro-step
                state_before = _values(self.inner_optimizer.variables)
            _assert_unchanged(weights_before, weights, micro_step)
            _assert_unchanged(state_before, self.inner_optimizer.variables, micro_step)
        if eager:
            micro = int(self._accumulator.micro_step.numpy())
            assert micro == 0, f"the group did not end after {accum_steps} micro-steps: {micro}"

    return apply


def _executing_eagerly():
    import tensorflow as tf

    return tf.executing_eagerly()


def _assert_unchanged(before, variables, micro_step):
    for old, variable in zip(before, variables, strict=True):
        new = np.array(keras.ops.convert_to_numpy(variable))
        assert np.array_equal(old, new, equal_nan=True), (
            f"{variable.path} changed at micro-step {micro_step + 1}, before the group's end"
        )


def _in_mode(case, mode):
    """A subclass of Keras's test case whose optimizers are wrappers, in ``mode``."""
    accum_steps = MODES[mode]
    original_set_up = case.setUp

    def setUp(self):

        _install_wrapping_new()
        _harness.accum_steps = accum_steps
        _harness.active = True
        self.addCleanup(_deactivate)
        patches = [
            mock.patch.object(
                GradientAccumulateOptimizer,
                "from_config",
                _from_config_unwrapped(GradientAccumulateOptimizer.__dict__["from_config"]),
            ),
        ]
        if accum_steps > 1:
            patches.append(
                mock.patch.object(
                    GradientAccumulateOptimizer,
                    "apply",
                    _repeating_apply(GradientAccumulateOptimizer.apply, accum_steps),
                )
            )
        for patcher in patches:
            patcher.start()
            self.addCleanup(patcher.stop)
        original_set_up(self)
        keras.utils.set_random_seed(0)

    namespace = {"setUp": setUp, "__module__": __name__}
    listed = dict(INHERENT_FAILURES)
    if accum_steps > 1:
        listed.update(INHERENT_FAILURES_WHEN_ACCUMULATING)
    for name, reason in listed.items():
        module, class_name, test = name.split("::")
        if module == case.__module__ and class_name == case.__name__:
            # A copy per mode: a mark set on Keras's function would mark every mode.
            namespace[test] = pytest.mark.xfail(strict=True, reason=reason)(
                _copied(getattr(case, test))
            )
    module_name = case.__module__.split(".")[-1]
    return type(f"TestWrapped_{mode}_{module_name}_{case.__name__}", (case,), namespace)


def _copied(method):
    @functools.wraps(method)
    def test(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return test


_collected = install_keras_test_cases(
    globals(),
    KERAS_TEST_MODULES,
    importlib.import_module,
    lambda case, name: [_in_mode(case, mode) for mode in MODES],
)

if not _collected:

    @pytest.mark.skip(reason=f"Keras {keras.__version__} ships no tests")
    def test_keras_optimizer_suites_through_the_wrapper():
        """Stands for the wrapped Keras test cases where the Keras wheel has none."""


@pytest.mark.skipif(not _collected, reason=f"Keras {keras.__version__} ships no tests")
def test_every_listed_failure_names_a_keras_test():
    for name in (*INHERENT_FAILURES, *INHERENT_FAILURES_WHEN_ACCUMULATING):
        module, class_name, test = name.split("::")
        case = getattr(importlib.import_module(module), class_name)
        assert callable(getattr(case, test, None)), f"{name}: no such test in Keras"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_harness_wraps_and_repeats(mode):
    # Inside a wrapped case, an optimizer class returns the wrapper at
    # accum_steps=k, and one `apply_gradients` is one group of k micro-steps.
    case = type("Probe", (_in_mode(_Probe, mode),), {"__test__": True})("test_probe")
    result = unittest.TestResult()
    case.run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert case.seen == (MODES[mode], 1, [0.5, 1.5])
    # Outside, Keras is as it was, constructor arguments included (a `__new__`
    # removed from the class at the end of a test broke every later one).
    assert type(keras.optimizers.SGD(0.1, momentum=0.5)) is keras.optimizers.SGD


class _Probe(unittest.TestCase):
    __test__ = False  # run by the test above, inside the harness

    def test_probe(self):
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
        variable = keras.Variable([1.0, 2.0])
        optimizer.apply_gradients([(keras.ops.ones((2,)), variable)])
        assert type(optimizer) is GradientAccumulateOptimizer
        updates = int(optimizer.iterations.numpy())
        self.seen = (optimizer.accum_steps, updates, variable.numpy().tolist())
