"""Keras's own model, trainer, saving and callback tests, every functional model a wrapper.

Each test case of the Keras test modules below runs unmodified, with
``keras.Model(inputs, outputs)`` (and ``Functional(inputs, outputs)``)
returning ``GradientAccumulateModel(accum_steps=1, inputs=..., outputs=...)``:
at ``accum_steps=1`` the wrapper must pass everything a plain functional
model passes. The tests that fail for a reason inherent to a wrapper (a class
of its own, constructor arguments of its own) are listed in
``INHERENT_FAILURES`` with the reason, and run as strict expected failures: a
listed test that starts passing fails here too. Subclassed and ``Sequential``
models are Keras's own: of ``trainer_test.py``, whose ``fit``/``evaluate``
cases build a subclassed model, only the cases that build a functional model
run here, and ``tests/test_model.py`` has the wrapper's functional twins of
the others. Cases needing a package CI does not install (JAX, torch, grain)
skip.

Keras ships its tests in the wheel from 3.15 on; with an older Keras this
module collects nothing but one skipped placeholder.
"""

import importlib
import importlib.util
import inspect
import re
import sys
import types
import unittest
from unittest import mock

import keras
import pytest

from gradient_accumulator import GradientAccumulateModel
from gradient_accumulator._compat import Functional, functional_form, written_class
from tests.helpers import install_keras_test_cases

# Keras's suites: out of the fast tier (``pytest --fast``, tests/conftest.py).
pytestmark = pytest.mark.keras_suite

# Keras's test modules. A wheel without tests (Keras < 3.15) has none of
# them and the module collects a skipped placeholder; a wheel with tests must
# import every one (a test module that stops importing fails the run).
KERAS_TEST_MODULES = (
    "keras.src.models.functional_test",
    "keras.src.models.model_test",
    "keras.src.trainers.trainer_test",
    "keras.src.saving.saving_api_test",
    "keras.src.saving.saving_lib_test",
    "keras.src.saving.serialization_lib_test",
    "keras.src.saving.object_registration_test",
    "keras.src.saving.file_editor_test",
    "keras.src.callbacks.backup_and_restore_test",
    "keras.src.callbacks.callback_test",
    "keras.src.callbacks.csv_logger_test",
    "keras.src.callbacks.early_stopping_test",
    "keras.src.callbacks.lambda_callback_test",
    "keras.src.callbacks.learning_rate_scheduler_test",
    "keras.src.callbacks.model_checkpoint_test",
    "keras.src.callbacks.monitor_callback_test",
    "keras.src.callbacks.reduce_lr_on_plateau_test",
    "keras.src.callbacks.swap_ema_weights_test",
    "keras.src.callbacks.terminate_on_nan_test",
    "keras.src.export.saved_model_test",
)

# "<module>::<class>::<test>" -> why a wrapper cannot pass it (strict: a
# listed test that passes fails the run).
_LEGACY_H5 = (
    "Keras's legacy `.h5` loader finds a model's class by its bare name, not "
    "its registered one, as for any Model subclass: `load_model(path, "
    "custom_objects={'GradientAccumulateModel': GradientAccumulateModel})` loads it "
    "(tests/test_model.py::test_a_legacy_h5_file_loads_with_custom_objects)"
)
INHERENT_FAILURES = {
    "keras.src.saving.saving_lib_test::SavingAPITest::test_model_api_endpoint_h5": _LEGACY_H5,
    "keras.src.saving.saving_lib_test::SavingBattleTest::test_legacy_h5_format": _LEGACY_H5,
    "keras.src.saving.saving_lib_test::SavingBattleTest::test_normalization_legacy_h5_format": (
        _LEGACY_H5
    ),
}

# Tests that fail on plain Keras models too, in the versions CI installs
# (not strict: they may pass once Keras or h5py changes).
FAILING_WITHOUT_THE_WRAPPER = {
    f"keras.src.saving.file_editor_test::SavingTest::{test}": (
        "Keras 3.15.1's KerasFileEditor cannot read its own file with h5py 3.14 "
        "(KeyError: bad object header version number), plain model or not"
    )
    for test in ("test_basics", "test_scalar_weight")
}
FAILING_WITHOUT_THE_WRAPPER[
    "keras.src.saving.saving_lib_test::SavingBattleTest::"
    "test_legacy_load_skips_missing_nested_containers"
] = "Keras 3.15.1 with h5py 3.14 (the same error), plain model or not"


def _returning_the_wrapper(original):
    # `keras.Model.__new__` picks the class of a `Model(inputs, outputs)`
    # call (`Functional` has its own); both are patched for each test. The
    # wrapper's functional instances are of its functional form, a
    # `Functional` subclass, so that `Functional(...)` returning one runs the
    # wrapper's `__init__`.
    def __new__(cls, *args, **kwargs):
        # Keras's rule for a functional call: `(inputs, outputs)`, given
        # positionally or by keyword.
        if cls in (keras.Model, Functional) and (len(args) == 2 or "outputs" in kwargs):
            return original(functional_form(GradientAccumulateModel), *args, **kwargs)
        return original(cls, *args, **kwargs)

    return staticmethod(__new__)


