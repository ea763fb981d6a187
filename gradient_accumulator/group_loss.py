"""The losses ``fit`` logs per update: each group's, as the big batch's.

Keras's loss tracker (a ``Mean``) receives each batch's loss weighted by its
samples, and with several outputs each output's loss tracker (``<name>_loss``)
receives that output's loss. Each micro-batch's own loss added so is the big
batch's where the loss is a mean over samples; where it divides by something
else (the valid entries of a mask, the sum of the sample weights) or by
nothing (``reduction="sum"``), the big batch's loss is not the samples' mean
of its micro-batches' losses but, per normaliser class ``c`` (see
:mod:`gradient_accumulator.weighting`),

    L = sum_c (sum_i a_ci) / (sum_i w_ci)

with ``a_ci`` micro-batch ``i``'s weighted part of the loss and ``w_ci`` its
share of the divisor: the function whose gradient the update applies (an
output's loss likewise, of its one term: ``sum_i(r_i * N_i) / sum_i(N_i)``,
or ``sum_i(r_i)`` for a sum). So every micro-step still adds its own loss to
the trackers (what a log in the middle of a group shows), and the group's
end corrects what the group added to each tracker, ``T`` over a
count ``C``, to ``L * n`` over ``n``, the group's samples (Keras counts an
output's batch as one sample where the batch's size is unknown when traced;
the group counts its samples, as the loss's tracker does). The trackers' state at the
group's start is kept to read ``T`` and ``C``; ``reset_metrics`` (each
``train_on_batch`` call, each epoch, ``evaluate``) forgets it, so the call
that updates returns the group's loss, and an epoch that starts inside a
group counts that group's samples since the epoch began at ``L``.

Per replica, as Keras's trackers are: each replica's group is its own big
batch.
"""

import tensorflow as tf
from keras import ops

from gradient_accumulator.engine import replica_local
from gradient_accumulator.writes import write


def tracker_state(tracker):
    """``[total, count]`` of a ``keras.metrics.Mean``, as float32 tensors."""
    return [ops.cast(tracker.total, "float32"), ops.cast(tracker.count, "float32")]


class GroupLoss:
    """Per replica, the group's loss sums and the loss trackers' state at its start.

    State (float32, one value per replica, transient: not saved):

    - ``sums``: the parts ``a`` then the shares ``w`` of each quantity: the
      loss's normaliser classes, then the outputs' losses.
    - ``base``: ``[total, count]`` of each tracker (the loss's, then the
      outputs') when the group began, or zeros since the last reset.

    Args:
        num_classes: Integer >= 1, the loss's normaliser classes.
        num_outputs: Integer >= 0, the outputs whose losses Keras logs apart.
    """

    def __init__(self, num_classes, num_outputs=0):
        self.num_classes = num_classes
        self.num_outputs = num_outputs
        summed = tf.VariableAggregation.SUM
        quantities = num_classes + num_outputs
        with tf.name_scope("group_loss"):
            self.sums = replica_local(0, (2 * quantities,), "float32", "group_loss_sums", summed)
            shape = (2 * (1 + num_outputs),)
            self.base = replica_local(0, shape, "float32", "group_loss_base", summed)

    def add(self, tracker, weighted, logged_loss, batch_size, outputs):
        """Adds one micro-step's loss to ``tracker`` and to the group's sums.

        Call in replica context, in place of the tracker's ``update_state``,
        after the forward pass (which updates the outputs' trackers).

        Args:
            tracker: Keras's loss tracker (a ``keras.metrics.Mean``).
            weighted: Per class, ``(a_ci, w_ci, s_c)``: ``a_ci`` ``None`` for
                a class without loss terms in this micro-batch; ``s_c`` the
                class's scale to the tracker's units
                (:meth:`~gradient_accumulator.engine.GradientAccumulator.weigh`).
            logged_loss: Float scalar, the micro-batch's loss in the tracker's
                units (Keras's: the replica's loss times the replicas).
            batch_size: Scalar, the micro-batch's samples.
            outputs: ``None`` (the outputs' trackers left as Keras updated
                them), or per output ``(tracker, r_i, N_i)``: its loss and
                its normaliser (``None`` for a sum).
        """
        size = ops.cast(batch_size, "float32")
        tracker.update_state(ops.cast(logged_loss, "float32"), sample_weight=size)
        if len(weighted) != self.num_classes:
            return  # a layout traced before this one was sized: the micro-batches' logs
        outputs = outputs if outputs and len(outputs) == self.num_outputs else []
        # What the group's end reads of the outputs (trace-time structure):
        # their trackers, and which are sums.
        self._outputs = [(each, None if n is None else 1.0) for each, _, n in outputs]
        zero = ops.zeros((), "float32")
        parts = [zero if a is None else ops.cast(a, "float32") * s for a, _, s in weighted]
        shares = [ops.cast(w, "float32") for _, w, _ in weighted]
        for _, value, normaliser in outputs:
            value = ops.cast(value, "float32")
            if normaliser is None:  # a sum: its loss is its parts' sum (share 0)
                parts.append(value)
                shares.append(zero)
            else:
                normaliser = ops.cast(normaliser, "float32")
                parts.append(value * normaliser)
                shares.append(normaliser)
        missing = self.num_outputs - len(outputs)
        parts += [zero] * missing
        shares += [zero] * missing
        write(self.sums, "add", ops.stack(parts + shares))

    def end(self, tracker, ends_group):
        """The group's end, if ``ends_group``: every tracker corrected, the sums emptied.

        Args:
            tracker: Keras's loss tracker.
            ends_group: Boolean (tensor or Python).
        """
        if ends_group is False:
            return
        sums = self.sums.read_value()
        classes, quantities = self.num_classes, self.num_classes + self.num_outputs
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        parts, shares = sums[:quantities], sums[quantities:]
        losses = [ops.sum(tf.math.divide_no_nan(parts[:classes], shares[:classes])) * replicas]
        trackers = [tracker]
        for k, (output_tracker, normaliser) in enumerate(getattr(self, "_outputs", [])):
            part, share = parts[classes + k], shares[classes + k]
            losses.append(part if normaliser is None else tf.math.divide_no_nan(part, share))
            trackers.append(output_tracker)
        ends = ops.cast(ends_group, "bool")
        base = self.base.read_value()
        after = []
        samples = None  # the group's samples since the base: the loss tracker's count
        for k, (each, loss) in enumerate(zip(trackers, losses)):
            total, count = tracker_state(each)
            added_total, added_count = total - base[2 * k], count - base[2 * k + 1]
            if samples is None:
                samples = added_count
            corrections = [loss * samples - added_total, samples - added_count]
            corrections = [ops.where(ends, c, ops.zeros_like(c)) for c in corrections]
            each.total.assign_add(ops.cast(corrections[0], each.total.dtype))
            each.count.assign_add(ops.cast(corrections[1], each.count.dtype))
            after += [total + corrections[0], count + corrections[1]]
        after += [base[k] for k in range(len(after), 2 * (1 + self.num_outputs))]
        self.base.assign(ops.where(ends, ops.stack(after), base))
        self.sums.assign(ops.where(ends, ops.zeros_like(sums), sums))

    def forget_base(self):
        """The trackers were reset: they hold nothing of the group."""
        self.base.assign(ops.zeros_like(self.base))
