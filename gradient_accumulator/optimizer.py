"""The optimizer wrapper: accumulates gradients for any Keras optimizer, in any training loop."""

import contextlib
import inspect
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator import update
from gradient_accumulator._compat import (
    check_optimizer_knows,
    loss_scale_optimizer_applying,
    loss_scale_optimizer_building,
    optimizer_chain,
    optimizer_variable_index,
    optimizer_variables_in_build_order,
    set_optimizer_own_iterations,
    stand_in_for_loss_scale_optimizer,
)
from gradient_accumulator._v05 import REMOVED_OPTIMIZER_ARGUMENTS
from gradient_accumulator.agc import agc_transform
from gradient_accumulator.engine import GradientAccumulator, load_state, save_state, without_state
from gradient_accumulator.validation import (
    check_accum_steps_or_schedule,
    check_agc_arguments,
    check_bool,
    check_keyword_arguments,
    check_optimizer,
    check_optimizer_does_not_accumulate,
    refuse_double_loss_scale,
)

# Arguments of `keras.optimizers.Optimizer` that belong to the inner optimizer:
# it applies them once per update, which is what accumulation needs.
_INNER_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
)


# The base class's attributes that configure the update: on the wrapper they
# read and set the inner optimizer's (the base class sets its defaults before
# the inner optimizer exists; those are the inner optimizer's business).
# `learning_rate` and `loss_scale_factor` have properties of their own.
_FORWARDED_ATTRIBUTES = tuple(
    name for name in _INNER_ARGUMENTS if name not in ("learning_rate", "loss_scale_factor")
)


def _forwarded_attribute(name):
    def get(self):
        inner = getattr(self, "inner_optimizer", None)
        if inner is None or getattr(self, "_recording_build", False):
            # The base class's `build` reads `use_ema` to make averages of
            # its own: the inner optimizer keeps them.
            return None if name != "use_ema" else False
        return getattr(inner, name)

    def set_(self, value):
        inner = getattr(self, "inner_optimizer", None)
        if inner is not None:
            setattr(inner, name, value)

    return property(get, set_, doc=f"The inner optimizer's ``{name}`` (readable and settable).")


# What to do instead of arguments that `GradientAccumulateOptimizer` refuses:
# the inner optimizer's own arguments, Keras's built-in accumulation, and the
# arguments of gradient_accumulator 0.5.
_REFUSED_ARGUMENTS = {
    **{
        name: "set it on the inner optimizer, which applies it once per update, "
        f"e.g. `GradientAccumulateOptimizer(keras.optimizers.Adam({name}=...), "
        "accum_steps=k)`."
        for name in _INNER_ARGUMENTS
    },
    "gradient_accumulation_steps": "pass `accum_steps` instead.",
    **REMOVED_OPTIMIZER_ARGUMENTS,
}
_OWN_ARGUMENTS = (
    "optimizer",
    "accum_steps",
    "use_agc",
    "clip_factor",
    "eps",
    "reduce_every_micro_step",
    "name",
)


def _ordered_gradients(optimizer, grads, trainable_variables):
    """``(variables, gradients)`` in the order of ``build`` (``None`` where none), checked.

    Builds ``optimizer`` (and its inner optimizer) at its first call, as
    Keras's ``apply`` builds an optimizer; refuses gradients that do not
    match the variables, and warns, as Keras does, of variables without one.
    """
    if trainable_variables is None:
        if not optimizer.built:
            raise ValueError(
                "When passing `grads` without `trainable_variables`, the optimizer must "
                "already be built. Call `optimizer.build(trainable_variables)` first."
            )
        trainable_variables = optimizer_variables_in_build_order(optimizer)
    else:
        trainable_variables = list(trainable_variables)
        if not optimizer.built:
            if not optimizer.inner_optimizer.built:
                # In the traced step, where Keras's `apply` builds it: a build
                # that reads the model's variables (ScheduleFreeAdamW copies
                # them) must run where a model built by that step has them.
                # Under a strategy (Keras < 3.5's fit builds nothing first),
                # outside: created there, they fail in the update's conditional.
                with tf.init_scope() if tf.distribute.has_strategy() else contextlib.nullcontext():
                    optimizer.inner_optimizer.build(trainable_variables)
            # The accumulation state is created outside the traced step (as
            # Keras >= 3.5's fit does by building first): inside it, the
            # update's conditional cannot initialize it under tf.distribute.
            with tf.init_scope():
                optimizer.build(trainable_variables)
        check_optimizer_knows(optimizer, trainable_variables)
    if len(grads) != len(trainable_variables):
        raise ValueError(
            "`grads` and `trainable_variables` must have the same length. "
            f"Received: len(grads)={len(grads)}, "
            f"len(trainable_variables)={len(trainable_variables)}"
        )
    if all(g is None for g in grads):
        raise ValueError("No gradients provided for any variable.")
    missing = [getattr(v, "path", v.name) for g, v in zip(grads, trainable_variables) if g is None]
    if missing:
        # Keras's own warning, for the variables the caller gave no gradient.
        warnings.warn(
            f"Gradients do not exist for variables {missing} when minimizing the "
            "loss. If using `model.compile()`, did you forget to provide a `loss` "
            "argument?",
            stacklevel=2,
        )
    # The engine sums into one fixed list: the variables of `build`.
    built_with = optimizer_variables_in_build_order(optimizer)
    ordered = [None] * len(built_with)
    for grad, variable in zip(grads, trainable_variables):
        ordered[optimizer_variable_index(optimizer, variable)] = grad
    return built_with, ordered


