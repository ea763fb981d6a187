"""The documentation: its code runs, its citations exist, its API check works, its claims hold.

The pages themselves are built and their doctests run by ``sphinx-build``
(``.ci/run``). These tests check what that build cannot: that every code block
is one that runs, that every test a page cites exists, that the build-time
API coverage check fails when it should, and, where the comparison page says
Keras fails (two devices, two workers), that this library trains there, with
Keras's own outcome recorded.
"""

import ast
import re
import sys
import warnings

import keras
import pytest

from tests.helpers import (
    FLOAT32_ATOL,
    KERAS_VERSION,
    ROOT,
    assert_diff_below,
    run_script_module,
    run_workers,
    script_results,
)
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
# Formulas render offline: the math script is served with the site
# ------------------------------------------------------------------------


def _conf_literals():
    """docs/conf.py's top-level assignments of literal values, read without running it."""
    values = {}
    for node in ast.parse((DOCS / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return values


def _loaded_urls(html):
    """Every script ``src`` and stylesheet ``href`` of an HTML page."""
    scripts = re.findall(r"<script[^>]*\ssrc=\"([^\"]+)\"", html)
    styles = re.findall(r"<link[^>]*\shref=\"([^\"]+)\"[^>]*rel=\"stylesheet\"", html)
    styles += re.findall(r"<link[^>]*rel=\"stylesheet\"[^>]*\shref=\"([^\"]+)\"", html)
    return {url.split("?")[0] for url in scripts + styles}


def test_math_is_rendered_by_a_script_served_with_the_site(tmp_path):
    # A two-page site with docs/conf.py's extensions (but the local ones,
    # which check the real API page) and math settings: whatever renders the
    # formulas must be a file of the built site, not a CDN URL that an
    # offline reader (or a local build viewed without network) cannot load.
    pytest.importorskip("sphinx", reason="the docs extra (sphinx) is not installed")
    from sphinx.cmd.build import build_main

    conf = _conf_literals()
    local = {path.stem for path in (DOCS / "_ext").glob("*.py")}
    extensions = [name for name in conf["extensions"] if name not in local]
    settings = {k: v for k, v in conf.items() if k.startswith(("mathjax", "katex"))}
    source = tmp_path / "src"
    source.mkdir()
    lines = [f"extensions = {extensions!r}"] + [f"{k} = {v!r}" for k, v in settings.items()]
    (source / "conf.py").write_text("\n".join(lines) + "\n")
    toctree = ".. toctree::\n\n   plain\n"
    (source / "index.rst").write_text(f"Math\n====\n\n:math:`2^{{20}}` bytes\n\n{toctree}")
    (source / "plain.rst").write_text("Plain\n=====\n\nNo formula.\n")
    out = tmp_path / "out"
    assert build_main(["-W", "-q", "-E", "-b", "html", str(source), str(out)]) == 0

    with_math = _loaded_urls((out / "index.html").read_text())
    math_urls = with_math - _loaded_urls((out / "plain.html").read_text())
    assert math_urls, f"no script or stylesheet for the math: {sorted(with_math)}"
    for url in with_math:
        assert "//" not in url, f"the page loads {url} from the network"
        assert (out / url).is_file(), f"{url} is not in the built site"


# ------------------------------------------------------------------------
# Where the comparison page says Keras fails: two devices, two workers
# ------------------------------------------------------------------------

# What Keras itself does there is recorded, not required: when a Keras
# release fixes one of these issues, the tests warn that the comparison page
# needs updating instead of failing.


def _warn_if_keras_trains(outcome, issue):
    if outcome == "trained":
        warnings.warn(
            f"keras-team/keras issue {issue} looks fixed in Keras {keras.__version__}: "
            "update docs/comparison.rst, which says that Keras fails there.",
            stacklevel=2,
        )


@pytest.mark.slow
def test_keras_builtin_accumulation_under_mirrored_strategy():
    # tests/scripts/keras_builtin_mirrored.py: two replicas on logical CPUs.
    results = script_results(run_script_module("keras_builtin_mirrored", timeout=300))
    assert results["replicas"] == 2
    # This library, 4 micro-steps: one update, the weights of one device at the big batch.
    library = results["library"]
    assert library["outcome"] == "trained", library
    assert library["updates"] == 1
    assert_diff_below(library["diff"], FLOAT32_ATOL, library)
    # Keras's built-in: trains, or fails with keras-team/keras issue 20582's
    # error (a merge_call inside the update's conditional).
    builtin = results["builtin"]["outcome"]
    assert builtin == "trained" or (
        builtin.startswith("RuntimeError")
        and "`merge_call` called while defining a new graph" in builtin
    ), builtin
    _warn_if_keras_trains(builtin, 20582)


def _documented_multi_worker_error(outcome, builtin):
    """Whether ``outcome`` is keras-team/keras issue 20585's failure for this Keras."""
    if KERAS_VERSION >= (3, 5):
        # Keras reduces the first batch, a nested structure of per-replica
        # values, to build the model, which fails.
        return outcome.startswith("ValueError") and "PerReplica" in outcome
    if not builtin:  # No build from the first batch: the scalar logs fail.
        return "Invalid reduction dimension 0" in outcome
    # The built-in accumulation's merge_call inside its conditional.
    return "`merge_call` called while defining a new graph" in outcome


@pytest.mark.slow
def test_keras_fit_under_multi_worker_strategy():
    # tests/scripts/keras_fit_multi_worker.py: two workers on loopback.
    for _, stdout, _ in run_workers("keras_fit_multi_worker", timeout=300):
        results = script_results(stdout)
        assert results["replicas"] == 2
        # This library, 8 micro-steps of 8 samples, accum_steps=2: 2 updates,
        # the weights of one device at the batch 16.
        library = results["library"]
        assert library["outcome"] == "trained", library
        assert library["updates"] == 2
        assert_diff_below(library["diff"], FLOAT32_ATOL, library)
        # Plain Keras fit, and with its built-in accumulation: trains, or
        # fails with keras-team/keras issue 20585's error.
        for name in ("keras", "keras_builtin"):
            outcome = results[name]["outcome"]
            assert outcome == "trained" or _documented_multi_worker_error(
                outcome, builtin=name == "keras_builtin"
            ), (name, outcome)
            _warn_if_keras_trains(outcome, 20585)
