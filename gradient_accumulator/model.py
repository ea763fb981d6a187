"""The model wrapper: `fit(batch_size=b)` with k-step accumulation equals `fit(batch_size=k*b)`."""

import functools
import inspect

import keras
import tensorflow as tf

from gradient_accumulator._compat import (
    Functional,
    builds_before_first_trace,
    creation_strategy,
    first_batch,
    functional_form,
    functional_from_config,
    functional_from_config_keeps_arguments,
    functional_init_arguments,
    optimizer_chain,
    output_loss_trackers,
)
from gradient_accumulator._v05 import REMOVED_MODEL_ARGUMENTS
from gradient_accumulator.agc import agc_transform
from gradient_accumulator.batchnorm_averaging import AverageBatchNormStatistics
from gradient_accumulator.coupled import (
    CoupledGroup,
    check_coupled_loss,
    couples_groups,
    warn_if_loss_couples_samples,
)
from gradient_accumulator.distribute import is_multi_worker
from gradient_accumulator.engine import GradientAccumulator, StateEntry, load_state, save_state
from gradient_accumulator.group_loss import GroupLoss
from gradient_accumulator.runner import GroupRunner
from gradient_accumulator.state_writes import StateWrites
from gradient_accumulator.steps import ModelSteps, update_step_scope
from gradient_accumulator.validation import (
    check_accum_steps,
    check_agc_arguments,
    check_auto_micro_batch,
    check_bool,
    check_jit_compile,
    check_keyword_arguments,
    check_micro_batch_size,
    check_noise_scale_arguments,
    check_optimizer_does_not_accumulate,
    check_statistics_layers,
    check_strategy,
    check_train_step_not_overridden,
)
from gradient_accumulator.weighting import ClassPlan, discover_classes, may_add_losses

# The wrapper's own constructor arguments, in signature order: the one list
# that `get_config`, `wrapper_config` and `replace_batchnorm_layers` read.
_WRAPPER_ARGUMENTS = (
    "accum_steps",
    "micro_batch_size",
    "use_agc",
    "clip_factor",
    "eps",
    "reduce_every_micro_step",
    "average_batchnorm_statistics",
    "coupled_loss",
    "gradient_norm",
    "noise_scale",
    "noise_scale_smoothing",
    "noise_scale_micro_batches",
    "noise_scale_every",
)

