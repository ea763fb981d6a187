"""Converting a model's BatchNormalization layers to AccumBatchNormalization and back."""

import inspect
import warnings

import keras
import numpy as np

from gradient_accumulator._compat import Functional, optimizer_chain, sublayers, written_class
from gradient_accumulator._v05 import check_position
from gradient_accumulator.layers import AccumBatchNormalization
from gradient_accumulator.model import GradientAccumulateModel
from gradient_accumulator.optimizer import GradientAccumulateOptimizer
from gradient_accumulator.validation import check_bool, check_layer_accum_steps

_BATCH_NORM = keras.layers.BatchNormalization


def _is_graph_model(layer):
    """True for models ``keras.models.clone_model`` can rebuild layer by layer."""
    return isinstance(layer, (Functional, keras.Sequential))


def _is_input_layer(layer):
    return isinstance(layer, keras.layers.InputLayer)


def _check_model(model, restore=False):
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a Keras Functional or Sequential model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if not _is_graph_model(model):
        instead = (
            "build the same class with `keras.layers.BatchNormalization` where it has "
            "`AccumBatchNormalization` and copy the weights (the first four of each such "
            "layer's `get_weights()`)"
            if restore
            else "create its normalization layers as `AccumBatchNormalization(accum_steps=...)` "
            "in its `__init__` (a drop-in subclass of `keras.layers.BatchNormalization`)"
        )
        raise ValueError(
            "`model` must be a Functional or Sequential model: a subclassed model's layers "
            "are connected only inside its `call()`, so they cannot be rewritten from the "
            f"outside. Instead, {instead}. Received: model={model.name!r} of type "
            f"{type(model).__name__}"
        )


def _check_wrapper_accum_steps(model, accum_steps):
    """Refuses layers whose ``accum_steps`` would differ from their wrapper's (as ``fit`` would)."""
    if not isinstance(model, GradientAccumulateModel) or accum_steps == "auto":
        return  # "auto" follows the model's groups
    expected = "'auto'" if model.micro_batch_size is not None else model.accum_steps
    if model.micro_batch_size is not None or model.accum_steps != accum_steps:
        raise ValueError(
            f"Model {model.name!r} is a GradientAccumulateModel with "
            f"`accum_steps={model.accum_steps}`, and the AccumBatchNormalization "
            "layers inside it must have the same value (or 'auto', and 'auto' with "
            "micro_batch_size='auto'), so that their moving statistics update with the "
            f"optimizer. Call `replace_batchnorm_layers(model, accum_steps={expected})`, "
            "or convert the unwrapped model and wrap it with the new value. "
            f"Received: accum_steps={accum_steps}"
        )


def _check_batchnorms_reachable(model, restore=False):
    """Refuses BatchNormalization layers (``restore``: AccumBatchNormalization) out of reach.

    Cloning rebuilds the layers of Functional and Sequential models one by one; any other
    layer (a custom layer, ``TimeDistributed``, a subclassed model) whole from its config.
    """
    kind = AccumBatchNormalization if restore else _BATCH_NORM
    hidden = {}
    stack = [model]
    while stack:
        for layer in stack.pop().layers:
            if _is_graph_model(layer):
                stack.append(layer)
            elif not isinstance(layer, _BATCH_NORM):
                inner = [sub.name for sub in sublayers(layer) if isinstance(sub, kind)]
                if inner:
                    hidden[f"{layer.name} ({type(layer).__name__})"] = inner
    if hidden:
        create = (
            "`keras.layers.BatchNormalization` in those layers' code for the plain Keras model "
            "(same weights: copy the first four of each layer's `get_weights()`)"
            if restore
            else "`AccumBatchNormalization(accum_steps=...)` in those layers' code (a drop-in "
            "subclass of `keras.layers.BatchNormalization`)"
        )
        raise ValueError(
            f"Some {kind.__name__} layers sit inside layers that are not Functional or "
            "Sequential models, where graph cloning cannot replace them. Create them as "
            f"{create}, or rebuild those parts as Functional models. Received: "
            f"model={model.name!r} with {kind.__name__} inside {hidden}"
        )


