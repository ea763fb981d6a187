"""Each micro-batch's loss weight: the rule that makes a group equal the big batch.

Keras divides every loss by a normaliser ``N_i`` of its own batch: the number
of loss elements (samples, or samples times time steps), the valid entries of
a mask, the sum of the sample weights (``reduction="mean_with_sample_weight"``),
or nothing (``reduction="sum"``). The big batch divides its sum by the sum of
the micro-batches' normalisers, so a group equals it exactly when micro-batch
``i`` is weighted by ``N_i`` (the formula: :mod:`gradient_accumulator.update`).
This module reads ``N_i`` from what Keras itself combined while computing the
loss: for every ``keras.losses.Loss`` call, its unreduced values, sample
weights, mask and reduction (:func:`gradient_accumulator._compat.recorded_loss_reductions`).

One gradient sum holds one normaliser. Terms that share it form one class
(every term a mean over samples; or masked by the same mask, or weighted by
the same weights; or a sum). Terms with different normalisers (a masked
per-token output beside a per-sample one), and data-dependent additional
losses beside a non-per-sample loss, form several classes (:class:`ClassPlan`,
found by a traced pass before the first step, :func:`discover_classes`).
:func:`weigh_classes` weights each class (one class the one-entry case); the
accumulator sums and divides each on its own. Terms that depend on the
weights only (kernel regularizers) count once per update whatever the
normaliser. A train function traced without that pass, or a loss with
``reduction=None``, is weighted by samples, with a warning that says so.
"""

import warnings

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    keras_apply_mask,
    keras_squeeze_or_expand_to_same_rank,
    replicas_dividing_the_training_loss,
    sublayers,
)

SAMPLES = "samples"
SUM = "sum"


def _ref(tensor):
    if tensor is None:
        return None
    return tensor.ref() if hasattr(tensor, "ref") else id(tensor)


def _size(tensor):
    return ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(tensor), "int32")), "float32")


class LossTerm:
    """How one Keras loss call divided its sum.

    Attributes:
        key: Hashable; terms with equal keys have equal normalisers in every
            micro-batch (``SAMPLES``: proportional to the batch size;
            ``SUM``: none; otherwise the mask or weights it divides by).
        normaliser: Float32 scalar ``N_i``, or ``None`` for ``SUM`` terms.
        capacity: Float32 scalar, the largest ``N_i`` of a micro-batch of
            this shape, or ``None`` for ``SUM`` terms.
    """

    def __init__(self, key, normaliser=None, capacity=None):
        self.key = key
        self.normaliser = normaliser
        self.capacity = capacity


def loss_term(values, sample_weight, mask, reduction, batch_size):
    """The :class:`LossTerm` of one ``reduce_weighted_values`` call, or ``None`` if unreduced.

    Mirrors Keras's reduction (``keras.losses.Loss``): ``"sum"`` divides by
    nothing; ``"sum_over_batch_size"`` (and ``"mean"``) by the number of
    loss elements, or, with a mask, by its valid entries (sample weights
    scale the sum, not the divisor); ``"mean_with_sample_weight"`` by the
    sum of the sample weights with the mask merged in, as Keras merges it.
    """
    values = ops.convert_to_tensor(values)
    if reduction in (None, "none") or values.shape.rank == 0 or tuple(values.shape) == (0,):
        return None
    if reduction == "sum":
        return LossTerm(SUM)
    weighted = reduction == "mean_with_sample_weight" and (
        sample_weight is not None or mask is not None
    )
    if mask is None and not weighted:
        if values.shape[1:].is_fully_defined():
            size = ops.cast(batch_size, "float32")
            return LossTerm(SAMPLES, size, size)
        # Elements per sample vary between batches: the term is its own class.
        return LossTerm(("elements", _ref(values)), _size(values), _size(values))
    if weighted:
        weights = keras_apply_mask(
            None if sample_weight is None else ops.convert_to_tensor(sample_weight, values.dtype),
            None if mask is None else ops.convert_to_tensor(mask, values.dtype),
            values.dtype,
            reduction,
        )
        _, weights = keras_squeeze_or_expand_to_same_rank(values, ops.cast(weights, values.dtype))
        normaliser = ops.cast(ops.sum(weights), "float32")
        return LossTerm(("weights", _ref(sample_weight), _ref(mask)), normaliser, _size(values))
    valid = ops.sum(ops.cast(mask, "float32"))
    return LossTerm(("mask", _ref(mask)), valid, _size(mask))


