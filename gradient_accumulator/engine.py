"""The accumulation engine shared by the model wrapper, the optimizer wrapper and BN.

One :class:`GradientAccumulator` holds the float32 gradient sums of one
accumulation group and decides, once per micro-step, whether this micro-step
ends the group (an *update step*). Everything that must line up with the
optimizer update reads that decision from here: the optimizer is called with
the accumulated gradient, and layers such as ``AccumBatchNormalization`` read it
through :func:`current_update_step` while the model's forward pass is traced.

The sums cross the replicas once per update, in one batched all-reduce
(:func:`gradient_accumulator.distribute.sum_across_replicas_if`); a micro-step
that does not update communicates nothing.
"""

import contextlib
import functools
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from gradient_accumulator import noise_scale
from gradient_accumulator._compat import (
    KerasSaveable,
    in_xla_compilation,
    optimizer_chain,
    scatter_add_in_place,
)
from gradient_accumulator.distribute import (
    all_reduce_in_replica,
    by_replica,
    gradients_already_reduced,
    maximum_of_rows,
    sum_across_replicas_if,
)

_context = threading.local()

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

    Keras's saving writes an attribute of a model that holds one at the
    attribute's path, after the model's layers, and reads it back on
    loading. The plain Keras model of the same graph has no such attribute:
    it loads the file and never reads the entry, and a file that it saved has
    no entry, which the owner's ``load`` receives as an empty store.

    Args:
        save: Callable ``(store) -> None`` writing the state.
        load: Callable ``(store) -> None`` restoring it (``store`` may be empty).
    """

    def __init__(self, save, load):
        # Callables, not the owner: Keras walks a saveable's attributes, and
        # one holding its owner would walk the owner again.
        self._save = save
        self._load = load

    def _obj_type(self):
        return "Layer"

    def save_own_variables(self, store):
        self._save(store)

    def load_own_variables(self, store):
        self._load(store)


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


def takes_maximum(variable):
    """Whether ``variable`` takes its group's maximum gradient, not the mean.

    Keras's ``overwrite_with_gradient`` variables (the scales and amax
    histories of float8 layers, ``model.quantize("float8")``) receive their
    new value as their "gradient", and the optimizer assigns it. A float8
    layer's new amax history is the old one with the micro-batch's largest
    magnitude in front, and its new scale depends on the old state only: the
    elementwise maximum over a group's micro-batches is the big batch's value
    exactly, where a sum or a mean is not. (Keras's own
    ``gradient_accumulation_steps`` keeps the maximum too.)
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _has_loss_scale(optimizer):
    """Whether a ``LossScaleOptimizer`` (it skips non-finite updates) is in the chain."""
    return any(
        isinstance(opt, keras.optimizers.LossScaleOptimizer) for opt in optimizer_chain(optimizer)
    )


class MicroStep:
    """What is known of a micro-step before its forward pass.

    Attributes:
        is_update_step: Boolean scalar, whether it ends its group (a Python
            ``bool`` where known when traced).
        is_first: Boolean scalar, whether it starts its group (the same).
        group_length: Float32 scalar ``K``, the micro-steps its group is
            planned to have (``accum_steps``, or fewer at the end of an
            epoch of known length).
    """

    def __init__(self, is_update_step, is_first, group_length):
        self.is_update_step = is_update_step
        self.is_first = is_first
        self.group_length = group_length


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
    return acc.assign(ops.where(is_first, grad, ops.maximum(acc, grad)), read_value=False)


def _add_in_place(acc, grad):
    if isinstance(grad, tf.IndexedSlices):
        return scatter_add_in_place(acc, grad)
    # The TensorFlow variable's own assign_add adds in place (Keras's
    # `Variable.assign_add` is `assign(self + value)`, which allocates a new
    # sum every micro-step).
    return acc.assign_add(ops.cast(grad, "float32"))


