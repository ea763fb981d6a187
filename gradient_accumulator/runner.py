"""The group runner: how ``fit`` and ``train_on_batch`` run micro-steps and updates.

A *group* is ``accum_steps`` micro-steps (fewer at the end of an epoch)
followed by one optimizer update. :class:`GroupRunner` runs the groups of
one :class:`~gradient_accumulator.GradientAccumulateModel`; every way a group
is run is one of its named cases:

- **Whole groups** (:meth:`GroupRunner.group_function`): ``fit`` on data whose
  epoch length is known, with no group pending at the epoch's start. One
  compiled call per group: a ``tf.while_loop`` of micro-steps that only add
  (each fetches its batch once the previous one has added its gradients),
  the last micro-step, then the update. The place of each micro-step in its
  group is known when traced, so no conditional decides the update. The
  program is one micro-step's size whatever ``accum_steps``, and any group
  length reuses it. Its two modes:

  - *graph*: the micro-steps and the update are traced inline;
  - *XLA* (``jit_compile=True``, one replica): each micro-step is one XLA
    program and the update another, called from the loop (one program for
    the whole group would keep several micro-steps' buffers alive).

  ``steps_per_execution=n`` runs ``n`` groups per call of Keras's loop, one
  compiled call each.
- **Whole groups of a coupled loss** (:meth:`GroupRunner.coupled_group_function`,
  ``coupled_loss``): one compiled call per group in two passes, each a
  ``tf.while_loop`` over its micro-batches: their outputs first, then the
  group's loss on them, then their gradients through it
  (:mod:`gradient_accumulator.coupled`). Graph and XLA; several replicas.
  The other cases below are refused for it (they do not see a whole group).
- **Micro-steps** (:meth:`GroupRunner.micro_steps_function`): data of unknown
  length, an epoch that starts inside a group (a resumed checkpoint, or
  after ``train_on_batch``), and ``train_on_batch``. Keras's own train
  function of ``train_step``, one micro-step per call, the update decided at
  run time by the accumulator's counters.
- **A group cut short** (:meth:`GroupRunner.apply_pending`): the update of a
  group that the data ended before ``accum_steps`` micro-steps (unknown
  length), at the epoch's end.
- **A group of given batches** (:meth:`GroupRunner.group_of_batches`):
  ``GradientAccumulateModel.group_step``, the whole-group case for a custom
  loop that holds the group's batches (unrolled, in replica context).

Under a strategy, the micro-steps run in every replica (``strategy.run``);
the update's sums cross the replicas in one batched reduction
(:meth:`gradient_accumulator.engine.GradientAccumulator.apply_if`).
"""

import contextlib

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    per_replica,
    raw_value,
    reduce_replica_logs,
    seed_generator_states,
)
from gradient_accumulator.coupled import check_replayed

WHOLE_GROUPS = "whole groups"
MICRO_STEPS = "micro-steps"


def _tensor_leaves(data):
    """The tensors of a batch's structure, and what :func:`_packed` puts them back into."""
    flat = tf.nest.flatten(data)
    template = tf.nest.pack_sequence_as(data, [None if t is None else 0 for t in flat])
    return [t for t in flat if t is not None], (template, [t is None for t in flat])


def _replicas_leaves(strategy, data):
    """Per local replica, the tensors of its shard of ``data`` (:func:`_tensor_leaves`)."""
    leaves, _ = _tensor_leaves(data)
    local = [strategy.experimental_local_results(t) for t in leaves]
    return [[each[r] for each in local] for r in range(len(local[0]))]


def _replicas_results(strategy, result):
    """Per local replica, its part of ``strategy.run``'s ``result`` (a structure)."""
    flat = tf.nest.flatten(result)
    local = [strategy.experimental_local_results(t) for t in flat]
    return [
        tf.nest.pack_sequence_as(result, [each[r] for each in local]) for r in range(len(local[0]))
    ]


def _replica_devices(strategy):
    """The local replicas' devices (``None``: the default strategy's one, unplaced)."""
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has none
        return [None]


def _distributed(values):
    """``values`` (one structure per local replica) as ``strategy.run``'s argument."""
    if len(values) == 1:
        return values[0]
    return tf.nest.map_structure(lambda *each: per_replica(each), *values)


def _packed(structure, leaves):
    template, missing = structure
    values = iter(leaves)
    return tf.nest.pack_sequence_as(template, [None if m else next(values) for m in missing])


def _cached_values(leaves, outputs):
    """Per local replica, what the first pass caches of a micro-batch: tensors, outputs, rows."""
    return [[*each, *out, tf.shape(each[0])[0]] for each, out in zip(leaves, outputs)]


