"""The suite's report of its equivalence figures (tests/conftest.py): a file, printed with ``-v``.

Each test runs pytest in a fresh process on a suite of one test under
``tmp_path``, whose conftest brings this repository's hooks, with CI's
``-p no:cacheprovider``.
"""

import os
import subprocess
import sys

import pytest

from tests.conftest import FIGURES_TITLE
from tests.helpers import ROOT

SUITE = {
    "conftest.py": (
        "from tests.conftest import (  # noqa\n"
        "    pytest_addoption,\n"
        "    pytest_runtest_logreport,\n"
        "    pytest_runtest_makereport,\n"
        "    pytest_terminal_summary,\n"
        ")\n"
    ),
    "test_one.py": (
        "from tests.helpers import assert_diff_below\n"
        "\n"
        "\n"
        "def test_measured():\n"
        "    assert_diff_below(1.25e-07, 1e-06)\n"
    ),
}
# The figure's line, as the file holds it and -v prints it.
FIGURE = "  1.25e-07  test_one.py::test_measured"
# Each test starts pytest in processes of its own, which import TensorFlow
# (6-13 s a test): not in the fast tier.
pytestmark = pytest.mark.slow


def run_suite(directory, *args):
    """Runs ``python -m pytest -p no:cacheprovider *args`` on SUITE in ``directory``; its stdout."""
    for name, text in SUITE.items():
        (directory / name).write_text(text)
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, "PYTHONPATH": str(ROOT)},
    )
    assert completed.returncode == 0, f"{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def summary_lines(out):
    return [line for line in out.splitlines() if line.startswith("equivalence:")]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_a_default_run_writes_the_figures_to_a_file_and_names_it_in_one_line(tmp_path, workers):
    # Under pytest-xdist the figure is measured in a worker and written by
    # the controller, which reads it from the test's report.
    out = run_suite(tmp_path, "-q", *workers)
    (written,) = (tmp_path / "build" / "equivalence").iterdir()
    assert written.read_text().splitlines()[0] == f"# {FIGURES_TITLE}"
    assert FIGURE in written.read_text().splitlines()
    assert FIGURE not in out
    assert summary_lines(out) == [
        f"equivalence: 1 measured max |diff| figures in "
        f"{written.relative_to(tmp_path)}; -v prints them"
    ]


def test_verbose_prints_the_figures_and_the_option_names_the_file(tmp_path):
    out = run_suite(tmp_path, "-v", "--equivalence-figures", "figures.txt")
    assert FIGURES_TITLE in out
    assert out.splitlines().index(FIGURE) < out.splitlines().index(summary_lines(out)[-1])
    assert summary_lines(out) == ["equivalence: 1 measured max |diff| figures in figures.txt"]
    assert FIGURE in (tmp_path / "figures.txt").read_text().splitlines()
    assert not (tmp_path / "build").exists()