class _ClassLayout:
    """Where each normaliser class's gradients are summed (plain Python, not tracked).

    One class (every variable reached by class 0 only) is the layout of a
    loss with one normaliser.

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


def _mean(total, weight):
    """``total / weight``, 0 where ``weight`` is 0.

    A group whose normaliser is 0 (a masked loss with no valid token in any
    of its micro-batches) has a zero sum: its gradient is 0, as Keras's loss
    of such a batch is, not 0 / 0.
    """
    return tf.math.divide_no_nan(total, ops.cast(weight, total.dtype))


def _group_means(plan, sums, weights, count):
    """Per variable, ``sum_c G_c / W_c`` over its classes; ``None`` where no sum is present.

    A variable that takes its group's maximum (:func:`takes_maximum`) gets
    ``max_c G_c``: its sums hold maxima, which are not divided.

    Where every divisor is exactly 1 (each micro-batch weighed by its share
    of the group, and the group as planned: equal micro-batches counted by
    samples, ``accum_steps`` of them), the sums already are the means, and
    dividing them would give the same bits: the division is skipped (one
    conditional per update), which saves a read and a write of every sum.

    One variable after the other (each waits for the previous one's), so
    that one mean's temporary is alive at a time beside the optimizer's.
    Where the sums are this replica's accumulators themselves (one replica,
    or sums reduced at every micro-step), each mean is written into its
    variable's first sum, which takes the new buffer and frees its own, and
    the optimizer reads it from there: the means then cost one variable's
    buffer at a time, not the size of every gradient (the sums are emptied
    after the update anyway). Elsewhere ``sums`` are the all-reduced tensors.

    Args:
        plan: The update's :class:`_UpdatePlan`.
        sums: One tensor per entry of ``plan.slots`` (the reduced sums).
        weights: Per class, the group's divisor.
        count: The number of variables.
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


def _sum_aggregation(variable):
    """How a sum reads outside the replicas (saving): the total, or one replica's maximum.

    A checkpoint holds one value per variable, and TensorFlow aggregates
    replica-local variables by sum or mean only: a sum of maxima saved inside
    a group under several replicas keeps the first replica's maximum (which
    every replica takes on restoring).
    """
    if takes_maximum(variable):
        return tf.VariableAggregation.ONLY_FIRST_REPLICA
    return tf.VariableAggregation.SUM


def _sum_name(variable):
    path = getattr(variable, "path", None) or variable.name
    return path.replace("/", "_").replace(":", "_") + "_accumulator"


# The update's cases: how the group's sums reach the optimizer
# (`_UpdatePlan.case`, decided when the update is traced). A loss scale (a
# `LossScaleOptimizer`, which skips non-finite updates) adds to any of them:
# the reset then overwrites non-finite sums (`GradientAccumulator.reset`).
#: One replica: the sums are the group's; each mean is written into its sum
#: in place, where the optimizer reads it.
ONE_REPLICA = "one replica"
#: Several replicas, sums of their own: the sums, divisors and statistics
#: cross the replicas in one batched all-reduce; the means are the reduced
#: tensors divided.
REDUCED_ONCE_PER_UPDATE = "reduced once per update"
#: Several replicas, ``reduce_every_micro_step=True``: the sums are global
#: already; only the statistics cross at the update, the means are written in
#: place as with one replica.
REDUCED_EVERY_MICRO_STEP = "reduced every micro-step"