def _fresh_inputs(model):
    """New inputs for a Functional clone, each ``model``'s ``InputLayer`` rebuilt from its config.

    Keras's ``clone_model`` names new input layers after the input *tensors*
    (``keras_tensor_3``). ``None`` (Keras's own inputs) for Sequential models, whose clone
    keeps them, and for inputs that do not come from an ``InputLayer`` of ``model``.
    """
    if isinstance(model, keras.Sequential):
        return None
    input_layers = [layer for layer in model.layers if _is_input_layer(layer)]
    missing = []

    def fresh(tensor):
        for layer in input_layers:
            if layer.output is tensor:
                return keras.layers.InputLayer.from_config(layer.get_config()).output
        missing.append(tensor)
        return tensor

    inputs = keras.tree.map_structure(fresh, model.input)
    return None if missing else inputs


def _weights_to_copy(layer):
    """``layer.get_weights()``, an AccumBatchNormalization's without its accumulation state.

    Keras's four come first; the copy starts with an empty group.
    """
    weights = layer.get_weights()
    if isinstance(layer, AccumBatchNormalization):
        weights = weights[: len(weights) - len(layer.accumulation_variables)]
    return weights


class _Rewriter:
    """Clones a graph model, recording every (original, clone) pair of layers."""

    def __init__(self, accum_steps, synchronized, restore=False):
        self.accum_steps = accum_steps
        self.synchronized = synchronized
        # Restoring: AccumBatchNormalization back to Keras's layer (which
        # takes the arguments of its own config only); other layers cloned.
        self.restore = restore
        self.allowed = set(_BATCH_NORM().get_config())
        if not restore:
            own = inspect.signature(AccumBatchNormalization.__init__).parameters
            self.allowed |= set(own) - {"self", "kwargs"}
        # id(original) -> (original, clone); the original is kept so that its
        # id cannot be reused. Shared layers and nested models shared between
        # several places are cloned once, at any depth.
        self.pairs = {}
        self.replaced = []  # original BatchNormalization layers, in order
        self.already_accumulating = []  # (name, old accum_steps)
        self.unsynchronized = []  # names of layers that had synchronized=True
        self.dropped = {}  # name -> config keys AccumBatchNormalization lacks

    def clone(self, model):
        """Clones ``model`` with ``keras.models.clone_model``; nested graph models too."""
        return keras.models.clone_model(
            model, input_tensors=_fresh_inputs(model), clone_function=self._clone_layer
        )

    def _clone_layer(self, layer):
        if not isinstance(layer, keras.layers.Layer):
            # Keras 3.5 to 3.9 record mixed precision's input casts in the
            # graph as operations (`Cast`), stateless: they stay as they are.
            return layer
        key = id(layer)
        if key not in self.pairs:
            if self.restore and isinstance(layer, AccumBatchNormalization):
                clone = self._keras_batchnorm(layer)
            elif not self.restore and isinstance(layer, _BATCH_NORM):
                clone = self._accum_batchnorm(layer)
            elif _is_graph_model(layer):
                # Recursion by hand rather than `recursive=True`: the same
                # memo then covers every depth, so a layer shared between
                # a nested model and its parent stays shared.
                clone = self.clone(layer)
            else:
                clone = layer.__class__.from_config(layer.get_config())
            self.pairs[key] = (layer, clone)
        return self.pairs[key][1]

    def _accum_batchnorm(self, layer):
        config = layer.get_config()
        if isinstance(layer, AccumBatchNormalization):
            self.already_accumulating.append((layer.name, layer.accum_steps))
        if config.get("renorm") and self.accum_steps != 1:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} uses batch "
                "renormalization, which cannot be combined with "
                "`accum_steps > 1` (its per-call corrections cannot wait for "
                "the accumulated batch). Rebuild the model with "
                "`renorm=False` there, or use `accum_steps=1`. Received: "
                f"renorm=True, accum_steps={self.accum_steps}"
            )
        if config.get("synchronized") and not self.synchronized:
            self.unsynchronized.append(layer.name)
        extra = sorted(set(config) - self.allowed)
        if extra:
            self.dropped[layer.name] = extra
        config = {k: v for k, v in config.items() if k in self.allowed}
        config.update(accum_steps=self.accum_steps, synchronized=self.synchronized)
        self.replaced.append(layer)
        return AccumBatchNormalization.from_config(config)

    def _keras_batchnorm(self, layer):
        config = {k: v for k, v in layer.get_config().items() if k in self.allowed}
        self.replaced.append(layer)
        return _BATCH_NORM.from_config(config)

    def copy_state(self, model, new_model):
        """Copies ``trainable`` flags and weights from every original to its clone."""
        # Keras's clone keeps the `trainable` flag of plain layers (in their
        # config) and of Sequential models, not of Functional models nor of
        # what a layer builds inside itself, and setting the flag sets it on
        # every sublayer. So every layer gets its original's flag, parents
        # first (`_flatten_layers` lists a layer before its sublayers).
        clones = self._all_clones(model, new_model)
        for original in [model, *sublayers(model)]:
            clone = clones.get(id(original))
            if clone is not None:
                clone.trainable = original.trainable
        for original, clone in self.pairs.values():
            # A nested model's layers are pairs of their own.
            if not _is_graph_model(original) and original.weights:
                clone.set_weights(_weights_to_copy(original))

    def _all_clones(self, model, new_model):
        """id(original) -> clone, for every layer whose clone can be found.

        Beyond the cloned layers: input layers (made anew by the cloning),
        paired by name, and the sublayers a custom layer builds itself,
        paired in order when both lists hold the same types.
        """
        clones = {id(model): new_model}
        clones.update((key, clone) for key, (_, clone) in self.pairs.items())
        for original, clone in [(model, new_model), *self.pairs.values()]:
            if _is_graph_model(original):
                inputs = {
                    x.name: x for x in sublayers(clone, recursive=False) if _is_input_layer(x)
                }
                for layer in sublayers(original, recursive=False):
                    if _is_input_layer(layer) and layer.name in inputs:
                        clones[id(layer)] = inputs[layer.name]
            else:
                inner, new_inner = sublayers(original), sublayers(clone)
                if [type(x) for x in inner] == [type(x) for x in new_inner]:
                    clones.update(zip(map(id, inner), new_inner))
        return clones

    def warn(self, model, new_model):
        if written_class(model) not in (Functional, keras.Sequential, GradientAccumulateModel):
            if type(new_model) is type(model):
                rebuilt = (
                    f"as `{type(model).__name__}(inputs, outputs, name=...)`: "
                    "other arguments of its constructor take their defaults "
                    "and attributes set outside it are not copied"
                )
            else:
                rebuilt = (
                    f"as a plain `{type(new_model).__name__}`: its class, "
                    "constructor arguments and attributes are not kept"
                )
            warnings.warn(
                f"Model {model.name!r} is a {type(model).__name__}, which "
                f"`keras.models.clone_model` rebuilds {rebuilt}.",
                stacklevel=3,
            )
        if not self.replaced:
            warnings.warn(
                f"Model {model.name!r} has no BatchNormalization layer: "
                "`replace_batchnorm_layers` returns an equivalent copy with "
                "the same layers and weights.",
                stacklevel=3,
            )
        if self.already_accumulating:
            changes = sorted({steps for _, steps in self.already_accumulating})
            warnings.warn(
                f"{len(self.already_accumulating)} layer(s) of model "
                f"{model.name!r} already were AccumBatchNormalization "
                f"(accum_steps={changes}); their copies have "
                f"accum_steps={self.accum_steps} and an empty accumulation "
                f"state. Layers: {[name for name, _ in self.already_accumulating]}",
                stacklevel=3,
            )
        if self.unsynchronized:
            warnings.warn(
                f"BatchNormalization layer(s) {self.unsynchronized} of model "
                f"{model.name!r} had synchronized=True; their copies have "
                "synchronized=False, as requested. Pass `synchronized=True` "
                "to keep cross-replica statistics.",
                stacklevel=3,
            )
        if self.dropped:
            warnings.warn(
                "Subclasses of BatchNormalization were replaced by "
                "AccumBatchNormalization, which does not take these "
                f"arguments of theirs (dropped): {self.dropped}",
                stacklevel=3,
            )