def _cache(like, length, device=None):
    """A ``TensorArray`` of ``length`` micro-batches' rows of tensors like ``like``."""
    shape = like.shape[1:] if like.shape.rank else like.shape
    element = tf.TensorShape([None]).concatenate(shape) if like.shape.rank else shape
    with tf.device(device):
        return tf.TensorArray(like.dtype, size=length, infer_shape=False, element_shape=element)


class Place:
    """Where a micro-step sits in its group, known when it is traced.

    Attributes:
        index: Integer (Python or int32 tensor), its position from 0.
        length: Integer (Python or int32 tensor), its group's micro-steps.
        ends_group: Python boolean, whether it is the group's last (its
            forward pass then moves the statistics of layers that follow the
            update boundary).
        measures: Whether the noise scale measures the group
            (``noise_scale_every``): a Python boolean, or ``None`` to read
            it from the accumulator's count at run time.
    """

    def __init__(self, index, length, ends_group, measures=None):
        self.index = index
        self.length = length
        self.ends_group = ends_group
        self.measures = measures


def after(done, data):
    """``data``, read once ``done`` (a tensor, or ``None``: at once) is computed."""
    if done is None:
        return data
    with tf.control_dependencies([done]):
        return tf.nest.map_structure(
            lambda t: t if t is None else tf.identity(t), data, expand_composites=True
        )


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

    def __init__(self, model):
        super().__init__()
        self._owner = model
        self.epoch_steps = None  # micro-batches in this epoch, if known
        self.first_step = 0  # the first micro-batch of the coming call
        self.continues_group = False

    def on_epoch_begin(self, epoch, logs=None):
        accumulator = self._owner._accumulator
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
        self._owner._accumulator.steps_to_boundary.assign(-1)


