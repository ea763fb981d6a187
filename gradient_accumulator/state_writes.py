"""Layer state written in a training call: once per update, as the big batch's one call writes it.

Some layers assign their own variables in every training call: Keras's
``SpectralNormalization`` runs a power iteration and assigns the normalised
kernel (and its vector ``u``) before using it. The big batch makes one call
per update; ``accum_steps`` micro-batches make ``accum_steps`` calls, and the
kernel would be normalised again at each one. Within
:func:`writes_once_per_update` (entered by the model wrapper around the
forward pass of a micro-step), every such write of the model's variables
follows one rule, decided by what the written value depends on:

- on the layer's state only (not on the micro-batch): the write happens at
  the group's first micro-step and is skipped at the others, which read the
  state it wrote, as every sample of the big batch does. Exact.
- on the micro-batch: no micro-step writes the big batch's value, so the
  write is refused with an error naming the variable (a stateful RNN's
  states, a custom layer's running statistics), except:

  - a ``BatchNormalization`` layer's statistics: Keras's own move once per
    micro-batch, with that micro-batch's statistics (documented);
    :class:`~gradient_accumulator.AccumBatchNormalization` moves them once
    per update with the group's;
  - random seed generators' states: each micro-batch draws its own numbers.

What a value depends on is read from the traced graph (its ancestors reach
the micro-batch's inputs or not); in eager mode from one symbolic trace of
the forward pass, made at the first eager micro-step.
"""

import contextlib
import threading
import weakref

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    is_variable,
    raw_value,
    seed_generator_states,
    sublayers,
)

_WRITES = ("assign", "assign_add", "assign_sub")
_lock = threading.Lock()
_installed = {}  # id(variable) -> [variable, installations, originals]
_frames = threading.local()
# Per model, per variable: whether its write depends on the micro-batch, as
# learnt from a symbolic trace (eager mode).
_dependence = weakref.WeakKeyDictionary()


class _Frame:
    """One micro-step's forward pass: its place, its inputs, and what was learnt of its writes."""

    def __init__(self, model, inputs, is_first, record=None):
        self.model = model
        self.sources = {t.ref() for t in _symbolic(inputs)}
        self.is_first = is_first
        self.record = record  # a dict to fill (a classification trace) or None


def _symbolic(structure):
    return [
        t
        for t in tf.nest.flatten(structure, expand_composites=True)
        if tf.is_tensor(t) and not isinstance(t, tf.__internal__.EagerTensor)
    ]


def _outer(tensor):
    """The tensor of the enclosing graph that ``tensor`` (a function's capture) stands for."""
    graph = tensor.graph
    for external, internal in getattr(graph, "captures", ()):
        if internal is tensor:
            return external
    return None


def depends_on(tensor, sources):
    """Whether the symbolic ``tensor`` is computed from any tensor of ``sources`` (refs).

    Walks its ancestors, out of nested function graphs through their
    captures (a write inside a ``tf.cond`` branch, say).
    """
    stack, seen = [tensor], set()
    while stack:
        current = stack.pop()
        if current.ref() in sources:
            return True
        if current.ref() in seen or isinstance(current, tf.__internal__.EagerTensor):
            continue  # a captured constant has no ancestors
        seen.add(current.ref())
        stack.extend(current.op.inputs)
        if current.op.type == "Placeholder":
            outer = _outer(current)
            if outer is not None:
                stack.append(outer)
    return False


def _state(model):
    """Every variable of ``model``'s layers: its ``variables`` and those its layers hold untracked.

    A stateful RNN keeps its states in an attribute that Keras does not
    track (they are no model variables, and are still written in ``call``).
    """
    found = {id(v): v for v in model.variables}
    for layer in sublayers(model):
        for value in vars(layer).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if is_variable(item):
                    found.setdefault(id(item), item)
    return list(found.values())


def _exempt(model):
    """The variables whose writes keep their own rule: BatchNormalization's, seed states."""
    exempt = {id(v) for v in seed_generator_states(model)}
    for layer in sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            exempt.update(id(v) for v in layer.weights)
    return exempt


