"""The documentation: its code runs, its citations exist, its API check works, its claims hold.

The pages themselves are built and their doctests run by ``sphinx-build``
(``.ci/run``). These tests check what that build cannot: that every code block
is one that runs, that every test a page cites exists, that the build-time
API coverage check fails when it should, and the claims of the comparison page
about Keras that need two devices or two workers.
"""

import ast
import json
import re
import sys

import pytest

from tests.helpers import KERAS_VERSION, ROOT, run_script, run_workers
from tests.test_examples import TESTED_EXAMPLES

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.rst"))
PAGE_IDS = [str(page.relative_to(DOCS)) for page in PAGES]

# Directives whose body is code, and the languages allowed in `code-block`:
# shell commands (checked below) and plain text. Python code must be a
# doctest or included from an example script that the tests run.
_DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::\s*(.*)$")
_CODE_BLOCK_LANGUAGES = {"console", "text"}
_DOCTEST_DIRECTIVES = {"doctest", "testcode", "testoutput", "testsetup", "testcleanup"}

# Shell commands the pages may show, each run by CI or by the test suite.
_CI = (ROOT / ".ci" / "run").read_text()
_PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _blocks(page):
    """``(directive, argument, body lines)`` of every directive on ``page``."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if not match:
            continue
        indent, directive, argument = len(match.group(1)), match.group(2), match.group(3)
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            body.append(following)
        blocks.append((directive, argument.strip(), body))
    return blocks


def _check_command(command):
    """Raises AssertionError unless ``command`` is one that CI or the tests run."""
    if command.startswith("sphinx-build "):
        assert command in _CI, f"not a docs build command of .ci/run: {command}"
        return
    match = re.fullmatch(r'python -m pip install -e "\.\[([\w,]+)\]"', command)
    if match:
        for extra in match.group(1).split(","):
            assert re.search(rf"^{extra} = \[", _PYPROJECT, re.M), f"no extra {extra!r}"
        return
    match = re.fullmatch(r"python examples/(\w+\.py)( --quick)?", command)
    if match:
        assert match.group(1) in TESTED_EXAMPLES, f"examples/{match.group(1)} is not tested"
        return
    match = re.fullmatch(r"python -m benchmarks\.(\w+)( --quick)?", command)
    if match:
        assert (ROOT / "benchmarks" / f"{match.group(1)}.py").exists(), command
        return
    if re.fullmatch(r"python -m pytest( .*)?", command):
        return
    raise AssertionError(f"unknown shell command in the docs: {command}")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_code_block_runs(page):
    """Code is a doctest, an included example script, or a command CI runs."""
    text = page.read_text()
    doctest_lines = set()
    for directive, argument, body in _blocks(page):
        if directive in _DOCTEST_DIRECTIVES:
            doctest_lines.update(line.strip() for line in body)
        elif directive == "code-block":
            assert argument in _CODE_BLOCK_LANGUAGES, f"{page.name}: code-block:: {argument}"
            if argument == "console":
                commands = [line.strip()[2:] for line in body if line.strip().startswith("$ ")]
                assert commands, f"{page.name}: console block without a `$ ` command"
                for command in commands:
                    _check_command(command)
        elif directive == "literalinclude":
            target = (page.parent / argument).resolve()
            assert target.parent == ROOT / "examples", f"{page.name}: includes {argument}"
            assert target.name in TESTED_EXAMPLES, f"{page.name}: {argument} is not tested"
        else:
            assert directive not in {"code", "sourcecode", "ipython"}, f"{page.name}: {directive}"
    # `>>>` outside a doctest directive would be shown but never run.
    for line in text.splitlines():
        if line.strip().startswith(">>>"):
            assert line.strip() in doctest_lines, f"{page.name}: untested example {line!r}"
    # A paragraph ending in `::` starts a literal block that nothing runs.
    for line in text.splitlines():
        if line.rstrip().endswith("::") and not _DIRECTIVE.match(line):
            raise AssertionError(f"{page.name}: literal block after {line!r}")


def test_cited_tests_exist():
    """Every ``tests/test_x.py::test_name`` a page cites names a real test."""
    cited = {}
    for page in PAGES:
        for path, name in re.findall(r"tests/(test_\w+\.py)::(test_\w+)", page.read_text()):
            cited.setdefault((path, name), page.name)
    assert cited
    for (path, name), page in sorted(cited.items()):
        source = ROOT / "tests" / path
        assert source.exists(), f"{page} cites {path}, which does not exist"
        assert re.search(rf"^def {name}\(", source.read_text(), re.M), (
            f"{page} cites tests/{path}::{name}, which does not exist"
        )


# ------------------------------------------------------------------------
# The troubleshooting page: every message the package raises, and no other
# ------------------------------------------------------------------------

TROUBLESHOOTING = DOCS / "troubleshooting.rst"
PACKAGE = ROOT / "gradient_accumulator"


def _normalized(text):
    return " ".join(text.split())


def _literal_parts(node):
    """The literal text of a message expression, ``None`` for each computed part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return [None]


