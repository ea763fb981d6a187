"""Sphinx extension: show a Keras class's ``__init__`` signature in the API reference.

Keras's ``Layer`` and ``Model`` define ``__new__(cls, *args, **kwargs)``,
which autodoc prefers to ``__init__``, so every Keras subclass would be shown
as ``Class(*args, **kwargs)``. For those classes this puts the constructor's
own parameters back (type hints stay in the argument descriptions, as
``autodoc_typehints = "description"`` puts them for every other object).
"""

import inspect


def init_signature(cls):
    """``cls.__init__``'s signature without ``self`` and annotations, as text."""
    signature = inspect.signature(cls.__init__)
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in list(signature.parameters.values())[1:]
    ]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def _process_signature(app, what, name, obj, options, signature, return_annotation):
    if what != "class" or signature != "(*args, **kwargs)" or not inspect.isclass(obj):
        return None
    return init_signature(obj), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _process_signature)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
