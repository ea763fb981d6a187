"""The update: a group's sums, reduced over the replicas, to the optimizer as one mean gradient.

The formula, written once (the other docstrings link here). Micro-step ``i``
of a group differentiates ``w_i * loss_i``: ``loss_i`` its micro-batch's loss
(a sum divided by its normaliser ``N_i``: samples, valid tokens, sample
weights' sum), ``w_i = N_i / (C_1 * K)`` its share of the group (``C_1`` the
capacity of the group's first micro-batch, ``K`` the micro-steps the group is
planned to have). The accumulator sums ``G = sum_i(w_i * g_i)`` and ``W =
sum_i(w_i)``; the update hands the optimizer::

    g = sum_c G_c / W_c

over the loss's normaliser classes ``c`` (one, ``G / W``, unless the loss
mixes normalisers: :mod:`gradient_accumulator.weighting`): the gradient of the
concatenated group's loss, whatever its micro-batches hold. ``C_1 * K``
cancels; it makes ``w_i`` the micro-batch's share (``1 / K`` for equal
micro-batches), so that in the backward pass (one scalar multiply dearer)
every per-sample quantity has the big batch's magnitude (under a float16
loss scale, a micro-batch overflows only where the big batch would).
A summed loss (``reduction="sum"``) adds ``w_i = 1`` and ``1`` to ``W`` once
per group: ``g = sum_i(g_i)``. A variable marked ``overwrite_with_gradient``
(float8 scales and amax histories) takes ``max_i(g_i)``, the big batch's
value (:func:`~gradient_accumulator.engine.takes_maximum`). Then the
optional gradient transform (AGC), the optimizer's ``apply``, and the sums
emptied.

How the sums reach the optimizer (``_UpdatePlan.case``, decided when the
update is traced):

- :data:`ONE_REPLICA`: the sums are the group's; each mean is written into
  its sum in place, where the optimizer reads it;
- :data:`REDUCED_ONCE_PER_UPDATE`: several replicas with sums of their own;
  the sums, divisors and statistics cross the replicas in one batched
  all-reduce, and the means are the reduced tensors divided;
- :data:`REDUCED_EVERY_MICRO_STEP` (``reduce_every_micro_step=True``): the
  sums are global already; only the statistics cross, the means are written
  in place as with one replica.

A loss scale (a ``LossScaleOptimizer``, which skips non-finite updates) adds
to any of them: the reset then overwrites non-finite sums.
"""

import functools

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator import noise_scale
from gradient_accumulator._compat import in_xla_compilation, optimizer_chain
from gradient_accumulator.distribute import (
    by_replica,
    gradients_already_reduced,
    maximum_of_rows,
    sum_across_replicas_if,
    sum_in_replica,
    supports_collectives_in_conditionals,
)

#: One replica: each mean is written into its sum in place.
ONE_REPLICA = "one replica"
#: Several replicas, sums of their own, reduced in one batch at the update.
REDUCED_ONCE_PER_UPDATE = "reduced once per update"
#: Several replicas, ``reduce_every_micro_step=True``: the sums are global.
REDUCED_EVERY_MICRO_STEP = "reduced every micro-step"


class PresentGradients:
    """Hands ``inner_optimizer`` only the variables that have a gradient.

    The accumulator passes ``None`` for the variables (of its fixed list)
    without one, on each of which Keras's optimizers would warn; plain Keras
    does not warn of a subset. The update finds the optimizer chain through
    ``inner_optimizer``.
    """

    def __init__(self, optimizer):
        self.inner_optimizer = optimizer

    def apply(self, grads, variables):
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        self.inner_optimizer.apply([g for g, _ in present], [v for _, v in present])


def _mean(total, weight):
    """``total / weight``; 0 (as Keras's loss) where a group's normaliser is 0 (no valid token)."""
    return tf.math.divide_no_nan(total, ops.cast(weight, total.dtype))


