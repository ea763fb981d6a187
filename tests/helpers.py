"""Reference helpers: the same model trained plainly on the big batch, and with accumulation.

Every equivalence test builds the model twice from the same seed (identical
initial weights, separate layers), trains one with plain Keras at batch
``accum_steps * micro_batch`` and one with ``GradientAccumulateModel`` at batch
``micro_batch`` on the same data in the same order, and compares weights.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np

from gradient_accumulator import GradientAccumulateModel

ROOT = Path(__file__).resolve().parent.parent

# float32: both runs compute the same sums in a different order, so weights
# differ by a few ulps (observed <= 1.2e-7 on weights of magnitude ~1).
FLOAT32_ATOL = 1e-6

# float16 compute (the mixed_float16 policy): each micro-batch's activations
# and gradients are rounded to float16 (an 11-bit significand, relative
# rounding ~5e-4) before they reach the float32 sums, and the big batch rounds
# its own sums differently; observed weight differences stay below 2e-4 after
# several updates. The one float16 tolerance of the tests and the docs.
FLOAT16_ATOL = 2e-3

# The installed Keras as (major, minor), for the few assertions about Keras's
# own behaviour that changed between the supported versions.
KERAS_VERSION = tuple(int(part) for part in keras.__version__.split(".")[:2])

# 76 samples at micro-batch 8: nine full micro-batches and one of 4. With
# accum_steps=4 the epoch ends with a shorter group (two micro-batches, 12
# samples), matching the reference's last batch of 76 - 2 * 32 = 12.
NUM_SAMPLES = 76
MICRO_BATCH = 8


def make_regression_data(num_samples=NUM_SAMPLES, features=5, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(num_samples, outputs))).astype("float32")
    return x, y


def build_dense(cls=keras.Model, seed=0, features=5, outputs=1, **kwargs):
    """A small MLP with fresh layers, identical weights for the same ``seed``."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,), name="x")
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(outputs, name="out")(hidden)
    return cls(inputs=inputs, outputs=out, **kwargs)


# Measured max |diff| of every equivalence assertion, printed by conftest's
# terminal summary so that the figures come from the test run itself.
MEASURED = {}


def max_abs_diff(weights_a, weights_b):
    assert len(weights_a) == len(weights_b)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def assert_close(weights_a, weights_b, atol):
    """Asserts max |a - b| < atol over all arrays, and records the figure."""
    diff = max_abs_diff(weights_a, weights_b)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    MEASURED[test] = max(diff, MEASURED.get(test, 0.0))
    assert diff < atol, f"max |diff| = {diff:.3g} >= {atol:.3g}"


def train_pair(
    build,
    make_optimizer,
    x,
    y,
    accum_steps=4,
    micro_batch=MICRO_BATCH,
    epochs=2,
    compile_kwargs=None,
    fit_kwargs=None,
):
    """Trains the plain big-batch reference and the accumulating model.

    Returns ``(reference, accumulating)``, both trained.
    """
    compile_kwargs = {"loss": "mse", **(compile_kwargs or {})}
    fit_kwargs = {"epochs": epochs, "shuffle": False, "verbose": 0, **(fit_kwargs or {})}

    reference = build(keras.Model)
    reference.compile(optimizer=make_optimizer(), **compile_kwargs)
    reference.fit(x, y, batch_size=accum_steps * micro_batch, **fit_kwargs)

    accumulating = build(GradientAccumulateModel, accum_steps=accum_steps)
    accumulating.compile(optimizer=make_optimizer(), **compile_kwargs)
    accumulating.fit(x, y, batch_size=micro_batch, **fit_kwargs)
    return reference, accumulating


def numpy_agc(grad, weight, clip_factor, eps):
    """Adaptive gradient clipping (Brock et al. 2021), unit by unit, in float64.

    A unit is one index of the last (output) axis; scalars and vectors are one
    unit. Each unit's gradient is scaled down to at most
    ``clip_factor * max(||weight unit||, eps)``.
    """
    grad = np.asarray(grad, "float64")
    weight = np.asarray(weight, "float64")
    if weight.ndim <= 1:
        units = [(Ellipsis,)]  # one unit: the whole tensor
    else:
        units = [(Ellipsis, u) for u in range(weight.shape[-1])]
    out = grad.copy()
    for unit in units:
        max_norm = clip_factor * max(np.linalg.norm(weight[unit]), eps)
        grad_norm = np.linalg.norm(grad[unit])
        if grad_norm > max_norm:
            out[unit] = grad[unit] * (max_norm / grad_norm)
    return out


def free_ports(count):
    """``count`` distinct free TCP ports on the loopback interface."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_workers(source, num_workers=2, timeout=600, args=(), check=True):
    """Runs ``source`` as a MultiWorkerMirroredStrategy cluster on loopback.

    Each worker is a fresh process with its own ``TF_CONFIG``; returns the
    ``(returncode, stdout, stderr)`` of each, in worker order.
    """
    import json

    ports = free_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = []
    for index in range(num_workers):
        tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps(tf_config)}
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(source), *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if check:
        for index, (code, out, err) in enumerate(results):
            if code != 0:
                raise AssertionError(f"worker {index} failed ({code}):\n{out}\n{err[-5000:]}")
    return results


_LOGICAL_CPUS = """
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * {count},
)
"""


def run_python(args, timeout=600, env=None, label=None):
    """Runs ``python *args`` from the repository root in a fresh process; returns its stdout.

    Fails the test, with both outputs, if the process fails. ``label`` names
    the run in that message (default: the arguments).
    """
    completed = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )
    assert completed.returncode == 0, (
        f"{label or ' '.join(args)} failed ({completed.returncode}):\n"
        f"{completed.stdout}\n{completed.stderr}"
    )
    return completed.stdout


def run_script(source, timeout=600, env=None, logical_cpus=None):
    """Runs ``source`` in a fresh Python process; returns its stdout.

    Fresh processes are needed for logical-device setups and strategies, which
    a process can configure only once. ``logical_cpus=n`` splits the CPU into
    ``n`` logical devices before ``source`` runs (for MirroredStrategy).
    """
    source = textwrap.dedent(source)
    if logical_cpus:
        source = _LOGICAL_CPUS.format(count=logical_cpus) + source
    return run_python(["-c", source], timeout=timeout, env=env, label="script")
