"""Sphinx extension: fail the build when a public name has no API entry.

The public surface is ``__all__`` of each module listed in the
``api_coverage_modules`` config value (dunder names such as ``__version__``
excluded) plus the dotted names in ``api_coverage_extra_names``. After all
documents are read (``env-check-consistency``, every builder), each of those
names must be a documented Python object (``autoclass``, ``autofunction``,
``py:class``...), under that dotted name or under another public path of the
same object (``package.name`` for ``package.module.name``); each one that is
not is reported as a warning, which ``sphinx-build -W`` turns into a failed
build.

It also resolves cross-references to a public object written with the path of
its defining module (``gradient_accumulator.layers.AccumBatchNormalization``,
as docstrings do) to the entry documented under the public path
(``gradient_accumulator.AccumBatchNormalization``).
"""

import importlib

from sphinx.util import logging
from sphinx.util.nodes import make_refnode

logger = logging.getLogger(__name__)


def public_names(modules, extra_names):
    """The dotted names that must be documented, in a stable order."""
    names = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            raise ValueError(f"`api_coverage_modules` lists {module_name!r}, which has no __all__.")
        names += [
            f"{module_name}.{name}"
            for name in exported
            if not (name.startswith("__") and name.endswith("__"))
        ]
    return names + [name for name in extra_names if name not in names]


def resolve(dotted):
    """The object a dotted name refers to (module attributes, at any depth)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def undocumented(expected, documented):
    """Names of ``expected`` documented neither by name nor as the same object."""
    documented = set(documented)
    missing = [name for name in expected if name not in documented]
    if not missing:
        return []
    documented_objects = [resolve(name) for name in documented]
    return [
        name
        for name in missing
        if not any(obj is not None and obj is resolve(name) for obj in documented_objects)
    ]


def _check(app, env):
    expected = public_names(app.config.api_coverage_modules, app.config.api_coverage_extra_names)
    missing = undocumented(expected, env.get_domain("py").objects)
    if missing:
        logger.warning(
            "public name(s) without an API reference entry: %s. Add an "
            "`autoclass`/`autofunction` for each to the API page.",
            ", ".join(missing),
            type="api_coverage",
        )


def _resolve_defining_module_path(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    objects = env.get_domain("py").objects
    for module_name in app.config.api_coverage_modules:
        prefix = module_name + "."
        if not target.startswith(prefix) or target in objects:
            continue
        public = prefix + target.rsplit(".", 1)[-1]
        entry = objects.get(public)
        if entry is not None and entry.objtype in ("class", "function", "exception", "data"):
            return make_refnode(
                app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, public
            )
    return None


def setup(app):
    app.add_config_value("api_coverage_modules", [], "env")
    app.add_config_value("api_coverage_extra_names", [], "env")
    app.connect("env-check-consistency", _check)
    app.connect("missing-reference", _resolve_defining_module_path)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