class MicroBatchLoss:
    """A micro-batch's loss and what weighing it reads (the model's forward pass makes it).

    Attributes:
        loss: The scalar Keras computed (``model.compute_loss``, already
            divided by the replicas in sync).
        records: The reductions recorded while computing it.
        batch_size: Scalar, samples in the micro-batch.
        additional_losses: The model's ``losses`` (regularizers, ``add_loss``).
        weight_only_losses: How many of them depend on the weights only
            (kernel, bias and embedding regularizers).
    """

    def __init__(self, loss, records, batch_size, additional_losses, weight_only_losses):
        self.loss = loss
        self.records = records
        self.batch_size = batch_size
        self.additional_losses = additional_losses
        self.weight_only_losses = weight_only_losses

    @property
    def data_extras(self):
        """Whether some additional losses depend on the data (activity regularizers, add_loss)."""
        return len(self.additional_losses) > self.weight_only_losses

    def partition(self):
        """:func:`normaliser_partition` of the records, once (its tensors are this trace's)."""
        if not hasattr(self, "_partition"):
            self._partition = normaliser_partition(self.records, self.batch_size, self.data_extras)
        return self._partition


def weigh_classes(micro_loss, plan, num_classes, is_first, tape, owner):
    """Per normaliser class: ``(objective, normaliser, capacity, log scale)`` of this micro-step.

    Pure: what :meth:`~gradient_accumulator.engine.GradientAccumulator.weigh`
    weighs. Class ``c``'s objective is its part of the loss
    (:func:`class_data_objectives`), with the normaliser and capacity of
    :func:`loss_term`. A sum has no normaliser (``None``): its objective is
    the replica's own sum (the training loss of Keras < 3.8 divides it by the
    replicas, undone here), and its weight regularizers count once per group
    (at ``is_first``), as in the big batch. The log scale turns the class's
    ``objective / divisor`` into the training loss's units
    (:class:`~gradient_accumulator.group_loss.GroupLoss`).

    A trace whose classes are not ``plan``'s (a loss with ``reduction=None``;
    terms of different normalisers that no class discovery separated) is
    weighted by one rule, with a warning (:func:`_one_sum_rule`): its
    objective goes to the first class, the others' are ``None``.

    Args:
        micro_loss: The :class:`MicroBatchLoss`.
        plan: The :class:`ClassPlan` the accumulator was configured with.
        num_classes: Integer, the accumulator's classes.
        is_first: Boolean scalar, whether the micro-step starts its group.
        tape: The persistent ``GradientTape`` recording the loss if ``plan``
            has several classes (unused with one).
        owner: String naming the model, for warnings.
    """
    terms, found = micro_loss.partition()
    if not plan.holds(found) or plan.num_classes != num_classes:
        found = _one_sum_rule(terms, micro_loss, owner)
    loss = micro_loss.loss
    objectives = class_data_objectives(micro_loss, found, tape)
    sum_scale = replicas_dividing_the_training_loss()
    classes = []
    for c, ((positions, kind), objective) in enumerate(zip(found.partition, objectives)):
        if kind == SUM:
            summed = sum_scale * objective
            if c == found.extras_class and micro_loss.additional_losses:
                extra = _additional_total(micro_loss.additional_losses, loss.dtype)
                first = ops.cast(is_first, loss.dtype)
                summed = sum_scale * (objective - extra) + first * extra
            classes.append((summed, None, None, 1.0 / sum_scale))
        elif kind == SAMPLES:
            size = ops.cast(micro_loss.batch_size, "float32")
            classes.append((objective, size, size, 1.0))
        else:
            term = terms[positions[0]]
            classes.append((objective, term.normaliser, term.capacity, 1.0))
    return classes + [(None, None, None, 1.0)] * (num_classes - len(classes))


