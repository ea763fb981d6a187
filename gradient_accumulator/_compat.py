"""Every Keras and TensorFlow internal the library touches, and what differs between versions.

The rest of the package uses public Keras 3 and TensorFlow API only; where no
public route exists, it goes through a function of this module, which names
the private attribute and says why. ``tests/test_compat.py`` checks each, so
CI, not a user, finds the Keras release that changes one.
"""

import contextlib
import inspect
import threading

import keras
import tensorflow as tf

# What `keras.Model(inputs, outputs)` makes and `clone_model` decides on, with no exported
# name: it tells graph models from subclassed ones.
from keras.src.models.functional import Functional  # noqa: E402, F401  # isort: skip

# Keras's saving gives a model's attribute holding one of these an entry of its own in `.keras`
# and `.weights.h5` files; no public base class does so without being a layer, metric or
# optimizer (which the model would track). The model wrapper keeps its accumulation state there.
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402, F401  # isort: skip

# Keras's TensorFlow optimizer sums gradients across replicas in this method,
# after clipping, inside `apply`; there is no public switch to turn it off
# (see `distribute.gradients_already_reduced`, which replaces it per instance).
OPTIMIZER_ALL_REDUCE_METHOD = "_all_reduce_sum_gradients"

# Private hooks of `keras.Model` that `GradientAccumulateModel` overrides: the
# Keras version that introduced each (before it, Keras never calls it and the
# override is inert) and the parameters the override relies on.
OVERRIDDEN_MODEL_HOOKS = {"_maybe_symbolic_build": ((3, 5), ("iterator", "data_batch"))}


def sublayers(layer, recursive=True):
    """The layers inside ``layer`` (not itself): Keras's own walk, ``_flatten_layers``.

    It sees nested models and the layers a custom layer holds as attributes;
    ``layer.layers`` lists only a model's direct, graph-connected layers.
    """
    return list(layer._flatten_layers(include_self=False, recursive=recursive))