def _with_wrapper(case):
    """A subclass of Keras's test case whose functional models are wrappers."""
    original_set_up = case.setUp

    def setUp(self):
        for owner in (keras.Model, Functional):
            patcher = mock.patch.object(
                owner, "__new__", _returning_the_wrapper(owner.__dict__["__new__"].__func__)
            )
            patcher.start()
            self.addCleanup(patcher.stop)
        original_set_up(self)
        keras.utils.set_random_seed(0)

    namespace = {"setUp": setUp, "__module__": __name__}
    for listed, strict in ((INHERENT_FAILURES, True), (FAILING_WITHOUT_THE_WRAPPER, False)):
        for name, reason in listed.items():
            module, class_name, test = name.split("::")
            if module == case.__module__ and class_name == case.__name__:
                method = getattr(case, test)
                namespace[test] = pytest.mark.xfail(strict=strict, reason=reason)(method)
    return type(f"TestWrapped_{case.__module__.split('.')[-1]}_{case.__name__}", (case,), namespace)


# `trainer_test.py` imports `jax` at its top but uses it only on the JAX
# backend and in its cases drawing sparse batches from JAX; without JAX
# installed, it is imported with a stand-in for `jax`. Cases that need a
# package CI does not install (JAX, torch, grain) skip, named by that package.
_NEEDS_PACKAGE = {"jax": "_sparse_jax_", "torch": "_torch_", "grain": "_grain_"}

# Most of `trainer_test.py` builds subclassed models (`ExampleModel`), which
# never reach the wrapper: there only the cases that build a functional model
# run (tests/test_model.py::test_trainer_cases_on_a_functional_wrapper is the
# wrapper's twin of the others).
_FUNCTIONAL_CASES_ONLY = ("keras.src.trainers.trainer_test",)
_BUILDS_A_FUNCTIONAL_MODEL = re.compile(r"\b(Model|Functional)\(|get_functional\(")


def _import_without_jax(name):
    """Imports Keras's test module `name` with a stand-in for `jax` if JAX is absent."""
    if importlib.util.find_spec("jax") is not None:
        return importlib.import_module(name)
    stand_in = types.ModuleType("jax")
    stand_in.__getattr__ = _jax_is_not_installed
    sys.modules["jax"] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["jax"]


def _jax_is_not_installed(attribute):
    # An AttributeError, so that `hasattr(jax, ...)` reads it as missing.
    raise AttributeError(f"jax.{attribute}: JAX is not installed (a stand-in for Keras's tests)")


def _skipping_what_cannot_reach_the_wrapper(case, module_name):
    for test in [name for name in dir(case) if name.startswith("test")]:
        method = getattr(case, test)
        reason = None
        for package, marker in _NEEDS_PACKAGE.items():
            if marker in test and importlib.util.find_spec(package) is None:
                reason = f"needs {package}, which is not installed"
        if module_name in _FUNCTIONAL_CASES_ONLY and not _BUILDS_A_FUNCTIONAL_MODEL.search(
            inspect.getsource(method)
        ):
            reason = "builds no functional model (Keras's own path, not the wrapper's)"
        if reason:
            setattr(case, test, pytest.mark.skip(reason=reason)(method))
    return case


_collected = install_keras_test_cases(
    globals(),
    KERAS_TEST_MODULES,
    _import_without_jax,
    lambda case, name: [_skipping_what_cannot_reach_the_wrapper(_with_wrapper(case), name)],
)

if not _collected:

    @pytest.mark.skip(reason=f"Keras {keras.__version__} ships no tests")
    def test_keras_model_suites_through_the_wrapper():
        """Stands for the wrapped Keras test cases where the Keras wheel has none."""


def test_the_patch_makes_functional_models_wrappers():
    # The harness itself: inside a wrapped case, `keras.Model(inputs,
    # outputs)` is the wrapper at accum_steps=1, and subclasses are not.
    case = type("Probe", (_with_wrapper(_Probe),), {"__test__": True})("test_probe")
    result = unittest.TestResult()
    case.run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    # Outside a wrapped case, Keras is as it was.
    inputs = keras.Input((2,))
    assert type(keras.Model(inputs, keras.layers.Dense(1)(inputs))) is Functional


class _Probe(unittest.TestCase):
    __test__ = False  # run by the test above, inside the harness

    def test_probe(self):
        inputs = keras.Input((2,))
        outputs = keras.layers.Dense(1)(inputs)
        for model in (
            keras.Model(inputs, outputs),
            keras.Model(inputs, outputs=outputs),
            keras.Model(inputs=inputs, outputs=outputs),
            Functional(inputs, outputs),
        ):
            assert written_class(model) is GradientAccumulateModel and model.accum_steps == 1

        class Subclassed(keras.Model):
            pass

        assert type(Subclassed(inputs, outputs)) is Subclassed


@pytest.mark.skipif(not _collected, reason=f"Keras {keras.__version__} ships no tests")
def test_every_listed_failure_names_a_keras_test():
    for name in (*INHERENT_FAILURES, *FAILING_WITHOUT_THE_WRAPPER):
        module, class_name, test = name.split("::")
        case = getattr(importlib.import_module(module), class_name)
        found = callable(getattr(case, test, None))
        assert found, f"{name}: no such test in Keras {keras.__version__}"


@pytest.mark.skipif(not _collected, reason=f"Keras {keras.__version__} ships no tests")
def test_the_trainer_cases_that_build_a_functional_model_run():
    # The source filter of `_FUNCTIONAL_CASES_ONLY` keeps the cases that
    # reach the wrapper, and only them.
    case = globals()["TestWrapped_trainer_test_TestTrainer"]
    running = {
        name
        for name in dir(case)
        if name.startswith("test")
        and not any(mark.name == "skip" for mark in getattr(getattr(case, name), "pytestmark", ()))
    }
    assert {"test_multiple_compiles", "test_predict_preserve_order_1_jit"} <= running
    assert "test_fit_flow_jit" not in running  # an ExampleModel case