class _UpdatePlan:
    """What one update reads (trace time): the sums, the divisors, the statistics.

    Attributes:
        slots: The ``(variable index, class, sum variable)`` entries holding a gradient.
        weight_sums: Per class, its divisor's variable.
        statistics: The ``(value, apply_fn)`` pairs of :func:`apply_if`.
        noise_sums: The noise scale's summaries (a variable), or ``None``.
        case: :data:`ONE_REPLICA`, :data:`REDUCED_ONCE_PER_UPDATE` or
            :data:`REDUCED_EVERY_MICRO_STEP` (read in replica context).
        takes_maximum: Per variable, whether its sums hold maxima, which
            cross the replicas as a maximum.
    """

    def __init__(self, accumulator, present, statistics):
        slots = accumulator.slots()
        self.slots = [slots[k] for k in present]
        self.weight_sums = accumulator.weight_sums()
        self.statistics = list(statistics)
        self.noise_sums = accumulator.noise_sums if accumulator.noise_scale_decay else None
        if accumulator.reduce_every_micro_step:
            self.case = REDUCED_EVERY_MICRO_STEP
        elif tf.distribute.get_strategy().num_replicas_in_sync == 1:
            self.case = ONE_REPLICA
        else:
            self.case = REDUCED_ONCE_PER_UPDATE
        self.takes_maximum = accumulator.takes_maximum

    def values_to_reduce(self):
        """What crosses the replicas at the update, in one batch (replica context).

        A sum of maxima enters as :func:`~gradient_accumulator.distribute.by_replica`
        rows, so that the one batched sum carries every replica's maximum.
        """
        shared = [value for value, _ in self.statistics]
        if self.noise_sums is not None:
            shared.append(self.noise_sums.read_value())
        if self.case == REDUCED_EVERY_MICRO_STEP:
            return shared
        sums = [by_replica(acc) if self.takes_maximum[i] else acc for i, _, acc in self.slots]
        return [*sums, *self.weight_sums, *shared]

    def split(self, reduced):
        """``reduced`` (of :meth:`values_to_reduce`) as (sums, weights, statistics, noise)."""
        reduced = list(reduced)
        noise = reduced.pop() if self.noise_sums is not None else None
        if self.case == REDUCED_EVERY_MICRO_STEP:
            sums = [ops.convert_to_tensor(acc) for _, _, acc in self.slots]
            weights = [ops.convert_to_tensor(w) for w in self.weight_sums]
            return sums, weights, reduced, noise
        count = len(self.slots) + len(self.weight_sums)
        sums = [
            maximum_of_rows(total) if self.takes_maximum[i] else total
            for (i, _, _), total in zip(self.slots, reduced[: len(self.slots)])
        ]
        return sums, reduced[len(self.slots) : count], reduced[count:], noise


