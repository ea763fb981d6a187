"""The example scripts: each runs with ``--quick`` in a fresh process and prints what it promises.

The documentation includes code from these scripts (``literalinclude``), so
these tests are what keeps that code running. Each script runs as a user
would run it, from the repository root, in its own process (the multi-replica
example must configure its devices before TensorFlow starts), and prints
nothing but its own output: TensorFlow's start-up log is kept off stderr by
``examples/_quiet_tensorflow.py``, which every script imports first.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

# The examples print the same comparison with plain Keras at the big batch as
# the equivalence tests, so they share its float32 tolerance.
from tests.helpers import FLOAT32_ATOL, KERAS_VERSION, ROOT

# Every script in examples/ and the test that runs it (checked below); the
# modules they share start with an underscore.
TESTED_EXAMPLES = (
    "quickstart.py",
    "custom_loop.py",
    "mobilenetv2_bn_swap.py",
    "multi_replica.py",
    "sequence_tagging.py",
    "noise_scale.py",
    "kerashub_finetune.py",
    "tuning.py",
    "retrieval.py",
)


def environment_of_a_user(**variables):
    """This process's environment without ``TF_CPP_MIN_LOG_LEVEL``, which the examples set."""
    environment = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return {**environment, **variables}


def run_example(name, timeout=300):
    """Runs ``python examples/<name> --quick`` from the repository root; returns stdout.

    Fails the test, with both outputs, if the script fails or prints anything
    to stderr.
    """
    completed = subprocess.run(
        [sys.executable, f"examples/{name}", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment_of_a_user(),
    )
    outputs = f"{completed.stdout}\n{completed.stderr}"
    assert completed.returncode == 0, f"examples/{name} failed ({completed.returncode}):\n{outputs}"
    assert not completed.stderr, f"examples/{name} printed to stderr:\n{completed.stderr}"
    return completed.stdout


def value(pattern, text):
    """The number captured by ``pattern`` in ``text`` (which must match)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text}"
    return float(match.group(1))


def accuracies(text):
    return [float(a) for a in re.findall(r"test accuracy, .*: (\d\.\d+)", text)]


def test_every_example_is_run_here():
    scripts = sorted(path.name for path in (ROOT / "examples").glob("[!_]*.py"))
    assert scripts == sorted(TESTED_EXAMPLES)


# What TensorFlow 2.21 (absl's lines) and 2.16 (the dated ones) print while
# loading on a machine without a GPU, and two lines that must always pass;
# each with the lowest TF_CPP_MIN_LOG_LEVEL that hides it (4: none does).
START_UP_LOG = {
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR": 2,
    "I0000 00:00:1700000000.123456    1234 port.cc:153] oneDNN custom operations are on.": 1,
    "I0000 00:00:1700000000.123456    1234 cudart_stub.cc:31] Could not find cuda drivers": 1,
    "E0000 00:00:1700000000.123456    1234 cuda_dnn.cc:8579] Unable to register cuDNN": 3,
    "2024-01-01 12:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom": 1,
    "2024-01-01 12:00:00.123456: E external/local_xla/xla/cuda_fft.cc:479] Unable": 3,
    "F0000 00:00:1700000000.123456    1234 check.cc:12] a fatal error": 4,
    "a line of TensorFlow's own": 4,
}


@pytest.mark.parametrize("level", [None, "2", "1"], ids=["default", "level2", "level1"])
def test_quiet_tensorflow_drops_only_the_log_lines_below_the_level(tmp_path, level):
    """``_quiet_tensorflow`` filters what ``import tensorflow`` prints; Python warnings pass.

    A stand-in ``tensorflow`` package prints the start-up log, as TensorFlow's
    C++ code does, straight to the file descriptor, and issues a Python warning.
    """
    package = tmp_path / "tensorflow"
    package.mkdir()
    log = "".join(f"{line}\n" for line in START_UP_LOG).encode()
    (package / "__init__.py").write_text(
        f"import os, warnings\nos.write(2, {log!r})\nwarnings.warn('a Python warning')\n"
    )
    variables = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "examples")])}
    if level is not None:
        variables["TF_CPP_MIN_LOG_LEVEL"] = level
    completed = subprocess.run(
        [sys.executable, "-c", "import _quiet_tensorflow"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment_of_a_user(**variables),
    )
    assert completed.returncode == 0, completed.stderr
    shown = [line for line in START_UP_LOG if int(level or 3) < START_UP_LOG[line]]
    lines = completed.stderr.splitlines()
    assert lines[: len(shown)] == shown
    assert "UserWarning: a Python warning" in lines[len(shown)]


@pytest.mark.slow
def test_quickstart():
    pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")
    out = run_example("quickstart.py")
    assert "Effective batch: 8 micro-batches x 8 samples = 64" in out
    assert "Epoch 2/2" in out  # Keras's progress bar
    # 1500 samples, 2 epochs: 188 micro-batches (the last of 4) per epoch,
    # in groups of 8, as plain Keras's 24 batches of 64 (the last of 28).
    assert "Micro-steps run: 376; optimizer updates: 48 (plain batch 64: 48)" in out
    # Not silent while the references train: each says what it is.
    assert "Training plain Keras at batch 64 (the reference) ... done." in out
    assert "Training plain Keras at batch 8 (for contrast) ... done." in out
    diff = value(r"vs plain batch 64: (\S+)", out)
    assert diff < FLOAT32_ATOL
    assert value(r"vs plain batch 8: +(\S+)", out) > 1e-2  # another run altogether
    accumulate, big, small = accuracies(out)
    assert accumulate == big
    # The last line is the verdict, from the figures printed above, at the
    # tests' own float32 tolerance.
    verdict = re.fullmatch(
        r"equal to plain batch 64 within float32 rounding: "
        r"max \|diff\| (\S+) \(tolerance (\S+)\)",
        out.strip().splitlines()[-1],
    )
    assert verdict, out.strip().splitlines()[-1]
    assert float(verdict.group(1)) == pytest.approx(diff, rel=1e-2)
    assert float(verdict.group(2)) == FLOAT32_ATOL


@pytest.mark.slow
def test_quickstart_fails_loudly_outside_the_tolerance():
    pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")
    completed = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--quick", "--tolerance", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert completed.returncode == 1, completed.stderr[-2000:]
    last = completed.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: not equal to plain batch 64: max |diff| "), last
    assert "(tolerance 0e+00)" in last


@pytest.mark.slow
def test_custom_loop():
    pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")
    out = run_example("custom_loop.py")
    assert "Effective batch: 8 micro-batches x 8 samples = 64" in out
    # 1536 samples, 2 epochs: 384 micro-steps, 48 updates, as 48 batches of 64.
    assert "Micro-steps run: 384; optimizer updates: 48 (plain batch 64: 48)" in out
    assert value(r"vs plain batch 64: (\S+)", out) < FLOAT32_ATOL
    accumulate, big = accuracies(out)
    assert accumulate == big


@pytest.mark.slow
def test_sequence_tagging():
    out = run_example("sequence_tagging.py")
    moved = value(r"its weights moved by (\S+)", out)
    assert moved > 1e-2
    assert value(r"GradientAccumulateModel\(accum_steps=4\), batch 8: max \|diff\| (\S+)", out) < (
        FLOAT32_ATOL
    )
    assert value(r"custom loop, batch 8: max \|diff\| (\S+)", out) < FLOAT32_ATOL
    # Keras's own accumulation weights micro-batches by samples: a visible part of the update.
    builtin = value(r"Keras gradient_accumulation_steps=4, batch 8: +max \|diff\| (\S+)", out)
    assert builtin > moved / 100
    assert "equal to plain batch 32 within float32 rounding" in out


@pytest.mark.slow
def test_multi_replica():
    pytest.importorskip("sklearn", reason="the examples extra (scikit-learn) is not installed")
    out = run_example("multi_replica.py")
    assert "Replicas: 2; micro-batch: 8 per replica, 16 in all; effective batch: 4 x 16 = 64" in out
    assert "Epoch 2/2" in out
    # 1500 samples at 16: 94 micro-steps per epoch, 24 groups (the last of 2).
    assert value(r"Micro-steps run: (\d+)", out) == 188
    assert value(r"optimizer updates \(= gradient all-reduces\): (\d+)", out) == 48
    assert value(r"on one device: (\d+)\)", out) == 48
    assert value(r"at the effective batch: (\S+)", out) < FLOAT32_ATOL
    replicas, one_device = accuracies(out)
    # Keras < 3.10's evaluate is off under MirroredStrategy when the last
    # batch does not split evenly (plain Keras models too).
    if KERAS_VERSION >= (3, 10):
        assert replicas == one_device


@pytest.mark.slow
def test_mobilenetv2_bn_swap():
    out = run_example("mobilenetv2_bn_swap.py")
    assert (
        "BatchNormalization layers: 52 in the original, 52 AccumBatchNormalization "
        "(and 0 BatchNormalization) after the swap"
    ) in out
    assert value(r"after the swap: (\S+)", out) <= 1e-6  # lossless conversion
    assert "Effective batch: 4 micro-batches x 8 samples = 32; input 32x32" in out
    assert "Epoch 2/2" in out
    # 128 samples at 8: 16 micro-steps per epoch, 4 updates.
    assert "Micro-steps run: 32; optimizer updates: 8" in out
    assert "samples left pending in the BN layers after fit: 0" in out
    assert 0.0 <= value(r"test accuracy \(moving statistics\): (\S+)", out) <= 1.0
    # Handed over as plain Keras, saved and reloaded: the trained model's outputs.
    assert (
        "Handed over as plain Keras: Functional, 52 BatchNormalization, 0 AccumBatchNormalization"
    ) in out
    assert value(r"of the reloaded plain model: (\S+)", out) <= 1e-6


@pytest.mark.heavy
def test_noise_scale():
    out = run_example("noise_scale.py")
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, flags=re.MULTILINE)
    assert [int(epoch) for epoch, _, _ in rows] == [1, 2, 3, 4], out
    losses = [float(loss) for _, loss, _ in rows]
    scales = [float(scale) for _, _, scale in rows]
    assert losses == sorted(losses, reverse=True), out  # it trains
    # The noise scale grows as training goes on (58 -> 109 over these epochs).
    assert 0 < scales[0] < scales[-1], out


def skip_without(module, extra):
    """Skips the test if ``module`` is missing, unless CI's newest job requires it (fails)."""
    if importlib.util.find_spec(module) is None:
        if os.environ.get("GA_REQUIRE_OPTIONAL_EXAMPLES"):
            pytest.fail(f"GA_REQUIRE_OPTIONAL_EXAMPLES is set and {module} is not installed")
        pytest.skip(f'{module} is not installed: pip install -e ".[{extra}]"')


@pytest.mark.heavy
def test_tuning():
    # KerasTuner's grid over accum_steps 1, 4, 16 at micro-batch 8 (batches
    # 8, 32, 128) and two learning rates: every trial trains, each with the
    # updates of its batch (2 epochs of 1400 samples, the last group shorter).
    skip_without("keras_tuner", "kerastuner")
    out = run_example("tuning.py")
    rows = re.findall(r"^\s*(\d+)\s+([\d.e-]+)\s+(\d+)\s+([\d.]+)$", out, flags=re.MULTILINE)
    assert len(rows) == 6, out
    for batch, _, updates, accuracy in rows:
        assert int(updates) == 2 * -(-1400 // int(batch)), out
        assert 0.1 < float(accuracy) <= 1.0, out
    assert re.search(r"^best: batch (8|32|128) \(accum_steps (1|4|16)\)", out, re.MULTILINE), out


@pytest.mark.heavy
def test_kerashub_finetune():
    # A KerasHub CausalLM (GPT-2) and TextClassifier (BERT) built from small
    # configurations, fine-tuned through the wrapper with AdamW and its
    # weight-decay exclusions: equal to the big batch's update (plain Keras
    # with dense gradients) within float32 rounding, the logged loss the big
    # batch's; then generate / predict, save and load. CI's newest job installs
    # keras-hub (Python >= 3.11).
    skip_without("keras_hub", "kerashub")
    out = run_example("kerashub_finetune.py", timeout=600)
    for task in ("CausalLM", "TextClassifier"):
        line = next(line for line in out.splitlines() if line.startswith(f"{task}:"))
        assert value(r"from the big batch's update ([\d.e+-]+)", line) < FLOAT32_ATOL, out
        assert value(r"loss ([\d.]+)", line) == value(r"big batch ([\d.]+)", line), out
    # Keras's Adam on the classifier's sparse embedding gradient (the task's
    # own fit) squares each token's occurrences before summing: not the big
    # batch's update (the LM's embedding is tied to its output: dense).
    classifier = next(line for line in out.splitlines() if line.startswith("TextClassifier:"))
    assert value(r"from the task's own fit ([\d.e+-]+)", classifier) > 1e-4, out
    assert out.count("after save and load, the same: True") == 2, out


def test_retrieval():
    # A two-tower retrieval model written the KerasRS way (its candidate tower
    # in `compute_loss`) on GradientAccumulateModel with coupled_loss: the big
    # batch's weights within float32 rounding; coupled_loss=None is another
    # objective, and the library warns about it. Evaluated with KerasRS's
    # BruteForceRetrieval (keras-rs needs Python >= 3.11).
    skip_without("keras_rs", "kerasrs")
    out = run_example("retrieval.py")
    assert value(r"moved by ([\d.e+-]+);", out) > 1e-3, out
    assert value(r"coupled_loss='replica', .*max \|diff\| ([\d.e+-]+)", out) < FLOAT32_ATOL, out
    assert value(r"coupled_loss=None, .*max \|diff\| ([\d.e+-]+)", out) > 1e-4, out
    assert "coupled_loss=None warned: " in out, out
    assert "equal to plain batch 64 within float32 rounding" in out, out