def _one_sum_rule(terms, micro_loss, owner):
    """The one-class :class:`ClassPlan` of a trace whose classes no plan holds, with a warning.

    Weighted by samples, or, where the only other class is the data-dependent
    additional losses', by the loss's own normaliser (the closer of the two).
    """
    keys = list(dict.fromkeys(term.key for term in terms if term is not None))
    key, reason = SAMPLES, None  # no Keras loss was called: one's own, unknown
    if None in terms:
        reason = "a loss with reduction=None returned unreduced values"
    elif len(keys) > 1:
        reason = (
            "its loss terms divide by different normalisers (e.g. a masked "
            "per-token output beside a per-sample one), and one gradient sum "
            "holds one normaliser"
        )
    elif keys:
        (key,) = keys
        if key != SAMPLES and micro_loss.data_extras:
            reason = (
                "its activity regularizers or `add_loss` terms depend on the "
                "data and its loss is not a mean over samples"
            )
    if reason is not None:
        rule = "samples" if key == SAMPLES else "its loss's normaliser"
        warnings.warn(
            f"Gradient accumulation in model '{owner}' is not exactly the big "
            f"batch: {reason}; each micro-batch is weighted by {rule}. See "
            "'Which losses are exact' in the documentation.",
            stacklevel=5,
        )
    positions = tuple(j for j, term in enumerate(terms) if term is not None and term.key == key)
    return ClassPlan((((positions, _kind(key)),)), 0)


def _additional_total(additional_losses, dtype):
    """The sum of ``model.losses``, divided by the replicas as Keras's loss is."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    extra = ops.sum(ops.stack([ops.sum(ops.cast(term, "float32")) for term in additional_losses]))
    return ops.cast(extra / replicas, dtype)


def weight_only_loss_count(model):
    """How many of ``model.losses`` are weight regularizers (data-independent)."""
    return sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None) is not None)


# ----------------------------------------------------------------------------
# Several normaliser classes
# ----------------------------------------------------------------------------


def _kind(key):
    return key if isinstance(key, str) else key[0]


class ClassPlan:
    """The normaliser classes of a model's loss, as found by a symbolic pass.

    Stable across traces (keys of masks and weights are not: they name the
    tensors of one trace), so a class is the set of positions of its loss
    terms among the recorded Keras reductions.

    Attributes:
        partition: Tuple, per class, of ``(term positions, kind)`` in the
            order of each class's first term; ``None`` for one class of any
            terms (:meth:`one_class`: a loss whose classes no pass looked for).
        extras_class: Integer, the class carrying the loss's terms that are no
            recorded reduction (weight regularizers, ``add_loss``): the
            per-sample class if any, else the first that is not a sum.
        routing: Tuple, per trainable variable, of the classes whose
            gradient reaches it; ``None`` for one class (every variable).
    """

    def __init__(self, partition, extras_class, routing=None):
        self.partition = partition
        self.extras_class = extras_class
        self.routing = routing

    @classmethod
    def one_class(cls):
        return cls(None, 0)

    @property
    def num_classes(self):
        return 1 if self.partition is None else len(self.partition)

    def holds(self, found):
        """Whether the classes ``found`` in one trace (a plan or ``None``) are this plan's."""
        if found is None:
            return False
        if self.partition is None:
            return found.num_classes == 1
        return found.partition == self.partition


def normaliser_partition(records, batch_size, data_extras=False):
    """``(terms, ClassPlan without routing)`` of one trace's recorded reductions.

    ``None`` for the plan if a term is unreduced (no class can hold it). A
    loss without recorded reductions (one's own) is one per-sample class.
    ``data_extras``: the model has data-dependent additional losses (activity
    regularizers, ``add_loss``), whose normaliser is unseen: weighted by
    samples, they join the per-sample class, one of their own if none is.
    """
    terms = [loss_term(v, w, m, r, batch_size) for v, w, m, r, _ in records]
    if None in terms:
        return terms, None
    members = {}  # per key, in the order of its first term
    for position, term in enumerate(terms):
        members.setdefault(term.key, []).append(position)
    partition = tuple((tuple(m), _kind(k)) for k, m in members.items())
    kinds = [kind for _, kind in partition]
    if (data_extras or not partition) and SAMPLES not in kinds:
        partition += (((), SAMPLES),)
        kinds.append(SAMPLES)
    if SAMPLES in kinds:
        extras = kinds.index(SAMPLES)
    else:
        extras = next((c for c, kind in enumerate(kinds) if kind != SUM), 0)
    return terms, ClassPlan(partition, extras)