class _UpdatePlan:
    """What one update reads (trace time): the sums, the divisors, the statistics.

    Attributes:
        slots: The ``(variable index, class, sum variable)`` entries that
            hold a gradient.
        weight_sums: Per class, its divisor's variable.
        statistics: The ``(value, apply_fn)`` pairs of :meth:`GradientAccumulator.apply_if`.
        case: The update's case: :data:`ONE_REPLICA`,
            :data:`REDUCED_ONCE_PER_UPDATE` or :data:`REDUCED_EVERY_MICRO_STEP`
            (read in replica context).
        takes_maximum: Per variable, whether its sums hold maxima
            (:func:`takes_maximum`), which cross the replicas as a maximum.
    """

    def __init__(self, slots, weight_sums, statistics, reduced_every_micro_step, takes_maximum):
        self.slots = slots
        self.weight_sums = weight_sums
        self.statistics = statistics
        if reduced_every_micro_step:
            self.case = REDUCED_EVERY_MICRO_STEP
        elif tf.distribute.get_strategy().num_replicas_in_sync == 1:
            self.case = ONE_REPLICA
        else:
            self.case = REDUCED_ONCE_PER_UPDATE
        self.takes_maximum = takes_maximum

    @property
    def reduced_every_micro_step(self):
        return self.case == REDUCED_EVERY_MICRO_STEP

    def values_to_reduce(self):
        """What crosses the replicas at the update, in one batch (call in replica context).

        A sum of maxima enters as
        :func:`~gradient_accumulator.distribute.by_replica` rows, so that the
        one batched sum carries every replica's maximum.
        """
        statistics = [value for value, _ in self.statistics]
        if self.reduced_every_micro_step:
            return statistics
        sums = [by_replica(acc) if self.takes_maximum[i] else acc for i, _, acc in self.slots]
        return [*sums, *self.weight_sums, *statistics]

    def split(self, reduced):
        """``reduced`` (the sums of :meth:`values_to_reduce`) as (sums, weights, statistics)."""
        if self.reduced_every_micro_step:
            sums = [ops.convert_to_tensor(acc) for _, _, acc in self.slots]
            weights = [ops.convert_to_tensor(w) for w in self.weight_sums]
            return sums, weights, list(reduced)
        count = len(self.slots) + len(self.weight_sums)
        reduced = list(reduced)
        sums = [
            maximum_of_rows(total) if self.takes_maximum[i] else total
            for (i, _, _), total in zip(self.slots, reduced[: len(self.slots)])
        ]
        return sums, reduced[len(self.slots) : count], reduced[count:]


