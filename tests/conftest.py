"""Shared pytest configuration: quiet TensorFlow, restore global Keras state."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_keras_globals():
    """Each test starts from float32 and a fresh Keras graph state."""
    yield
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def pytest_terminal_summary(terminalreporter):
    from tests.helpers import MEASURED

    if not MEASURED:
        return
    terminalreporter.section("equivalence: measured max |diff| against the reference")
    for test, diff in sorted(MEASURED.items()):
        terminalreporter.write_line(f"{diff:10.3g}  {test}")