def optimizer_chain(optimizer):
    """``optimizer`` and every optimizer it wraps (``inner_optimizer``), outermost first.

    Keras has no function that walks ``LossScaleOptimizer`` (or our wrapper) chains.
    """
    chain = []
    while optimizer is not None and not any(optimizer is seen for seen in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def seed_generator_states(layer):
    """The state variables of the random seed generators of ``layer`` and its sublayers.

    Keras tracks a layer's ``SeedGenerator`` objects (Dropout's, the noise
    and random layers') in ``_seed_generators``; no public list holds them.
    """
    states = []
    for each in [layer, *sublayers(layer)]:
        states += [generator.state for generator in getattr(each, "_seed_generators", [])]
    return states


def is_variable(value):
    """Whether ``value`` is a Keras variable (``keras.src.backend.Variable``).

    ``keras.Variable`` is not their class before Keras 3.4 (an export class of its own).
    """
    from keras.src.backend import Variable

    return isinstance(value, Variable)


def raw_value(variable):
    """``variable``'s stored value (``_value``), in its own dtype.

    Inside a layer's ``call`` under a mixed precision policy, ``variable.value`` is autocast.
    """
    return tf.convert_to_tensor(variable._value)


def tf_variable(variable):
    """The TensorFlow variable of a Keras variable (``variable`` itself if it is one).

    Keras's TensorFlow variable class holds it as ``_value``; reading or
    assigning it bypasses the autocast and the Keras wrapper (``.value`` is
    the autocast read before Keras 3.10).
    """
    return getattr(variable, "_value", variable) if is_variable(variable) else variable


_reductions = threading.local()


def _recording_reduce_weighted_values(original):
    def reduce_weighted_values(values, sample_weight=None, mask=None, *args, **kwargs):
        loss = original(values, sample_weight, mask, *args, **kwargs)
        records = getattr(_reductions, "records", None)
        if records is not None:
            reduction = kwargs.get("reduction", args[0] if args else "sum_over_batch_size")
            records.append((values, sample_weight, mask, reduction, loss))
        return loss

    reduce_weighted_values.recorded = original
    return reduce_weighted_values


@contextlib.contextmanager
def recorded_loss_reductions():
    """Records every loss reduction a Keras ``Loss`` makes inside (this thread only).

    Yields a list that receives ``(values, sample_weight, mask, reduction, loss)`` per
    ``Loss.__call__``, which hands them to its module's private ``reduce_weighted_values``
    and exposes none (:mod:`gradient_accumulator.weighting` reads the normaliser from
    them). That function is wrapped once, on first use; it records only in this context.
    """
    from keras.src.losses import loss as loss_module

    if not hasattr(loss_module.reduce_weighted_values, "recorded"):
        loss_module.reduce_weighted_values = _recording_reduce_weighted_values(
            loss_module.reduce_weighted_values
        )
    previous = getattr(_reductions, "records", None)
    _reductions.records = records = []
    try:
        yield records
    finally:
        _reductions.records = previous


def _calling_self(matches, depth):
    """The ``self`` of the nearest of ``depth`` frames above the caller's that ``matches``.

    ``matches(frame, self_of_frame)`` decides; ``None`` if no frame does.
    """
    frame = inspect.currentframe().f_back
    try:
        for _ in range(depth):
            frame = frame.f_back
            if frame is None:
                return None
            caller = frame.f_locals.get("self")
            if matches(frame, caller):
                return caller
        return None
    finally:
        del frame


def loss_scale_optimizer_building(optimizer):
    """The ``LossScaleOptimizer`` whose ``build`` is building ``optimizer`` now, or ``None``.

    Nothing tells an optimizer that one wraps it (Keras >= 3.10 only clears its
    ``loss_scale_factor``), but ``LossScaleOptimizer.build`` calls
    ``self.inner_optimizer.build(var_list)``: the calling frames hold it.
    """
    return _calling_self(
        lambda frame, caller: (
            isinstance(caller, keras.optimizers.LossScaleOptimizer)
            and caller.inner_optimizer is optimizer
        ),
        depth=8,
    )


def loss_scale_optimizer_applying(outer):
    """Whether ``outer`` (a ``LossScaleOptimizer``) is inside its own ``apply`` now.

    Its first ``apply`` builds it (and the optimizer it wraps), then unscales: the
    calling frames tell.
    """
    found = _calling_self(
        lambda frame, caller: frame.f_code.co_name == "apply" and caller is outer, depth=16
    )
    return found is not None


def stand_in_for_loss_scale_optimizer(outer, scale_loss, apply, inner_optimizer):
    """Hands ``outer``'s loss scaling to a wrapper it wraps; returns the update's scaler.

    Under ``mixed_float16``, ``compile`` wraps the optimizer in a ``LossScaleOptimizer``
    whose ``scale_loss`` and ``apply`` ``fit`` calls: no public route lets the optimizer
    inside weight the loss or see the gradients before they are unscaled and checked. So
    instance attributes of ``outer`` (built) shadow those two methods with the given
    callables (``scale_loss(loss)``, ``apply(grads, trainable_variables=None)``), and the
    returned ``LossScaleOptimizer`` of ``inner_optimizer`` keeps its scale and counter in
    ``outer``'s ``dynamic_scale`` and ``step_counter``, which users, callbacks and saving read.
    """
    vars(outer)["scale_loss"] = scale_loss
    vars(outer)["apply"] = apply
    scaler = keras.optimizers.LossScaleOptimizer(
        inner_optimizer,
        initial_scale=outer.initial_scale,
        dynamic_growth_steps=outer.dynamic_growth_steps,
        name=f"{outer.name}_of_{inner_optimizer.name}",
    )
    # `build` would make variables of its own; it makes nothing else that
    # `apply` reads when the trainable variables are passed.
    scaler.step_counter = outer.step_counter
    scaler.dynamic_scale = outer.dynamic_scale
    scaler.built = True
    return scaler


def keras_apply_mask(sample_weight, mask, dtype, reduction):
    """Keras's merge of a mask into sample weights (``losses.loss.apply_mask``), to the bit.

    With ``squeeze_or_expand_to_same_rank``, what ``reduce_weighted_values`` does first.
    """
    from keras.src.losses import loss as loss_module

    return loss_module.apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)


def keras_squeeze_or_expand_to_same_rank(x1, x2):
    """Keras's rank alignment of losses and their weights (``losses.loss``)."""
    from keras.src.losses import loss as loss_module

    return loss_module.squeeze_or_expand_to_same_rank(x1, x2)


def loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` that ``fit`` reports (``_loss_tracker``).

    A train step of one's own must update it, as Keras's does through this private attribute.
    """
    return model._loss_tracker


def output_loss_trackers(model):
    """The ``Mean`` metrics behind each output's logged loss (``<name>_loss``), or ``[]``.

    Keras >= 3.9 (about) keeps them in its private ``CompileLoss``, in the order of its
    flat losses, once built; older Keras logs none.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None or not getattr(compile_loss, "built", False):
        return []
    metrics = getattr(compile_loss, "metrics", None)
    return list(metrics) if isinstance(metrics, (list, tuple)) else []


def creation_strategy(model):
    """The ``tf.distribute`` strategy ``model`` was created under, or ``None``.

    ``model.distribute_strategy`` falls back to the current strategy; only
    ``_distribute_strategy`` tells a model made outside the scope.
    """
    return model._distribute_strategy


def is_eager_tensor(value):
    """Whether ``value`` is an eager tensor (a constant captured by a traced function).

    ``tf.is_tensor`` is true of symbolic ones too; the class's only name is
    ``tf.__internal__.EagerTensor``.
    """
    return isinstance(value, tf.__internal__.EagerTensor)


def functional_init_arguments(args, kwargs):
    """Whether a model's constructor arguments build a functional model (inputs and outputs).

    The private test of ``Model.__init__`` (``keras.src.models.model``).
    """
    from keras.src.models.model import functional_init_arguments as keras_test

    return keras_test(args, kwargs)


_FORM_ATTRIBUTE = "_keras_functional_form"
_WRITTEN_CLASSES = {}  # functional form -> the class it is made of


def functional_form(cls):
    """``cls`` with Keras's ``Functional`` among its bases: the class of its functional instances.

    ``Model.__init__`` assigns ``Functional`` into the ``__bases__`` of a subclass built
    from inputs and outputs and of its ancestors (``inject_functional_model_class``), after
    which a subclass written the subclassing way fails to construct (``Functional.__init__()
    missing ... 'inputs' and 'outputs'``). Functional instances are made of this class
    instead (one per ``cls``, with its name, module and registered name), leaving the
    ancestors alone. Pickle finds it as ``cls._keras_functional_form``.
    """
    if _FORM_ATTRIBUTE not in vars(cls):
        qualname = f"{cls.__qualname__}.{_FORM_ATTRIBUTE}"
        namespace = {"__module__": cls.__module__, "__qualname__": qualname, "__doc__": cls.__doc__}
        form = type(cls.__name__, (cls, Functional), namespace)
        setattr(cls, _FORM_ATTRIBUTE, form)
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package=package, name=name)(form)
        _WRITTEN_CLASSES[form] = cls
    return vars(cls)[_FORM_ATTRIBUTE]


def written_class(model):
    """The class ``model`` was made from: its class, or the class of its functional form."""
    return _WRITTEN_CLASSES.get(type(model), type(model))


def functional_from_config(cls, config, custom_objects=None):
    """Keras's rebuilding of a functional model from its config (Keras < 3.7 only)."""
    from keras.src.models.functional import functional_from_config as rebuild

    return rebuild(cls, config, custom_objects=custom_objects)


def optimizer_variables_in_build_order(optimizer):
    """The trainable variables ``optimizer`` was built with (``_trainable_variables``)."""
    return optimizer._trainable_variables


def optimizer_variable_index(optimizer, variable):
    """The position of ``variable`` among them (``_get_variable_index``)."""
    return optimizer._get_variable_index(variable)


def check_optimizer_knows(optimizer, variables):
    """Keras's own error for variables the optimizer was not built with."""
    optimizer._check_variables_are_known(variables)


def optimizer_own_variables(optimizer):
    """The base class's bookkeeping variables of ``optimizer`` (``_variables``)."""
    return optimizer._variables


def set_optimizer_own_iterations(optimizer, value):
    """Stores the base class's own ``iterations`` counter (``_iterations``)."""
    optimizer._iterations = value


def strategy_supports_no_merge_call():
    """Whether the current strategy allows collectives in a replica-context conditional.

    Keras's ``LossScaleOptimizer`` makes this test, exposed only under ``tf.__internal__``.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def in_xla_compilation():
    """Whether the function being traced is XLA-compiled (``jit_compile``, or inside one).

    TensorFlow's own ops test it with ``control_flow_util``, which it does not export.
    """
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def in_multi_worker_mode(strategy):
    """Whether ``strategy`` spans several workers (``extended._in_multi_worker_mode``)."""
    return strategy.extended._in_multi_worker_mode()


def batchnorm_takes(argument):
    """Whether the installed ``keras.layers.BatchNormalization`` takes ``argument``.

    ``renorm``, ``renorm_clipping`` and ``renorm_momentum`` arrived in Keras 3.14.
    """
    return argument in inspect.signature(keras.layers.BatchNormalization.__init__).parameters


def compute_training_loss(model, x, y, y_pred, sample_weight):
    """``model.compute_loss(...)`` in training mode, divided by the replicas in sync.

    Keras 3.4 added ``compute_loss``'s ``training`` argument; it is passed only where
    ``compute_loss`` (Keras's or an override) takes it, as Keras's train step does. For
    the division see :func:`replicas_dividing_the_training_loss`.
    """
    kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = True
    return model.compute_loss(**kwargs) / replicas_dividing_the_training_loss()


def per_replica(values):
    """A ``tf.distribute`` per-replica value of ``values`` (one tensor per local replica).

    ``strategy.run`` hands each replica its entry; TensorFlow exports no constructor for it.
    """
    from tensorflow.python.distribute.values import PerReplica

    return PerReplica(tuple(values))


def reduce_replica_logs(logs, strategy):
    """The logs of ``strategy.run`` of a train step, reduced as Keras's own train function does.

    With the TensorFlow trainer's private ``reduce_per_replica`` (``reduction="auto"``).
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    return reduce_per_replica(logs, strategy, reduction="auto")


def keras_version():
    """The installed Keras version as ``(major, minor)``."""
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def builds_before_first_trace():
    """Whether Keras builds a model's metrics and optimizer from a batch before tracing.

    Keras 3.5 added ``Model._maybe_symbolic_build`` for it (the model
    wrapper overrides it, see ``OVERRIDDEN_MODEL_HOOKS``); before, the
    compiled metrics are built inside the first traced step.
    """
    return keras_version() >= (3, 5)


def functional_from_config_keeps_arguments():
    """Whether Keras's functional ``from_config`` passes a subclass its other arguments.

    Keras < 3.7 rebuilds a functional model from its graph alone and drops
    the constructor's other arguments (see :func:`functional_from_config`).
    """
    return keras_version() >= (3, 7)


def replicas_dividing_the_training_loss():
    """What :func:`compute_training_loss` divides the loss by: the replicas in sync, or 1.

    Keras 3.8 made the loss the replica's share of the global loss (the replicas'
    gradients are summed); before, it is the replica's own mean, divided here.
    """
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return float(replicas) if keras_version() < (3, 8) and replicas > 1 else 1.0


def build_compiled_metrics_outside_trace(model, y, y_pred):
    """Builds the compiled metrics (``_compile_metrics``) of Keras < 3.5 outside the traced step.

    Built in the first traced step, their variables put the step inside TensorFlow's
    lazy-initialization conditional, where the update's ``merge_call`` fails under
    tf.distribute. Does nothing on later versions.
    """
    compiled_metrics = getattr(model, "_compile_metrics", None)
    if builds_before_first_trace() or compiled_metrics is None or compiled_metrics.built:
        return
    with tf.init_scope():
        compiled_metrics.build(y, y_pred)


def first_batch(iterator):
    """The first batch of a Keras epoch iterator (its private stepping; 3.5 to newest).

    Keras 3.5 and 3.6 step through an epoch only with ``enumerate_epoch()``;
    from 3.11 its tuples hold a step range before the batches.
    """
    for *_, batches in iterator.enumerate_epoch():
        return next(iter(batches))
    return None


def batchnorm_reduction_axes(layer):
    """The axes a built Keras ``BatchNormalization`` reduces over (its ``_reduction_axes``)."""
    return layer._reduction_axes


def scatter_add_in_place(variable, slices):
    """Adds ``slices`` (``tf.IndexedSlices``) into ``variable``, in place; duplicates summed.

    ``variable.scatter_add`` refuses replica-local (``ON_READ``) variables under a
    strategy; in replica context ``variable.handle`` is the replica's own copy.
    """
    return tf.raw_ops.ResourceScatterAdd(
        resource=variable.handle,
        indices=slices.indices,
        updates=tf.cast(slices.values, variable.dtype),
    )


def stateless_scope_writes(scope):
    """The writes a ``keras.StatelessScope`` caught: ``{id(variable): value}``, in order.

    ``state_mapping`` is the scope's undocumented dict (its public
    ``get_current_value`` needs the variable, and the variables written are
    what the caller wants to find).
    """
    return scope.state_mapping


def replace_optimizer_all_reduce(optimizer, replacement):
    """Makes ``optimizer``'s own all-reduce of gradients ``replacement`` (``None``: Keras's again).

    An instance attribute shadows :data:`OPTIMIZER_ALL_REDUCE_METHOD`.
    """
    if replacement is None:
        vars(optimizer).pop(OPTIMIZER_ALL_REDUCE_METHOD, None)
    else:
        vars(optimizer)[OPTIMIZER_ALL_REDUCE_METHOD] = replacement


@contextlib.contextmanager
def custom_gradients_dropped():
    """Drops the custom gradients that TensorFlow registers inside the block, on leaving it.

    A traced ``tf.custom_gradient`` stays in the global registry (``ops._gradient_registry``,
    no public API removes it) with every variable its graph reads
    (tensorflow/tensorflow#97697, #80895): a model trained with ``fit`` (Keras's all-reduce
    uses one) stays in memory after it is deleted. Only around functions not called after.
    """
    from tensorflow.python.framework import ops as tf_ops

    registry = tf_ops._gradient_registry._registry
    before = set(registry)
    try:
        yield
    finally:
        for name in set(registry) - before:
            if name.startswith("CustomGradient-"):
                del registry[name]


# Keras's TensorFlow backend: `keras.RematScope` and `keras.remat` call this module's
# `remat(f)` (looked up when a layer made in the scope is called, or when
# `keras.remat` is); on TensorFlow it is `tf.recompute_grad`.
def _backend_core():
    from keras.src.backend.tensorflow import core

    return core


def keras_rematerialises():
    """Whether this Keras has ``keras.RematScope`` and ``keras.remat`` (Keras >= 3.9)."""
    return hasattr(keras, "RematScope") and hasattr(_backend_core(), "remat")


def install_backend_remat(remat):
    """Makes ``remat(f)`` Keras's TensorFlow backend remat, for the process.

    Keras has no public hook: its ``RematScope`` and ``keras.remat`` call
    ``keras.src.backend.tensorflow.core.remat`` (when a marked layer is
    called, when ``keras.remat`` is). Importing the package replaces it
    (:mod:`gradient_accumulator.remat`). Nothing where this Keras has no
    rematerialisation (Keras < 3.9).
    """
    if keras_rematerialises():
        _backend_core().remat = remat


@contextlib.contextmanager
def backend_remat(remat):
    """Within, Keras's TensorFlow backend remat is ``remat(f)`` (tests: Keras's own again)."""
    core = _backend_core()
    previous = core.remat
    core.remat = remat
    try:
        yield
    finally:
        core.remat = previous


# Keras's dynamic context of a layer call, which a recomputation in the backward
# pass (run outside it) must see again: the call context carries `training` to
# sublayers called without it; the autocast scope casts variables under mixed precision.
_CALL_CONTEXT = ("current_call_ctx", "autocast_scope")


def call_context():
    """Keras's context of the current layer call (its private ``global_state``)."""
    from keras.src.backend.common import global_state

    return {name: global_state.get_global_attribute(name) for name in _CALL_CONTEXT}


@contextlib.contextmanager
def call_context_of(context):
    """Within, Keras's layer-call context is ``context`` (:func:`call_context`)."""
    from keras.src.backend.common import global_state

    before = call_context()
    for name, value in context.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            global_state.set_global_attribute(name, value)


def no_autocast():
    """A scope in which Keras variables read in their own dtype (no mixed-precision cast)."""
    from keras.src.backend.common.variables import AutocastScope

    return AutocastScope(None)


class LeafWritesScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` in which a written trainable variable reads back as a leaf.

    TensorFlow differentiates a read that follows ``kernel.assign(new)`` as a
    read of the variable: no gradient through how ``new`` was computed
    (SpectralNormalization relies on it). A plain scope would return ``new``
    itself; here its value is ``new`` and its gradient goes to the value the
    variable was mapped to. Overrides the scope's ``add_update``, which Keras
    calls for every write inside it (not public API).
    """

    def __init__(self, state_mapping, trainable):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self._leaves = {
            id(variable): self.get_current_value(variable)
            for variable, _ in state_mapping
            if id(variable) in trainable
        }
        self._mapped = {id(variable) for variable, _ in state_mapping}
        self.foreign = []  # variables written that the mapping does not hold

    def add_update(self, update):
        variable, value = update
        if id(variable) not in self._mapped:
            self._mapped.add(id(variable))
            self.foreign.append(variable)
        leaf = self._leaves.get(id(variable))
        if leaf is not None:
            value = tf.stop_gradient(value) + (leaf - tf.stop_gradient(leaf))
        super().add_update((variable, value))


def loss_owners(layer, losses):
    """For each of ``losses`` added in a stateless scope, the layer (``layer`` or in it) that did.

    Keras records the losses a layer adds in a ``keras.StatelessScope`` by
    their ``id`` in the layer's private ``_loss_ids``; a loss collected by the
    scope must be added again to the same layer to count in ``model.losses``
    (a Functional model refuses ``add_loss``). ``None`` where none did.
    """
    candidates = [layer, *sublayers(layer)] if layer is not None else []
    return [
        next((c for c in candidates if id(loss) in getattr(c, "_loss_ids", ())), None)
        for loss in losses
    ]