# What `keras.Model` takes besides them: a functional model's `inputs`,
# `outputs`, `name`, `trainable`, and the keyword arguments of every Keras
# layer (a subclassed model passes those to `keras.layers.Layer`). Keras's
# functional constructor drops any other keyword without a word.
_KERAS_ARGUMENTS = {"inputs", "outputs", "name", "trainable"} | {
    name
    for name, parameter in inspect.signature(keras.layers.Layer.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
}


def _spec(value):
    """``tf.TensorSpec`` of a batch's tensor (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, tf.TensorSpec):
        return value
    return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))


def _fit_batch_spec(arguments):
    """The spec ``(x, y, sample_weight)`` of a batch of ``fit``'s data, if it is knowable.

    From arrays (and dicts or lists of them) and from a ``tf.data.Dataset``;
    ``None`` for generators and ``keras.utils.PyDataset``.
    """
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        element = x.element_spec
        return element if isinstance(element, tuple) else (element,)

    def array_spec(value):
        if value is None:
            return None
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError
        dtype = tf.as_dtype(value.dtype)
        if dtype == tf.float64:
            dtype = tf.float32
        return tf.TensorSpec((None, *value.shape[1:]), dtype)

    try:
        specs = [keras.tree.map_structure(array_spec, arguments.get(name)) for name in ("x", "y")]
    except TypeError:
        return None
    if arguments.get("sample_weight") is not None or arguments.get("class_weight") is not None:
        specs.append(tf.TensorSpec((None,), tf.float32))
    return tuple(specs)


def _first_replica(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` accumulates gradients over micro-batches.

    Each micro-step adds one micro-batch's gradient to float32 sums; every
    ``accum_steps``-th hands the group's mean to the compiled optimizer and
    empties the sums. With micro-batch gradients ``g_i`` of a loss that Keras
    divides by ``N_i`` (its samples, its valid tokens under a mask, or its
    sample weights' sum), the update uses the gradient of the concatenated
    group's loss::

        g = sum_i(N_i * g_i) / sum_i(N_i)

    (``sum_i(g_i)`` for a summed loss; ``max_i(g_i)`` for float8 scales and
    amax histories). So ``fit(x, y, batch_size=b)`` trains like plain Keras
    ``fit(x, y, batch_size=accum_steps * b)`` on the same data order, for any
    optimizer, whose ``iterations`` count updates. An epoch's leftover
    micro-batches form a shorter last group, weighted by their samples as
    Keras's shorter last batch; groups never span epochs. ``fit`` runs one
    compiled call per group where the epoch's length is known (batch
    callbacks then run once per update); ``train_on_batch`` is one
    micro-step. Losses with different normalisers (a masked per-token output
    beside a per-sequence one) are summed and divided per normaliser class.
    Not identical to the big batch: batch-dependent forward passes
    (``BatchNormalization``; see ``AccumBatchNormalization``), losses whose
    normaliser the wrapper cannot see (:ref:`which-losses-are-exact`), and float
    rounding.

    State: the sums are not model weights (``get_weights()`` is the
    unwrapped model's) but are saved by ``save_weights``, ``.keras`` files,
    ``BackupAndRestore`` and ``tf.train.Checkpoint``, in an entry of their
    own written only while a group is pending, so a run resumed inside a
    group ends where an uninterrupted one does.

    Args:
        accum_steps: Integer >= 1, micro-batches per optimizer update; ``1``
            is plain Keras training.
        micro_batch_size: ``None``, or ``"auto"``: ``fit``'s batch is then the
            update's batch (``batch_size``, or the dataset's batch), which
            ``fit`` cuts into the largest micro-batches that fit, found at
            the first batch and lowered to the next smaller divisor of the
            batch whenever a group runs out of memory (that group run again
            from its start); ``accum_steps`` stays ``1``
            (:ref:`auto-micro-batch`). ``None`` (the default): ``fit``'s
            batch is the micro-batch, ``accum_steps`` of them per update.
        use_agc: Boolean, clip the mean gradient adaptively at each update
            (:func:`~gradient_accumulator.adaptive_clip_gradients`), before
            the optimizer. Defaults to ``False``.
        clip_factor: Float > 0, AGC's largest ratio of gradient norm to
            weight norm; only with ``use_agc=True``. Defaults to ``0.01``.
        eps: Float > 0, AGC's floor on weight norms; only with
            ``use_agc=True``. Defaults to ``1e-3``.
        reduce_every_micro_step: Boolean, under a strategy all-reduce every
            micro-step's gradients instead of the sums once per update (same
            result, ``accum_steps`` times the communication). Defaults to
            ``False``.
        average_batchnorm_statistics: Boolean, under several replicas make
            the replicas' copies of Keras BatchNormalization statistics equal
            before validation, at epoch ends and at the end of training
            (:class:`~gradient_accumulator.AverageBatchNormStatistics`).
            Defaults to ``True``.
        coupled_loss: ``None``, or ``"replica"``/``"global"`` for a loss
            that compares the samples of a batch with each other (a
            contrastive loss with in-batch negatives): ``fit`` then computes
            the loss, and the metrics, on each group's whole batch at once,
            in two forward passes per micro-batch
            (:doc:`/guides/contrastive`). ``None`` (the default): each
            sample's loss depends on its own outputs only, and each
            micro-batch's loss is computed on its own.
        gradient_norm: Boolean, log ``gradient_norm`` with each update: the
            global L2 norm of the group's mean gradient, unscaled, before
            any clipping or AGC (the norm ``global_clipnorm`` compares), the
            big batch's gradient norm. The epoch's value in ``History`` is
            its last update's. Costs one squared-norm reduction per update.
            Defaults to ``False``.
        noise_scale: Boolean, log the gradient noise scale with each update
            (``noise_scale``, and this update's estimates
            ``noise_scale_trace`` of ``tr(Sigma)`` and ``noise_scale_signal``
            of ``|G|^2``): McCandlish et al.'s ``B_simple``, the batch
            beyond which a bigger batch buys little, from each micro-batch's
            gradient and its group's (:mod:`gradient_accumulator.noise_scale`).
            Needs two micro-batches or more per update (``accum_steps >= 2``
            or several replicas), a loss of one normaliser, no regularizer.
            Defaults to ``False``.
        noise_scale_smoothing: Float in [0, 1), the weight the moving
            averages of the two estimates keep at each measured update
            (see ``noise_scale_every``). Defaults to ``0.95``.
        noise_scale_micro_batches: ``"all"`` or ``"last"``: which of a
            group's micro-batches the noise scale measures the gradient of.
            ``"all"`` costs one squared-norm reduction per micro-step;
            ``"last"`` one per update (the group's last micro-batch: a
            sample of one, unbiased, so noisier estimates), for whom the
            reduction is a large part of a micro-step (a small model under
            XLA on a CPU; see the guide's figures). Defaults to ``"all"``.
        noise_scale_every: Integer >= 1: the noise scale measures one update
            in that many (updates ``0, m, 2m, ...`` of the accumulator's
            count; the others leave the moving averages and logged figures
            as they are, and, in ``fit`` on data of known length, run no
            reduction and no conditional). Where one reduction per update
            is still too much; the estimates' standard error grows by about
            its square root. Defaults to ``1``.
        **kwargs: Passed to ``keras.Model``, usually ``inputs=`` and
            ``outputs=``.

    Example:

    >>> import keras
    >>> from gradient_accumulator import GradientAccumulateModel
    >>> inputs = keras.Input((4,))
    >>> outputs = keras.layers.Dense(1)(inputs)
    >>> model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=outputs)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> model.accum_steps
    4
    """

    def __new__(cls, *args, **kwargs):
        # Built from inputs and outputs: an instance of the class's functional
        # form (before Keras's `Layer.__new__` binds its methods), so that
        # Keras does not turn this class, and every subclass of it written the
        # subclassing way, into a functional one.
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = functional_form(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        accum_steps: int = 1,
        micro_batch_size: str | None = None,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        reduce_every_micro_step: bool = False,
        average_batchnorm_statistics: bool = True,
        coupled_loss: str | None = None,
        gradient_norm: bool = False,
        noise_scale: bool = False,
        noise_scale_smoothing: float = 0.95,
        noise_scale_micro_batches: str = "all",
        noise_scale_every: int = 1,
        **kwargs,
    ):
        check_keyword_arguments(
            "GradientAccumulateModel",
            {k: v for k, v in kwargs.items() if k not in _KERAS_ARGUMENTS},
            set(_WRAPPER_ARGUMENTS) | _KERAS_ARGUMENTS,
            REMOVED_MODEL_ARGUMENTS,
        )
        self.accum_steps = check_accum_steps(accum_steps)
        self.micro_batch_size = check_micro_batch_size(micro_batch_size, self.accum_steps)
        self.reduce_every_micro_step = check_bool(
            "reduce_every_micro_step", reduce_every_micro_step
        )
        self.average_batchnorm_statistics = check_bool(
            "average_batchnorm_statistics", average_batchnorm_statistics
        )
        self.use_agc, self.clip_factor, self.eps = check_agc_arguments(use_agc, clip_factor, eps)
        self.coupled_loss = check_coupled_loss(coupled_loss)
        self.gradient_norm = check_bool("gradient_norm", gradient_norm)
        self.noise_scale = check_bool("noise_scale", noise_scale)
        noise_arguments = (noise_scale_smoothing, noise_scale_micro_batches, noise_scale_every)
        self.noise_scale_smoothing, self.noise_scale_micro_batches, self.noise_scale_every = (
            check_noise_scale_arguments(self.noise_scale, *noise_arguments, self.coupled_loss)
        )
        super().__init__(*args, **kwargs)
        self._accumulator = None
        self._group_loss = None
        self._steps = ModelSteps(self)
        self._coupled_group = CoupledGroup(self, self._steps)
        self._runner = GroupRunner(self, self._steps, self._coupled_group)
        # The accumulation state's entry in weights files, apart from the
        # model's own variables, so that the plain model of the same graph
        # loads the file (and a file without it loads here).
        self._accumulation_state = StateEntry(
            self._save_accumulation_state, self._load_accumulation_state
        )
        if self.built:
            # A functional model is built here: refuse a mismatch now, not at `fit`.
            check_statistics_layers(self, self._steps.statistics_layers())
            self._ensure_accumulator()

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        check_strategy(self, creation_strategy(self))
        super().compile(optimizer, *args, **kwargs)
        check_optimizer_does_not_accumulate(
            optimizer_chain(self.optimizer), self.accum_steps, "GradientAccumulateModel"
        )
        replicas = self.distribute_strategy.num_replicas_in_sync
        if self.noise_scale and not self._accumulates() and replicas == 1:
            raise ValueError(
                f"Model '{self.name}' has `noise_scale=True` and one micro-batch per update "
                "on one replica: the noise scale compares a micro-batch's gradient with a "
                "bigger batch's, and there is none. Use accum_steps >= 2 (or several "
                "replicas). Received: accum_steps=1"
            )
        if self.built:
            self._ensure_accumulator()
        # The losses may have changed: find their classes again at the next fit.
        self._classes_discovered = False
        self._coupling_checked = False

    @classmethod
    def from_config(cls, config, custom_objects=None):
        functional = all(k in config for k in ("name", "layers", "input_layers", "output_layers"))
        if (
            functional_from_config_keeps_arguments()
            or not functional
            or cls.__init__ is not GradientAccumulateModel.__init__
        ):
            return super().from_config(config, custom_objects=custom_objects)
        # Keras < 3.7 rebuilds a functional model from its graph alone and
        # drops the constructor's other arguments (`accum_steps`, ...); its
        # own (private) rebuilding function is given them bound to the class.
        config = dict(config)
        arguments = {name: config.pop(name) for name in _WRAPPER_ARGUMENTS if name in config}
        return functional_from_config(
            functools.partial(cls, **arguments), config, custom_objects=custom_objects
        )

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden; this
        # override only adds validation, so compile as Keras would.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def train_step(self, data):
        """One micro-step; the group's end if its counters say it ends the group."""
        _, logs = self._steps.micro_step(data)
        return logs

    def group_step(self, batches):
        """A whole accumulation group: one micro-step per batch, then the update.

        Each micro-step's place is known when traced: the ``len(batches) - 1``
        first only add to the sums, the last one also updates (no conditional
        around the update; its one conditional skips dividing the sums where
        the divisor is exactly 1, outside XLA). Each reads its batch once the
        previous one has added its gradients, so that one batch's activations
        are alive at a time. Call it in replica context, as Keras calls
        ``train_step``, at the start of a group (no micro-step pending).

        Args:
            batches: Sequence of ``accum_steps`` batches (or fewer: a shorter
                group), each as ``train_step`` takes it.

        Returns:
            The logs of the last micro-step (the metrics over every
            micro-step seen since they were reset).
        """
        if self.micro_batch_size is not None:
            raise ValueError(
                f"`group_step` runs one micro-step per batch given, and model '{self.name}' "
                "chooses its micro-batches itself: train it with `fit` or `train_on_batch` "
                "(one batch, one update). Received: "
                f"micro_batch_size={self.micro_batch_size!r}"
            )
        if couples_groups(self):
            raise ValueError(
                f"`group_step` runs one micro-step per batch, and model '{self.name}' has "
                f"`coupled_loss={self.coupled_loss!r}`, whose loss is computed on the "
                "group's outputs at once: train it with `fit`. Received: "
                f"coupled_loss={self.coupled_loss!r}"
            )
        return self._runner.group_of_batches(batches)

    def fit(self, *args, **kwargs):
        bound = inspect.signature(super().fit).bind(*args, **kwargs)
        if not builds_before_first_trace() and self._needs_check("_classes_discovered"):
            # Keras < 3.5 has no build hook with a batch before the first
            # trace (`_maybe_symbolic_build`): the batch's spec comes from
            # fit's own arguments (arrays or a tf.data.Dataset).
            spec = _fit_batch_spec(bound.arguments)
            if spec is not None:
                self._discover_normaliser_classes(spec)
        callbacks = bound.arguments.get("callbacks")
        boundary = self._runner.begin_fit()
        # First, so that callbacks that save see the averaged statistics.
        first = []
        if self.average_batchnorm_statistics and self.distribute_strategy.num_replicas_in_sync > 1:
            first.append(AverageBatchNormStatistics())
            first[0].set_model(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks[:0] = first
            callbacks.append(boundary)
        else:
            bound.arguments["callbacks"] = [*first, *(callbacks or []), boundary]
        try:
            return super().fit(*bound.args, **bound.kwargs)
        finally:
            self._runner.end_fit()

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # A private hook of keras.Model (see _compat.OVERRIDDEN_MODEL_HOOKS).
        # Keras 3 builds metrics and the optimizer from the first batch, which
        # it merges across replicas with `strategy.reduce` over the whole
        # nested batch; MultiWorkerMirroredStrategy cannot reduce a nested
        # structure, so plain Keras `fit` fails under it (keras-team/keras
        # issue 20585). One replica's shard has the shapes the build needs.
        strategy = creation_strategy(self)
        if iterator is not None and strategy is not None:
            batch = first_batch(iterator)
            if batch is not None:
                data_batch = keras.tree.map_structure(
                    functools.partial(_first_replica, strategy), batch
                )
            iterator = None
        needs_batch = any(map(self._needs_check, ("_classes_discovered", "_coupling_checked")))
        if iterator is not None and data_batch is None and needs_batch:
            # No strategy: Keras builds in the first trace; the class
            # discovery and the coupling check need a batch now (fit resets
            # the iterator after).
            data_batch = first_batch(iterator)
            iterator = None
        result = super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        if data_batch is not None and self._needs_check("_classes_discovered"):
            self._discover_normaliser_classes(tf.nest.map_structure(_spec, data_batch))
        if data_batch is not None and self._needs_check("_coupling_checked"):
            self._coupling_checked = True
            if self.micro_batch_size is not None:
                # The update's batch may not fit a forward pass: four rows
                # show a coupling as well.
                data_batch = tf.nest.map_structure(
                    lambda t: None if t is None else t[:4], data_batch
                )
            warn_if_loss_couples_samples(self, data_batch)
        return result

    def _accumulates(self):
        # Whether a group may have several micro-batches.
        return self.accum_steps > 1 or self.micro_batch_size is not None

    @property
    def micro_batch_changes(self):
        """The changes of the micro-batch in force (``micro_batch_size="auto"``), oldest first.

        A list of :class:`~gradient_accumulator.auto_micro_batch.MicroBatchChange`:
        the update whose group ran out of memory, the old and new micro-batch,
        the error's first line.
        """
        return list(self._runner.auto.changes)

    def _needs_check(self, done):
        # Once per compile (`done`: the check's flag), where each micro-batch's
        # loss is computed on its own (a coupled loss's group is one loss: one class).
        return (
            self.optimizer is not None
            and self._accumulates()
            and self.coupled_loss is None
            and not getattr(self, done, False)
        )

    def _discover_normaliser_classes(self, batch_spec):
        """Finds the loss's normaliser classes and what each reaches, before the first trace.

        A symbolic pass of the forward pass and loss on ``batch_spec``, the
        ``tf.TensorSpec`` structure of a batch ``(x, y, sample_weight)``
        (:func:`~gradient_accumulator.weighting.discover_classes`); none for
        one loss (one target, Keras's ``compute_loss``) and no data-dependent
        additional one: one class. The classes' state is created here,
        eagerly under the strategy scope: tf.distribute forbids it in a
        traced step.
        """
        self._classes_discovered = True
        data = keras.utils.unpack_x_y_sample_weight(batch_spec)
        self._ensure_accumulator()

        def forward(x, y, sample_weight):
            with update_step_scope(tf.constant(False)):
                return self._steps.forward(x, y, sample_weight, False)

        plan = ClassPlan.one_class()
        if len(tf.nest.flatten(data[1])) > 1 or may_add_losses(self):
            plan = discover_classes(
                forward, self.trainable_variables, self.distribute_strategy, data
            )
        with self.distribute_strategy.scope():
            self._accumulator.configure_classes(plan.routing, self.trainable_variables)
        self._normaliser_classes = plan

    def make_train_function(self, force=False):
        # Variables are created here, eagerly and under the strategy scope,
        # never inside the traced step (that breaks tf.distribute).
        check_strategy(self, creation_strategy(self))
        check_train_step_not_overridden(self, GradientAccumulateModel)
        check_jit_compile(self)
        check_auto_micro_batch(
            self, self._steps.statistics_layers(), is_multi_worker(self.distribute_strategy)
        )
        check_statistics_layers(self, self._steps.statistics_layers())
        if not force and self.train_function is not None:
            self._steps.check_variables()
        self._ensure_accumulator()
        self._size_group_loss()
        if self.optimizer is not None and not self.optimizer.built:
            # Keras < 3.5 builds the optimizer in the first train step, where
            # the update runs in a conditional, which cannot create variables.
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)
        self._runner.restore_steps_per_execution()
        if force or self.train_function is None:
            self._runner.reset()
            self.train_function = self._runner.train_function
        return self.train_function

    def reset_metrics(self):
        super().reset_metrics()
        if self._group_loss is not None:
            self._group_loss.forget_base()

    def _size_group_loss(self):
        """A :class:`GroupLoss` for the loss's classes and the outputs' trackers (eagerly).

        Both are known only once the classes are found (or restored) and
        Keras's loss is built: before each train function.
        """
        group_loss = self._group_loss
        if group_loss is None:
            return
        classes = self._accumulator.num_classes
        outputs = len(output_loss_trackers(self))
        if (group_loss.num_classes, group_loss.num_outputs) != (classes, outputs):
            with self.distribute_strategy.scope():
                self._group_loss = GroupLoss(classes, outputs)

    def apply_accumulated_gradients(self):
        """Applies a non-empty, unfinished group now; otherwise does nothing.

        ``fit`` does this at the end of every epoch. Call it yourself after
        ``train_on_batch`` loops whose length is not a multiple of
        ``accum_steps``.
        """
        if self._accumulator is not None and self.optimizer is not None:
            self._runner.apply_pending()

    def get_config(self):
        return {**super().get_config(), **self.wrapper_config()}

    def wrapper_config(self):
        """The wrapper's own constructor arguments (``accum_steps``, ``use_agc``, ...).

        Part of ``get_config``; ``replace_batchnorm_layers`` re-wraps a
        converted model with them.

        Returns:
            Dict of every argument of ``GradientAccumulateModel`` that
            ``keras.Model`` does not take, by name.
        """
        return {name: getattr(self, name) for name in _WRAPPER_ARGUMENTS}

    def _save_accumulation_state(self, store):
        # Only a pending group has state to keep: without one the entry is
        # empty, as in a plain model's file (always so at accum_steps=1).
        if self._accumulator is not None and int(self._accumulator.micro_step.numpy()) > 0:
            save_state(self._accumulator, store)

    def _load_accumulation_state(self, store):
        # A file holds the weights of one moment: with its group's state, or
        # (saved by a plain model) with no group pending.
        self._ensure_accumulator()
        with self.distribute_strategy.scope():
            self._accumulator.empty_group()
            load_state(
                self._accumulator, store, f"model '{self.name}'", variables=self.trainable_variables
            )
        self._runner.forget_update_count()

    def _ensure_accumulator(self):
        variables = self.trainable_variables
        if self._accumulator is not None and self._accumulator.matches(variables):
            return
        with self.distribute_strategy.scope():
            accumulator = GradientAccumulator(
                self.accum_steps,
                variables,
                gradient_transform=agc_transform(self.use_agc, self.clip_factor, self.eps),
                reduce_every_micro_step=self.reduce_every_micro_step,
                track_gradient_norm=self.gradient_norm,
                noise_scale_decay=self.noise_scale_smoothing if self.noise_scale else None,
                noise_scale_every=self.noise_scale_every,
                noise_scale_last_only=self.noise_scale_micro_batches == "last",
                name="gradient_accumulator",
            )
            # Not tracked: a plain object (the group's loss sums are transient).
            group_loss = GroupLoss(1) if self._accumulates() and self.coupled_loss is None else None
        # A tf.Module: TF's checkpoint tracking picks it up, Keras's weight
        # tracking does not, so the sums are saved but are not model weights.
        self._accumulator = accumulator
        self._group_loss = group_loss
        self._state_writes = StateWrites(self)
        self._runner.reset()
        self._classes_discovered = False
        self._normaliser_classes = None