class GradientAccumulator(tf.Module):
    """Float32 gradient sums of one accumulation group and its update boundary.

    With micro-batch gradients ``g_i`` of a loss that is a sum over its
    micro-batch divided by a normaliser ``N_i`` (samples, valid tokens, the
    sum of sample weights), and micro-batch weights ``w_i = N_i / (C_1 * K)``
    (``C_1``: the capacity of the group's first micro-batch, e.g. its sample
    or padded-token count; ``K``: the micro-steps the group is planned to
    have), the gradient handed to the optimizer at the update step is::

        g = sum_i(w_i * g_i) / sum_i(w_i)

    which is the gradient of the loss of the concatenated group (its sum
    divided by ``sum_i(N_i)``), whatever the micro-batches hold. The
    reference ``C_1 * K`` cancels; it makes ``w_i`` the micro-batch's share
    of the group (``1 / K`` for equal micro-batches), so that in the backward
    pass of ``w_i * loss_i`` every per-sample quantity has the magnitude it has
    in the big batch's (under a float16 loss scale, a micro-batch overflows
    only where the big batch would). The caller provides ``w_i * g_i``
    directly by differentiating ``w_i * loss_i`` (one scalar multiply in the
    backward pass), so accumulating costs one in-place ``assign_add`` per
    variable. A loss that is a plain sum (``reduction="sum"``) adds
    ``w_i = 1`` every micro-step and ``1`` to the divisor once per group.

    A variable marked ``overwrite_with_gradient`` (a float8 layer's scales
    and amax histories; Keras's optimizers assign it its "gradient") receives
    ``max_i(g_i)`` instead, elementwise, the maximum across replicas too: the
    big batch's value (see :func:`takes_maximum`).

    A group ends after ``accum_steps`` micro-steps, or earlier when
    ``steps_to_boundary`` (set by the caller, e.g. to the micro-steps left in
    the epoch) reaches zero.

    State (replica-local variables created at construction, float32 sums
    whatever the compute dtype):

    - ``gradient_sums[j]``: ``sum_i(w_i * g_ij)`` for trainable variable ``j``;
      ``max_i(g_ij)`` for one marked ``overwrite_with_gradient``.
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
            are replica-local and cross replicas once, at the update.
            ``True``: every micro-step's gradient is all-reduced before it is
            added (what plain data-parallel training does each step), so the
            sums are global between updates; ``accum_steps`` times the
            communication, for whoever wants replicas' sums in step.
        track_gradient_norm: Boolean, keep each update's mean gradient's
            norm in ``gradient_norm``.
        noise_scale_decay: ``None``, or the noise scale's moving averages'
            decay (:mod:`gradient_accumulator.noise_scale`).
        noise_scale_every: Integer >= 1: the noise scale measures one update
            in that many (:meth:`noise_update_measured`).
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
        name="gradient_accumulator",
    ):
        super().__init__(name=name)
        self._track_gradient_norm = track_gradient_norm
        self._noise_scale_decay = noise_scale_decay
        self._noise_scale_every = noise_scale_every
        self.accum_steps = accum_steps
        self._gradient_transform = gradient_transform
        self._reduce_every_micro_step = reduce_every_micro_step
        # Identities only: holding the variables would make tf.train.Checkpoint
        # save every model weight a second time under this object.
        self._variable_ids = tuple(id(v) for v in variables)
        self._takes_maximum = tuple(takes_maximum(v) for v in variables)

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

        A group's mean gradient is ``sum_c G_c / W_c``: class ``c``'s
        gradients (its loss terms, each weighted by its normaliser's share)
        are summed in ``G_c`` and its shares in ``W_c``. A variable that the
        gradients of one class only reach (a head's) keeps its one sum in
        ``gradient_sums``; one reached by several classes (the shared trunk)
        gets one more sum per further class, in ``class_gradient_sums``.

        Creates variables: call eagerly, under the strategy scope, never
        inside a traced step. A routing of one class restores the one-class
        layout (the extra variables are dropped).

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
                entries = []
                for k, c in enumerate(classes):
                    if k == 0:
                        entries.append((c, primary))
                        continue
                    name = _sum_name(variable).replace("_accumulator", f"_class_{c}_accumulator")
                    aggregation = _sum_aggregation(variable)
                    acc = replica_local(0, variable.shape, "float32", name, aggregation)
                    extra.append(acc)
                    entries.append((c, acc))
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

    def _weight_sums(self):
        return [self.weight_sum, *self.class_weight_sums]

    def _group_references(self):
        return [self.group_reference, *self.class_group_references]

    def _all_sums(self):
        return [*self.gradient_sums, *self.class_gradient_sums]

    def save_state(self, store):
        """Writes the state into a Keras weights ``store`` (keys ``accumulator_<i>``).

        And the normaliser classes' routing (key :data:`CLASSES_KEY`).
        """
        for i, variable in enumerate(self.state_variables):
            store[f"{STATE_KEY_PREFIX}{i}"] = variable.numpy()
        routing = self._classes.routing
        width = max((len(classes) for classes in routing), default=0)
        store[CLASSES_KEY] = np.array(
            [list(classes) + [-1] * (width - len(classes)) for classes in routing], "int32"
        ).reshape(len(routing), width)

    def load_state(self, store, owner, variables=None):
        """Restores the state from a Keras weights ``store`` written by :meth:`save_state`.

        Does nothing if ``store`` holds no state; warns, and starts a new
        group, if it holds state for another set of variables. A store with
        normaliser classes configures them first (:meth:`configure_classes`,
        which creates variables: call it eagerly, under the strategy scope).

        Args:
            store: The mapping Keras hands ``load_own_variables``.
            owner: String naming the model or optimizer, for the warning.
            variables: The accumulator's trainable variables; needed only to
                configure classes.
        """
        saved = [
            key for key in store.keys() if key.startswith(STATE_KEY_PREFIX) and key != CLASSES_KEY
        ]
        if not saved:
            return
        if CLASSES_KEY in store.keys() and variables is not None and self.matches(variables):
            routing = [[int(c) for c in row if c >= 0] for row in np.asarray(store[CLASSES_KEY])]
            self.configure_classes(routing, variables)
        state = self.state_variables
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
            self.empty_group()
            return
        for i, variable in enumerate(state):
            # An array: Keras < 3.14's weight files hand out h5py datasets,
            # which TensorFlow variables cannot take under tf.distribute.
            variable.assign(np.asarray(store[f"{STATE_KEY_PREFIX}{i}"]))

    def empty_group(self):
        """Empties the group eagerly: no micro-step pending (``update_count`` is kept).

        What loading a weights file without accumulation state means: the
        file's weights with no group pending.
        """
        for acc in self._all_sums():
            acc.assign(tf.zeros(acc.shape, acc.dtype))
        for total in self._weight_sums():
            total.assign(0.0)
        for reference in self._group_references():
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
            ops.greater_equal(self.micro_step + 1, steps),
            ops.equal(steps_left, 0),
        )
        is_first = ops.equal(self.micro_step, 0)
        # The micro-steps this group will have, as far as known at its start
        # (the epoch's last group is shorter when the epoch's length is known).
        planned = ops.where(
            ops.greater_equal(steps_left, 0), ops.minimum(steps, steps_left + 1), steps
        )
        return MicroStep(is_update_step, is_first, ops.cast(planned, "float32"))

    def micro_step_at(self, index, length, ends_group=None):
        """The :class:`MicroStep` of micro-step ``index`` of a group of ``length``.

        For a function that runs a whole group: whether the micro-step ends
        its group is known when it is traced, so ``is_update_step`` is a
        Python boolean and nothing is decided at run time (see
        :func:`sum_across_replicas_if`). ``index`` and ``length`` may be
        integer tensors (one trace for every place in every group) when
        ``ends_group`` says whether it is the last; with Python integers it
        may be left ``None``. The group must start empty.
        """
        if ends_group is None:
            ends_group = index == length - 1
        is_first = index == 0 if isinstance(index, int) else ops.equal(index, 0)
        return MicroStep(ends_group, is_first, ops.cast(length, "float32"))

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
        stored = self._group_references()[normaliser_class]
        reference = ops.where(micro.is_first, capacity * micro.group_length, stored)
        stored.assign(reference)
        return tf.stop_gradient(ops.cast(normaliser, "float32") / reference)

    def current_accum_steps(self):
        """Micro-steps in the current group: ``accum_steps`` or its schedule."""
        if callable(self.accum_steps):
            steps = ops.cast(self.accum_steps(self.update_count), "int64")
            return ops.maximum(steps, 1)
        return self.accum_steps

    def step(
        self,
        grads,
        loss_weight,
        is_update_step,
        optimizer,
        variables,
        statistics=(),
        divisor=None,
    ):
        """Adds ``grads`` to the sums, then updates through ``optimizer`` if due.

        Must be called in replica context (inside ``strategy.run`` or with no
        strategy). ``grads`` are the gradients of ``loss_weight * loss`` (times
        the loss scale under mixed precision) in the order of ``variables``;
        ``None`` entries stay ``None`` for the optimizer, so variables without
        a gradient are left alone as in plain Keras. ``divisor`` is what this
        micro-step adds to the group's divisor (``loss_weight`` if ``None``).
        """
        divisor = loss_weight if divisor is None else divisor
        # The one-class case of `step_classes` (with several classes, the
        # missing classes' gradients fail loudly there).
        self.step_classes([grads], [divisor], is_update_step, optimizer, variables, statistics)

    def step_classes(
        self,
        class_grads,
        divisors,
        is_update_step,
        optimizer,
        variables,
        statistics=(),
    ):
        """:meth:`step` with one gradient list and divisor per normaliser class.

        Args:
            class_grads: Per class, the gradients (order of ``variables``) of
                that class's weighted objective; ``None`` where it does not
                reach (a variable outside the class's routing is ignored).
            divisors: Per class, what this micro-step adds to its divisor.
        """
        present = self.add_classes(class_grads, divisors)
        self.apply_if(is_update_step, optimizer, variables, statistics, present)

    def add_classes(self, class_grads, divisors):
        """Adds one micro-step's gradients and divisors to the sums, without updating.

        For a caller that runs the update itself once the group's last
        micro-step has added (:meth:`apply_if` with ``True``). Arguments as in
        :meth:`step_classes`; returns the indices of the sums that received a
        gradient (see :meth:`_accumulate`).
        """
        grads = [class_grads[c][i] for i, c, _ in self._slots()]
        return self._accumulate(grads, divisors)

    def add_group_gradients(self, grads, variables):
        """Adds gradients that belong to the group as a whole to the sums (replica context).

        A coupled loss's own dependence on the weights, with the outputs
        held fixed (a tower that ``compute_loss`` runs, the regularizers):
        part of the group's gradient, added once, without a divisor or a
        micro-step. One normaliser class (a coupled loss has one).

        Args:
            grads: One gradient (or ``None``) per entry of ``variables``.
            variables: The trainable variables the sums were made for.

        Returns:
            The indices of the sums that received a gradient (for
            :meth:`apply_if`'s ``present``).
        """
        slot_grads = [grads[i] for i, _, _ in self._slots()]
        for (i, _, _), grad in zip(self._slots(), slot_grads):
            if grad is not None and self._takes_maximum[i]:
                raise ValueError(
                    f"Variable '{variables[i].path}' holds float8 state (a scale or an "
                    "amax history, whose update is its group's maximum), and the loss reads "
                    "it outside the model's forward pass (`compute_loss`): its value would "
                    "be summed, not kept. Call the float8 layers in `call`. Received: the "
                    "loss's gradient of that variable"
                )
        if self._reduce_every_micro_step:
            slot_grads, _ = all_reduce_in_replica(slot_grads, [], [False] * len(slot_grads))
        for (_, _, acc), grad in zip(self._slots(), slot_grads):
            if grad is not None:
                _add_in_place(acc, grad)
        return [k for k, grad in enumerate(slot_grads) if grad is not None]

    def apply_pending(self, optimizer, variables, statistics=()):
        """Updates with a non-empty, unfinished group (replica context).

        For a group cut short by the end of the data when the number of
        micro-steps was not known in advance. ``statistics`` as in
        :meth:`apply_if`.
        """
        self.apply_if(ops.greater(self.micro_step, 0), optimizer, variables, statistics)

    # The paths of a micro-step, in order: `_accumulate` (every micro-step),
    # then `apply_if`, which hands `_update` to `sum_across_replicas_if`: the
    # sums cross the replicas in one batch and `_update` runs only at an
    # update step, in replica context, whichever of its two paths (conditional
    # in the replica, or in cross-replica context) the strategy needs.

    def _slots(self):
        """Every gradient sum, as ``(variable index, class, sum variable)``."""
        return self._classes.flat()

    def _accumulate(self, slot_grads, divisors):
        """Adds one micro-step: the gradients into their sums, the divisors into theirs.

        Args:
            slot_grads: One gradient (or ``None``) per entry of :meth:`_slots`.
            divisors: Per class, what this micro-step adds to its divisor.

        Returns:
            The indices of the slots that received a gradient: trace-time
            structure, the same at every micro-step of a traced function. Also
            kept as ``traced_slots`` for :meth:`apply_pending`, which traces an
            update without gradients to look at.
        """
        # Each replica adds its share of the weight, so that the all-reduced
        # sum is the group's total weight whatever the number of replicas.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weights = [ops.cast(d, "float32") / replicas for d in divisors]
        slots = self._slots()
        maximum = [self._takes_maximum[i] for i, _, _ in slots]
        if self._reduce_every_micro_step:
            slot_grads, weights = all_reduce_in_replica(slot_grads, weights, maximum)
        # Read only where a sum keeps a maximum (float8 state).
        is_first = ops.equal(self.micro_step, 0) if any(maximum) else None
        adds = [
            _maximum_in_place(acc, grad, is_first) if takes else _add_in_place(acc, grad)
            for (_, _, acc), grad, takes in zip(slots, slot_grads, maximum)
            if grad is not None
        ]
        adds += [total.assign_add(weight) for total, weight in zip(self._weight_sums(), weights)]
        # The count moves once every add is done: a read of it marks the
        # micro-step's end (the model's group function starts the next
        # micro-step after it).
        with tf.control_dependencies(adds):
            self.micro_step.assign_add(1)
        self.traced_slots = [k for k, grad in enumerate(slot_grads) if grad is not None]
        return self.traced_slots

    def apply_if(
        self, is_update_step, optimizer, variables, statistics=(), present=None, noise_measured=None
    ):
        """Hands the group's mean gradient to ``optimizer`` if ``is_update_step``.

        Called in replica context; resets the group after updating. The
        group's gradient sums, its weight sums and each entry of
        ``statistics`` cross the replicas in one batched reduction (the sums
        only if they were not reduced at every micro-step).

        Args:
            statistics: Sequence of ``(value, apply_fn)``: a float32 tensor of
                this replica's to sum over the replicas with the gradients,
                and a callable that receives the sum in the update, in
                replica context (``AccumBatchNormalization`` merges its
                replicas' pending statistics so).
            present: Indices into :meth:`_slots` of the sums that hold a
                gradient; the last traced micro-step's (``traced_slots``) if
                ``None``, all of them before any.
            noise_measured: Whether the noise scale measures this update
                (``noise_scale_every``): a Python boolean where the caller
                knows, ``None`` to read it from ``update_count`` at run time.
        """
        slots = self._slots()
        if present is None:
            present = getattr(self, "traced_slots", range(len(slots)))
        if self._noise_scale_decay is not None:
            # The group's summaries cross the replicas with the gradients;
            # `_update` reads their sum (`_noise_sums_reduced`).
            statistics = [*statistics, (self.noise_sums.read_value(), self._keep_noise_sums)]
        plan = _UpdatePlan(
            [slots[k] for k in present],
            self._weight_sums(),
            list(statistics),
            reduced_every_micro_step=self._reduce_every_micro_step,
            takes_maximum=self._takes_maximum,
        )
        with gradients_already_reduced(optimizer):
            sum_across_replicas_if(
                is_update_step,
                plan.values_to_reduce(),
                lambda *reduced: self._update(plan, reduced, optimizer, variables, noise_measured),
            )

    def _update(self, plan, reduced, optimizer, variables, noise_measured=None):
        """The update (replica context): ``sum_c G_c / W_c`` to ``optimizer``, then a reset."""
        sums, weights, statistic_sums = plan.split(reduced)
        for (_, apply_statistics), total in zip(plan.statistics, statistic_sums):
            apply_statistics(total)
        means = _group_means(plan, sums, weights, len(variables))
        mean_grads = [
            None if m is None else ops.cast(m, var.dtype) for var, m in zip(variables, means)
        ]
        noise = self._noise_scale_decay is not None and noise_measured is not False
        decide_at_run_time = noise_measured is None and self._noise_scale_every > 1
        if noise and decide_at_run_time and not self._track_gradient_norm:
            # Decided at run time (`noise_scale_every`): the group's norm
            # only in the updates that measure.
            def measure():
                norm = self._mean_gradient_norm(mean_grads, optimizer)
                self._update_noise_scale(ops.square(norm))
                return ops.zeros((), "float32")

            tf.cond(self.noise_update_measured(), measure, lambda: ops.zeros((), "float32"))
        elif self._track_gradient_norm or noise:
            norm = self._mean_gradient_norm(mean_grads, optimizer)
            if self._track_gradient_norm:
                self.gradient_norm.assign(norm)
            if noise:
                self._update_noise_scale(ops.square(norm))
        if self._gradient_transform is not None:
            # Not applied to maxima, which are values to assign, not gradients.
            maxima = self._takes_maximum
            means_only = [None if m else g for g, m in zip(mean_grads, maxima)]
            transformed = self._gradient_transform(means_only, variables)
            mean_grads = [g if m else t for g, t, m in zip(mean_grads, transformed, maxima)]
        optimizer.apply(mean_grads, variables)
        self.update_count.assign_add(1)
        # The sums are emptied once the optimizer has written the variables
        # (after their reads, which wait for those writes), not beside it: the
        # reset's temporaries then do not add to the optimizer's (the
        # benchmarks page has the figures).
        with tf.control_dependencies([tf.convert_to_tensor(v) for v in variables]):
            self.reset(_has_loss_scale(optimizer))

    def noise_update_measured(self):
        """Whether the noise scale measures the coming update: every ``noise_scale_every``-th.

        A boolean tensor (replica context, before the update's count moves):
        updates ``0, m, 2m, ...`` of ``update_count``.
        """
        if self._noise_scale_every == 1:
            return tf.constant(True)
        return ops.equal(self.update_count.read_value() % self._noise_scale_every, 0)

    def add_noise_summary(self, summary):
        """Adds one micro-batch's summary (:func:`noise_scale.micro_batch_summary`)."""
        return self.noise_sums.assign_add(summary, read_value=False)

    def _keep_noise_sums(self, total):
        self._noise_sums_reduced = total

    def _update_noise_scale(self, big_squared_norm):
        trace, signal, valid = noise_scale.estimates(self._noise_sums_reduced, big_squared_norm)
        averages, ratio = noise_scale.smoothed(
            self.noise_averages.read_value(), trace, signal, valid, self._noise_scale_decay
        )
        previous = self.noise_logs.read_value()
        self.noise_averages.assign(averages)
        self.noise_logs.assign(ops.where(valid, ops.stack([ratio, trace, signal]), previous))

    def _mean_gradient_norm(self, mean_grads, optimizer):
        """The global L2 norm of the mean gradient, divided by the loss scale if any.

        Float8 scales and amax histories (maxima, not gradients) are left out.
        """
        squared = noise_scale.squared_norm(mean_grads, self._takes_maximum)
        scale = ops.cast(optimizer.scale_loss(tf.constant(1.0)), "float32")
        return ops.sqrt(squared) / scale

    def reset(self, check_finite=False):
        """Empties the group (call in replica context).

        The sums are zeroed in place (``s + (-s)`` is exactly 0 for finite
        ``s``); assigning new zero tensors would allocate every sum's size
        at once at each update, which raises peak memory (the figures are on
        the benchmarks page of the documentation).

        Args:
            check_finite: Boolean. ``True`` where training goes on after a
                non-finite gradient, i.e. when the optimizer is a
                ``LossScaleOptimizer``, which skips such updates: sums
                holding an infinity or NaN are then overwritten with zeros
                (a finite total of all sums proves every element finite).
                Elsewhere a non-finite gradient has already made the weights
                non-finite, and the check would only cost time and memory.
        """
        for total in self._weight_sums():
            total.assign(0.0)
        if self._noise_scale_decay is not None:
            self.noise_sums.assign(ops.zeros_like(self.noise_sums))
        self.micro_step.assign(0)
        sums = self._all_sums()

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