def _group_means(plan, sums, weights, count):
    """Per variable, ``sum_c G_c / W_c`` (``max_c G_c`` for maxima); ``None`` where no sum.

    Where every divisor is exactly 1 (equal micro-batches counted by samples,
    the group as planned), the sums already are the means to the bit: the
    division is skipped (one conditional per update, saving a read and a
    write of every sum). The means are made one variable after the other,
    so that one mean's temporary is alive at a time; where the sums are this
    replica's accumulators (not :data:`REDUCED_ONCE_PER_UPDATE`), each mean
    is written into its variable's first sum (which takes the new buffer)
    and the optimizer reads it there.

    ``sums``: one tensor per entry of ``plan.slots``; ``weights``: per
    class, the group's divisor; ``count``: the number of variables.
    """
    in_place = plan.case != REDUCED_ONCE_PER_UPDATE
    terms = {}
    for (i, c, acc), total in zip(plan.slots, sums):
        terms.setdefault(i, []).append((acc, acc if in_place else total, c))
    means = [None] * count
    for i, entries in terms.items():
        if plan.takes_maximum[i]:
            means[i] = functools.reduce(ops.maximum, [total for _, total, _ in entries])
    divided = {i: entries for i, entries in terms.items() if not plan.takes_maximum[i]}
    if not divided:
        return means

    def unless_all_one(skip, divide):
        if in_xla_compilation():
            # XLA fuses the division into the optimizer's update, where it
            # costs nothing, and the conditional would cost time (the
            # benchmarks page has the figures).
            return divide()
        return tf.cond(ops.all(ops.equal(ops.stack(weights), 1.0)), skip, divide)

    def combined(divisors):
        # Per variable of `divided`: its mean, written into its first sum
        # where in place (then None); the classes' sum where `divisors` is
        # None (each divisor 1).
        results = []
        previous = []
        for entries in divided.values():
            if in_place and divisors is None and len(entries) == 1:
                results.append(None)  # the sum is the mean
                continue
            with tf.control_dependencies(previous):
                mean = None
                for _, total, c in entries:
                    term = total if divisors is None else _mean(total, divisors[c])
                    mean = term if mean is None else mean + term
                if in_place:
                    mean = entries[0][0].assign(mean, read_value=False)
            results.append(mean)
            previous = [mean]
        return results

    if in_place:
        # Writes only (the branches output a flag): the means are read from
        # the first sums afterwards.
        def written(divisors):
            with tf.control_dependencies([w for w in combined(divisors) if w is not None]):
                return tf.constant(True)

        done = unless_all_one(lambda: written(None), lambda: written(weights))
        with tf.control_dependencies([done]):
            for i, entries in divided.items():
                means[i] = entries[0][0].read_value()
        return means
    results = unless_all_one(lambda: combined(None), lambda: combined(weights))
    for i, mean in zip(divided, results):
        means[i] = mean
    return means


def apply_if(
    accumulator,
    condition,
    optimizer,
    variables,
    statistics=(),
    present=None,
    noise_measured=None,
):
    """Hands the group's mean gradient to ``optimizer`` if ``condition``, then empties the group.

    Call in replica context. The sums (unless reduced at every micro-step),
    the divisors and ``statistics`` cross the replicas in one batch, only if
    ``condition`` (under ``tf.cond``; where collectives cannot run in a
    conditional, :func:`~gradient_accumulator.distribute.sum_across_replicas_if`).

    Args:
        accumulator: The :class:`~gradient_accumulator.engine.GradientAccumulator`.
        condition: Python boolean (known when traced: no conditional) or a
            boolean scalar tensor, the same in every replica.
        optimizer: What ``apply(grads, variables)`` updates with.
        variables: The accumulator's trainable variables.
        statistics: Sequence of ``(value, apply_fn)``: a float32 tensor of this
            replica's, summed over the replicas with the gradients, and a
            callable receiving the sum in the update, in replica context
            (``AccumBatchNormalization`` merges its replicas' statistics so).
        present: Indices into the accumulator's ``slots()`` of the sums that
            hold a gradient; the last traced micro-step's
            (``traced_slots``) if ``None``, all of them before any.
        noise_measured: Whether the noise scale measures this update
            (``noise_scale_every``): a Python boolean where the caller
            knows, ``None`` to read it from ``update_count`` at run time.
    """
    if condition is False:
        return
    if present is None:
        present = getattr(accumulator, "traced_slots", range(len(accumulator.slots())))
    plan = _UpdatePlan(accumulator, present, statistics)
    update = functools.partial(_update, accumulator, plan, optimizer, variables, noise_measured)
    values = plan.values_to_reduce()
    with gradients_already_reduced(optimizer):
        if not supports_collectives_in_conditionals():
            # MirroredStrategy on CPUs: decided and reduced in cross-replica
            # context (`merge_call`), then back in each replica.
            sum_across_replicas_if(condition, values, update)
        elif condition is True:
            update(*sum_in_replica(values))
        else:
            # In replica context, with no call from distribute back into this module.
            tf.cond(condition, lambda: update(*sum_in_replica(values)), lambda: None)


