"""The distributions a user gets: the wheel carries the LICENSE, the sdist can run its tests."""

import subprocess
import sys
import tarfile
import zipfile

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def distributions(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build tools come from the test extra, not the network.
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", out],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def _tracked(*folders):
    if not (ROOT / ".git").exists():
        pytest.skip("compares with the files git tracks: needs a git checkout, not an sdist")
    listed = subprocess.run(
        ["git", "ls-files", *folders], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return {path for path in listed if (ROOT / path).is_file()}


def test_wheel_carries_the_license_and_the_package_only(distributions):
    _, wheel = distributions
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: MIT" in text
    assert "Requires-Dist: tensorflow" not in text.split("Provides-Extra")[0]  # only as an extra
    assert {name.split("/")[0] for name in names} <= {
        "gradient_accumulator",
        next(name.split("/")[0] for name in names if ".dist-info/" in name),
    }


def test_sdist_holds_everything_its_tests_read(distributions):
    sdist, _ = distributions
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        names = {name[len(top) + 1 :] for name in archive.getnames()}
    needed = _tracked("tests", "examples", "docs", "benchmarks", ".ci") | {
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "pyproject.toml",
    }
    missing = sorted(needed - names)
    assert not missing, f"the sdist lacks what its tests need: {missing}"


def test_installation_page_lists_exactly_the_versions_ci_tests():
    import re

    from gradient_accumulator._backend import MIN_KERAS, MIN_TENSORFLOW

    jobs = [
        line.split()
        for line in (ROOT / ".ci" / "versions").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    page = (ROOT / "docs" / "installation.rst").read_text()
    # The list-table's rows: "* - name" then "- python", "- tensorflow", "- keras".
    rows = re.findall(
        r"^\s*\* - (\S+)\n\s*- (\S+)\n\s*- (.+)\n\s*- (.+)\n", page, flags=re.MULTILINE
    )
    listed = {name: (python, tf, keras) for name, python, tf, keras in rows if name != "CI"}
    assert set(listed) == {name for name, *_ in jobs}, listed
    for name, python, tensorflow, keras, tests in jobs:
        assert listed[name] == (python, tensorflow, keras), (name, listed[name])
        assert tests in ("all", "one-process"), (name, tests)  # what .ci/run knows
    # The floor CI tests is the floor the import check and pyproject.toml declare.
    _, python, tensorflow, keras, tests = next(job for job in jobs if job[0] == "floor")
    assert tests == "all"
    assert tensorflow.startswith(".".join(map(str, MIN_TENSORFLOW[:2])) + ".")
    assert keras == ".".join(map(str, MIN_KERAS))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"keras>={keras}"' in pyproject
    assert f'requires-python = ">={python}"' in pyproject
    # Every Python version CI tests is declared, and only those.
    declared = set(re.findall(r"Programming Language :: Python :: (3\.\d+)", pyproject))
    assert declared == {job[1] for job in jobs}, declared
