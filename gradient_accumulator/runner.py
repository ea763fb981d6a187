"""The group runner: how ``fit`` and ``train_on_batch`` run micro-steps and updates.

A *group* is ``accum_steps`` micro-steps (fewer at the end of an epoch)
followed by one optimizer update. :class:`GroupRunner` runs the groups of
one :class:`~gradient_accumulator.GradientAccumulateModel`: it decides where
and in which compiled function each step runs, and calls the model's steps
through one interface, :class:`~gradient_accumulator.steps.ModelSteps`, and
the coupled loss's group through
:meth:`~gradient_accumulator.coupled.CoupledGroup.group_function`.

The ways a group runs, each one case of the runner:

- **Whole groups** (:data:`WHOLE_GROUPS`, :meth:`GroupRunner.group_function`):
  ``fit`` on data whose epoch length is known, with no group pending at the
  epoch's start. One compiled call per group: a ``tf.while_loop`` of
  micro-steps that only add (each fetches its batch once the previous one
  has added its gradients), the last micro-step, then the group's end. The
  place of each micro-step is known when traced, so no conditional decides
  the update; the program is one micro-step's size whatever
  ``accum_steps``, and any group length reuses it. Under XLA
  (``jit_compile=True``, one replica) each micro-step is one XLA program
  and the group's end another, called from the loop (one program for the
  whole group would keep several micro-steps' buffers alive).
  ``steps_per_execution=n`` runs ``n`` groups per call of Keras's loop.
- **Coupled whole groups** (:data:`COUPLED_GROUPS`, ``coupled_loss``): the
  same, in two passes over the group's micro-batches
  (:mod:`gradient_accumulator.coupled`). The cases below are refused for it
  (they do not see a whole group).
- **Micro-steps** (:data:`MICRO_STEPS`, :meth:`GroupRunner.micro_steps_function`):
  data of unknown length, an epoch that starts inside a group (a resumed
  checkpoint, or after ``train_on_batch``), and ``train_on_batch``. Keras's
  own train function of ``train_step``, one micro-step per call, which ends
  its group when the accumulator's counters say so (decided at run time).
- **A group cut short** (:meth:`GroupRunner.apply_pending`): the end of a
  group that the data ended before ``accum_steps`` micro-steps (unknown
  length), at the epoch's end.
- **Split batches** (:data:`SPLIT_BATCHES`, :meth:`GroupRunner.split_group_functions`):
  ``micro_batch_size="auto"``: each of ``fit``'s batches is one group, cut
  into micro-batches in the group's function; the micro-steps and the
  group's end are two calls, so that a group that runs out of memory can be
  run again (:mod:`gradient_accumulator.auto_micro_batch`).
- **A group of given batches** (:meth:`GroupRunner.group_of_batches`):
  ``GradientAccumulateModel.group_step``, the whole-groups case unrolled
  over a custom loop's batches, in replica context.

Under a strategy, the steps run in every replica (``strategy.run``); the
update's sums cross the replicas in one batched reduction
(:func:`gradient_accumulator.update.apply_if`).
"""

import contextlib

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import reduce_replica_logs
from gradient_accumulator.auto_micro_batch import (
    AUTO,
    AutoMicroBatch,
    carried_sums,
    write_carried_sums,
    xla_micro_step,
)
from gradient_accumulator.coupled import couples_groups

WHOLE_GROUPS = "whole groups"
COUPLED_GROUPS = "coupled whole groups"
MICRO_STEPS = "micro-steps"
SPLIT_BATCHES = "split batches"


def after(done, data):
    """``data``, read once ``done`` (a tensor, a list of them, or ``None``: at once) is computed."""
    if done is None:
        return data
    with tf.control_dependencies(done if isinstance(done, list) else [done]):
        return tf.nest.map_structure(
            lambda t: t if t is None else tf.identity(t), data, expand_composites=True
        )


