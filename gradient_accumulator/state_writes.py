"""Layer state written in a training call: once per update, as the big batch's one call writes it.

Some layers assign their own variables in every training call: Keras's
``SpectralNormalization`` runs a power iteration and assigns the normalised
kernel (and its vector ``u``) before using it. The big batch makes one call
per update; ``accum_steps`` micro-batches make ``accum_steps`` calls, and the
kernel would be normalised again at each one. Within
:meth:`StateWrites.once_per_update` (entered by the model wrapper around the
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

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    is_eager_tensor,
    is_variable,
    raw_value,
    seed_generator_states,
    sublayers,
)

_WRITES = ("assign", "assign_add", "assign_sub")
_lock = threading.Lock()
_installed = {}  # id(variable) -> [installations, the original methods]
_frames = threading.local()


def _skipped(value, *args, **kwargs):
    """A write not made (:meth:`StateWrites.replayed`): the value, as Keras's writes return it."""
    return value


def active_frame():
    """The rule in force for the writes of layer state (:meth:`StateWrites.once_per_update`).

    ``None`` outside it. A recomputation of the forward pass in the backward
    pass (:mod:`gradient_accumulator.remat`) runs it again with :func:`in_frame`.
    """
    stack = getattr(_frames, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def in_frame(frame):
    """Within, ``frame`` (:func:`active_frame`'s; ``None``: nothing) is the rule in force."""
    if frame is None:
        yield
        return
    owner = frame["owner"]
    stack = _frames.__dict__.setdefault("stack", [])
    with owner._patched(owner.variables, owner._write):
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()


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
        if current.ref() in seen or is_eager_tensor(current):
            continue  # a captured constant has no ancestors
        seen.add(current.ref())
        stack.extend(current.op.inputs)
        if current.op.type == "Placeholder":  # a capture: the enclosing graph's tensor
            captures = getattr(current.graph, "captures", ())
            stack.extend(external for external, internal in captures if internal is current)
    return False


def _layer_state(model):
    """Every variable of ``model``'s layers: its ``variables`` and those its layers hold untracked.

    A stateful RNN keeps its states in an attribute that Keras does not
    track (they are no model variables, and are still written in ``call``).
    """
    found = {id(v): v for v in model.variables}
    for layer in sublayers(model):
        for value in vars(layer).values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
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


class StateWrites:
    """The rule for one model's writes of its own state in a training call.

    Args:
        model: The ``GradientAccumulateModel``, built. Its variables are read
            here, once: the rule covers every variable of its layers but
            BatchNormalization statistics and seed generator states (none where
            each micro-step is its group: ``accum_steps=1`` without
            ``micro_batch_size="auto"``).
    """

    def __init__(self, model):
        self._model = model
        self.variables = []
        if model._accumulates():
            exempt = _exempt(model)
            self.variables = [v for v in _layer_state(model) if id(v) not in exempt]
        self._replayed = None  # every layer variable but seed states (see `replayed`)
        # Per variable id: whether its write depends on the micro-batch, as
        # the traced graph shows it (or, in eager mode, a symbolic trace).
        self._depends = {}
        self._sources = set()
        self._is_first = None
        self._recording = False

    @contextlib.contextmanager
    def once_per_update(self, inputs, is_first):
        """Within, the model's state is written as the big batch's one training call writes it.

        Enter around the forward pass of a micro-step, in replica context; the rule is the
        module docstring's.

        Args:
            inputs: The micro-batch's model inputs (a structure of tensors).
            is_first: Boolean (Python or scalar tensor), whether the
                micro-step starts its group.
        """
        if not self.variables:
            yield
            return
        if tf.executing_eagerly() and not self._depends:
            self._classify(inputs)
        with self._frame(inputs, is_first, recording=False):
            yield

    @contextlib.contextmanager
    def replayed(self):
        """Within, a training call writes none of the model's state but its seed generators'.

        For a forward pass that repeats one already made (:mod:`gradient_accumulator.coupled`),
        which made the writes (BatchNormalization's included): a layer that writes, then reads
        its variable, reads what the first wrote. The caller sets the seed generators' states,
        so that the repeat draws the first's random numbers.
        """
        if self._replayed is None:
            seeds = {id(v) for v in seed_generator_states(self._model)}
            self._replayed = [v for v in _layer_state(self._model) if id(v) not in seeds]
        with self._patched(self._replayed, lambda variable, name, original: _skipped):
            yield

    @contextlib.contextmanager
    def _patched(self, variables, make_write):
        # The variables' write methods replaced by `make_write(variable, name,
        # original)`'s, until the last user is gone (replicas trace in threads
        # of their own). Contexts of different rules are not nested.
        with _lock:
            for variable in variables:
                entry = _installed.get(id(variable))
                if entry is None:
                    originals = {name: getattr(variable, name) for name in _WRITES}
                    for name, original in originals.items():
                        setattr(variable, name, make_write(variable, name, original))
                    entry = _installed[id(variable)] = [0, originals]
                entry[0] += 1
        try:
            yield
        finally:
            with _lock:
                for variable in variables:
                    entry = _installed[id(variable)]
                    entry[0] -= 1
                    if entry[0] == 0:
                        for name in _WRITES:
                            delattr(variable, name)
                        del _installed[id(variable)]

    @contextlib.contextmanager
    def _frame(self, inputs, is_first, recording):
        # Replicas trace in threads of their own: each pushes its own frame.
        leaves = tf.nest.flatten(inputs, expand_composites=True)
        sources = {t.ref() for t in leaves if tf.is_tensor(t) and not is_eager_tensor(t)}
        frame = {"sources": sources, "is_first": is_first, "recording": recording, "owner": self}
        with in_frame(frame):
            yield

    def _write(self, variable, name, original):
        """``variable``'s write method ``name`` under the rule."""

        def write(value, *args, **kwargs):
            stack = getattr(_frames, "stack", None)
            if not stack:
                return original(value, *args, **kwargs)
            frame = stack[-1]
            if tf.is_tensor(value) and not is_eager_tensor(value):
                self._depends[id(variable)] = depends_on(value, frame["sources"])
            if self._depends.get(id(variable), False) and not frame["recording"]:
                self._refuse(variable)
            is_first = frame["is_first"]
            if frame["recording"] or is_first is True:
                return original(value, *args, **kwargs)
            if is_first is False:
                return value
            # Where not first, a write of what it holds: no conditional (a
            # variable of several replicas is written with a merge_call,
            # which a conditional in replica context cannot hold).
            value = ops.convert_to_tensor(value, variable.dtype)
            kept = raw_value(variable) if name == "assign" else ops.zeros_like(value)
            return original(ops.where(is_first, value, kept), *args, **kwargs)

        return write

    def _refuse(self, variable):
        model = self._model
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

    def _classify(self, inputs):
        """What each write depends on, from one symbolic trace of the training call (eager mode)."""

        def forward(x):
            with self._frame(x, False, recording=True):
                self._model(x, training=True)

        specs = tf.nest.map_structure(
            lambda t: tf.TensorSpec((None, *t.shape[1:]), t.dtype), inputs
        )
        tf.function(forward, autograph=False).get_concrete_function(specs)
        self._depends.setdefault(None, False)  # classified, even with no write seen