def step(accumulator, class_grads, divisors, condition, optimizer, variables, statistics=()):
    """One micro-step of a caller that updates at run time: the add, then :func:`apply_if`.

    Arguments as in :meth:`~gradient_accumulator.engine.GradientAccumulator.add`
    and :func:`apply_if` (replica context).
    """
    present = accumulator.add(class_grads, divisors)
    apply_if(accumulator, condition, optimizer, variables, statistics, present)


def _update(accumulator, plan, optimizer, variables, noise_measured, *reduced):
    """The update (replica context): ``sum_c G_c / W_c`` to ``optimizer``, then a reset."""
    sums, weights, statistic_sums, noise_sums = plan.split(reduced)
    for (_, apply_statistics), total in zip(plan.statistics, statistic_sums):
        apply_statistics(total)
    means = _group_means(plan, sums, weights, len(variables))
    mean_grads = [None if m is None else ops.cast(m, v.dtype) for v, m in zip(variables, means)]
    measured = False
    if noise_sums is not None:
        schedule = accumulator.noise_schedule
        measured = schedule.update_measured(accumulator.update_count, noise_measured)
    if not isinstance(measured, bool) and not accumulator.track_gradient_norm:
        # Decided at run time (`noise_scale_every`): the group's norm only
        # in the updates that measure.
        def measure():
            norm = _mean_gradient_norm(accumulator, mean_grads, optimizer)
            _update_noise_scale(accumulator, noise_sums, ops.square(norm))
            return ops.zeros((), "float32")

        tf.cond(measured, measure, lambda: ops.zeros((), "float32"))
    elif accumulator.track_gradient_norm or measured is not False:
        norm = _mean_gradient_norm(accumulator, mean_grads, optimizer)
        if accumulator.track_gradient_norm:
            accumulator.gradient_norm.assign(norm)
        if measured is not False:
            # Unmeasured updates (decided at run time) have no summaries:
            # their estimates are not valid, and leave the averages.
            _update_noise_scale(accumulator, noise_sums, ops.square(norm))
    transform = accumulator.gradient_transform
    if transform is not None:
        # Not applied to maxima, which are values to assign, not gradients.
        maxima = accumulator.takes_maximum
        transformed = transform([None if m else g for g, m in zip(mean_grads, maxima)], variables)
        mean_grads = [g if m else t for g, t, m in zip(mean_grads, transformed, maxima)]
    optimizer.apply(mean_grads, variables)
    accumulator.update_count.assign_add(1)
    # The sums are emptied after the optimizer's writes (the variables' reads
    # wait for them), not beside it: the reset's temporaries then do not add
    # to the optimizer's (the benchmarks page has the figures).
    loss_scaled = any(
        isinstance(opt, keras.optimizers.LossScaleOptimizer) for opt in optimizer_chain(optimizer)
    )
    with tf.control_dependencies([tf.convert_to_tensor(v) for v in variables]):
        accumulator.reset(check_finite=loss_scaled)


def _update_noise_scale(accumulator, noise_sums, big_squared_norm):
    trace, signal, valid = noise_scale.estimates(noise_sums, big_squared_norm)
    averages, ratio = noise_scale.smoothed(
        accumulator.noise_averages.read_value(), trace, signal, valid, accumulator.noise_scale_decay
    )
    previous = accumulator.noise_logs.read_value()
    accumulator.noise_averages.assign(averages)
    accumulator.noise_logs.assign(ops.where(valid, ops.stack([ratio, trace, signal]), previous))


def _mean_gradient_norm(accumulator, mean_grads, optimizer):
    """The mean gradient's global L2 norm over the loss scale if any, float8 maxima left out."""
    squared = noise_scale.squared_norm(mean_grads, accumulator.takes_maximum)
    scale = ops.cast(optimizer.scale_loss(tf.constant(1.0)), "float32")
    return ops.sqrt(squared) / scale
