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
    assert "ImportError: gradient_accumulator supports TensorFlow >= 2.16 with Keras >= " in stderr
    assert re.search(expected, stderr), stderr


def _import_with(tmp_path, prelude):
    """``import gradient_accumulator`` after ``prelude`` (which may fake a module)."""
    code = f"import sys\n{prelude}\nimport gradient_accumulator\n"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode != 0, result.stdout
    return result.stderr


def _fake_module(tmp_path, name, version):
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")


def test_missing_tensorflow_names_the_install_command(tmp_path):
    stderr = _import_with(tmp_path, "sys.modules['tensorflow'] = None")
    assert "supports TensorFlow >= 2.16 with Keras >= " in stderr
    assert "No TensorFlow was found" in stderr
    assert 'pip install "gradient-accumulator[tensorflow]"' in stderr


def test_too_old_tensorflow_names_the_version_found_and_the_fix(tmp_path):
    _fake_module(tmp_path, "tensorflow", "2.15.1")
    stderr = _import_with(tmp_path, "")
    assert 'Found tensorflow==2.15.1. Upgrade it: pip install -U "tensorflow>=2.16"' in stderr
    assert "use gradient_accumulator 0.5" in stderr


@pytest.mark.parametrize("version", ["2.15.0", "3.2.1"])
def test_too_old_keras_names_the_version_found_and_the_fix(tmp_path, version):
    from gradient_accumulator._backend import MIN_KERAS

    _fake_module(tmp_path, "keras", version)  # found before the installed Keras
    stderr = _import_with(tmp_path, "")
    minimum = ".".join(map(str, MIN_KERAS))
    assert f'Found keras=={version}. Upgrade it: pip install -U "keras>={minimum}"' in stderr
