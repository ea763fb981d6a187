"""The package's size: lines per module and class, code and docstrings counted apart.

Prints, per module of ``gradient_accumulator/``, its lines, and of them the
lines of docstrings, of comments, blank lines and code (the rest); then the
classes of more than 300 lines; then the totals. A docstring is a string
statement first in a module, class or function body; a comment line holds
nothing but a comment.

Run: ``python -m tests.scripts.sizes`` (``--json``: one JSON object).
``tests/test_runner.py`` keeps the module and class bounds.
"""

import argparse
import ast
import io
import json
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "gradient_accumulator")


_KEYS = {"lines": "lines", "code": "code", "docs": "docstrings", "comments": "comments"}
_KEYS["blank"] = "blank"


def _docstring_lines(tree):
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _comment_lines(source):
    lines = set()
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code.update(range(token.start[0], token.end[0] + 1))
    return lines - code


def module_sizes(path):
    """``(figures, classes)`` of one module: its line counts, and its classes' lines."""
    with open(path) as handle:
        source = handle.read()
    tree = ast.parse(source)
    all_lines = source.splitlines()
    docstrings = _docstring_lines(tree)
    comments = _comment_lines(source) - docstrings
    blank = {i for i, line in enumerate(all_lines, 1) if not line.strip()} - docstrings
    total = len(all_lines)
    figures = {
        "lines": total,
        "docstrings": len(docstrings),
        "comments": len(comments),
        "blank": len(blank),
        "code": total - len(docstrings) - len(comments) - len(blank),
    }
    classes = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    return figures, classes


def measure():
    modules, classes = {}, {}
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.endswith(".py"):
            figures, found = module_sizes(os.path.join(PACKAGE_DIR, name))
            modules[name[:-3]] = figures
            classes.update({f"{name[:-3]}.{cls}": size for cls, size in found.items()})
    totals = {key: sum(m[key] for m in modules.values()) for key in next(iter(modules.values()))}
    return {"modules": modules, "classes": classes, "totals": totals}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    sizes = measure()
    if args.json:
        print(json.dumps(sizes))
        return 0
    columns = ("lines", "code", "docs", "comments", "blank")
    print(f"{'module':22s} " + " ".join(f"{c:>8s}" for c in columns))
    for name, m in sorted(sizes["modules"].items(), key=lambda item: -item[1]["lines"]):
        print(f"{name:22s} " + " ".join(f"{m[_KEYS[c]]:8d}" for c in columns))
    t = sizes["totals"]
    print(f"{'total':22s} " + " ".join(f"{t[_KEYS[c]]:8d}" for c in columns))
    print("\nclasses over 300 lines:")
    for name, size in sorted(sizes["classes"].items(), key=lambda item: -item[1]):
        if size > 300:
            print(f"  {name:50s} {size:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
