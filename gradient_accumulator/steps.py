"""A model's micro-step and its group's end: what the runner calls, in replica context.

:class:`ModelSteps` is the interface between the group runner
(:mod:`gradient_accumulator.runner`, which decides where and in which
compiled function each runs) and a ``GradientAccumulateModel``:
:meth:`~ModelSteps.micro_step` (the forward pass and the loss,
:meth:`~ModelSteps.forward`; the classes' gradients,
:func:`~gradient_accumulator.weighting.class_gradients`; the add,
:meth:`~gradient_accumulator.engine.GradientAccumulator.add`), the group's
one end for every way a group runs (:meth:`~ModelSteps.end_group`) and the
last update's figures in the logs (:meth:`~ModelSteps.with_update_logs`).
"""

import contextlib
import threading

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator import noise_scale, update
from gradient_accumulator._compat import (
    build_compiled_metrics_outside_trace,
    compute_training_loss,
    loss_tracker,
    output_loss_trackers,
    recorded_loss_reductions,
    sublayers,
)
from gradient_accumulator.distribute import logs_for_keras
from gradient_accumulator.group_loss import tracker_state
from gradient_accumulator.weighting import (
    SUM,
    ClassPlan,
    MicroBatchLoss,
    class_gradients,
    weigh_classes,
    weight_only_loss_count,
)
from gradient_accumulator.writes import read, write

_context = threading.local()


@contextlib.contextmanager
def update_step_scope(is_update_step):
    """Makes ``is_update_step`` the answer of :func:`current_update_step` inside.

    Entered by the model wrapper around its forward pass, so that every layer
    whose state follows the update boundary reads one source of truth instead
    of keeping a counter of its own that could drift.
    """
    stack = _context.__dict__.setdefault("stack", [])
    stack.append(is_update_step)
    try:
        yield
    finally:
        stack.pop()


def current_update_step():
    """Boolean tensor: does the micro-step being traced end its group?

    ``None`` outside a :func:`update_step_scope` (a layer used on its own).
    """
    stack = getattr(_context, "stack", None)
    return stack[-1] if stack else None


def _batch_size(x, y):
    """The batch's rows: the leading dimension of its first tensor, ``x``'s before ``y``'s.

    Call after the forward pass, which refuses a ``None`` for a required input
    with Keras's own error.
    """
    for t in (*keras.tree.flatten(x), *keras.tree.flatten(y)):
        if t is not None:
            return ops.shape(t)[0]
    raise ValueError(
        "A train step received a batch without any tensor: `x` and `y` are both "
        f"None or empty. Pass the data to `fit`. Received: x={x!r}, y={y!r}"
    )