def _message_key(node):
    """A fixed piece of a raised message that any instance of it shows.

    The first literal stretch (between computed values) of at least 12
    characters, up to its "Received" clause, cut to 40 characters.
    """
    stretches, current = [], ""
    for part in _literal_parts(node):
        if part is None:
            stretches.append(current)
            current = ""
        else:
            current += part
    stretches.append(current)
    for stretch in stretches:
        text = _normalized(stretch.split(" Received")[0])
        if len(text) >= 12:
            return text[:40]
    return None


def _raised_messages():
    """``{key: "file:line"}`` for every ``raise SomeError("message...")`` in the package."""
    keys = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                key = _message_key(node.exc.args[0])
                assert key, f"{path.name}:{node.lineno}: no fixed text in the message"
                keys[key] = f"{path.name}:{node.lineno}"
    return keys


def test_troubleshooting_covers_every_raised_message():
    keys = _raised_messages()
    assert len(keys) > 30
    page = _normalized(TROUBLESHOOTING.read_text())
    missing = {where: key for key, where in keys.items() if key not in page}
    assert not missing, f"messages without an entry on docs/troubleshooting.rst: {missing}"
    # The sentence every ImportError starts with, versions included.
    from gradient_accumulator._backend import _SUPPORTED

    assert _normalized(_SUPPORTED) in page


def test_troubleshooting_quotes_only_real_messages():
    keys = _raised_messages()
    blocks = [body for directive, _, body in _blocks(TROUBLESHOOTING) if directive == "code-block"]
    assert blocks
    for body in blocks:
        for message in "\n".join(body).split("\n\n"):
            if message.strip():
                assert any(key in _normalized(message) for key in keys), (
                    f"not a message the package raises: {message.strip()!r}"
                )


def test_changelog_has_a_section_for_this_release():
    from gradient_accumulator import __version__

    release = re.match(r"\d+\.\d+\.\d+", __version__).group(0)  # "0.6.0" of "0.6.0.dev0"
    text = (ROOT / "CHANGELOG.md").read_text()
    section = re.search(rf"^## {re.escape(release)}\b.*?(?=^## |\Z)", text, re.M | re.S)
    assert section, f"CHANGELOG.md has no section for {release}"
    for heading in ("Added", "Changed", "Removed", "Fixed"):
        assert f"### {heading}" in section.group(0), heading
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / link).exists(), f"CHANGELOG.md links to {link}, which does not exist"


# ------------------------------------------------------------------------
# The build-time API coverage check (docs/_ext/api_coverage.py)
# ------------------------------------------------------------------------

_FAKE_PACKAGE = '''
"""A package with three public names."""
__all__ = ["Documented", "forgotten", "__version__"]
__version__ = "0"


class Documented:
    """Documented."""


def forgotten():
    """Not on the API page."""


Alias = Documented  # another public path of a documented object
'''

_FAKE_CONF = """
import sys
sys.path.insert(0, {here!r})
sys.path.insert(0, {ext!r})
extensions = ["sphinx.ext.autodoc", "api_coverage"]
api_coverage_modules = ["fake_public_api"]
api_coverage_extra_names = {extra!r}
"""


def _build_fake_docs(tmp_path, api_page, extra=()):
    """Builds a one-page site with ``-W``; returns (exit code, warnings)."""
    from sphinx.cmd.build import build_main

    source = tmp_path / "src"
    source.mkdir()
    (tmp_path / "fake_public_api.py").write_text(_FAKE_PACKAGE)
    (source / "conf.py").write_text(
        _FAKE_CONF.format(here=str(tmp_path), ext=str(DOCS / "_ext"), extra=list(extra))
    )
    (source / "index.rst").write_text("API\n===\n\n" + api_page)
    warnings = tmp_path / "warnings.txt"
    try:
        arguments = ["-W", "-q", "-E", "-b", "html", "-w", str(warnings)]
        code = build_main([*arguments, str(source), str(tmp_path / "out")])
    finally:
        sys.modules.pop("fake_public_api", None)
    return code, warnings.read_text()


def test_api_coverage_fails_the_build_on_an_undocumented_name(tmp_path):
    pytest.importorskip("sphinx", reason="the docs extra (sphinx) is not installed")
    code, warnings = _build_fake_docs(
        tmp_path,
        ".. autoclass:: fake_public_api.Documented\n",
        extra=["fake_public_api.Documented.extra_method"],
    )
    assert code != 0
    assert "fake_public_api.forgotten" in warnings
    assert "fake_public_api.Documented.extra_method" in warnings
    assert "__version__" not in warnings
    assert "fake_public_api.Documented," not in warnings


