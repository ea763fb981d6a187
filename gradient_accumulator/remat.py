"""Rematerialisation (gradient checkpointing) that works on TensorFlow, and exactly.

Keras 3.9 and later mark what to recompute in the backward pass with
``keras.RematScope`` (around a model's construction) or ``keras.remat``. On
TensorFlow its backend does it with ``tf.recompute_grad``, which fails in a
compiled ``fit`` as soon as a layer is called with a keyword (``training``,
``mask``: Dense, BatchNormalization, Dropout, every model; Keras issue
21207), and where it runs, recomputes a stateful layer wrongly: Dropout draws
a new mask, BatchNormalization moves its statistics a second time.

:func:`recompute` does it instead:

- the call's tensors are the inputs of a ``tf.custom_gradient``, its other
  arguments (``training=True``, ``mask=None``) are kept aside;
- the layer's variables (weights, statistics, random seed states) are read
  once before the call and are inputs too: the forward pass and the
  recomputation run the layer in a ``keras.StatelessScope`` that maps them
  to those values, so the recomputation draws the same masks and reads the
  same statistics; what the forward pass writes is assigned once after it,
  what the recomputation writes is dropped; a written weight reads back as
  a leaf, as TensorFlow differentiates a read after a write
  (SpectralNormalization);
- losses the call adds (``add_loss``) are outputs, added to the layer once;
- the recomputation runs in the forward call's Keras context (``training``
  for sublayers called without it, mixed precision's autocast);
- its inputs get a zero computed from the output's gradient, so it cannot
  run before the backward pass reaches it and cannot be merged with the
  forward pass (Grappler and XLA would otherwise do so: no memory saved).

:func:`install` makes it Keras's TensorFlow backend remat; importing
``gradient_accumulator`` calls it, so a model built under
``keras.RematScope`` (a ``GradientAccumulateModel`` or not, in ``fit``,
``evaluate``, ``predict`` or a custom loop) recomputes its activations, and
``keras.remat(f)`` works, once the package is imported. ``keras.remat``
binds the backend's remat when it is called: where it was called before the
import, :func:`remat` is the same with :func:`recompute`.
"""

import functools

import keras
import tensorflow as tf

from gradient_accumulator._compat import (
    LeafWritesScope,
    call_context,
    call_context_of,
    install_backend_remat,
    loss_owners,
    no_autocast,
)
from gradient_accumulator.state_writes import active_frame, in_frame


def install():
    """Makes :func:`recompute` Keras's TensorFlow remat (importing the package does)."""
    install_backend_remat(recompute)


def remat(f):
    """``keras.remat(f)`` that works on TensorFlow, exactly (:func:`recompute`).

    ``f``: a layer or a function of tensors (a layer's sub-computation); its
    activations are recomputed in the backward pass.
    """
    return recompute(f)


def _owner(f):
    """The layer whose variables ``f`` uses: ``f`` itself, or a bound method's layer."""
    owner = f if isinstance(f, keras.layers.Layer) else getattr(f, "__self__", None)
    return owner if isinstance(owner, keras.layers.Layer) else None


def _is_float(value):
    return value is not None and value.dtype.is_floating


def _after(grads):
    """A float32 zero that cannot be computed before ``grads``, nor folded into a constant."""
    for grad in grads:
        if _is_float(grad):
            first = tf.cast(tf.reduce_max(tf.reshape(grad, [-1])[:1]), "float32")
            return tf.where(tf.math.is_nan(first), first, tf.zeros_like(first))
    return None


# TensorFlow's random operations that keep their own state (not Keras's, which
# draw from seed states the layer owns): a recomputation would draw anew.
_STATEFUL_RANDOM = {
    "RandomUniform",
    "RandomUniformInt",
    "RandomStandardNormal",
    "TruncatedNormal",
    "Multinomial",
    "RandomGamma",
    "RandomPoisson",
    "RandomPoissonV2",
    "RandomShuffle",
    "StatefulUniform",
    "StatefulUniformInt",
    "StatefulUniformFullInt",
    "StatefulStandardNormalV2",
    "StatefulTruncatedNormal",
    "RngSkip",
    "RngReadAndSkip",
}


def _refuse_inexact(f, layer, foreign, operations):
    """Refuses a call that its recomputation could not repeat: see the error."""
    random = sorted({op.type for op in operations if op.type in _STATEFUL_RANDOM})
    if not foreign and not random:
        return
    name = layer.name if layer is not None else getattr(f, "__name__", repr(f))
    received = [f"writes of {[v.path for v in foreign]}"] if foreign else []
    received += [f"TensorFlow random operations {random}"] if random else []
    raise ValueError(
        f"Layer '{name}' is rematerialised (keras.RematScope, keras.remat or "
        "gradient_accumulator.remat), but its call uses state it does not own: random "
        "numbers drawn from TensorFlow's own generators or from Keras's global one "
        "(keras.random with seed=None), or another layer's variables written. Its "
        "recomputation in the backward pass would not repeat them, and the gradient would "
        "silently not be the call's. Draw random numbers from a "
        "keras.random.SeedGenerator the layer owns (seed=self.seed_generator), or build "
        f"the layer outside the RematScope. Received: {'; '.join(received)}"
    )


