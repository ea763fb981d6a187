"""The accumulation-aware BatchNormalization: moving statistics of the whole accumulated batch."""

import numbers

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import batchnorm_reduction_axes, batchnorm_takes
from gradient_accumulator._moments import (
    batch_moments,
    merge_moments,
    merge_replica_summaries,
    variance_from_moments,
)
from gradient_accumulator.distribute import sum_across_replicas_if
from gradient_accumulator.steps import current_update_step
from gradient_accumulator.validation import (
    check_layer_accum_steps,
    check_positive_float,
    check_unit_interval,
)

# Name of every variable this layer adds to Keras BatchNormalization's, in
# creation (and therefore `weights`) order: the pending statistics, then the counter.
_PENDING = ("pending_count", "pending_shift", "pending_mean_offset", "pending_m2")
_ACCUMULATION_VARIABLES = (*_PENDING, "micro_step")


def _check_axis_type(axis):
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise ValueError(
            f"`axis` must be an integer (the channel axis; one axis only). Received: axis={axis!r}"
        )
    return int(axis)


@keras.saving.register_keras_serializable(package="gradient_accumulator")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose moving statistics follow the accumulated batch.

    A drop-in subclass of ``keras.layers.BatchNormalization`` whose moving
    mean and variance are updated **once per update**, with the mean and
    biased variance of the whole accumulated batch ``B = concat(micro_batch_1,
    ..., micro_batch_n)``, as Keras's layer updates them after one training
    step on ``B``::

        moving_mean     = momentum * moving_mean     + (1 - momentum) * mean(B)
        moving_variance = momentum * moving_variance + (1 - momentum) * var(B)

    ``var(B)`` includes the spread between micro-batch means and weighs each
    micro-batch by its size (or its unmasked entries). In training, each
    micro-batch is normalized with its own statistics (the forward pass
    cannot see the rest of the group); in inference (``training=False`` or
    ``trainable=False``) the layer uses the moving statistics and changes no
    state. Used on its own, the layer counts its training calls and updates
    at every ``accum_steps``-th; inside ``GradientAccumulateModel`` it
    updates on the model's update steps, pooling all its calls of a group,
    and its ``accum_steps`` must be the model's (or ``"auto"``, which
    follows the model's groups). With ``accum_steps=1`` it is
    Keras's layer: no extra state, ``renorm`` allowed. The maths and its
    float32 accuracy: :doc:`/background`; conversion of a model:
    :func:`~gradient_accumulator.replace_batchnorm_layers`.

    State (with ``accum_steps > 1`` or ``"auto"``; after Keras's four variables, channel
    shape, float32, saved so that training resumes inside a group). With
    ``n_i``, ``mean_i``, ``m2_i`` the count, mean and sum of squared
    deviations of micro-batch ``i`` and ``d_i = mean_i - pending_shift``,
    each training call updates:

    - ``pending_count``: ``count += n_i``.
    - ``pending_shift``: the float32 ``mean_i`` of the group's first
      non-empty micro-batch (the origin of the group's mean).
    - ``pending_mean_offset``: ``offset += (d_i - offset) * n_i / count``.
    - ``pending_m2``: ``m2 += m2_i + (d_i - offset) ** 2 * (count - n_i) * n_i
      / count`` (``offset`` before its update).
    - ``micro_step`` (int64 scalar): training calls of the group, when used
      on its own.

    An update uses ``mean(B) = pending_shift + pending_mean_offset`` and
    ``var(B) = pending_m2 / pending_count`` on channels with
    ``pending_count > 0`` and resets the five to 0. ``set_weights`` takes
    all weights or Keras's four alone (which empties the pending state).

    Args:
        accum_steps: Integer >= 1, micro-batches whose statistics make one
            update of the moving statistics, or ``"auto"``: the groups of the
            ``GradientAccumulateModel`` it is in, whatever their length (for
            ``micro_batch_size="auto"``, whose groups change length; refused
            outside such a model). Defaults to ``1`` (Keras's layer).
        synchronized: Boolean. ``True``: under a strategy with several
            replicas, each training call uses the statistics of the global
            micro-batch, gathered in one collective and merged exactly.
            Defaults to ``False`` (each replica its own shard, as in Keras).
        renorm: Boolean, Keras's Batch Renormalization; only with
            ``accum_steps=1`` and Keras >= 3.14. Defaults to ``False``.
        **kwargs: Every other argument of ``keras.layers.BatchNormalization``
            (``axis``, ``momentum``, applied once per update, ``epsilon``,
            ``center``, ``scale``, initializers, regularizers, constraints,
            ``renorm_clipping``, ``renorm_momentum``) and of a Keras layer,
            with Keras's defaults.

    Call arguments:
        inputs: Tensor of rank >= 1, any float dtype (statistics in float32).
        training: Python boolean, training or inference mode.
        mask: Optional tensor with one dimension less than ``inputs``;
            entries where it is false are left out of the statistics.

    Example:

    >>> import numpy as np
    >>> from gradient_accumulator.layers import AccumBatchNormalization
    >>> layer = AccumBatchNormalization(accum_steps=2, momentum=0.0)
    >>> x = np.random.default_rng(0).normal(5.0, 2.0, (8, 3)).astype("float32")
    >>> _ = layer(x[:3], training=True)  # first micro-batch: accumulated only
    >>> int(layer.micro_step.numpy()), layer.pending_count.numpy().tolist()
    (1, [3.0, 3.0, 3.0])
    >>> _ = layer(x[3:], training=True)  # second: update with all 8 rows
    >>> int(layer.micro_step.numpy()), layer.pending_count.numpy().tolist()
    (0, [0.0, 0.0, 0.0])
    >>> bool(np.allclose(layer.moving_variance.numpy(), x.var(axis=0), rtol=1e-5))
    True
    >>> [w.name for w in layer.weights]  # doctest: +NORMALIZE_WHITESPACE
    ['gamma', 'beta', 'moving_mean', 'moving_variance', 'pending_count',
     'pending_shift', 'pending_mean_offset', 'pending_m2', 'micro_step']
    """

    def __init__(
        self,
        accum_steps: int | str = 1,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        renorm: bool = False,
        renorm_clipping: dict | None = None,
        renorm_momentum: float = 0.99,
        synchronized: bool = False,
        **kwargs,
    ):
        accum_steps = check_layer_accum_steps(accum_steps)
        axis = _check_axis_type(axis)
        # Keras takes any number here; a momentum outside [0, 1] or a
        # non-positive epsilon trains on without a word.
        momentum = check_unit_interval("momentum", momentum)
        epsilon = check_positive_float("epsilon", epsilon)
        if renorm and accum_steps != 1:
            raise ValueError(
                "`renorm=True` cannot be combined with `accum_steps > 1`: "
                "batch renormalization corrects every micro-batch with "
                "statistics updated on every call, which cannot wait for the "
                "accumulated batch. Use `renorm=False`, or `accum_steps=1` "
                "for plain Keras behaviour. "
                f"Received: renorm={renorm!r}, accum_steps={accum_steps}"
            )
        renorm_arguments = dict(
            renorm=renorm, renorm_clipping=renorm_clipping, renorm_momentum=renorm_momentum
        )
        if not batchnorm_takes("renorm"):
            if renorm:
                raise ValueError(
                    "`renorm` needs Keras >= 3.14 (installed: "
                    f"{keras.__version__}). Received: renorm={renorm!r}"
                )
            # Keras's BatchNormalization has no renorm arguments to take.
            renorm_arguments = {}
        super().__init__(
            axis=axis,
            momentum=momentum,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **renorm_arguments,
            synchronized=synchronized,
            **kwargs,
        )
        self.accum_steps = accum_steps
        for name in _ACCUMULATION_VARIABLES:
            setattr(self, name, None)

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        rank = len(input_shape)
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"`axis` must be in [-{rank}, {rank}) for inputs of rank "
                f"{rank}. Received: axis={self.axis} for "
                f"input_shape={input_shape}"
            )
        if input_shape[self.axis] is None:
            raise ValueError(
                "The channel dimension (`axis`) of the input must be known. "
                f"Received: axis={self.axis} for input_shape={input_shape}"
            )
        super().build(input_shape)
        if self.accum_steps == 1:
            return
        channels = (input_shape[self.axis],)

        def state(name, shape=channels, dtype="float32"):
            # float32 whatever the dtype policy; `autocast=False` keeps it so
            # inside a float16 autocast scope.
            return self.add_weight(
                shape=shape,
                dtype=dtype,
                initializer="zeros",
                trainable=False,
                autocast=False,
                name=name,
            )

        for name in _PENDING:
            setattr(self, name, state(name))
        self.micro_step = state("micro_step", shape=(), dtype="int64")

    def call(self, inputs, training=None, mask=None):
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "`mask` must have one dimension less than `inputs` (it is "
                "broadcast along the last axis). Received: "
                f"mask.shape={tuple(mask.shape)}, "
                f"inputs.shape={tuple(inputs.shape)}"
            )
        if self.accum_steps == 1 or not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)

        # As Keras: float16/bfloat16 inputs are normalized in float32.
        x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        if mask is not None:
            mask = ops.cast(ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(x)), "bool")
        count, mean, residual, m2 = self._micro_batch_moments(x, mask)
        self._accumulate(count, mean, residual, m2)

        # Keras < 3.5 leaves `beta`/`gamma` unset without `center`/`scale`.
        beta, gamma = getattr(self, "beta", None), getattr(self, "gamma", None)
        outputs = ops.batch_normalization(
            x=x,
            mean=ops.cast(mean + residual, x.dtype),
            variance=ops.cast(variance_from_moments(count, m2), x.dtype),
            axis=self.axis,
            offset=None if beta is None else ops.cast(beta, x.dtype),
            scale=None if gamma is None else ops.cast(gamma, x.dtype),
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config["accum_steps"] = self.accum_steps
        return config

    def apply_pending_statistics(self, is_update_step=None):
        """Moves the pending statistics into the moving statistics if due.

        Where ``is_update_step`` is true, makes the update of the class docstring (the
        moving statistics from the pending ones, then the five reset to 0); where it is
        false nothing changes (bit-identical). Graph-safe: tensor decisions go
        through ``ops.where``, with no conditional or collective, so it runs
        eagerly, under ``tf.function``, XLA ``jit_compile`` and in a replica
        context. Does nothing with ``accum_steps=1`` (no pending state), on
        an unbuilt layer, or when ``trainable`` is ``False`` (a frozen layer
        changes no state; what it had pending waits until it is unfrozen).

        ``GradientAccumulateModel`` calls it after the forward pass of each
        train step with its ``is_update_step``. Call it with ``None`` (or
        ``True``) to flush an unfinished group, e.g. at the end of an epoch.

        Args:
            is_update_step: Boolean scalar (Python or tensor), or ``None``
                for ``True``.
        """
        if self.accum_steps == 1 or not self.built or not self.trainable:
            return
        if is_update_step is False:
            return  # known when traced: a micro-step that only accumulates
        is_update_step = ops.convert_to_tensor(is_update_step is None or is_update_step, "bool")
        count = self.pending_count.value
        self._update_moving_statistics(
            is_update_step,
            count,
            self.pending_shift.value + self.pending_mean_offset.value,
            variance_from_moments(count, self.pending_m2.value),
        )
        self._reset_pending(is_update_step)

    def merges_replicas_at_update(self):
        """Whether each replica holds pending statistics of its own, merged at the update.

        True for a trainable, built layer with ``accum_steps > 1`` and ``synchronized=False``
        in the replica context of several replicas. At the update every replica's are merged
        (:meth:`pending_replica_summary`, summed over the replicas, then
        :meth:`apply_replica_summaries`), so that all hold the global accumulated batch's.
        """
        if self.accum_steps == 1 or self.synchronized or not self.built or not self.trainable:
            return False
        replica_context = tf.distribute.get_replica_context()
        return replica_context is not None and replica_context.num_replicas_in_sync > 1

    def pending_replica_summary(self):
        """This replica's pending statistics, in its row of a float32 ``(replicas, 4, channels)``.

        Row ``r`` holds replica ``r``'s ``(pending_count, pending_shift,
        pending_mean_offset, pending_m2)`` and every other row is zero, so
        the sum of this tensor over the replicas (exact: each entry is one
        replica's value plus zeros) gathers every replica's statistics.
        Call in replica context.
        """
        replica_context = tf.distribute.get_replica_context()
        local = ops.stack([getattr(self, name).value for name in _PENDING])
        row = ops.one_hot(
            replica_context.replica_id_in_sync_group,
            replica_context.num_replicas_in_sync,
            dtype="float32",
        )
        return ops.reshape(row, (-1, 1, 1)) * ops.expand_dims(local, 0)

    def apply_replica_summaries(self, summaries):
        """Applies the pending statistics of all replicas, merged exactly, then resets them.

        ``summaries`` is the sum over the replicas of
        :meth:`pending_replica_summary`. The replicas' ``(count, mean, m2)``
        are merged with Chan's formula from a common origin (no
        ``E[x^2] - E[x]^2`` cancellation; unequal or empty shards weighted by
        their counts), and every replica makes the update of the class docstring
        with ``B`` the global accumulated batch (every replica's micro-batches
        of the group). Call in replica context, in every replica.
        """
        count, origin, residual, m2 = merge_replica_summaries(*(summaries[:, i] for i in range(4)))
        update = ops.convert_to_tensor(True)
        self._update_moving_statistics(
            update, count, origin + residual, variance_from_moments(count, m2)
        )
        self._reset_pending(update)

    def _update_moving_statistics(self, is_update_step, count, mean, variance):
        """Keras's moving-average update where ``is_update_step`` and ``count > 0``."""
        due = ops.logical_and(is_update_step, ops.greater(count, 0.0))
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            old = ops.cast(moving.value, "float32")
            # Keras's formula, term for term.
            new = old * self.momentum + batch * (1.0 - self.momentum)
            moving.assign(ops.cast(ops.where(due, new, old), moving.dtype))

    def _reset_pending(self, is_update_step):
        """Empties the pending statistics and ``micro_step`` where ``is_update_step``."""
        for name in _PENDING:
            pending = getattr(self, name)
            pending.assign(ops.where(is_update_step, 0.0, pending.value))
        self.micro_step.assign(
            ops.where(is_update_step, ops.zeros((), "int64"), self.micro_step.value)
        )

    def set_weights(self, weights):
        """Sets all weights, or only the Keras BatchNormalization ones.

        Args:
            weights: List of arrays: either ``len(self.weights)`` of them, or
                as many as a Keras BatchNormalization with the same arguments
                has (``keras_bn.get_weights()``), in which case the
                accumulation state is emptied.
        """
        weights = list(weights)
        accumulation = self.accumulation_variables
        if accumulation and len(weights) == len(self.weights) - len(accumulation):
            weights += [np.zeros(v.shape, v.dtype) for v in accumulation]
        super().set_weights(weights)

    @property
    def accumulation_variables(self):
        """The variables beyond Keras BatchNormalization's four (empty at ``accum_steps=1``).

        ``get_weights()[:-len(layer.accumulation_variables)]`` (or all of
        them when empty) is what a Keras BatchNormalization layer holds.
        """
        if self.accum_steps == 1 or not self.built:
            return []
        return [getattr(self, name) for name in _ACCUMULATION_VARIABLES]

    def _micro_batch_moments(self, x, mask):
        """``(count, mean, residual, m2)`` of the micro-batch (see ``batch_moments``).

        Global over replicas if ``synchronized`` under a multi-replica
        strategy; then ``mean`` is a common origin and ``residual`` the
        offset of the global mean from it.
        """
        count, mean, residual, m2 = batch_moments(x, batchnorm_reduction_axes(self), mask)
        replica_context = tf.distribute.get_replica_context()
        if (
            self.synchronized
            and replica_context is not None
            and replica_context.num_replicas_in_sync > 1
        ):
            # One collective gathers every replica's summary (replicas x 4 x C);
            # every replica merges the same tensor, so all get the same result.
            replicas = replica_context.num_replicas_in_sync
            local = ops.expand_dims(ops.stack([count, mean, residual, m2]), 0)
            gathered = ops.reshape(  # restores the static shape all_gather drops
                replica_context.all_gather(local, axis=0),
                (replicas, 4, self.moving_mean.shape[0]),
            )
            count, mean, residual, m2 = merge_replica_summaries(*(gathered[:, i] for i in range(4)))
        return count, mean, residual, m2

    def _accumulate(self, count, mean, residual, m2):
        """Merges a micro-batch summary into the pending statistics."""
        count, mean, residual, m2 = (ops.stop_gradient(t) for t in (count, mean, residual, m2))
        pending_count = self.pending_count.value
        # The group's first non-empty micro-batch sets the shift; later ones
        # are expressed as offsets from it (exact subtraction of nearby
        # float32 values, then the residual added).
        shift = ops.where(pending_count > 0, self.pending_shift.value, mean)
        merged = merge_moments(
            pending_count,
            self.pending_mean_offset.value,
            self.pending_m2.value,
            count,
            (mean - shift) + residual,
            m2,
        )
        self.pending_shift.assign(shift)
        for variable, value in zip(
            (self.pending_count, self.pending_mean_offset, self.pending_m2), merged
        ):
            variable.assign(value)
        is_update_step = current_update_step()
        if is_update_step is None:
            if self.accum_steps == "auto":
                raise ValueError(
                    f"Layer '{self.name}' has accum_steps='auto': its groups are those of "
                    "the GradientAccumulateModel it is in, and it was trained outside one "
                    "(a plain keras.Model, or with GradientAccumulateOptimizer). Give it "
                    "the optimizer's accum_steps, or wrap the model in a "
                    "GradientAccumulateModel. Received: accum_steps='auto'"
                )
            # On its own: this layer's counter decides.
            # Read after the add: Keras < 3.5's `assign_add` returns None.
            self.micro_step.assign_add(1)
            due = ops.greater_equal(self.micro_step.value, self.accum_steps)
            if self.merges_replicas_at_update():
                # One reduction of the replicas' pending statistics, at the
                # update only (the engine's, as for gradients).
                sum_across_replicas_if(
                    due, [self.pending_replica_summary()], self.apply_replica_summaries
                )
            else:
                self.apply_pending_statistics(due)