class GroupRunner:
    """Runs the micro-steps and updates of one ``GradientAccumulateModel``.

    The model provides, in replica context, ``_micro_step(data, place)`` (one
    micro-batch's forward pass, weighted loss and gradients added to the
    sums; with ``place=None`` the accumulator's counters decide at run time
    whether it also updates) and ``_update(condition)`` (the group's mean
    gradient to the optimizer, then the sums emptied, if ``condition``).
    The runner decides which to call, where and in which compiled function.

    Args:
        model: The ``GradientAccumulateModel``.
    """

    def __init__(self, model):
        self._model = model
        self._functions = {}
        self.epoch_boundary = None  # an EpochBoundary while `fit` runs
        self._fit_steps_per_execution = None
        # The accumulator's update count at the coming group, where known
        # in Python (`_measures_next_group`); `None` to read it.
        self._next_update = None

    # ------------------------------------------------------------------
    # fit's loop
    # ------------------------------------------------------------------

    def begin_fit(self):
        """Prepares a ``fit`` call: returns its callbacks with the epoch boundary.

        Keras's loop calls the train function, and the callbacks' batch
        hooks, once per ``steps_per_execution`` batches: here once per
        ``steps_per_execution`` groups (``accum_steps`` times as many
        micro-batches). :meth:`restore_steps_per_execution`, which the
        model's ``make_train_function`` calls, restores the user's value for
        validation and ``evaluate``.

        Args:
            callbacks: What ``fit`` was given: ``None``, a list, or a
                ``keras.callbacks.CallbackList``; ``first`` callbacks are
                placed before the user's.
        """
        model = self._model
        self.epoch_boundary = EpochBoundary(model)
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

    def case(self):
        """What the coming call of the train function runs: ``WHOLE_GROUPS`` or ``MICRO_STEPS``."""
        boundary = self.epoch_boundary
        if boundary is None or boundary.epoch_steps is None or boundary.continues_group:
            return MICRO_STEPS
        return WHOLE_GROUPS

    def train_function(self, iterator):
        """The model's train function (``fit`` and ``train_on_batch``): one call of Keras's loop.

        Whole groups: ``steps_per_execution`` groups, or as many micro-batches
        as the epoch has left, its last group shorter. Micro-steps: as many
        micro-steps as Keras's loop expects of the call.
        """
        model = self._model
        boundary = self.epoch_boundary
        # `fit`'s loop expects `steps_per_execution` groups of a call (its
        # own value, restored by then: see `begin_fit`); `train_on_batch`
        # one batch, whatever `steps_per_execution` is (its iterator holds
        # one).
        per_call = 1
        if boundary is not None:
            per_call = model.steps_per_execution * model.accum_steps
        coupled = model.coupled_loss is not None and model.accum_steps > 1
        if self.case() == MICRO_STEPS:
            if coupled:
                self._refuse_micro_steps()
            self.forget_update_count()
            return self.micro_steps_function()(iterator, per_call)
        count = min(per_call, boundary.epoch_steps - boundary.first_step)
        logs = None
        for start in range(0, count, model.accum_steps):
            length = min(model.accum_steps, count - start)
            if coupled:
                group = self.coupled_group_function()
            else:
                group = self.group_function(self._measures_next_group())
            logs = group(iterator, tf.constant(length, "int32"))
        return logs

    def forget_update_count(self):
        """The accumulator's update count may have moved outside this runner's view: read it again.

        Called where updates run that ``_measures_next_group`` does not
        count (micro-steps, ``group_step``, a group applied early) and where
        the count is set (a new ``fit``, a loaded file).
        """
        self._next_update = None

    def _measures_next_group(self):
        """Whether the noise scale measures the coming group's update (Python boolean).

        Every group with ``noise_scale_every=1`` (and without the noise
        scale: the flag is then unused). Otherwise the accumulator's count,
        read once (a device sync) after any update this runner did not
        count, then counted here: the updates
        :meth:`GradientAccumulator.noise_update_measured` names.
        """
        model = self._model
        every = model.noise_scale_every if model.noise_scale else 1
        if every == 1:
            return True
        if self._next_update is None:
            self._next_update = int(model._accumulator.update_count.numpy())
        measures = self._next_update % every == 0
        self._next_update += 1
        return measures

    # ------------------------------------------------------------------
    # Whole groups
    # ------------------------------------------------------------------

    def group_function(self, measures=True):
        """One whole group: ``(iterator, length) -> logs``, compiled once for every length.

        ``measures``: whether the noise scale measures its update (a
        Python boolean: one function each).

        ``length`` (an int32 scalar, 1 to ``accum_steps``) micro-batches are
        fetched from ``iterator``. The ``length - 1`` first micro-steps run
        in a ``tf.while_loop``, one after the other: each fetches its batch
        once the previous one has added its gradients (nothing else orders
        them, as the weights do not change inside a group, and TensorFlow
        would run their forward passes side by side, holding several
        micro-batches' activations). Then the last micro-step, and the
        update. A micro-step is traced twice whatever the length (in the
        loop and last), one fetch each.
        """
        key = ("group", measures)
        if key not in self._functions:
            model = self._model
            adding, last, update = self._group_steps(measures)

            def group(iterator, length):
                def adding_one(index, done):
                    with tf.control_dependencies([done]):
                        data = next(iterator)
                    marker, _ = adding(data, index, length)
                    return index + 1, marker

                start = (tf.constant(0, "int32"), tf.zeros((), "int64"))
                _, done = tf.while_loop(lambda index, _: index < length - 1, adding_one, start)
                with tf.control_dependencies([done]):
                    data = next(iterator)
                _, logs = last(data, length - 1, length)
                update()
                return model._with_update_logs(logs)

            if not model.run_eagerly:
                group = tf.function(group, reduce_retracing=True, autograph=False)
            self._functions[key] = group
        return self._functions[key]

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

    # ------------------------------------------------------------------
    # Whole groups of a loss that couples the samples
    # ------------------------------------------------------------------

    def coupled_group_function(self):
        """One whole group in two passes (``coupled_loss``): ``(iterator, length) -> logs``.

        :mod:`gradient_accumulator.coupled` says why and what each pass is.
        Here: the first pass, a ``tf.while_loop`` of one micro-batch after
        the other, fetches each micro-batch and caches it, its outputs and
        its seed generators' states in ``TensorArray`` s (the first
        micro-batch peeled off the loop: its outputs give the caches' types);
        the loss then runs on the caches concatenated; the second pass, a
        loop again, puts back each micro-batch's seed states and adds its
        gradients. Then the update. The loops run one iteration at a time
        (``parallel_iterations=1``), so that one micro-batch's activations
        are alive at a time. Under XLA, each step is a program of its own.
        """
        if "coupled" not in self._functions:
            model = self._model
            strategy = model.distribute_strategy
            forward, loss, backward, update = self._coupled_steps()

            def group(iterator, length):
                seeds = seed_generator_states(model)
                devices = _replica_devices(strategy)
                data = next(iterator)
                _, structure = _tensor_leaves(data)
                leaves = _replicas_leaves(strategy, data)
                saved = [raw_value(seed) for seed in seeds]
                outputs = forward(leaves, structure, tf.constant(True))
                # Per replica: its micro-batch's tensors, outputs, rows; the seed states.
                caches = [
                    [_cache(t, length, device).write(0, t) for t in values]
                    for values, device in zip(_cached_values(leaves, outputs), devices)
                ]
                seed_caches = [_cache(t, length).write(0, t) for t in saved]

                def first_pass(index, caches, seed_caches):
                    flows = [c.flow for c in tf.nest.flatten(caches) + seed_caches]
                    with tf.control_dependencies(flows):
                        data = next(iterator)
                    leaves = _replicas_leaves(strategy, data)
                    saved = [raw_value(seed) for seed in seeds]
                    outputs = forward(leaves, structure, tf.constant(False))
                    caches = [
                        [c.write(index, v) for c, v in zip(replica_caches, values)]
                        for replica_caches, values in zip(caches, _cached_values(leaves, outputs))
                    ]
                    seed_caches = [c.write(index, v) for c, v in zip(seed_caches, saved)]
                    return index + 1, caches, seed_caches

                _, caches, seed_caches = tf.while_loop(
                    lambda index, *_: index < length,
                    first_pass,
                    (tf.constant(1, "int32"), caches, seed_caches),
                    parallel_iterations=1,
                )
                n_leaves = len(leaves[0])
                group_leaves = [[c.concat() for c in each[:n_leaves]] for each in caches]
                group_outputs = [[c.concat() for c in each[n_leaves:-1]] for each in caches]
                output_grads, logs = loss(group_leaves, group_outputs, structure)
                rows = [each[-1].stack() for each in caches]
                grad_caches = [
                    [_cache(g, length, device).split(g, replica_rows) for g in grads]
                    for grads, replica_rows, device in zip(output_grads, rows, devices)
                ]

                def second_pass(index, done, drift):
                    with tf.control_dependencies([done]):
                        for seed, cache in zip(seeds, seed_caches):
                            seed.assign(cache.read(index))
                        leaves = [[c.read(index) for c in each[:n_leaves]] for each in caches]
                    grads = [[c.read(index) for c in each] for each in grad_caches]
                    first = [[c.read(index) for c in each[n_leaves:-1]] for each in caches]
                    marker, step_drift = backward(
                        leaves, grads, structure, ops.equal(index, 0), first
                    )
                    return index + 1, marker, ops.maximum(drift, step_drift)

                _, _, drift = tf.while_loop(
                    lambda index, *_: index < length,
                    second_pass,
                    (tf.constant(0, "int32"), tf.zeros((), "int64"), tf.zeros(())),
                    parallel_iterations=1,
                )
                with tf.control_dependencies([check_replayed(drift, model.name)]):
                    update()
                return model._with_update_logs(logs)

            if not model.run_eagerly:
                group = tf.function(group, reduce_retracing=True, autograph=False)
            self._functions["coupled"] = group
        return self._functions["coupled"]

    def _coupled_steps(self):
        """The two-pass group's ``(forward, loss, backward, update)``, in graph or XLA mode.

        Called in cross-replica context with per-replica lists (one entry
        per local replica) of the batch's tensors (``structure`` packs them:
        :func:`_tensor_leaves`), outputs and output gradients; ``forward``
        returns the replicas' outputs, ``loss`` their output gradients and
        the reduced logs, ``backward`` a marker computed after the adds.
        """
        model = self._model
        strategy = model.distribute_strategy
        coupled = model._coupled_group
        batch = {}  # the batch's structure, set by the group's trace (`pack`)

        def pack(leaves):
            return _packed(batch["structure"], leaves)

        def forward_in_replica(leaves, is_first):
            return coupled.forward(pack(leaves), is_first)

        def loss_in_replica(leaves, outputs):
            return coupled.loss(pack(leaves), outputs)

        def backward_in_replica(leaves, grads, is_first, first_outputs):
            return coupled.backward(pack(leaves), grads, is_first, first_outputs)

        if model.jit_compile and not model.run_eagerly:
            # One replica (XLA is refused with several): each a program of its own.
            def compiled(fn):
                return tf.function(fn, reduce_retracing=True, jit_compile=True, autograph=False)

            forward_in_replica = compiled(forward_in_replica)
            loss_in_replica = compiled(loss_in_replica)
            backward_in_replica = compiled(backward_in_replica)

        def forward(leaves, structure, is_first):
            batch["structure"] = structure
            result = strategy.run(forward_in_replica, args=(_distributed(leaves), is_first))
            return _replicas_results(strategy, result)

        def loss(leaves, outputs, structure):
            batch["structure"] = structure
            grads, logs = strategy.run(
                loss_in_replica, args=(_distributed(leaves), _distributed(outputs))
            )
            return _replicas_results(strategy, grads), reduce_replica_logs(logs, strategy)

        def backward(leaves, grads, structure, is_first, first_outputs):
            batch["structure"] = structure
            arguments = (_distributed(leaves), _distributed(grads), is_first)
            marker, drift = strategy.run(
                backward_in_replica, args=(*arguments, _distributed(first_outputs))
            )
            marker = ops.sum(ops.stack(strategy.experimental_local_results(marker)))
            return marker, ops.max(ops.stack(strategy.experimental_local_results(drift)))

        def update():
            strategy.run(coupled.update)

        if model.jit_compile and not model.run_eagerly:
            update = tf.function(update, jit_compile=True, autograph=False)
        return forward, loss, backward, update

    def _group_steps(self, measures):
        """The group's ``(adding, last, update)`` callables, in graph or in XLA mode.

        ``measures``: whether the noise scale measures the group (Python boolean).

        ``adding`` and ``last`` map ``(data, index, length)`` to ``(marker,
        logs)``: the marker is a tensor computed once the micro-step's
        gradients are added (:meth:`_step_in_replica`). ``update() -> None``.
        Each is called in cross-replica context.
        """
        model = self._model
        strategy = model.distribute_strategy

        def step(ends_group):
            def run(data, index, length):
                place = Place(index, length, ends_group, measures)
                marker, logs = strategy.run(self._step_in_replica, args=(data, place))
                marker = ops.sum(ops.stack(strategy.experimental_local_results(marker)))
                return marker, reduce_replica_logs(logs, strategy)

            return run

        def update():
            strategy.run(model._update, args=(True, measures))

        if not (model.jit_compile and not model.run_eagerly):
            return step(False), step(True), update

        # XLA: each a program of its own. Without layers that follow the
        # update boundary, the last micro-step is the same computation as
        # the others (one program for both), unless the noise scale measures
        # the last micro-batch only (its reduction in that program alone).
        def compiled(fn):
            return tf.function(fn, reduce_retracing=True, jit_compile=True, autograph=False)

        adding = compiled(step(False))
        last_differs = model._statistics_layers() or (measures and model._noise_measures_last())
        last = compiled(step(True)) if last_differs else adding
        self._functions[("xla", measures)] = (adding, last, compiled(update))
        return self._functions[("xla", measures)]

    def _step_in_replica(self, data, place):
        """One micro-step at ``place`` (replica context): ``(marker, logs)``.

        The marker is the accumulator's count, read after the micro-step's
        adds (the count moves after them): a batch fetched under a control
        dependency on it waits for this micro-step.
        """
        logs = self._model._micro_step(data, place)
        return self._model._accumulator.micro_step.read_value(), logs

    def group_of_batches(self, batches):
        """``group_step``: a whole group of given batches, in replica context.

        The whole-groups case unrolled over a Python sequence: each
        micro-step reads its batch once the previous one has added its
        gradients; the last one's logs are returned after the update.
        """
        model = self._model
        self.forget_update_count()
        done = None
        length = len(batches)
        for index, data in enumerate(batches[:-1]):
            done, _ = self._step_in_replica(after(done, data), Place(index, length, False))
        logs = model._micro_step(after(done, batches[-1]), Place(length - 1, length, True))
        model._update(True)
        return logs

    # ------------------------------------------------------------------
    # Micro-steps, and a group cut short
    # ------------------------------------------------------------------

    def micro_steps_function(self):
        """``(iterator, steps) -> logs``: up to ``steps`` micro-steps, one call each.

        Each is one call of Keras's own train function of ``train_step``
        (built for one batch per call). A call that runs out of data after
        a micro-step returns its logs; the next call's first fetch then ends
        the epoch, as Keras expects.
        """
        if "micro_step" not in self._functions:
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

            self._functions["micro_step"] = micro_steps
        return self._functions["micro_step"]

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
        """Applies a non-empty, unfinished group now (eagerly); otherwise does nothing."""
        model = self._model
        self.forget_update_count()
        if int(model._accumulator.micro_step.numpy()) == 0:
            return
        if "pending" not in self._functions:

            def pending_in_replica():
                # No last micro-step moved the statistics: they move here.
                model._apply_statistics(None)
                model._end_cut_group(ops.greater(model._accumulator.micro_step, 0))

            @tf.function(autograph=False)
            def pending():
                model.distribute_strategy.run(pending_in_replica)

            self._functions["pending"] = pending
        self._functions["pending"]()