def _outer_loss_scale(optimizer):
    """The ``LossScaleOptimizer`` wrapping ``optimizer`` whose role it takes, if any.

    Called from ``build``, which an outer ``LossScaleOptimizer``'s ``build``
    calls (``model.compile()`` wraps it so under 'mixed_float16'). Refuses a
    second loss scale; otherwise takes the outer one's role, unless built by
    its first ``apply`` eagerly (``run_eagerly=True``): that step is already
    scaled by the outer one's ``scale_loss``, so it warns and leaves the role
    to it. (Built by that ``apply`` while tracing, the role is taken: ``fit``
    traces its step again, and that trace runs.)
    """
    outer = loss_scale_optimizer_building(optimizer)
    if outer is None:
        return None
    if isinstance(optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer):
        refuse_double_loss_scale(
            f"LossScaleOptimizer(GradientAccumulateOptimizer(LossScaleOptimizer("
            f"{type(optimizer.inner_optimizer.inner_optimizer).__name__})))"
        )
    if not (tf.executing_eagerly() and loss_scale_optimizer_applying(outer)):
        return outer
    warnings.warn(
        "A `LossScaleOptimizer` wraps this `GradientAccumulateOptimizer` "
        "(`model.compile()` does so under 'mixed_float16') and builds it in its "
        "first `apply`, eagerly (`fit` with `run_eagerly=True`): that step has "
        "already been scaled as a whole batch, so the wrapper cannot take the "
        "loss scale's role, and every micro-batch's loss is scaled as a whole "
        "batch's (a micro-batch may overflow where the big batch would not; that "
        "micro-step is dropped and the scale halved). Build the optimizer before "
        "`fit`, `model.optimizer.build(model.trainable_variables)`, for the big "
        "batch's loss scale.",
        stacklevel=3,
    )
    return None


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class GradientAccumulateOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that it updates once every ``accum_steps`` calls.

    For custom training loops and for ``compile()`` of a plain ``keras.Model``.
    Each ``apply_gradients`` call (a *micro-step*) adds its gradients to
    float32 sums; every ``accum_steps``-th (an *update*) hands their mean to
    the inner optimizer and empties the sums: with ``g_i`` the gradient of
    micro-step ``i`` of a group of ``k = accum_steps``, the update applies
    ``(g_1 + ... + g_k) / k`` (``sum_i(w_i * g_i) / sum_i(w_i)`` with
    :meth:`scale_loss`; the formula: :mod:`gradient_accumulator.update`),
    clipped by AGC if ``use_agc=True``.

    The calls in between change neither the weights nor the inner optimizer's
    state, so ``iterations`` and learning-rate schedules count updates. When
    each ``g_i`` is the gradient of the mean loss over an equal-sized
    micro-batch, an update is the inner optimizer's step on the concatenated
    batch, for any optimizer (float32 rounding); micro-batches of different
    sizes weigh right through ``scale_loss(loss, normaliser=...)``. The
    wrapper does not see epochs: :meth:`apply_accumulated_gradients` ends a
    group early, and ``GradientAccumulateModel`` does both for ``fit``.
    Distribution, mixed precision and sparse gradients:
    :doc:`/guides/custom_loop`.

    State (``accumulation_variables``, replica-local, saved with the
    optimizer): ``<variable>_accumulator``, ``sum_i(w_i * g_i)`` per
    trainable variable (``w_i = 1`` without :meth:`scale_loss`;
    ``max_i(g_i)`` for float8 scales and amax histories, which optimizers
    assign); ``weight_sum``, ``sum_i(w_i)``; ``micro_step``, the micro-steps
    of the group; ``update_count``, the updates made; ``group_reference``,
    the reference ``C_1 * K`` of the group's weights, which
    :meth:`scale_loss` sets at a group's first micro-step. ``variables`` are
    the inner optimizer's.

    Args:
        optimizer: A ``keras.optimizers.Optimizer``, or its name or config
            (``"adam"``), not accumulating itself; may be a
            ``LossScaleOptimizer``. Defaults to ``"sgd"``.
        accum_steps: Integer >= 1, micro-steps per update (``1``: every call
            updates), or a registered callable mapping the updates so far
            (int64 tensor) to the next group's micro-steps. Defaults to ``1``.
        use_agc: Boolean, clip the mean gradient adaptively at each update.
            Defaults to ``False``.
        clip_factor: Float > 0, AGC's largest ratio of gradient norm to
            weight norm; only with ``use_agc=True``. Defaults to ``0.01``.
        eps: Float > 0, AGC's floor on weight norms; only with
            ``use_agc=True``. Defaults to ``1e-3``.
        reduce_every_micro_step: Boolean, all-reduce every micro-step's
            gradients instead of the sums once per update (same result,
            ``accum_steps`` times the communication). Defaults to ``False``.
        name: String, the name scope of the accumulation state.

    Example:

    >>> import keras
    >>> import tensorflow as tf
    >>> from gradient_accumulator import GradientAccumulateOptimizer
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> opt = GradientAccumulateOptimizer("adam", accum_steps=4)
    >>> x, y = tf.ones((2, 3)), tf.zeros((2, 1))
    >>> for _ in range(8):
    ...     with tf.GradientTape() as tape:
    ...         loss = keras.losses.mean_squared_error(y, model(x))
    ...     grads = tape.gradient(loss, model.trainable_variables)
    ...     _ = opt.apply_gradients(zip(grads, model.trainable_variables))
    >>> int(opt.iterations.numpy())  # 8 micro-steps, 2 updates
    2
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str | dict = "sgd",
        accum_steps: int | Callable = 1,
        use_agc: bool = False,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        reduce_every_micro_step: bool = False,
        name: str | None = None,
        **kwargs,
    ):
        check_keyword_arguments(
            "GradientAccumulateOptimizer", kwargs, _OWN_ARGUMENTS, _REFUSED_ARGUMENTS
        )
        accum_steps = check_accum_steps_or_schedule(accum_steps)
        inner_optimizer = check_optimizer(optimizer)
        check_optimizer_does_not_accumulate(
            optimizer_chain(inner_optimizer), accum_steps, "GradientAccumulateOptimizer"
        )
        use_agc, clip_factor, eps = check_agc_arguments(use_agc, clip_factor, eps)
        reduce_every_micro_step = check_bool("reduce_every_micro_step", reduce_every_micro_step)
        # The base class needs a learning rate; the inner optimizer's is the
        # one used (see the `learning_rate` property), as in LossScaleOptimizer.
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.accum_steps = accum_steps
        self.use_agc = use_agc
        self.clip_factor = clip_factor
        self.eps = eps
        self.reduce_every_micro_step = reduce_every_micro_step
        self._accumulator = None
        self._apply_inner = None  # the update's optimizer (see `build`)
        self._recording_build = False
        self._scaled_before_build = False

    def build(self, var_list):
        """Builds the inner optimizer (unless built) and the accumulation state.

        Call it eagerly before the first traced step (``fit`` does), so that no
        variable is created inside a ``tf.function``.

        Args:
            var_list: The trainable variables, in a fixed order. Later calls
                of :meth:`apply` may pass gradients for any subset of them.
        """
        var_list = list(var_list)
        outer = _outer_loss_scale(self)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        with keras.name_scope(self.name, caller=self):
            self._accumulator = GradientAccumulator(
                self.accum_steps,
                var_list,
                gradient_transform=agc_transform(self.use_agc, self.clip_factor, self.eps),
                reduce_every_micro_step=self.reduce_every_micro_step,
                name="accumulator",
            )
        scaler = self.inner_optimizer
        if outer is not None:
            scaler = stand_in_for_loss_scale_optimizer(
                outer, self.scale_loss, self.apply, self.inner_optimizer
            )
        # The optimizer of the update (and of `scale_loss` once built).
        self._apply_inner = update.PresentGradients(scaler)
        # The base class records the variables (its `use_ema` reads False meanwhile).
        self._recording_build = True
        try:
            super().build(var_list)
        finally:
            self._recording_build = False
        if self._scaled_before_build:
            # `scale_loss` weighted the first micro-step before the state
            # existed: the same weight, recorded.
            accumulator = self._accumulator
            accumulator.set_pending_weight(
                accumulator.share(1.0, 1.0, accumulator.planned_micro_step())
            )
            self._scaled_before_build = False

    def apply(self, grads, trainable_variables=None):
        """Accumulates ``grads``; on an update step, applies the group's mean.

        Args:
            grads: List of gradients (tensors, ``tf.IndexedSlices`` or
                ``None``), one per entry of ``trainable_variables``.
            trainable_variables: The variables the gradients belong to, a
                subset of those the optimizer was built with (built on the
                first call). ``None``: all of them, in build order.
        """
        grads = list(grads)
        if not grads:
            return
        built_with, ordered = _ordered_gradients(self, grads, trainable_variables)
        accumulator = self._accumulator
        micro = accumulator.start_micro_step()
        weight = accumulator.take_pending_weight()
        update.step(
            accumulator, [ordered], [weight], micro.is_update_step, self._apply_inner, built_with
        )

    def apply_accumulated_gradients(self):
        """Applies a non-empty, unfinished group now; otherwise does nothing.

        The update uses the mean over the micro-steps accumulated so far, like
        a shorter last batch. Call it at the end of a custom loop whose
        number of micro-steps is not a multiple of ``accum_steps``, in the
        same context as ``apply_gradients`` (inside ``strategy.run`` under a
        ``tf.distribute`` strategy).
        """
        if self._accumulator is None:
            return
        variables = optimizer_variables_in_build_order(self)
        pending = ops.greater(self._accumulator.micro_step, 0)
        update.apply_if(self._accumulator, pending, self._apply_inner, variables)

    def apply_gradients(self, grads_and_vars):
        """Accumulates one micro-step's gradients; on an update step, applies the group's mean.

        The Keras optimizer API: :meth:`apply` with the pairs unzipped.

        Args:
            grads_and_vars: Iterable of ``(gradient, variable)`` pairs.
                Gradients may be tensors, ``tf.IndexedSlices`` or ``None``;
                the variables are a subset of those the optimizer was built
                with (it is built on the first call).

        Returns:
            The inner optimizer's ``iterations`` variable, which counts
            updates.
        """
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables)
        return self.iterations

    @property
    def iterations(self):
        """The innermost optimizer's ``iterations``, which counts updates."""
        return optimizer_chain(self.inner_optimizer)[-1].iterations

    @iterations.setter
    def iterations(self, value):
        # Keras < 3.5 sets the base class's own (unused) counter through this
        # attribute; later versions keep it in `_iterations` directly.
        set_optimizer_own_iterations(self, value)

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (readable and settable)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def loss_scale_factor(self):
        """The inner optimizer's ``loss_scale_factor``; a ``LossScaleOptimizer``'s initial scale.

        Forwarded so that an outer ``LossScaleOptimizer``, which clears its
        inner optimizer's factor, clears the applied one. With a
        ``LossScaleOptimizer`` inside, the factor is that one's initial scale,
        and clearing it (the loss would be scaled twice) is refused.
        """
        inner = getattr(self, "inner_optimizer", None)
        if inner is None:
            return None
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            return inner.initial_scale
        return inner.loss_scale_factor

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        inner = getattr(self, "inner_optimizer", None)
        if inner is None:
            return  # the base class's default None, before `inner_optimizer` exists
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            refuse_double_loss_scale(f"loss_scale_factor={value!r}")
        inner.loss_scale_factor = value

    @property
    def variables(self):
        """The inner optimizer's variables: its ``iterations``, learning rate and slots.

        What the inner optimizer alone lists, so ``set_weights`` takes a plain
        optimizer's ``variables`` and a plain optimizer takes these. Not the
        wrapper's two unused base-class variables, nor the accumulation state
        (TensorFlow variables, where Keras code expects Keras ones):
        ``accumulation_variables`` lists it, and saving includes it.
        """
        return self.inner_optimizer.variables

    def set_weights(self, weights):
        """Sets :attr:`variables` (the inner optimizer's), all of them; a group goes on.

        Args:
            weights: One array per entry of :attr:`variables`, in that order.
                Refused unless built, and unless one per variable (Keras's
                own ``set_weights`` would set the first ones, ignore the rest).
        """
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not "
                "yet been built. Please call `optimizer.build(trainable_variables)` "
                "to create the optimizer weights before calling `set_weights()`."
            )
        weights = list(weights)
        if len(weights) != len(self.variables):
            raise ValueError(
                "`weights` must have one entry per variable of the optimizer "
                f"(`optimizer.variables`, the inner optimizer's: {len(self.variables)}). "
                f"Received: {len(weights)} weights"
            )
        self.inner_optimizer.set_weights(weights)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay (see Keras's method)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's update rule for one variable, applied now (no accumulation).

        The inner optimizer's ``apply`` calls it, with the group's mean.
        """
        return self.inner_optimizer.update_step(gradient, variable, learning_rate)

    def add_variable(self, *args, **kwargs):
        """Creates a variable of the inner optimizer (listed in :attr:`variables`, saved)."""
        return self.inner_optimizer.add_variable(*args, **kwargs)

    def add_variable_from_reference(self, *args, **kwargs):
        """Creates a variable of the inner optimizer shaped like a model variable."""
        return self.inner_optimizer.add_variable_from_reference(*args, **kwargs)

    def add_optimizer_variables(self, *args, **kwargs):
        """Creates variables of the inner optimizer, one per model variable (Keras >= 3.10)."""
        return self.inner_optimizer.add_optimizer_variables(*args, **kwargs)

    @property
    def accumulation_variables(self):
        """The accumulation state (empty before ``build``), in a fixed order."""
        return [] if self._accumulator is None else self._accumulator.state_variables

    def save_own_variables(self, store):
        """Saves ``variables`` as Keras does, then the accumulation state."""
        super().save_own_variables(store)
        if self._accumulator is not None:
            save_state(self._accumulator, store)

    def load_own_variables(self, store):
        """Restores what :meth:`save_own_variables` saved (the state, if built)."""
        super().load_own_variables(without_state(store))
        if self._accumulator is not None:
            load_state(self._accumulator, store, f"optimizer '{self.name}'")

    def scale_loss(self, loss, normaliser=None, capacity=None):
        """Returns ``loss`` weighted by this micro-batch's share of its group, then scaled.

        ``model.compile``'s ``fit`` calls it on every micro-step; in a custom
        loop, differentiate ``optimizer.scale_loss(loss)`` and pass its
        gradients to :meth:`apply_gradients` (call it on every micro-step or
        on none: without it, every micro-step has weight 1). The weight
        ``w_i`` also enters the group's divisor, so it leaves the update
        unchanged while every float16 intermediate of the backward pass has
        the big batch's magnitude (:mod:`gradient_accumulator.update`). Then
        the inner optimizer's ``scale_loss`` applies: a ``LossScaleOptimizer``'s
        dynamic scale, or a ``loss_scale_factor``.

        Args:
            loss: Scalar, the micro-batch's loss, a sum divided by
                ``normaliser`` (e.g. Keras's mean over its valid tokens).
            normaliser: Optional scalar, what ``loss`` is divided by: its
                samples, valid tokens or sum of sample weights. ``None``:
                the micro-batches count equally (``w_i = 1 / k``). Given,
                micro-batch ``i`` weighs ``normaliser_i / sum(normaliser)``
                in the update, as in the big batch.
            capacity: Optional scalar > 0 with ``normaliser``: the largest
                it can be for a micro-batch of this shape (samples, or padded
                tokens ``tf.size(mask)``), the reference of the weights; the
                same on every replica. Required under a strategy with several
                replicas (whose normalisers differ); on one device it
                defaults to the group's first ``normaliser``.
        """
        accumulator = self._accumulator
        if normaliser is None and capacity is not None:
            raise ValueError(
                "`capacity` is the reference of `normaliser` and needs it. "
                f"Received: normaliser=None, capacity={capacity!r}"
            )
        loss = ops.convert_to_tensor(loss)
        if accumulator is None and normaliser is None and tf.executing_eagerly():
            # `fit` with `run_eagerly=True` builds the optimizer at its first
            # `apply`, after this: the first micro-step's weight is kept until
            # then. It is the group's first, of equal weight: 1 / its micro-steps.
            self._scaled_before_build = True
            steps = self.accum_steps
            if callable(steps):
                steps = max(int(steps(tf.constant(0, "int64"))), 1)
            return self._scaler().scale_loss(loss * ops.cast(1.0 / steps, loss.dtype))
        if accumulator is None:
            if normaliser is not None:
                # A first micro-step weighted 1 and later ones by their share
                # would not be the big batch: refuse rather than mix them.
                raise ValueError(
                    "`scale_loss` weights the micro-batch by its share of the "
                    "group, which needs the accumulation state: build the "
                    "optimizer first, `optimizer.build(model.trainable_variables)`. "
                    f"Received: an unbuilt optimizer, normaliser={normaliser!r}"
                )
            # Keras < 3.5 traces `fit`'s step before building the optimizer:
            # that trace weighs every micro-step 1 (nothing pending).
            return self._scaler().scale_loss(loss)
        micro = accumulator.planned_micro_step()
        if normaliser is None:
            weight = accumulator.share(1.0, 1.0, micro)
        else:
            if capacity is None:
                replicas = tf.distribute.get_strategy().num_replicas_in_sync
                if replicas > 1:
                    raise ValueError(
                        "Under a strategy with several replicas, `scale_loss` needs "
                        "`capacity` with `normaliser`: a reference that is the same "
                        "on every replica (e.g. `tf.size(mask)`, the padded token "
                        "count, for a token count). Received: capacity=None with "
                        f"{replicas} replicas"
                    )
                capacity = ops.maximum(ops.cast(normaliser, "float32"), 1.0)
            weight = accumulator.share(normaliser, capacity, micro)
        accumulator.set_pending_weight(weight)
        return self._scaler().scale_loss(loss * ops.cast(weight, loss.dtype))

    def finalize_variable_values(self, var_list):
        """Forwards to the inner optimizer (with ``use_ema``, copies the averages into the weights).

        ``fit`` calls it at the end of training.
        """
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        """Every constructor argument; the inner optimizer serialized by Keras.

        Raises:
            ValueError: If ``accum_steps`` is a callable that Keras cannot
                find again by name (see ``accum_steps``).
        """
        accum_steps = self.accum_steps
        if callable(accum_steps):
            # Whether Keras can deserialize it by its registered name.
            target = accum_steps if inspect.isfunction(accum_steps) else type(accum_steps)
            name = keras.saving.get_registered_name(target)
            if keras.saving.get_registered_object(name) is not target:
                raise ValueError(
                    "`accum_steps` is a callable that Keras cannot serialize, "
                    "so this optimizer cannot be saved. Decorate a named "
                    "function (or a class with `get_config`) with "
                    "`@keras.saving.register_keras_serializable()`, or pass "
                    f"an integer. Received: accum_steps={accum_steps!r}"
                )
            accum_steps = keras.saving.serialize_keras_object(accum_steps)
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accum_steps": accum_steps,
            "use_agc": self.use_agc,
            "clip_factor": self.clip_factor,
            "eps": self.eps,
            "reduce_every_micro_step": self.reduce_every_micro_step,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Creates the optimizer from :meth:`get_config`'s output."""
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects
        )
        if isinstance(config.get("accum_steps"), dict):
            config["accum_steps"] = keras.saving.deserialize_keras_object(
                config["accum_steps"], custom_objects=custom_objects
            )
        return cls(**config)

    def _scaler(self):
        """What scales the loss: the update's optimizer once built, else the inner one."""
        applied = self._apply_inner
        return self.inner_optimizer if applied is None else applied.inner_optimizer


for _name in _FORWARDED_ATTRIBUTES:
    setattr(GradientAccumulateOptimizer, _name, _forwarded_attribute(_name))
del _name