def replace_batchnorm_layers(
    model: keras.Model,
    accum_steps: int | str,
    position: str = "replace",
    *,
    synchronized: bool = False,
) -> keras.Model:
    """Returns a copy of ``model`` whose BatchNormalization layers accumulate.

    Rebuilds ``model`` (``keras.models.clone_model``) with every
    ``keras.layers.BatchNormalization``, at any depth of nested Functional and
    Sequential models, replaced by an
    :class:`~gradient_accumulator.AccumBatchNormalization` of the same
    configuration and weights; every other layer is a fresh copy with the
    original's weights, in the original's graph (connections, shared layers,
    inputs, outputs, ``trainable`` flags). So inference outputs are equal,
    and the copy trains with
    :class:`~gradient_accumulator.GradientAccumulateModel` with its moving
    statistics those of the accumulated batch. With ``accum_steps > 1`` each
    new layer adds five non-trainable state variables, created empty.
    ``model`` is not modified; a ``GradientAccumulateModel`` comes back as
    one, and a compiled model compiled alike (with a fresh optimizer). What
    is kept, refused and warned about, case by case: :doc:`/guides/batchnorm`.

    Args:
        model: A Keras Functional or Sequential model (nested models
            included); subclassed models are refused.
        accum_steps: Integer >= 1, the new layers' ``accum_steps`` (a
            ``GradientAccumulateModel``'s own), or ``"auto"`` (the groups of
            the model they are in: for ``micro_batch_size="auto"``).
        position: String, only ``"replace"`` (the default).
        synchronized: Boolean (keyword only), the new layers'
            ``synchronized`` flag. Defaults to ``False``.

    Returns:
        A new, built ``keras.Model`` of the same kind and name.

    Raises:
        ValueError: If ``model`` is not a Functional or Sequential Keras
            model, if a BatchNormalization sits where cloning cannot reach it
            (inside a custom layer), if an argument is invalid, or if a layer
            uses ``renorm=True`` with ``accum_steps > 1``.

    Example:

    >>> import keras
    >>> from gradient_accumulator import GradientAccumulateModel
    >>> from gradient_accumulator.layers import AccumBatchNormalization
    >>> from gradient_accumulator.utils import replace_batchnorm_layers
    >>> model = keras.applications.MobileNetV2(
    ...     input_shape=(32, 32, 3), weights=None, classes=10)
    >>> new = replace_batchnorm_layers(model, accum_steps=4)
    >>> sum(isinstance(layer, AccumBatchNormalization) for layer in new.layers)
    52
    >>> len(new.weights) - len(model.weights)  # 5 state variables per layer
    260
    >>> wrapped = GradientAccumulateModel(
    ...     accum_steps=4, inputs=new.input, outputs=new.output)
    >>> wrapped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")

    ``wrapped.fit(x, y, batch_size=2)`` then updates the weights and the 52
    layers' moving statistics once every 4 micro-batches, with the statistics
    of the 8 samples of the group.
    """
    _check_model(model)
    accum_steps = check_layer_accum_steps(accum_steps)
    check_position(position)
    synchronized = check_bool("synchronized", synchronized)
    _check_wrapper_accum_steps(model, accum_steps)
    _check_batchnorms_reachable(model)

    rewriter = _Rewriter(accum_steps, synchronized)
    new_model = rewriter.clone(_plain_view(model))
    accumulating = isinstance(model, GradientAccumulateModel)
    if accumulating:  # wrapped again, with the wrapper's own arguments
        new_model = GradientAccumulateModel(
            inputs=new_model.input,
            outputs=new_model.output,
            name=model.name,
            **model.wrapper_config(),
        )
    rewriter.copy_state(model, new_model)
    if accumulating and model.compiled:
        # After the `trainable` flags: compiling sizes the gradient sums.
        new_model.compile_from_config(model.get_compile_config())
    rewriter.warn(model, new_model)
    return new_model