def _rows(data):
    """The rows of a batch (its first tensor's), an int32 scalar."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    if isinstance(first, tf.RaggedTensor):
        return tf.cast(first.nrows(), "int32")
    return tf.shape(first)[0]


def local_sum(strategy, value):
    """The sum of a per-replica scalar over the local replicas (a marker of every replica)."""
    return ops.sum(ops.stack(strategy.experimental_local_results(value)))


class EpochBoundary(keras.callbacks.Callback):
    """Tells the runner where ``fit`` is in the epoch; ends the group with the epoch.

    ``fit`` adds this callback itself. It reads the epoch's length (Keras's
    ``steps``; ``None`` for data of unknown length) and the first micro-batch
    of each call of the train function, and whether the epoch starts inside
    a group. An epoch that continues a group tells the accumulator how many
    micro-steps are left, so that its last group ends with its last
    micro-step; with data of unknown length, whatever is left is applied when
    the epoch ends (after validation), as after ``stop_training``.
    """

    def __init__(self, model, steps):
        super().__init__()
        self._owner = model
        self._steps = steps
        self.epoch_steps = None  # micro-batches in this epoch, if known
        self.first_step = 0  # the first micro-batch of the coming call
        self.continues_group = False

    def on_epoch_begin(self, epoch, logs=None):
        accumulator = self._steps.accumulator
        self.epoch_steps = self.params.get("steps")
        self.first_step = 0
        self.continues_group = int(accumulator.micro_step.numpy()) > 0
        known = self.epoch_steps is not None and self.continues_group
        accumulator.steps_to_boundary.assign(int(self.epoch_steps) if known else -1)

    def on_train_batch_begin(self, batch, logs=None):
        self.first_step = batch

    def on_epoch_end(self, epoch, logs=None):
        self._owner.apply_accumulated_gradients()

    def on_train_end(self, logs=None):
        self.epoch_steps = None
        self._steps.accumulator.steps_to_boundary.assign(-1)


class GroupRunner:
    """Runs the micro-steps and group ends of one ``GradientAccumulateModel``.

    Args:
        model: The ``GradientAccumulateModel`` (its public settings:
            ``accum_steps``, ``coupled_loss``, ``jit_compile``,
            ``steps_per_execution``, ``distribute_strategy``, the noise
            scale's).
        steps: Its :class:`~gradient_accumulator.steps.ModelSteps`.
        coupled: Its :class:`~gradient_accumulator.coupled.CoupledGroup`.
    """

    def __init__(self, model, steps, coupled):
        self._model = model
        self._steps = steps
        self._coupled = coupled
        self._functions = {}
        self.epoch_boundary = None  # an EpochBoundary while `fit` runs
        self._fit_steps_per_execution = None
        self.auto = AutoMicroBatch(model, steps, self.split_group_functions)

    def compiled(self, case, measures=True):
        """The function traced for ``case`` (for tests and benchmarks), or ``None`` before any.

        Args:
            case: :data:`WHOLE_GROUPS` (the group's function), ``"xla"``
                (under XLA, its programs: ``(adding, last, end)``),
                :data:`COUPLED_GROUPS`, :data:`MICRO_STEPS` or
                :data:`SPLIT_BATCHES` (``(group, end)``).
            measures: For the whole groups and split batches: the functions
                of the groups the noise scale measures (``True``) or skips.
        """
        if case in (WHOLE_GROUPS, "xla", SPLIT_BATCHES):
            return self._functions.get((case, measures))
        return self._functions.get(case)

    def begin_fit(self):
        """Prepares a ``fit`` call: returns its epoch boundary (a callback).

        Keras's loop calls the train function, and the callbacks' batch
        hooks, once per ``steps_per_execution`` batches: here once per
        ``steps_per_execution`` groups (``accum_steps`` times as many
        micro-batches). :meth:`restore_steps_per_execution`, which the
        model's ``make_train_function`` calls, restores the user's value for
        validation and ``evaluate``.
        """
        model = self._model
        self.epoch_boundary = EpochBoundary(model, self._steps)
        self.forget_update_count()
        self._fit_steps_per_execution = model.steps_per_execution
        model.steps_per_execution = model.accum_steps * self._fit_steps_per_execution
        return self.epoch_boundary

    def end_fit(self):
        self.restore_steps_per_execution()
        self.epoch_boundary = None

    def restore_steps_per_execution(self):
        if self._fit_steps_per_execution is not None:
            self._model.steps_per_execution = self._fit_steps_per_execution
            self._fit_steps_per_execution = None

    def reset(self):
        """Forgets every traced function (a new ``compile`` or train function)."""
        self._functions = {}
        self.auto.reset()

    def case(self):
        """What the coming call of the train function runs: one of the module's cases."""
        model = self._model
        boundary = self.epoch_boundary
        if model.micro_batch_size == AUTO:
            return SPLIT_BATCHES
        if boundary is None or boundary.epoch_steps is None or boundary.continues_group:
            return MICRO_STEPS
        if couples_groups(model):
            return COUPLED_GROUPS
        return WHOLE_GROUPS

    def train_function(self, iterator):
        """The model's train function (``fit`` and ``train_on_batch``): one call of Keras's loop.

        Whole groups: ``steps_per_execution`` groups, or as many micro-batches
        as the epoch has left, its last group shorter. Micro-steps: as many
        micro-steps as Keras's loop expects of the call.
        """
        model = self._model
        boundary = self.epoch_boundary
        # `fit`'s loop expects `steps_per_execution` groups of a call (its own
        # value, restored by then: see `begin_fit`); `train_on_batch` one batch
        # whatever `steps_per_execution` (its iterator holds one).
        per_call = 1 if boundary is None else model.steps_per_execution * model.accum_steps
        case = self.case()
        if case == SPLIT_BATCHES:
            self.forget_update_count()
            return self.auto.train_function(iterator, per_call)
        if case == MICRO_STEPS:
            if couples_groups(model):
                self._refuse_micro_steps()
            self.forget_update_count()
            return self.micro_steps_function()(iterator, per_call)
        count = min(per_call, boundary.epoch_steps - boundary.first_step)
        logs = None
        for start in range(0, count, model.accum_steps):
            length = min(model.accum_steps, count - start)
            if case == COUPLED_GROUPS:
                group = self._compiled_once(COUPLED_GROUPS, self._coupled.group_function)
            else:
                accumulator = self._steps.accumulator
                measures = accumulator.noise_schedule.next_group(accumulator.update_count)
                group = self.group_function(measures)
            logs = group(iterator, tf.constant(length, "int32"))
        return logs

    def forget_update_count(self):
        """Tells the noise scale's schedule that the update count may have moved outside its view.

        Where updates run that the whole-groups case does not count (micro-steps,
        ``group_step``, a group applied early) or the count is set (a new ``fit``, a loaded file).
        """
        if self._steps.accumulator is not None:
            self._steps.accumulator.noise_schedule.forget()

    def _compiled_once(self, key, make, jit_compile=False):
        """``make()``, compiled (``tf.function``, unless ``run_eagerly``) and kept under ``key``."""
        if key not in self._functions:
            function = make()
            if not self._model.run_eagerly:
                function = tf.function(
                    function, reduce_retracing=True, autograph=False, jit_compile=jit_compile
                )
            self._functions[key] = function
        return self._functions[key]

    def group_function(self, measures=True):
        """One whole group (see the module): ``(iterator, length) -> logs``, for every length.

        ``length``: an int32 scalar, 1 to ``accum_steps``; a micro-step is
        traced twice (in the loop and last), one fetch each. ``measures``:
        whether the noise scale measures the update (a Python boolean: one
        function each). The loop's fetch order is the only one between the
        micro-steps (the weights do not change inside a group): without it
        TensorFlow would run their forward passes side by side, holding
        several micro-batches' activations.
        """
        model = self._model
        steps = self._steps
        strategy = model.distribute_strategy
        xla = self._xla_programs(measures) if model.jit_compile and not model.run_eagerly else None

        def make():
            def group(iterator, length):
                accumulator = steps.accumulator

                def add_one(index, done):
                    with tf.control_dependencies([done]):
                        data = next(iterator)
                    if xla is not None:
                        marker, _ = xla[0](data, index, length)
                    else:
                        micro = accumulator.micro_step_at(index, length, False, measures)
                        marker, _ = strategy.run(steps.micro_step, args=(data, micro))
                    return index + 1, local_sum(strategy, marker)

                start = (tf.constant(0, "int32"), tf.zeros((), "int64"))
                _, done = tf.while_loop(lambda index, _: index < length - 1, add_one, start)
                with tf.control_dependencies([done]):
                    data = next(iterator)
                if xla is not None:
                    _, logs = xla[1](data, length - 1, length)
                    logs = xla[2](logs)
                else:
                    micro = accumulator.micro_step_at(length - 1, length, True, measures)
                    _, logs = strategy.run(steps.micro_step, args=(data, micro))
                    logs = strategy.run(steps.end_group, args=(True, measures, None, logs))
                return reduce_replica_logs(logs, strategy)

            return group

        return self._compiled_once((WHOLE_GROUPS, measures), make)

    def _xla_programs(self, measures):
        """Under XLA, the group's ``(adding, last, end)`` programs, each compiled on its own.

        ``adding`` and ``last`` map ``(data, index, length)`` to ``(marker,
        logs)`` (one replica: XLA is refused with several); ``end()`` ends
        the group. The last micro-step is the others' program unless the
        noise scale measures the last micro-batch only, in this update.
        """
        key = ("xla", measures)
        if key not in self._functions:
            steps = self._steps
            strategy = self._model.distribute_strategy

            def compiled(fn):
                return tf.function(fn, reduce_retracing=True, jit_compile=True, autograph=False)

            def step(ends_group):
                def run(data, index, length):
                    micro = steps.accumulator.micro_step_at(index, length, ends_group, measures)
                    return strategy.run(steps.micro_step, args=(data, micro))

                return compiled(run)

            adding = step(False)
            last_only = measures and steps.accumulator.noise_schedule.last_only
            last = step(True) if last_only else adding
            end = compiled(
                lambda logs: strategy.run(steps.end_group, args=(True, measures, None, logs))
            )
            self._functions[key] = (adding, last, end)
        return self._functions[key]

    def split_group_functions(self, measures=True):
        """``(group, end)``: one batch as one group, in two calls (``micro_batch_size="auto"``).

        ``group(data, count, size)`` cuts each replica's rows of ``data`` into
        ``count`` slices of ``size`` rows (a replica's last ones shorter where
        its share is; the same first slice on every replica, which the
        micro-batch weights take as the group's reference) and runs a
        micro-step on each, one after
        the other (each slice is read once the previous one has added its
        gradients), the last one traced as the group's last; it writes the
        sums, metrics and layers' state, never a weight or an optimizer
        variable (under XLA the sums go through the micro-steps' programs as
        values and are written once, after the last). ``end()`` ends the
        group and returns its logs. One trace for every ``count`` and
        ``size``; ``measures``: whether the noise scale measures the group
        (one pair of functions each).
        """
        if (SPLIT_BATCHES, measures) not in self._functions:
            model, steps = self._model, self._steps
            strategy = model.distribute_strategy
            coupled = model.coupled_loss is not None  # refused under XLA (validation)
            xla = model.jit_compile and not model.run_eagerly and not coupled
            if xla:
                programs = {
                    last: xla_micro_step(model, steps, last, measures) for last in (False, True)
                }

            def cut(data, index, size, done):
                # Micro-batch `index` of each replica's rows, read once `done` is.
                def replica(data):
                    rows = _rows(data)
                    start = ops.minimum(index * size, rows)
                    stop = ops.minimum(start + size, rows)
                    return tf.nest.map_structure(
                        lambda t: t if t is None else t[start:stop], after(done, data)
                    )

                return strategy.run(replica, args=(data,))

            def micro_step(data, index, count, size, ends_group, done, sums=None):
                data = cut(data, index, size, [done])
                if xla:
                    return programs[ends_group](data, index, count, sums)

                def run(data):
                    micro = steps.accumulator.micro_step_at(index, count, ends_group, measures)
                    return steps.micro_step(data, micro)

                marker, _ = strategy.run(run, args=(data,))
                return local_sum(strategy, marker)

            def xla_group(data, count, size):
                def add_one(index, done, sums):
                    done, sums = micro_step(data, index, count, size, False, done, sums)
                    return index + 1, done, sums

                start = (tf.constant(0, "int32"), tf.zeros((), "int64"), carried_sums(model, steps))
                _, done, sums = tf.while_loop(lambda index, *_: index < count - 1, add_one, start)
                _, sums = micro_step(data, count - 1, count, size, True, done, sums)
                return write_carried_sums(model, steps, sums)

            def group(data, count, size):
                def add_one(index, done):
                    return index + 1, micro_step(data, index, count, size, False, done)

                start = (tf.constant(0, "int32"), tf.zeros((), "int64"))
                _, done = tf.while_loop(lambda index, _: index < count - 1, add_one, start)
                return micro_step(data, count - 1, count, size, True, done)

            if coupled:
                group = self._coupled.split_group_function(cut)
            elif xla:
                group = xla_group

            def end():
                def run():
                    logs = dict(model.get_metrics_result())
                    if coupled:
                        return self._coupled.end_group(logs)
                    return steps.end_group(True, measures, None, logs)

                return reduce_replica_logs(strategy.run(run), strategy)

            self._functions[(SPLIT_BATCHES, measures)] = (
                self._compiled_once(("split group", measures), lambda: group),
                # Under XLA the update is an XLA program, as the fixed mode's: in graph
                # mode (its optimizer's ops one by one, not fused) it made the settled
                # mode 1.09-1.12x the fixed one (docs/benchmarks.rst). It writes the
                # variables in place; running out of memory there ends `fit`
                # (`AutoMicroBatch.run_group`).
                self._compiled_once(("split end", measures), lambda: end, jit_compile=xla),
            )
        return self._functions[(SPLIT_BATCHES, measures)]

    def _refuse_micro_steps(self):
        model = self._model
        boundary = self.epoch_boundary
        if boundary is None:
            what = "`train_on_batch` (one micro-batch at a time)"
        elif boundary.epoch_steps is None:
            what = (
                "`fit` on data of unknown length (pass `steps_per_epoch`, or a "
                "dataset whose length is known)"
            )
        else:
            what = "an epoch that starts inside a group (a group left pending before `fit`)"
        raise ValueError(
            f"Model '{model.name}' has `coupled_loss={model.coupled_loss!r}`: its loss is "
            "computed on a whole group's outputs at once, so every group runs in one call "
            f"that sees all of its micro-batches. That cannot be done with {what}. Use "
            "`fit` on data of known length, from the start of a group."
        )

    def group_of_batches(self, batches):
        """``group_step``: the whole-groups case unrolled over given batches (see its docstring)."""
        steps = self._steps
        accumulator = steps.accumulator
        self.forget_update_count()
        done = None
        length = len(batches)
        for index, data in enumerate(batches):
            micro = accumulator.micro_step_at(index, length)
            done, logs = steps.micro_step(after(done, data), micro)
        return steps.end_group(True, logs=logs)

    def micro_steps_function(self):
        """``(iterator, steps) -> logs``: up to ``steps`` micro-steps, one call each.

        Each is one call of Keras's own train function of ``train_step``
        (built for one batch per call). A call that runs out of data after
        a micro-step returns its logs; the next call's first fetch then ends
        the epoch, as Keras expects.
        """
        if MICRO_STEPS not in self._functions:
            model = self._model
            # Keras reads `steps_per_execution` when it builds the function
            # and when it traces it.
            with self.steps_per_execution_of(1):
                dispatcher = model.train_function
                keras.Model.make_train_function(model, force=True)
                one_step = model.train_function
                model.train_function = dispatcher

            def micro_steps(iterator, steps):
                logs = None
                for _ in range(steps):
                    try:
                        with self.steps_per_execution_of(1):
                            logs = one_step(iterator)
                    except (StopIteration, tf.errors.OutOfRangeError):
                        if logs is None:
                            raise
                        break
                return logs

            self._functions[MICRO_STEPS] = micro_steps
        return self._functions[MICRO_STEPS]

    @contextlib.contextmanager
    def steps_per_execution_of(self, steps):
        model = self._model
        saved = model.steps_per_execution
        model.steps_per_execution = steps
        try:
            yield
        finally:
            model.steps_per_execution = saved

    def apply_pending(self):
        """Ends a non-empty, unfinished group now (eagerly); otherwise does nothing."""
        steps = self._steps
        self.forget_update_count()
        if int(steps.accumulator.micro_step.numpy()) == 0:
            return

        if "pending" not in self._functions:

            def pending():
                condition = ops.greater(steps.accumulator.micro_step, 0)
                self._model.distribute_strategy.run(steps.end_group, args=(condition,))

            self._functions["pending"] = tf.function(pending, autograph=False)
        self._functions["pending"]()