def _refuse(model, variable):
    raise ValueError(
        f"A layer of model '{model.name}' writes its variable `{variable.path}` in every "
        "training call with a value computed from the micro-batch: each of the "
        f"`accum_steps={model.accum_steps}` micro-steps would write its own, and none is "
        "what the big batch's one call writes, so training would silently differ from "
        "the big batch. Train this model with `accum_steps=1`, or keep that state out "
        "of the training call (a BatchNormalization layer's statistics: "
        "`AccumBatchNormalization`). Received: a write of "
        f"`{variable.path}` that depends on the inputs."
    )


def _depends(frame, variable, value):
    """Whether this write's value depends on the micro-batch (``None``: unknown, eager)."""
    known = _dependence.setdefault(frame.model, {})
    tensor = value if tf.is_tensor(value) else None
    if tensor is not None and not isinstance(tensor, tf.__internal__.EagerTensor):
        known[id(variable)] = depends_on(tensor, frame.sources)
    elif tensor is None:
        known.setdefault(id(variable), False)  # a constant
    return known.get(id(variable))


def _patched(variable, name, original):
    def write(value, *args, **kwargs):
        stack = getattr(_frames, "stack", None)
        frame = stack[-1] if stack else None
        if frame is None or frame.model is None:
            return original(value, *args, **kwargs)
        depends = _depends(frame, variable, value)
        if frame.record is not None:
            frame.record[id(variable)] = depends
            return original(value, *args, **kwargs)
        if depends:
            _refuse(frame.model, variable)
        is_first = frame.is_first
        if isinstance(is_first, bool):
            return original(value, *args, **kwargs) if is_first else value
        # A write of the value it holds where not first: no conditional
        # (a variable of several replicas is written with a merge_call,
        # which a conditional in replica context cannot hold).
        value = ops.convert_to_tensor(value, variable.dtype)
        if name != "assign":
            value = ops.where(is_first, value, ops.zeros_like(value))
            return original(value, *args, **kwargs)
        return original(ops.where(is_first, value, raw_value(variable)), *args, **kwargs)

    return write


def _install(variables):
    with _lock:
        for variable in variables:
            entry = _installed.get(id(variable))
            if entry is None:
                originals = {name: getattr(variable, name) for name in _WRITES}
                for name, original in originals.items():
                    setattr(variable, name, _patched(variable, name, original))
                entry = _installed[id(variable)] = [variable, 0, originals]
            entry[1] += 1


def _uninstall(variables):
    with _lock:
        for variable in variables:
            entry = _installed[id(variable)]
            entry[1] -= 1
            if entry[1] == 0:
                for name in _WRITES:
                    delattr(variable, name)
                del _installed[id(variable)]


@contextlib.contextmanager
def _frame(frame, variables):
    _install(variables)
    stack = _frames.__dict__.setdefault("stack", [])
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        _uninstall(variables)


@contextlib.contextmanager
def writes_once_per_update(model, inputs, is_first):
    """Within, the model's variables are written as the big batch's one training call writes them.

    Enter around the forward pass of a micro-step, in replica context. A
    write whose value depends on the layer's state only is made where
    ``is_first`` and skipped elsewhere; one that depends on ``inputs`` (the
    micro-batch's) is refused, BatchNormalization statistics and seed
    generator states excepted (they write as they do without accumulation).
    Nothing changes with ``accum_steps=1``.

    Args:
        model: The ``GradientAccumulateModel``.
        inputs: The micro-batch's model inputs (a structure of tensors).
        is_first: Boolean (Python or scalar tensor), whether the micro-step
            starts its group.
    """
    if model.accum_steps == 1:
        yield
        return
    exempt = _exempt(model)
    variables = [v for v in _state(model) if id(v) not in exempt]
    if tf.executing_eagerly() and model not in _dependence:
        _classify_symbolically(model, inputs, variables)
    with _frame(_Frame(model, inputs, is_first), variables):
        yield


def _classify_symbolically(model, inputs, variables):
    """Records what each write depends on, from one symbolic trace of the training call."""
    record = {}

    def forward(x):
        with _frame(_Frame(model, x, False, record), variables):
            model(x, training=True)

    specs = tf.nest.map_structure(lambda t: tf.TensorSpec((None, *t.shape[1:]), t.dtype), inputs)
    tf.function(forward, autograph=False).get_concrete_function(specs)
    _dependence[model] = record