def test_api_coverage_passes_when_every_name_is_documented(tmp_path):
    pytest.importorskip("sphinx", reason="the docs extra (sphinx) is not installed")
    api_page = (
        ".. autoclass:: fake_public_api.Documented\n\n.. autofunction:: fake_public_api.forgotten\n"
    )
    # An extra name that is another path of a documented object is covered.
    code, warnings = _build_fake_docs(tmp_path, api_page, extra=["fake_public_api.Alias"])
    assert (code, warnings) == (0, "")


# ------------------------------------------------------------------------
# The comparison page's claims that need two devices or two workers
# ------------------------------------------------------------------------

_BUILTIN_UNDER_MIRRORED = """
import json
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np

from gradient_accumulator import GradientAccumulateModel

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x[:, :1]


def build(cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return cls(inputs=inputs, outputs=keras.layers.Dense(1)(inputs), **kwargs)


results = {"replicas": strategy.num_replicas_in_sync}
with strategy.scope():
    builtin = build()
    builtin.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), "mse")
try:
    builtin.fit(x, y, batch_size=16, verbose=0)
    results["builtin"] = "trained"
except Exception as error:
    results["builtin"] = f"{type(error).__name__}: {error}"
with strategy.scope():
    library = build(GradientAccumulateModel, accum_steps=4)
    library.compile(keras.optimizers.SGD(0.1), "mse")
library.fit(x, y, batch_size=16, verbose=0)
results["library_updates"] = int(library.optimizer.iterations.numpy())
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.slow
def test_keras_builtin_accumulation_fails_under_mirrored_strategy():
    stdout = run_script(_BUILTIN_UNDER_MIRRORED, timeout=300)
    line = next(line for line in stdout.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    assert results["replicas"] == 2
    # keras-team/keras issue 20582: a merge_call inside the update conditional.
    assert results["builtin"].startswith("RuntimeError")
    assert "`merge_call` called while defining a new graph" in results["builtin"]
    # The same model under the same strategy with this library: 4 micro-steps, 1 update.
    assert results["library_updates"] == 1


_KERAS_FIT_UNDER_MULTI_WORKER = """
import json
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras
import numpy as np

x = np.ones((32, 4), "float32")
results = {"replicas": strategy.num_replicas_in_sync}
for steps in (None, 2):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps), "mse")
    try:
        model.fit(x, x[:, :1], batch_size=8, verbose=0)
        results[str(steps)] = "trained"
    except Exception as error:
        results[str(steps)] = f"{type(error).__name__}: {error}"
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.slow
def test_keras_fit_fails_under_multi_worker_strategy():
    # keras-team/keras issue 20585: Keras reduces the first batch, a nested
    # structure of per-replica values, to build the model, which fails.
    # GradientAccumulateModel's fit is tested under the same strategy in
    # tests/test_distribute.py.
    for _, stdout, _ in run_workers(_KERAS_FIT_UNDER_MULTI_WORKER, timeout=300):
        line = next(line for line in stdout.splitlines() if line.startswith("RESULTS "))
        results = json.loads(line[len("RESULTS ") :])
        assert results["replicas"] == 2
        for steps in ("None", "2"):  # plain fit, and with the built-in accumulation
            if KERAS_VERSION >= (3, 5):
                assert results[steps].startswith("ValueError"), results
                assert "PerReplica" in results[steps], results
            elif steps == "None":  # No build from the first batch: the scalar logs fail.
                assert "Invalid reduction dimension 0" in results[steps], results
            else:  # The built-in accumulation's merge_call inside its conditional.
                assert "`merge_call` called while defining a new graph" in results[steps], results


def test_installation_page_lists_exactly_the_versions_ci_tests():
    from gradient_accumulator._backend import MIN_KERAS, MIN_TENSORFLOW

    jobs = [
        line.split()
        for line in (ROOT / ".ci" / "versions").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    page = (DOCS / "installation.rst").read_text()
    # The list-table's rows: "* - name" then "- python", "- tensorflow", "- keras".
    rows = re.findall(
        r"^\s*\* - (\S+)\n\s*- (\S+)\n\s*- (.+)\n\s*- (.+)\n", page, flags=re.MULTILINE
    )
    listed = {name: (python, tf, keras) for name, python, tf, keras in rows if name != "CI"}
    assert set(listed) == {"newest"} | {name for name, *_ in jobs}, listed
    for name, python, tensorflow, keras, _ in jobs:
        assert listed[name] == (python, tensorflow, keras), (name, listed[name])
    # The floor CI tests is the floor the import check enforces.
    floor = next(job for job in jobs if job[0] == "floor")
    assert floor[2] == ".".join(map(str, MIN_TENSORFLOW)) or floor[2].startswith(
        ".".join(map(str, MIN_TENSORFLOW[:2]))
    )
    assert floor[3] == ".".join(map(str, MIN_KERAS))
    assert f'"keras>={floor[3]}"' in (ROOT / "pyproject.toml").read_text()