def _plain_view(model):
    """``model``; a ``GradientAccumulateModel`` as a plain functional model of the same layers.

    Keras's clone would rebuild the wrapper as ``GradientAccumulateModel(inputs, outputs,
    name=...)``, every wrapper argument at its default.
    """
    if not isinstance(model, GradientAccumulateModel):
        return model
    return keras.Model(inputs=model.input, outputs=model.output, name=model.name)


def _pending_group(model):
    """What of a group in progress ``model`` holds, as words; empty if nothing."""
    pending = []
    accumulator = getattr(model, "_accumulator", None)
    steps = 0 if accumulator is None else int(accumulator.micro_step.numpy())
    if steps:
        pending.append(f"the gradients of {steps} micro-step(s)")
    layers = [
        layer.name
        for layer in sublayers(model)
        if isinstance(layer, AccumBatchNormalization)
        and getattr(layer, "pending_count", None) is not None
        and np.any(layer.pending_count.numpy() > 0)
    ]
    if layers:
        shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
        pending.append(
            f"pending statistics in {len(layers)} AccumBatchNormalization layer(s) ({shown})"
        )
    return " and ".join(pending)


def _accumulating_optimizer(model):
    """The ``GradientAccumulateOptimizer`` in ``model.optimizer``'s chain, or ``None``."""
    chain = optimizer_chain(getattr(model, "optimizer", None))
    return next((o for o in chain if isinstance(o, GradientAccumulateOptimizer)), None)


