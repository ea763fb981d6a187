"""The accumulation engine shared by the model wrapper, the optimizer wrapper and BN.

One :class:`GradientAccumulator` holds the float32 gradient sums of one
accumulation group: their state, the normaliser classes they are kept by,
their persistence in weights files, and the add of each micro-step. It
decides, once per micro-step, whether this micro-step ends the group (a
:class:`MicroStep`); everything that must line up with the optimizer update
reads that decision: the update (:mod:`gradient_accumulator.update`, where
the formula is written) and, while the model's forward pass is traced,
layers such as ``AccumBatchNormalization``
(:func:`gradient_accumulator.steps.current_update_step`).
"""

import warnings

import numpy as np
import tensorflow as tf
from keras import ops

from gradient_accumulator import noise_scale
from gradient_accumulator._compat import KerasSaveable
from gradient_accumulator.distribute import all_reduce_in_replica
from gradient_accumulator.writes import read, write

# The keys of the accumulation state in a Keras weights store (`.keras` and
# `.weights.h5` files), beside the owner's own numbered variables.
STATE_KEY_PREFIX = "accumulator_"
# The store key of the normaliser classes' routing (see `configure_classes`),
# saved beside the state so that a group can resume before `fit` finds them.
CLASSES_KEY = STATE_KEY_PREFIX + "classes"


def without_state(store):
    """The entries of a Keras weights store that are not accumulation state."""
    return {key: store[key] for key in store.keys() if not key.startswith(STATE_KEY_PREFIX)}


class StateEntry(KerasSaveable):
    """The accumulation state's own entry in Keras weights files (``.keras``, ``.weights.h5``).

    Keras saves a model's attribute that holds one at the attribute's path,
    after the layers. The plain Keras model of the same graph never reads the
    entry; a file it saved has none, which ``load`` receives as an empty store.
    ``save`` and ``load`` are callables ``(store) -> None``, not the owner:
    Keras walks a saveable's attributes, and would walk the owner again.
    """

    def __init__(self, save, load):
        self._save = save
        self._load = load

    def _obj_type(self):
        return "Layer"

    def save_own_variables(self, store):
        self._save(store)

    def load_own_variables(self, store):
        self._load(store)


def save_state(accumulator, store):
    """Writes ``accumulator``'s state into a Keras weights ``store`` (keys ``accumulator_<i>``).

    And the normaliser classes' routing (key :data:`CLASSES_KEY`).
    """
    for i, variable in enumerate(accumulator.state_variables):
        store[f"{STATE_KEY_PREFIX}{i}"] = variable.numpy()
    routing = accumulator.routing
    width = max((len(classes) for classes in routing), default=0)
    store[CLASSES_KEY] = np.array(
        [list(classes) + [-1] * (width - len(classes)) for classes in routing], "int32"
    ).reshape(len(routing), width)


def load_state(accumulator, store, owner, variables=None):
    """Restores ``accumulator``'s state from a Keras weights ``store`` (of :func:`save_state`).

    Does nothing if ``store`` holds no state; warns, and starts a new
    group, if it holds state for another set of variables. A store with
    normaliser classes configures them first (``configure_classes``,
    which creates variables: call it eagerly, under the strategy scope).

    Args:
        store: The mapping Keras hands ``load_own_variables``.
        owner: String naming the model or optimizer, for the warning.
        variables: The accumulator's trainable variables; needed only to
            configure classes.
    """
    saved = [key for key in store.keys() if key.startswith(STATE_KEY_PREFIX) and key != CLASSES_KEY]
    if not saved:
        return
    if CLASSES_KEY in store.keys() and variables is not None and accumulator.matches(variables):
        routing = [[int(c) for c in row if c >= 0] for row in np.asarray(store[CLASSES_KEY])]
        accumulator.configure_classes(routing, variables)
    state = accumulator.state_variables
    saved_shapes = [tuple(np.shape(store[f"{STATE_KEY_PREFIX}{i}"])) for i in range(len(saved))]
    shapes = [tuple(variable.shape) for variable in state]
    if saved_shapes != shapes:
        # The weights that the file holds do not fit either (Keras says so
        # for the layer that differs): the sums are another model's.
        warnings.warn(
            f"Not restoring the accumulation state of {owner}: the file holds "
            f"{len(saved)} accumulation variables of other shapes than its "
            f"{len(state)}. Training starts a new accumulation group.",
            stacklevel=3,
        )
        accumulator.empty_group()
        return
    for i, variable in enumerate(state):
        # An array: Keras < 3.14's weight files hand out h5py datasets,
        # which TensorFlow variables cannot take under tf.distribute.
        variable.assign(np.asarray(store[f"{STATE_KEY_PREFIX}{i}"]))


