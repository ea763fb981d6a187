"""The argument checks every public entry point shares (gradient_accumulator/validation.py)."""

import ast

import pytest

from gradient_accumulator import validation
from tests.helpers import ROOT


def test_validation_imports_nothing_from_the_package():
    # Every module may use it; it uses none of them (no import cycle).
    tree = ast.parse((ROOT / "gradient_accumulator" / "validation.py").read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name and name.startswith("gradient_accumulator")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"accum_step": 4},
            r"`Owner` does not take an argument `accum_step`\. Did you mean "
            r"`accum_steps`\? Its arguments are: accum_steps, name\. Received: accum_step=4$",
        ),
        (
            {"zzz": None},
            r"does not take an argument `zzz`\. Its arguments are: .*Received: zzz=None$",
        ),
        ({"old": 1}, r"`Owner` does not take `old`: use `new` instead\. Received: old=1$"),
    ],
    ids=["typo", "unrelated", "removed"],
)
def test_unknown_keyword_arguments_name_the_closest_or_the_replacement(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validation.check_keyword_arguments(
            "Owner", kwargs, {"accum_steps", "name"}, {"old": "use `new` instead."}
        )


def test_accepted_keyword_arguments_pass():
    validation.check_keyword_arguments("Owner", {"name": "x"}, {"name"})


@pytest.mark.parametrize("value", [1.5, -0.1, "0.5", True, None, float("nan")])
def test_unit_interval_refuses_what_is_not_a_float_in_0_1(value):
    with pytest.raises(
        ValueError, match=rf"`momentum` must be a float in \[0, 1\]\. Received: momentum={value!r}"
    ):
        validation.check_unit_interval("momentum", value)


@pytest.mark.parametrize("value", [0, 0.0, 1, 0.99])
def test_unit_interval_accepts_floats_in_0_1(value):
    assert validation.check_unit_interval("momentum", value) == float(value)
