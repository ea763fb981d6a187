"""Shared pytest configuration: quiet TensorFlow, restore global Keras state, file the figures."""

import gc
import os
import platform
import shlex
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow turns oneDNN on by default only on some x86 CPUs (Intel's with
# AVX-512 and the like); without it the CPU allocator keeps no statistics, which
# the memory tests read. On for every test (and the processes they start), so
# that the suite measures the same on every machine.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# Under pytest-xdist (``-n N``), each worker's TensorFlow gets its share of the
# cores (and so do the processes its tests start, which inherit these), not
# all of them each: N workers on N cores, not N times the threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(_share))
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(max(2, _share)))

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

FIGURES_TITLE = "equivalence: measured max |diff| against the reference"


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help=(
            "the fast tier, for checking a change in 2 to 3 minutes (with -n auto on 2 "
            "cores): the first parametrization of each test, without the multi-process "
            "(slow), benchmark, Keras-suite and heavy tests; CI runs everything"
        ),
    )
    parser.addoption(
        "--equivalence-figures",
        metavar="PATH",
        help=(
            "file to write the measured max |diff| of every equivalence assertion to "
            "(default: build/equivalence/<Python, TensorFlow and Keras versions>.txt "
            "under the rootdir); -v also prints them"
        ),
    )


_NOT_FAST = ("slow", "benchmarks", "keras_suite", "heavy")


def _fast_tier(config, items):
    """``--fast``: each test function's first parametrization, none of ``_NOT_FAST``."""
    kept, dropped, seen = [], [], set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if function in seen or any(item.get_closest_marker(m) for m in _NOT_FAST):
            dropped.append(item)
        else:
            seen.add(function)
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one pytest-xdist worker per core, and one more.

    A worker whose test waits for the processes it started (the multi-replica
    and multi-worker scripts, the examples) leaves part of a core idle: on 2
    cores the suite kept them 150% busy with 2 workers, 172% with 3 (805 s
    and 754 s of wall time, ``/usr/bin/time -v``). ``-n N`` still means N.
    """
    return (os.cpu_count() or 1) + 1


def _weight(items):
    """How long a module's tests are expected to take, for ordering: its
    tests that start processes or train large models, then its number of tests."""
    heavy = sum(1 for item in items if any(item.get_closest_marker(m) for m in ("slow", "heavy")))
    return heavy, len(items)


def _heaviest_modules_first(items):
    """Under pytest-xdist (``--dist loadfile``, the file order kept by
    ``--no-loadscope-reorder``): the modules whose tests start processes go
    first, so that the longest one (tests/test_distribute.py, ~6 minutes of a
    worker) does not start last and end alone."""
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(modules.values(), key=_weight, reverse=True)
    items[:] = [item for module in ordered for item in module]


def pytest_collection_modifyitems(config, items):
    """``--fast``: the fast tier (:func:`_fast_tier`); in a pytest-xdist
    worker, the heaviest modules first (:func:`_heaviest_modules_first`)."""
    if config.getoption("fast"):
        _fast_tier(config, items)
    if hasattr(config, "workerinput"):
        _heaviest_modules_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Moves the figures a test measured (``tests.helpers.MEASURED``) into its report.

    The controller gathers them from the reports (:func:`pytest_runtest_logreport`),
    so that the figures of every pytest-xdist worker reach one file.
    """
    from tests.helpers import MEASURED

    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and item.nodeid in MEASURED:
        report.user_properties.append(("equivalence_max_diff", MEASURED.pop(item.nodeid)))


def pytest_runtest_logreport(report):
    from tests.helpers import MEASURED

    for name, diff in report.user_properties:
        if name == "equivalence_max_diff":
            MEASURED[report.nodeid] = max(diff, MEASURED.get(report.nodeid, 0.0))


@pytest.fixture(autouse=True)
def _restore_keras_globals():
    """Each test starts from float32 and a fresh Keras graph state."""
    yield
    keras.mixed_precision.set_global_policy("float32")
    # Without its full `gc.collect()`, which walks every object the suite has
    # built up: Keras's globals are the state to reset.
    keras.backend.clear_session(free_memory=False)
    # The test's garbage collected, then what survives frozen: Python's
    # collections (this one and its automatic ones) then walk only the objects
    # made since the previous test, not the whole suite's heap (TensorFlow
    # keeps every traced training step alive, tensorflow/tensorflow#97697).
    # A frozen object is never freed (a module fixture's, once its module
    # ends). Tests 4.6 min -> 4.3 min (examples, Keras suites, model, not slow).
    gc.collect()
    gc.freeze()


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _environment():
    """The versions the figures were measured with, as a file name."""
    return f"python{platform.python_version()}-tensorflow{tf.__version__}-keras{keras.__version__}"


def _figures_path(config):
    """``--equivalence-figures``, or one file per environment under ``build/`` (git ignores it).

    One file per environment: CI runs the suite of several environments side by
    side in one checkout (with ``-p no:cacheprovider``), each writes its own.
    """
    path = config.getoption("equivalence_figures")
    if path is None:
        return config.rootpath / "build" / "equivalence" / f"{_environment()}.txt"
    return config.invocation_params.dir / path


def _write_atomically(path, text):
    """Writes this process's file beside ``path`` and renames it: never half a file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def pytest_terminal_summary(terminalreporter, config):
    """Writes the figures ``tests.helpers.MEASURED`` recorded to a file, names it in one line.

    ``-v`` also prints them, as a section before that line.
    """
    from tests.helpers import MEASURED

    if not MEASURED:
        return
    lines = [f"{diff:10.3g}  {test}" for test, diff in sorted(MEASURED.items())]
    verbose = config.option.verbose > 0
    if verbose:
        terminalreporter.section(FIGURES_TITLE)
        for line in lines:
            terminalreporter.write_line(line)
    path = _figures_path(config)
    arguments = shlex.join(config.invocation_params.args)
    header = [f"# {FIGURES_TITLE}", f"# {_environment()}; pytest {arguments}".rstrip()]
    try:
        _write_atomically(path, "\n".join(header + lines) + "\n")
    except OSError as error:
        written = f"not written ({error})"
    else:
        cwd = Path.cwd()
        written = f"in {path.relative_to(cwd) if path.is_relative_to(cwd) else path}"
    hint = "" if verbose else "; -v prints them"
    terminalreporter.write_line(
        f"equivalence: {len(lines)} measured max |diff| figures {written}{hint}"
    )
