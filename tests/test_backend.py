"""Importing under an unsupported Keras configuration fails with a message that says what to set."""

import os
import subprocess
import sys

import pytest


def _import_error(env_update):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env_update}
    result = subprocess.run(
        [sys.executable, "-c", "import gradient_accumulator"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode != 0
    return result.stderr


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"KERAS_BACKEND": "jax"}, r"Received: KERAS_BACKEND='jax'; set KERAS_BACKEND=tensorflow"),
        ({"KERAS_BACKEND": "numpy"}, r"Received: KERAS_BACKEND='numpy'"),
        ({"TF_USE_LEGACY_KERAS": "1"}, r"TF_USE_LEGACY_KERAS='1'; unset it"),
    ],
    ids=["jax", "numpy", "keras2"],
)
def test_unsupported_backend_raises_import_error(env, expected):
    import re

    stderr = _import_error(env)
    assert (
        "ImportError: gradient_accumulator supports Keras 3 with the TensorFlow backend" in stderr
    )
    assert re.search(expected, stderr), stderr