def recompute(f):
    """``f`` (a layer's call, a layer, a function), its activations recomputed in the backward pass.

    See the module for how; the result equals ``f``'s and so do the
    gradients, within float32 rounding (bit for bit in graph mode for most
    models; under XLA the recomputation is compiled apart).
    """
    layer = _owner(f)

    @functools.wraps(f)
    def rematerialised(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        slots = [i for i, value in enumerate(flat) if tf.is_tensor(value)]
        # Each variable once, in order.
        state = list({id(v): v for v in (layer.variables if layer is not None else [])}.values())
        trainable = {id(v) for v in layer.trainable_variables} if layer is not None else set()
        with no_autocast():  # the state in its own dtype, as it is kept
            values = [tf.convert_to_tensor(variable.value) for variable in state]
        context = call_context()
        frame = active_frame()
        count = len(slots)
        forward = {}

        def run(tensors, state_values):
            filled = list(flat)
            for slot, tensor in zip(slots, tensors):
                filled[slot] = tensor
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), filled)
            mapping = list(zip(state, state_values))
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            ops_before = len(graph.get_operations()) if graph is not None else 0
            with LeafWritesScope(mapping, trainable) as scope:
                start = [scope.get_current_value(variable) for variable in state]
                outputs = f(*call_args, **call_kwargs)
            drawn = graph.get_operations()[ops_before:] if graph is not None else []
            _refuse_inexact(f, layer, scope.foreign, drawn)
            written = [
                (variable, scope.get_current_value(variable))
                for variable, before in zip(state, start)
                if scope.get_current_value(variable) is not before
            ]
            return outputs, written, list(scope.losses)

        @tf.custom_gradient
        def checkpointed(*inputs):
            tensors = [tf.stop_gradient(t) for t in inputs[:count]]
            state_values = [tf.stop_gradient(t) for t in inputs[count:]]
            outputs, written, losses = run(tensors, state_values)
            flat_outputs = tf.nest.flatten(outputs)
            out_slots = [i for i, value in enumerate(flat_outputs) if tf.is_tensor(value)]
            forward.update(
                outputs=outputs,
                flat=flat_outputs,
                slots=out_slots,
                written=written,
                owners=loss_owners(layer, losses),
            )

            def grad(*output_grads, variables=None):
                gate = _after(output_grads)
                tensors = list(inputs[:count])
                state_values = list(inputs[count:])
                if gate is not None:
                    tensors = [t + tf.cast(gate, t.dtype) if _is_float(t) else t for t in tensors]
                    if not any(_is_float(t) for t in tensors):
                        state_values = [
                            v + tf.cast(gate, v.dtype) if id(variable) in trainable else v
                            for v, variable in zip(state_values, state)
                        ]
                sources = [t for t in tensors if _is_float(t)]
                weights = [
                    v for v, variable in zip(state_values, state) if id(variable) in trainable
                ]
                captured = list(variables or [])
                with tf.GradientTape() as tape, call_context_of(context), in_frame(frame):
                    tape.watch(sources + weights)
                    for variable in captured:
                        tape.watch(variable)
                    again, _, again_losses = run(tensors, state_values)
                again_flat = tf.nest.flatten(again)
                targets = [again_flat[i] for i in out_slots] + again_losses
                pairs = [
                    (target, tf.zeros_like(target) if g is None else g)
                    for target, g in zip(targets, output_grads)
                    if _is_float(target)
                ]
                grads = tape.gradient(
                    [target for target, _ in pairs],
                    sources + weights + captured,
                    output_gradients=[g for _, g in pairs],
                )
                source_grads = iter(grads[: len(sources)])
                weight_grads = iter(grads[len(sources) : len(sources) + len(weights)])
                input_grads = [next(source_grads) if _is_float(t) else None for t in tensors]
                input_grads += [
                    next(weight_grads) if id(variable) in trainable else None for variable in state
                ]
                if variables:
                    return input_grads, list(grads[len(sources) + len(weights) :])
                return input_grads

            return [flat_outputs[i] for i in out_slots] + losses, grad

        results = checkpointed(*[flat[i] for i in slots], *values)
        if not isinstance(results, (list, tuple)):
            results = [results]
        out_slots = forward["slots"]
        flat_outputs = list(forward["flat"])
        for slot, tensor in zip(out_slots, results[: len(out_slots)]):
            flat_outputs[slot] = tensor
        # The forward pass's writes, from its own tensors (not the custom
        # gradient's outputs): once, as without rematerialisation.
        for variable, value in forward["written"]:
            variable.assign(value)
        for loss, owner in zip(results[len(out_slots) :], forward["owners"]):
            owner.add_loss(loss)
        return tf.nest.pack_sequence_as(forward["outputs"], flat_outputs)

    return rematerialised