def class_data_objectives(micro_loss, plan, tape):
    """Per class of ``plan``, the part of the loss its terms contribute (unweighted).

    The loss is linear in the recorded reductions ``r_j`` (Keras weighs each by
    its ``loss_weights`` entry and the replicas, sums them, and adds the
    aggregated ``model.losses``): each coefficient ``a_j = d loss / d r_j``,
    read from ``tape`` (a scalar backward pass through that sum only), splits
    any linear ``compute_loss`` of Keras losses exactly. Class ``c``'s objective
    is ``sum_{j in c} a_j r_j``, plus the additional losses for
    ``plan.extras_class``; a one-class plan's is the whole loss (no pass).
    Call inside the tape's context (the objectives must be recorded).
    """
    loss = micro_loss.loss
    if plan.num_classes == 1:
        return [loss]
    reduced = [record[4] for record in micro_loss.records]
    with tape.stop_recording():
        coefficients = tape.gradient(
            loss, reduced, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
    objectives = []
    for c, (positions, _) in enumerate(plan.partition):
        parts = [
            ops.cast(tf.stop_gradient(coefficients[j]), loss.dtype)
            * ops.cast(reduced[j], loss.dtype)
            for j in positions
        ]
        if c == plan.extras_class and micro_loss.additional_losses:
            parts.append(_additional_total(micro_loss.additional_losses, loss.dtype))
        objectives.append(ops.sum(ops.stack(parts)) if len(parts) > 1 else parts[0])
    return objectives


def class_gradients(tape, objectives, routing, variables):
    """Per class, the gradients of its objective (order of ``variables``).

    Each class's backward pass runs only to the variables ``routing`` (per
    variable, its classes) says it reaches; ``None`` elsewhere, and for a
    class whose objective is ``None``.
    """
    class_grads = []
    for c, objective in enumerate(objectives):
        grads = [None] * len(variables)
        reached = [i for i, classes in enumerate(routing) if c in classes]
        if objective is not None and reached:
            partial = tape.gradient(objective, [variables[i] for i in reached])
            for i, grad in zip(reached, partial):
                grads[i] = grad
        class_grads.append(grads)
    return class_grads


def discover_classes(forward, variables, strategy, batch_spec):
    """The :class:`ClassPlan` of a model's loss, with its routing, from a symbolic pass.

    A traced, never-run function on ``batch_spec`` (the ``tf.TensorSpec``
    structure ``(x, y, sample_weight)``) runs ``forward`` (``(x, y,
    sample_weight) -> (y_pred, MicroBatchLoss)``, the train step's own),
    finds the classes of its recorded reductions and, with several, takes one
    gradient per class to see which of ``variables`` it reaches. Traced in
    replica context, as the train step runs (a distributed variable has no
    handle outside it).
    """
    found = {}

    def probe(x, y, sample_weight):
        with tf.GradientTape(persistent=True) as tape:
            _, micro_loss = forward(x, y, sample_weight)
            _, plan = micro_loss.partition()
            if plan is None or plan.num_classes < 2:
                return micro_loss.loss
            objectives = class_data_objectives(micro_loss, plan, tape)
        reaches = [
            [g is not None for g in tape.gradient(objective, variables)] for objective in objectives
        ]
        plan.routing = tuple(
            tuple(c for c in range(plan.num_classes) if reaches[c][i])
            for i in range(len(variables))
        )
        found["plan"] = plan
        return micro_loss.loss

    with strategy.scope():
        traced = tf.function(lambda *args: strategy.run(probe, args=args), autograph=False)
        traced.get_concrete_function(*batch_spec)
    return found.get("plan", ClassPlan.one_class())


def may_add_losses(model):
    """Whether the loss may hold more than one compiled loss's terms.

    An overridden ``compute_loss``, an activity regularizer, or a layer
    from outside Keras and this package (whose ``call`` may ``add_loss``).
    """
    if type(model).compute_loss is not keras.Model.compute_loss:
        return True
    for layer in sublayers(model):
        if getattr(layer, "activity_regularizer", None) is not None:
            return True
        module = type(layer).__module__
        if not module.startswith(("keras.", "gradient_accumulator.")):
            return True
    return False
