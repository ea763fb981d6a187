"""Variable writes that a program lists instead of making them, to make after it.

An XLA program that runs out of memory frees the buffers of the variables it
writes while they are still in use: the process then crashes, or trains on
garbage. A program that may run out of memory must therefore write none
(``micro_batch_size="auto"`` under XLA,
:func:`gradient_accumulator.auto_micro_batch.xla_micro_step`). Inside
:func:`writes_returned`, the library's writes of its own TensorFlow variables
(the accumulator's sums, weights and counters, the group loss's sums, the
noise scale's) go through :func:`write`, which lists them; :func:`read` reads a
variable as the listed writes leave it; :func:`make_writes` makes them, after
the program. Keras's own variables are caught by a ``keras.StatelessScope``
there. Outside :func:`writes_returned`, :func:`write` writes at once.

Variables *carried* by :func:`writes_returned` (the sums, under XLA) are
values passed in and out of the program: :func:`read` starts from the value
passed in, and their writes are not listed; the caller reads their new
values with :func:`read` before the context ends, and writes them when it
chooses (once per group).
"""

import contextlib
import threading

import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import scatter_add_in_place

_deferred = threading.local()


@contextlib.contextmanager
def writes_returned(carried=()):
    """Within, the accumulator's writes of its own variables are listed, not made.

    Yields the list, ``(variable, kind, value)`` in the order written
    (``kind``: ``"assign"``, ``"add"``, or ``"scatter_add"`` with
    ``tf.IndexedSlices``); :func:`make_writes` makes them. For a program
    that must write no variable (a micro-step under XLA that may run out of
    memory: ``gradient_accumulator.auto_micro_batch``); the writes of Keras
    variables go to a ``keras.StatelessScope`` there.

    Args:
        carried: ``(variable, value)`` pairs: variables whose value is
            ``value`` within, and whose writes are not listed (see the module).
    """
    previous = getattr(_deferred, "writes", None), getattr(_deferred, "carried", None)
    _deferred.writes = []
    _deferred.carried = {id(variable): [value] for variable, value in carried}
    try:
        yield _deferred.writes
    finally:
        _deferred.writes, _deferred.carried = previous


def make_writes(writes):
    """Makes ``writes``, ``(variable, kind, value)`` as :func:`writes_returned` lists them.

    Returns the write operations.
    """
    made = []  # Keras 3.3.3's writes of its variables return None: not listed
    for variable, kind, value in writes:
        # Keras's variables (written by a Keras layer or metric) take no `read_value`.
        keyword = {"read_value": False} if isinstance(variable, tf.Variable) else {}
        if kind == "assign":
            made.append(variable.assign(value, **keyword))
        elif kind == "scatter_add":
            made.append(scatter_add_in_place(variable, value))
        else:
            made.append(variable.assign_add(value, **keyword))
    return [write for write in made if write is not None]


def write(variable, kind, value):
    """Writes ``value`` into ``variable`` (``kind``: :func:`writes_returned`), or lists it."""
    writes = getattr(_deferred, "writes", None)
    if writes is None:
        made = make_writes([(variable, kind, value)])
        return made[0] if made else None
    carried = _deferred.carried.get(id(variable))
    if carried is not None:
        carried[0] = _written(carried[0], kind, value)
    else:
        writes.append((variable, kind, value))
    return None


def _written(value, kind, written):
    """``value`` after a write of ``written`` (``kind``: :func:`writes_returned`)."""
    if kind == "assign":
        return written
    if kind == "add":
        return value + written
    indices = ops.expand_dims(written.indices, -1)
    return tf.tensor_scatter_nd_add(value, indices, written.values)


def read(variable):
    """``variable``'s value, with the writes :func:`writes_returned` listed for it made."""
    carried = (getattr(_deferred, "carried", None) or {}).get(id(variable))
    if carried is not None:
        return carried[0]
    value = variable.read_value()
    for written, kind, written_value in getattr(_deferred, "writes", None) or []:
        if written is variable:
            value = _written(value, kind, written_value)
    return value