class ModelSteps:
    """The replica-context steps of one ``GradientAccumulateModel``'s groups.

    Args:
        model: The ``GradientAccumulateModel``; its accumulator, group loss,
            state writes and normaliser classes are read when a step is
            traced (the model makes them before each train function).
    """

    def __init__(self, model):
        self._model = model

    @property
    def accumulator(self):
        """The model's :class:`~gradient_accumulator.engine.GradientAccumulator`."""
        return self._model._accumulator

    def micro_step(self, data, micro=None):
        """One micro-step: the gradients of ``data`` added to the sums. Returns ``(marker, logs)``.

        Args:
            data: The batch ``(x, y, sample_weight)``, as ``train_step`` takes it.
            micro: The micro-step's :class:`~gradient_accumulator.engine.MicroStep`,
                where the runner knows its place when tracing: the micro-step
                then only adds, and the runner ends the group after its last.
                ``None`` (Keras's ``train_step``): the accumulator's counters
                decide at run time whether it ends its group, and it then
                also ends it (:meth:`end_group`).

        Returns:
            The marker, the accumulator's count read once the adds are done
            (a batch fetched under a control dependency on it waits for this
            micro-step), and the logs.
        """
        model = self._model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_variables()
        variables = model.trainable_variables
        accumulator = self.accumulator
        # Keras < 3.7 ends an epoch whose steps are not a multiple of
        # `steps_per_execution` with a step that has no batch: it fails at
        # fetching one, after running the ops that do not need it. So the
        # accumulator's state changes wait for the batch.
        inputs = [t for t in tf.nest.flatten(x, expand_composites=True) if t is not None]
        on_its_own = micro is None
        if on_its_own:
            with tf.control_dependencies(inputs):
                micro = accumulator.start_micro_step()
        # The loss's normaliser classes (found before the first trace; one unless
        # the loss mixes normalisers) each have their own weight and gradient:
        # a persistent tape where there are several.
        plan = getattr(model, "_normaliser_classes", None) or ClassPlan.one_class()
        group_loss = model._group_loss
        # The outputs' loss trackers, and their state before the forward pass
        # updates them (read only where the group's loss is logged).
        trackers = output_loss_trackers(model) if group_loss is not None else []
        before = [tracker_state(t) for t in trackers]
        with (
            update_step_scope(micro.is_update_step),
            tf.GradientTape(persistent=accumulator.num_classes > 1) as tape,
        ):
            y_pred, micro_loss = self.forward(x, y, sample_weight, micro.is_first)
            classes = weigh_classes(
                micro_loss, plan, accumulator.num_classes, micro.is_first, tape, model.name
            )
            weighted = accumulator.weigh(classes, micro)
            objectives = [
                None if objective is None else model.optimizer.scale_loss(objective)
                for objective, _, _ in weighted
            ]
        divisors = [divisor for _, divisor, _ in weighted]
        class_grads = class_gradients(tape, objectives, accumulator.routing, variables)
        del tape
        if model.noise_scale:
            self._add_noise_summary(micro_loss, class_grads, divisors, micro)
        # `loss` is scaled by 1/replicas for the cross-replica sum; undo that.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss = micro_loss.loss * replicas
        if group_loss is None:
            loss_tracker(model).update_state(loss, sample_weight=micro_loss.batch_size)
        else:
            # The group's end logs the group's loss (group_loss.py).
            outputs = self._output_losses(micro_loss, trackers, before)
            group_loss.add(loss_tracker(model), weighted, loss, micro_loss.batch_size, outputs)
        # Every state change waits for the batch (see above): the counters'
        # increments depend on nothing else, and TensorFlow may run them in a
        # step whose batch never arrives.
        with tf.control_dependencies(inputs):
            accumulator.add(class_grads, divisors)
            marker = accumulator.micro_step.read_value()
            if on_its_own:
                self.end_group(micro.is_update_step)
        build_compiled_metrics_outside_trace(model, y, y_pred)
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if on_its_own:
            # The update, if any, ran above: its figures.
            logs = self.with_update_logs(logs)
        return marker, logs_for_keras(logs, model.distribute_strategy)

    def end_group(self, condition, measures=None, present=None, logs=None):
        """The group's end, if ``condition``: statistics moved, group loss ended, update.

        The one end of every way a group runs. Layers that hold their
        replica's own statistics move them in the update (their pending
        statistics crossing the replicas in its one reduction), the others
        here; :class:`~gradient_accumulator.group_loss.GroupLoss` ends the
        logged loss; :func:`gradient_accumulator.update.apply_if` hands the
        group's mean gradient to the optimizer and empties the sums.

        Args:
            condition: Python boolean (known when traced) or boolean tensor.
            measures: Whether the noise scale measures this update (a Python
                boolean where the runner knows; ``None``: at run time).
            present: The sums that hold a gradient, where the caller knows
                (a coupled loss's group).
            logs: The logs of the group's last micro-step, or ``None``.

        Returns:
            ``logs`` as they read after the end (``None`` without): the
            metrics' results read again (the group's end corrects the loss
            trackers), the update's figures added.
        """
        model = self._model
        statistics = []
        for layer in self.statistics_layers():
            if layer.merges_replicas_at_update():
                statistics.append((layer.pending_replica_summary(), layer.apply_replica_summaries))
            else:
                layer.apply_pending_statistics(condition)
        if model._group_loss is not None:
            model._group_loss.end(loss_tracker(model), condition)
        update.apply_if(
            self.accumulator,
            condition,
            model.optimizer,
            model.trainable_variables,
            statistics,
            present=present,
            noise_measured=measures,
        )
        if logs is None:
            return None
        after = model.get_metrics_result()
        logs = {key: after.get(key, value) for key, value in logs.items()}
        return logs_for_keras(self.with_update_logs(logs), model.distribute_strategy)

    def with_update_logs(self, logs):
        """``logs`` with the last update's ``gradient_norm`` and noise scale, where tracked."""
        model = self._model
        logs = dict(logs)
        if model.gradient_norm:
            logs["gradient_norm"] = self.accumulator.gradient_norm.read_value()
        if model.noise_scale:
            figures = self.accumulator.noise_logs.read_value()
            for i, name in enumerate(("noise_scale", "noise_scale_trace", "noise_scale_signal")):
                logs[name] = figures[i]
        return logs

    def forward(self, x, y, sample_weight, is_first):
        """The forward pass and the loss: ``(y_pred, MicroBatchLoss)`` (call on a tape).

        Its writes of layer state happen as the big batch's one call makes
        them (:meth:`~gradient_accumulator.state_writes.StateWrites.once_per_update`);
        ``is_first``: whether the micro-step starts its group.
        """
        model = self._model
        with model._state_writes.once_per_update(x, is_first):
            y_pred = model(x, training=True)
        batch_size = _batch_size(x, y)
        with recorded_loss_reductions() as reductions:
            loss = compute_training_loss(model, x, y, y_pred, sample_weight)
        weight_only = weight_only_loss_count(model)
        return y_pred, MicroBatchLoss(loss, reductions, batch_size, model.losses, weight_only)

    def statistics_layers(self):
        """Layers whose statistics follow the update boundary (AccumBatchNormalization), nested."""
        return [
            layer for layer in sublayers(self._model) if hasattr(layer, "apply_pending_statistics")
        ]

    def per_micro_batch_layers(self):
        """Keras BatchNormalization layers (not AccumBatchNormalization): they see micro-batches."""
        return [
            layer
            for layer in sublayers(self._model)
            if isinstance(layer, keras.layers.BatchNormalization)
            and not hasattr(layer, "apply_pending_statistics")
        ]

    def group_state(self):
        """``(restorable, emptied)``: the variables a group's micro-steps write.

        What a group that fails before its end must put back: ``restorable``
        (the model's non-trainable variables, random seeds included, the
        metrics', the group's logged loss, the accumulator's counters, and
        what layers write in a training call, a trainable variable included:
        :class:`~gradient_accumulator.state_writes.StateWrites`) as they
        were, ``emptied`` (the sums) to zeros. The other weights and the
        optimizer's variables change only at the group's end.
        """
        model = self._model
        accumulator = self.accumulator
        emptied = accumulator.all_sums()
        skipped = {id(v) for v in [*emptied, *model.trainable_variables]}
        restorable = [*model.non_trainable_variables, *model.metrics_variables]
        listed = {id(v) for v in restorable}
        restorable += [v for v in model._state_writes.variables if id(v) not in listed]
        if model._group_loss is not None:
            restorable += [model._group_loss.sums, model._group_loss.base]
        restorable += [v for v in accumulator.variables if id(v) not in skipped]
        return restorable, emptied

    def check_variables(self):
        """Refuses to train with a train function traced for other trainable variables.

        Keras keeps the train function it traced until ``compile()``; after a
        ``trainable`` flag changes, it would go on training (and accumulating
        for) the variables of the trace without a word.
        """
        model = self._model
        variables = model.trainable_variables
        accumulator = self.accumulator
        if accumulator is not None and not accumulator.matches(variables):
            raise RuntimeError(
                f"The trainable variables of model '{model.name}' changed after its "
                "train function was built (a `trainable` flag was set): call "
                "`compile()` again before training, as Keras requires. Received: "
                f"{len(variables)} trainable variables, the train function was built "
                f"for {len(accumulator.gradient_sums)}"
            )

    def _add_noise_summary(self, micro_loss, class_grads, divisors, micro):
        """Adds this micro-batch's gradient summary for the noise scale, where it is measured.

        Only the group's last micro-step with ``noise_scale_micro_batches="last"``
        (``micro.is_update_step``: a Python boolean or a tensor), and only the
        updates that the :class:`~gradient_accumulator.noise_scale.Schedule` names.
        """
        model = self._model
        accumulator = self.accumulator
        _, found = micro_loss.partition()
        kinds = [kind for _, kind in (found.partition or [])] if found is not None else []
        if accumulator.num_classes > 1 or SUM in kinds or micro_loss.additional_losses:
            raise ValueError(
                f"Model '{model.name}' has `noise_scale=True`, which needs each micro-batch's "
                "gradient as a mean over its samples (or tokens): a loss of one normaliser, "
                "not a sum (`reduction='sum'`), and no regularizer or `add_loss` term "
                "(counted once per update, they are no micro-batch's). Received: "
                f"{accumulator.num_classes} normaliser class(es), reductions {kinds}, "
                f"{len(micro_loss.additional_losses)} additional loss term(s)"
            )
        if micro.measures is False:
            return  # an update the noise scale skips (`noise_scale_every`): nothing to add
        weight = ops.cast(divisors[0], "float32")
        scale = ops.cast(model.optimizer.scale_loss(tf.constant(1.0)), "float32")
        # The training loss is the replica's share (divided by the replicas).
        factor = weight * scale / tf.distribute.get_strategy().num_replicas_in_sync
        size = weight * read(accumulator.group_references()[0])

        def squared_norm():
            return noise_scale.squared_norm(class_grads[0], accumulator.takes_maximum)

        measured = accumulator.noise_schedule.micro_batch_measured(micro, accumulator.update_count)
        if measured is False:
            squared, measured = ops.zeros((), "float32"), tf.constant(False)
        elif measured is True:
            squared, measured = squared_norm(), None
        else:
            squared = tf.cond(measured, squared_norm, lambda: ops.zeros((), "float32"))
        summary = noise_scale.micro_batch_summary(squared, factor, size, measured)
        write(accumulator.noise_sums, "add", summary)

    def _output_losses(self, micro_loss, trackers, before):
        """Per output whose loss Keras logs apart, ``(tracker, loss, normaliser)``, or ``None``.

        The loss is what the forward pass added to the output's tracker
        (``before``: the ``trackers``' ``[total, count]`` before it); the
        normaliser its recorded reduction's. ``None`` (the micro-batches'
        logs) unless the loss is Keras's own, one per output.
        """
        overridden = type(self._model).compute_loss is not keras.Model.compute_loss
        if overridden or not trackers or len(trackers) != len(micro_loss.records):
            return None
        terms, _ = micro_loss.partition()
        if None in terms:
            return None
        outputs = []
        for tracker, (total, count), term in zip(trackers, before, terms):
            now_total, now_count = tracker_state(tracker)
            loss = tf.math.divide_no_nan(now_total - total, now_count - count)
            outputs.append((tracker, loss, term.normaliser))
        return outputs