def _plain_compile_config(model):
    """``model``'s compile configuration, a ``GradientAccumulateOptimizer`` unwrapped.

    Compiling with it under a ``mixed_float16`` policy wraps the inner
    optimizer in Keras's ``LossScaleOptimizer`` again.
    """
    config = model.get_compile_config()
    wrapper = _accumulating_optimizer(model)
    if wrapper is not None:
        config = dict(config, optimizer=keras.optimizers.serialize(wrapper.inner_optimizer))
    return config


def restore_batchnorm_layers(model: keras.Model) -> keras.Model:
    """Returns a copy of ``model`` that needs no ``gradient_accumulator``: plain Keras.

    The reverse of :func:`replace_batchnorm_layers`, for handing a trained
    model over: every ``AccumBatchNormalization`` (inside nested Functional
    and Sequential models too) becomes ``keras.layers.BatchNormalization``
    with the same configuration (``accum_steps`` dropped), weights and moving
    statistics; a ``GradientAccumulateModel`` becomes a plain
    ``keras.Model`` of the same layers (the wrapper dropped); every other
    layer is cloned with its weights and ``trainable`` flag. In inference
    the copy computes what ``model`` computes, and its ``.keras`` file and
    ``model.export()`` load where this package is not installed.

    A compiled ``model`` comes back compiled with the same configuration
    (fresh optimizer state), a ``GradientAccumulateOptimizer`` replaced by
    the optimizer it wraps. What a group in progress holds (gradient sums,
    statistics not yet in the moving statistics) is not carried over: call
    ``model.apply_accumulated_gradients()`` first to keep it (a warning says
    so). ``model`` itself is not modified.

    Args:
        model: A Keras Functional or Sequential model, or a
            ``GradientAccumulateModel`` (nested models included).
            Subclassed models are refused.

    Returns:
        A new, built ``keras.Model`` (``keras.Sequential`` for a Sequential
        model) with the same name, layers, weights and outputs, and no layer
        of this package.

    Raises:
        ValueError: If ``model`` is not a Keras model, is a subclassed model,
            or holds an ``AccumBatchNormalization`` inside a layer that is not
            a Functional or Sequential model (where cloning cannot reach it).

    Warns:
        UserWarning: When ``model`` has no layer, model class or optimizer of
            this package (the copy is then an equivalent copy),
            and when a group is in progress (what it holds is dropped).

    Example:

    >>> import keras
    >>> from gradient_accumulator import replace_batchnorm_layers, restore_batchnorm_layers
    >>> model = keras.applications.MobileNetV2(
    ...     input_shape=(32, 32, 3), weights=None, classes=10)
    >>> converted = replace_batchnorm_layers(model, accum_steps=4)
    >>> plain = restore_batchnorm_layers(converted)
    >>> sorted({type(layer).__name__ for layer in plain.layers if "bn" in layer.name.lower()})
    ['BatchNormalization']
    >>> len(plain.weights) == len(model.weights)
    True
    """
    _check_model(model, restore=True)
    _check_batchnorms_reachable(model, restore=True)
    pending = _pending_group(model)
    rewriter = _Rewriter(accum_steps=1, synchronized=False, restore=True)
    new_model = rewriter.clone(_plain_view(model))
    accumulating = isinstance(model, GradientAccumulateModel)
    rewriter.copy_state(model, new_model)
    if model.compiled:
        new_model.compile_from_config(_plain_compile_config(model))
    if not (rewriter.replaced or accumulating or _accumulating_optimizer(model)):
        warnings.warn(
            f"Model {model.name!r} has no AccumBatchNormalization layer, is not a "
            "GradientAccumulateModel and has no GradientAccumulateOptimizer: "
            "`restore_batchnorm_layers` returns an equivalent copy with the same "
            "layers and weights.",
            stacklevel=2,
        )
    if pending:
        warnings.warn(
            f"Model {model.name!r} has an accumulation group in progress: {pending}, "
            "not in its weights, are not carried over to the plain Keras copy. Call "
            "`model.apply_accumulated_gradients()` before this to apply them.",
            stacklevel=2,
        )
    return new_model