def takes_maximum(variable):
    """Whether ``variable`` takes its group's maximum gradient, not the mean.

    Keras's ``overwrite_with_gradient`` variables (float8 layers' scales and
    amax histories) receive their new value as their "gradient", which the
    optimizer assigns. The new amax history is the old one with the
    micro-batch's largest magnitude in front, the new scale depends on the old
    state only: the maximum over the micro-batches is the big batch's value
    exactly, a mean is not (Keras's ``gradient_accumulation_steps`` agrees).
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


class MicroStep:
    """What is known of a micro-step before its forward pass: where it sits in its group.

    Attributes:
        is_update_step: Boolean scalar, whether it ends its group: a Python
            ``bool`` where known when traced (a whole group's function),
            else a tensor the accumulator's counters decide.
        is_first: Boolean scalar, whether it starts its group (the same).
        group_length: Float32 scalar ``K``, the micro-steps its group is
            planned to have (``accum_steps``, or fewer at the end of an
            epoch of known length).
        measures: Whether the noise scale measures its group's update
            (``noise_scale_every``): a Python boolean where known when
            traced, ``None`` to read the accumulator's count at run time.
    """

    def __init__(self, is_update_step, is_first, group_length, measures=None):
        self.is_update_step = is_update_step
        self.is_first = is_first
        self.group_length = group_length
        self.measures = measures


def replica_local(value, shape, dtype, name, aggregation):
    # A TensorFlow variable: `keras.Variable` takes `synchronization`
    # only from Keras 3.10 (and exposes its TensorFlow variable, whose
    # in-place ops the engine needs, as `.value`).
    return tf.Variable(
        lambda: tf.fill(shape, tf.constant(value, dtype)),
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
    )


def _maximum_in_place(acc, grad, is_first):
    """``acc`` becomes ``grad`` at a group's first micro-step, else ``max(acc, grad)``."""
    grad = ops.cast(tf.convert_to_tensor(grad), "float32")  # IndexedSlices densified
    return write(acc, "assign", ops.where(is_first, grad, ops.maximum(read(acc), grad)))


def _add_in_place(acc, grad):
    if isinstance(grad, tf.IndexedSlices):
        return write(acc, "scatter_add", grad)
    # The TensorFlow variable's own assign_add adds in place (Keras's
    # `Variable.assign_add` is `assign(self + value)`, which allocates a new
    # sum every micro-step).
    return write(acc, "add", ops.cast(grad, "float32"))


class _ClassLayout:
    """Where each normaliser class's gradients are summed (plain Python, not tracked).

    Attributes:
        routing: Tuple, per variable, of the classes whose gradient reaches it.
        slots: List, per variable, of ``(class, sum variable)``: the first
            class's sum is the variable's entry of ``gradient_sums``, each
            further class has one of ``class_gradient_sums``.
    """

    def __init__(self, routing, slots):
        self.routing = routing
        self.slots = slots
        self.num_classes = 1 + max((c for cs in routing for c in cs), default=0)

    @classmethod
    def one_class(cls, sums):
        return cls(((0,),) * len(sums), [[(0, acc)] for acc in sums])

    def flat(self):
        return [(i, c, acc) for i, entries in enumerate(self.slots) for c, acc in entries]


def _sum_aggregation(variable):
    """How a sum reads outside the replicas (saving): the total, or one replica's maximum.

    TensorFlow aggregates replica-local variables by sum or mean only: a sum of
    maxima saved inside a group keeps the first replica's (every replica's on
    restoring).
    """
    if takes_maximum(variable):
        return tf.VariableAggregation.ONLY_FIRST_REPLICA
    return tf.VariableAggregation.SUM


def _sum_name(variable):
    path = getattr(variable, "path", None) or variable.name
    return path.replace("/", "_").replace(":", "_") + "_accumulator"


class GradientAccumulator(tf.Module):
    """Float32 gradient sums of one accumulation group and its update boundary.

    Each micro-step adds into the sums in place (:meth:`add`); the update
    that divides them is :mod:`gradient_accumulator.update`, where the
    formula is written. A group ends after ``accum_steps`` micro-steps, or earlier when
    ``steps_to_boundary`` (set by the caller, e.g. to the micro-steps left in
    the epoch) reaches zero.

    State (replica-local variables created at construction, float32 sums
    whatever the compute dtype):

    - ``gradient_sums[j]``: ``sum_i(w_i * g_ij)`` for trainable variable ``j``
      (``w_i`` the micro-batch's :meth:`share`); ``max_i(g_ij)`` for one
      marked ``overwrite_with_gradient`` (:func:`takes_maximum`).
    - ``weight_sum``: ``sum_i(w_i)``, the divisor of the mean.
    - ``group_reference``: ``C_1 * K``, set at the group's first micro-step.
    - ``micro_step``: micro-steps accumulated in the current group.
    - ``update_count``: updates made through this accumulator (the argument
      of a scheduled ``accum_steps``).
    - ``steps_to_boundary``: micro-steps left before a forced group end,
      negative for none. Transient: not in :attr:`state_variables` (so not
      saved); ``fit`` sets it at every epoch's start.
    - ``pending_weight``: the weight :meth:`set_pending_weight` gave the
      coming micro-step (the optimizer wrapper's ``scale_loss``), negative
      for none; read and cleared by :meth:`take_pending_weight`. Transient.

    Args:
        accum_steps: Integer >= 1, micro-steps per update; or a callable
            mapping the update count (int64 scalar tensor) to an integer
            tensor >= 1, to grow the effective batch during training.
        variables: The trainable variables whose gradients are accumulated,
            in the order gradients will be passed.
        gradient_transform: Optional callable ``(grads, variables) -> grads``
            applied to the group's mean gradient before the optimizer sees it
            (e.g. adaptive gradient clipping). ``None`` entries stay ``None``.
        reduce_every_micro_step: Boolean. ``False`` (the default): the sums
            are replica-local and cross replicas once, at the update. ``True``:
            each micro-step's gradient is all-reduced before it is added, so
            the sums are global between updates (``accum_steps`` times the
            communication).
        track_gradient_norm: Boolean, keep each update's mean gradient's
            norm in ``gradient_norm``.
        noise_scale_decay: ``None``, or the noise scale's moving averages'
            decay (:mod:`gradient_accumulator.noise_scale`).
        noise_scale_every: Integer >= 1: the noise scale measures one update
            in that many (``noise_schedule``, a
            :class:`~gradient_accumulator.noise_scale.Schedule`).
        noise_scale_last_only: Boolean, the noise scale measures each
            measured group's last micro-batch only.
        name: String, the name scope of the state.
    """

    def __init__(
        self,
        accum_steps,
        variables,
        gradient_transform=None,
        reduce_every_micro_step=False,
        track_gradient_norm=False,
        noise_scale_decay=None,
        noise_scale_every=1,
        noise_scale_last_only=False,
        name="gradient_accumulator",
    ):
        super().__init__(name=name)
        self.track_gradient_norm = track_gradient_norm
        self.noise_scale_decay = noise_scale_decay
        measured = noise_scale_decay is not None
        self.noise_schedule = noise_scale.Schedule(
            noise_scale_every if measured else 1, noise_scale_last_only and measured
        )
        self.accum_steps = accum_steps
        self.gradient_transform = gradient_transform
        self.reduce_every_micro_step = reduce_every_micro_step
        # Identities only: holding the variables would make tf.train.Checkpoint
        # save every model weight a second time under this object.
        self._variable_ids = tuple(id(v) for v in variables)
        self.takes_maximum = tuple(takes_maximum(v) for v in variables)

        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        local = replica_local
        with tf.name_scope(name):
            self.gradient_sums = [
                local(0, v.shape, "float32", _sum_name(v), _sum_aggregation(v)) for v in variables
            ]
            self.weight_sum = local(0, (), "float32", "weight_sum", tf.VariableAggregation.SUM)
            self.group_reference = local(1, (), "float32", "group_reference", first)
            self.micro_step = local(0, (), "int64", "micro_step", first)
            self.steps_to_boundary = local(-1, (), "int64", "steps_to_boundary", first)
            self.update_count = local(0, (), "int64", "update_count", first)
            self.pending_weight = local(-1, (), "float32", "pending_weight", first)
            if track_gradient_norm:
                # The last update's mean gradient's norm. Transient.
                self.gradient_norm = local(0, (), "float32", "gradient_norm", first)
            if noise_scale_decay is not None:
                # The noise scale (see noise_scale.py): the group's micro-batch
                # summaries (summed over the replicas at the update), the
                # moving averages of the estimates, and the last update's
                # [noise scale, trace, signal]. Transient.
                summed = tf.VariableAggregation.SUM
                size = (noise_scale.SUMMARY_SIZE,)
                self.noise_sums = local(0, size, "float32", "noise_sums", summed)
                self.noise_averages = local(0, (2,), "float32", "noise_averages", first)
                self.noise_logs = local(0, (3,), "float32", "noise_logs", first)
        # The normaliser classes (see `configure_classes`) after the first,
        # each with its divisor, its reference and its extra sums: none for
        # a loss of one class.
        self.class_weight_sums = []
        self.class_group_references = []
        self.class_gradient_sums = []
        self._classes = _ClassLayout.one_class(self.gradient_sums)

    @property
    def state_variables(self):
        """The variables a checkpoint must hold to resume inside a group."""
        # The further classes' state last: a one-class file is a prefix.
        return [
            self.micro_step,
            self.weight_sum,
            self.group_reference,
            self.update_count,
            *self.gradient_sums,
            *self.class_weight_sums,
            *self.class_group_references,
            *self.class_gradient_sums,
        ]

    @property
    def num_classes(self):
        """Normaliser classes with a divisor of their own (1 unless configured)."""
        return self._classes.num_classes

    @property
    def routing(self):
        """Per trainable variable, the normaliser classes whose gradient it sums."""
        return self._classes.routing

    def configure_classes(self, routing, variables):
        """Gives every normaliser class its own divisor, and its own sums where needed.

        Class ``c``'s weighted gradients are summed in ``G_c``, its shares in
        ``W_c`` (the mean: :mod:`gradient_accumulator.update`). A variable
        reached by one class (a head's) keeps its one sum in ``gradient_sums``;
        one reached by several (the shared trunk) gets one more per further
        class, in ``class_gradient_sums``. Creates variables: call eagerly,
        under the strategy scope. A routing of one class restores the
        one-class layout (the extra variables are dropped).

        Args:
            routing: Sequence, per variable in the order of ``variables``, of
                the ascending class indices whose gradient reaches it; ``None``
                for one class.
            variables: The accumulator's trainable variables (those it was
                built for: see :meth:`matches`).
        """
        if routing is not None:
            routing = tuple(tuple(sorted(classes)) for classes in routing)
        layout_classes = 1 + max((c for cs in routing or () for c in cs), default=0)
        if layout_classes < 2:
            routing = ((0,),) * len(self.gradient_sums)  # one class: every sum its own
        if self._classes.routing == routing:
            return
        sum_ = tf.VariableAggregation.SUM
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        with tf.name_scope(self.name):
            weight_sums = [
                replica_local(0, (), "float32", f"weight_sum_class_{c}", sum_)
                for c in range(1, layout_classes)
            ]
            references = [
                replica_local(1, (), "float32", f"group_reference_class_{c}", first)
                for c in range(1, layout_classes)
            ]
            extra, slots = [], []
            for variable, primary, classes in zip(variables, self.gradient_sums, routing):
                entries = [(c, primary) for c in classes[:1]]
                for c in classes[1:]:
                    name = _sum_name(variable).replace("_accumulator", f"_class_{c}_accumulator")
                    aggregation = _sum_aggregation(variable)
                    extra.append(replica_local(0, variable.shape, "float32", name, aggregation))
                    entries.append((c, extra[-1]))
                slots.append(entries)
        self._set_class_state("class_weight_sums", weight_sums)
        self._set_class_state("class_group_references", references)
        self._set_class_state("class_gradient_sums", extra)
        self._classes = _ClassLayout(routing, slots)
        if hasattr(self, "traced_slots"):
            del self.traced_slots  # slots of the layout traced before

    def _set_class_state(self, name, variables):
        # Into the tracked (empty) list of one class: a tf.train.Checkpoint
        # restored before the classes were configured restores the variables
        # as they are added (a new list would not be restored).
        current = getattr(self, name)
        if len(current) == 0:
            current.extend(variables)
        else:
            setattr(self, name, variables)

    def weight_sums(self):
        return [self.weight_sum, *self.class_weight_sums]

    def group_references(self):
        return [self.group_reference, *self.class_group_references]

    def all_sums(self):
        return [*self.gradient_sums, *self.class_gradient_sums]

    def empty_group(self):
        """Empties the group eagerly, keeping ``update_count`` (a file without the state loaded)."""
        for acc in self.all_sums():
            acc.assign(tf.zeros(acc.shape, acc.dtype))
        for total in self.weight_sums():
            total.assign(0.0)
        for reference in self.group_references():
            reference.assign(1.0)
        self.micro_step.assign(0)

    def matches(self, variables):
        """Whether this accumulator was built for exactly ``variables``."""
        return tuple(id(v) for v in variables) == self._variable_ids

    def start_micro_step(self):
        """Starts a micro-step (before the forward pass): returns a :class:`MicroStep`."""
        steps_left = self.steps_to_boundary.assign_sub(1)
        steps = ops.cast(self.current_accum_steps(), "int64")
        is_update_step = ops.logical_or(
            ops.greater_equal(self.micro_step + 1, steps), ops.equal(steps_left, 0)
        )
        is_first = ops.equal(self.micro_step, 0)
        # The micro-steps this group will have, as far as known at its start
        # (the epoch's last group is shorter when the epoch's length is known).
        planned = ops.where(
            ops.greater_equal(steps_left, 0), ops.minimum(steps, steps_left + 1), steps
        )
        return MicroStep(is_update_step, is_first, ops.cast(planned, "float32"))

    def micro_step_at(self, index, length, ends_group=None, measures=None):
        """The :class:`MicroStep` of micro-step ``index`` of a group of ``length``.

        For a function that runs a whole group, which must start empty: whether
        it ends its group is known when traced (``is_update_step``, a Python
        boolean). ``index`` and ``length`` may be integer tensors (one trace
        for every place in every group) if ``ends_group`` says whether it is
        the last; with Python integers it may be ``None``.
        """
        if ends_group is None:
            ends_group = index == length - 1
        is_first = index == 0 if isinstance(index, int) else ops.equal(index, 0)
        return MicroStep(ends_group, is_first, ops.cast(length, "float32"), measures)

    def planned_micro_step(self):
        """The :class:`MicroStep` the next micro-step will be, without starting it.

        For callers that weight the loss before the step (the optimizer
        wrapper's ``scale_loss``); ``is_update_step`` is left ``None``.
        """
        steps = ops.cast(self.current_accum_steps(), "float32")
        return MicroStep(None, ops.equal(self.micro_step, 0), steps)

    def set_pending_weight(self, weight):
        """Records the weight the coming micro-step's gradients carry."""
        self.pending_weight.assign(ops.cast(weight, "float32"))

    def take_pending_weight(self):
        """The recorded weight of this micro-step (1 if none), and clears it."""
        pending = ops.convert_to_tensor(self.pending_weight)
        weight = ops.where(ops.greater_equal(pending, 0.0), pending, 1.0)
        with tf.control_dependencies([weight]):
            self.pending_weight.assign(-1.0)
        return weight

    def share(self, normaliser, capacity, micro, normaliser_class=0):
        """The micro-batch weight ``w_i = N_i / (C_1 * K)`` (float32, no gradient).

        Args:
            normaliser: Scalar, ``N_i``: what the micro-batch's loss is
                divided by (samples, valid tokens, sum of sample weights).
            capacity: Scalar > 0, ``C_i``: the most ``N_i`` can be for a
                micro-batch of this shape, the same on every replica whose
                shard has the same shape (samples, padded tokens).
            micro: The :class:`MicroStep` from :meth:`start_micro_step`.
            normaliser_class: Integer, the class (see
                :meth:`configure_classes`) whose reference ``C_1 * K`` to use.
        """
        capacity = ops.cast(capacity, "float32")
        stored = self.group_references()[normaliser_class]
        reference = ops.where(micro.is_first, capacity * micro.group_length, stored)
        write(stored, "assign", reference)
        return tf.stop_gradient(ops.cast(normaliser, "float32") / reference)

    def weigh(self, classes, micro):
        """Each class's objective times the micro-batch's weight: ``(objective, divisor, scale)``.

        The one place a micro-batch's weight is made from what
        :func:`~gradient_accumulator.weighting.weigh_classes` returns: a
        class with a normaliser is multiplied by its weight :meth:`share`,
        which is also its divisor; a sum (no normaliser) by 1, its divisor 1
        at the group's first micro-step and 0 after; a class without terms
        in this micro-batch has no objective and divisor 0.
        """
        first = ops.cast(micro.is_first, "float32")
        weighted = []
        for c, (objective, normaliser, capacity, scale) in enumerate(classes):
            if objective is None:
                weighted.append((None, ops.zeros(()), scale))
            elif normaliser is None:
                weighted.append((objective, first, scale))
            else:
                weight = self.share(normaliser, capacity, micro, normaliser_class=c)
                weighted.append((objective * ops.cast(weight, objective.dtype), weight, scale))
        return weighted

    def current_accum_steps(self):
        """Micro-steps in the current group: ``accum_steps`` or its schedule."""
        if callable(self.accum_steps):
            return ops.maximum(ops.cast(self.accum_steps(self.update_count), "int64"), 1)
        return self.accum_steps

    def add_group_gradients(self, grads, variables):
        """Adds gradients of the group as a whole to the sums, once: no divisor, no micro-step.

        A coupled loss's own dependence on the weights with the outputs held
        fixed (a tower that ``compute_loss`` runs, the regularizers); one
        normaliser class. ``grads``: one gradient (or ``None``) per entry of
        ``variables``, the trainable variables. Call in replica context.

        Returns:
            The indices of the sums that received a gradient (``present`` of
            :func:`~gradient_accumulator.update.apply_if`).
        """
        slots = self.slots()
        slot_grads = [grads[i] for i, _, _ in slots]
        for (i, _, _), grad in zip(slots, slot_grads):
            if grad is not None and self.takes_maximum[i]:
                raise ValueError(
                    f"Variable '{variables[i].path}' holds float8 state (a scale or an "
                    "amax history, whose update is its group's maximum), and the loss reads "
                    "it outside the model's forward pass (`compute_loss`): its value would "
                    "be summed, not kept. Call the float8 layers in `call`. Received: the "
                    "loss's gradient of that variable"
                )
        if self.reduce_every_micro_step:
            slot_grads, _ = all_reduce_in_replica(slot_grads, [], [False] * len(slot_grads))
        for (_, _, acc), grad in zip(slots, slot_grads):
            if grad is not None:
                _add_in_place(acc, grad)
        return [k for k, grad in enumerate(slot_grads) if grad is not None]

    def slots(self):
        """Every gradient sum, as ``(variable index, class, sum variable)``."""
        return self._classes.flat()

    def add(self, class_grads, divisors):
        """Adds one micro-step: its gradients into their sums, its divisors into theirs.

        Call in replica context; the update is :func:`gradient_accumulator.update.apply_if`.

        Args:
            class_grads: Per normaliser class, the gradients (order of the
                variables) of that class's weighted objective; ``None`` where
                it does not reach (a variable outside the class's routing is
                ignored).
            divisors: Per class, what this micro-step adds to its divisor.

        Returns:
            The indices of the sums that received a gradient: trace-time
            structure, the same at every micro-step of a traced function. Also
            kept as ``traced_slots`` for a group cut short, whose update is
            traced without gradients to look at.
        """
        slots = self.slots()
        slot_grads = [class_grads[c][i] for i, c, _ in slots]
        # Each replica adds its share of the weight, so that the all-reduced
        # sum is the group's total weight whatever the number of replicas.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weights = [ops.cast(d, "float32") / replicas for d in divisors]
        maximum = [self.takes_maximum[i] for i, _, _ in slots]
        if self.reduce_every_micro_step:
            slot_grads, weights = all_reduce_in_replica(slot_grads, weights, maximum)
        # Read only where a sum keeps a maximum (float8 state).
        is_first = ops.equal(self.micro_step, 0) if any(maximum) else None
        adds = [
            _maximum_in_place(acc, grad, is_first) if takes else _add_in_place(acc, grad)
            for (_, _, acc), grad, takes in zip(slots, slot_grads, maximum)
            if grad is not None
        ]
        adds += [write(total, "add", weight) for total, weight in zip(self.weight_sums(), weights)]
        # The count moves once every add is done: a read of it marks the
        # micro-step's end (the group's function starts the next micro-step
        # after it).
        with tf.control_dependencies([add for add in adds if add is not None]):
            write(self.micro_step, "add", tf.constant(1, self.micro_step.dtype))
        self.traced_slots = [k for k, grad in enumerate(slot_grads) if grad is not None]
        return self.traced_slots

    def reset(self, check_finite=False):
        """Empties the group (call in replica context).

        The sums are zeroed in place (``s + (-s)`` is exactly 0 for finite
        ``s``): new zero tensors would allocate every sum's size at once, which
        raises peak memory (the benchmarks page has the figures).

        Args:
            check_finite: Boolean, ``True`` under a ``LossScaleOptimizer``, which
                skips non-finite updates: sums holding an infinity or NaN are
                then overwritten with zeros (a finite total proves every element
                finite). Elsewhere a non-finite gradient has already made the
                weights non-finite, and the check would only cost.
        """
        for total in self.weight_sums():
            total.assign(0.0)
        if self.noise_scale_decay is not None:
            self.noise_sums.assign(ops.zeros_like(self.noise_sums))
        self.micro_step.assign(0)
        sums = self.all_sums()

        def zero_in_place():
            for acc in sums:
                acc.assign_add(ops.negative(acc))

        def overwrite():
            # Zeros filled from a value read at run time (the count, just
            # reset): zeros of a known shape would be folded into constants
            # that the graph holds for good, up to the sums' size.
            zero = ops.cast(self.micro_step.read_value(), "float32")
            for acc in sums:
                acc.assign(tf.fill(tf.shape(acc), zero), read_value=False)

        if check_finite and sums:
            total = ops.sum(ops.stack([ops.sum(acc) for acc in sums]))
            tf.cond(ops.isfinite(total), zero_in_place, overwrite)
        else:
            zero_in_place()
