"""Losses that couple the samples of a batch: the group's loss at once, through cached gradients.

A contrastive loss (InfoNCE, CLIP's, in-batch negatives) compares every
sample of the batch with the others: the loss of ``accum_steps``
micro-batches, each on its own, is another objective than the big batch's
(each sample sees ``b - 1`` negatives instead of ``k * b - 1``). With
``GradientAccumulateModel(coupled_loss=...)`` a group runs in two passes
(Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under
Memory Limited Setup"):

1. each micro-batch forward, without a tape: its outputs are kept, its
   activations freed;
2. the loss (and the metrics) on the whole group's outputs at once, and its
   gradient with respect to them, ``dL/dy``;
3. each micro-batch forward again under a tape, its gradient of
   ``sum(dL/dy_i * y_i)`` added to the sums: the chain rule makes their sum
   ``dL/dW``. Then one update.

What keeps the two forward passes of a micro-batch the same computation:
its random seed generators' states are put back to what they were before
its first pass (the same dropout masks); the second pass writes no layer
state (:meth:`~gradient_accumulator.state_writes.StateWrites.replayed`), so
BatchNormalization statistics move once per micro-batch.

The memory of a group: one micro-batch's activations, plus the group's
inputs and outputs and the loss's own (``N x N`` similarities for ``N``
samples). The time: one more forward pass per micro-batch.
"""

import warnings

import keras
import tensorflow as tf
from keras import ops

from gradient_accumulator._compat import (
    build_compiled_metrics_outside_trace,
    compute_training_loss,
    loss_tracker,
    per_replica,
    raw_value,
    reduce_replica_logs,
    seed_generator_states,
)
from gradient_accumulator.distribute import logs_for_keras
from gradient_accumulator.steps import update_step_scope
from gradient_accumulator.weighting import weight_only_loss_count

COUPLED_LOSS_SCOPES = ("replica", "global")


def check_coupled_loss(value):
    """Returns ``value`` (``None``, ``"replica"`` or ``"global"``), or raises a ValueError."""
    if value is None or value in COUPLED_LOSS_SCOPES:
        return value
    raise ValueError(
        "`coupled_loss` must be None (each sample's loss depends on its own outputs "
        "only), 'replica' (the loss compares the samples of each replica's batch) or "
        "'global' (of the batch of every replica). Received: "
        f"coupled_loss={value!r}"
    )


def couples_groups(model):
    """Whether ``fit``'s groups run the two passes: its loss on the group's whole batch.

    Several micro-batches, or the global batch (``"global"``) of several
    replicas, of which one micro-step's loss sees only its replica's share.
    """
    if model.coupled_loss is None:
        return False
    replicas = model.distribute_strategy.num_replicas_in_sync
    return model.accum_steps > 1 or (model.coupled_loss == "global" and replicas > 1)


def _gather(tensors, rows, replicas):
    """Every replica's ``tensors`` (``rows`` each), concatenated in replica order.

    Returns this replica's first row in them and the gathered tensors. By
    two summing all-reductions (the rows of each replica, then each replica's
    tensors placed at its rows of zeros): TensorFlow's ``all_gather`` fails
    under MultiWorkerMirroredStrategy ("destinations can not be empty", TF
    2.21). Integer and boolean tensors cross as float64 (exact below 2**53),
    one reduction per dtype.
    """
    context = tf.distribute.get_replica_context()
    replica = context.replica_id_in_sync_group
    mine = tf.one_hot(replica, replicas, dtype="float32") * ops.cast(rows, "float32")
    counts = ops.cast(context.all_reduce(tf.distribute.ReduceOp.SUM, mine), "int32")
    offset = ops.sum(counts[:replica])
    total = ops.sum(counts)
    padded = []
    for t in tensors:
        wire = t if t.dtype.is_floating else ops.cast(t, "float64")
        padding = [[offset, total - offset - rows]] + [[0, 0]] * (t.shape.rank - 1)
        padded.append(tf.pad(wire, padding))
    # One reduction per dtype (a batched reduction concatenates its tensors).
    summed = [None] * len(padded)
    for dtype in {t.dtype for t in padded}:
        indices = [i for i, t in enumerate(padded) if t.dtype == dtype]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [padded[i] for i in indices])
        for i, r in zip(indices, reduced):
            summed[i] = r
    return offset, [
        s if t.dtype.is_floating else ops.cast(s, t.dtype) for t, s in zip(tensors, summed)
    ]


# The relative residual of `loss_couples_samples` above which a loss compares the samples.
COUPLING_TOLERANCE = 1e-4


def loss_couples_samples(model, data):
    """Whether ``model``'s loss compares the samples of a batch: the relative residual, or ``None``.

    One eager check, in inference mode, on a batch ``data`` (``(x, y,
    sample_weight)``): the compiled loss's gradient with respect to the
    outputs, on the whole batch, restricted to its first half, against the
    gradient on the first half alone. A loss of each sample's own outputs
    gives proportional gradients (its normaliser only scales them). Returns
    the largest relative residual over the outputs after the best scaling,
    or ``None`` where it cannot tell (under 4 rows, a loss that fails eagerly).
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    leaves = [t for t in tf.nest.flatten(x) if getattr(t, "shape", None) is not None]
    rows = int(leaves[0].shape[0] or 0) if leaves else 0
    if rows < 4:
        return None
    half = rows // 2

    def gradient(count):
        first_x, first_y, first_weight = tf.nest.map_structure(
            lambda t: None if t is None else t[:count], (x, y, sample_weight)
        )
        flat = [t[:count] for t in tf.nest.flatten(outputs)]
        with tf.GradientTape() as tape:
            tape.watch(flat)
            y_pred = tf.nest.pack_sequence_as(outputs, flat)
            loss = compute_training_loss(model, first_x, first_y, y_pred, first_weight)
        return tape.gradient(loss, flat)

    try:
        outputs = tf.nest.map_structure(lambda t: ops.cast(t, "float32"), model(x, training=False))
        whole, alone = gradient(rows), gradient(half)
    except (tf.errors.OpError, ValueError, TypeError):
        # Not computable eagerly on this batch: the training step says why, if it fails.
        return None
    residual = 0.0
    for w, a in zip(whole, alone):
        if w is None or a is None:
            continue
        w, a = tf.reshape(w[:half], [-1]), tf.reshape(a, [-1])
        scale = tf.math.divide_no_nan(tf.reduce_sum(w * a), tf.reduce_sum(a * a))
        size = tf.reduce_max(tf.abs(w))
        if float(size) == 0.0:
            continue
        residual = max(residual, float(tf.reduce_max(tf.abs(w - scale * a)) / size))
    return residual


def warn_if_loss_couples_samples(model, data):
    """Warns where ``model`` (``coupled_loss=None``) has a loss that compares its samples."""
    residual = loss_couples_samples(model, data)
    if residual is None or residual <= COUPLING_TOLERANCE:
        return
    warnings.warn(
        f"Model '{model.name}' has `coupled_loss=None`, and its loss compares the samples "
        "of a batch with each other (a contrastive loss, in-batch negatives, a "
        "batch-hard triplet loss): the gradient it gives the first half of a batch "
        "changes when the other half is left out (relative difference "
        f"{residual:.3g}). Accumulated so, each micro-batch's loss compares only its own "
        f"samples: training is not the big batch of accum_steps={model.accum_steps} "
        "micro-batches, but another objective. Pass `coupled_loss='replica'` (or "
        "'global' under several replicas) to compute each group's loss on its whole "
        "batch; see 'Contrastive and retrieval losses' in the documentation.",
        stacklevel=3,
    )


# How far a micro-batch's second forward pass may compute from its first,
# relative to the outputs' magnitude: nondeterministic GPU kernels move the
# last bits; a random op drawn anew, a dropout mask say, moves the outputs
# by their own size.
REPLAY_TOLERANCE = 1e-3


def check_replayed(drift, model_name):
    """Fails the step where a second forward pass did not compute its first's outputs.

    ``drift`` is :meth:`CoupledGroup.backward`'s figure (the largest over a
    group). Outside XLA (an assertion is no XLA operation).
    """
    return tf.debugging.assert_less_equal(
        drift,
        tf.constant(REPLAY_TOLERANCE, drift.dtype),
        message=(
            f"Model '{model_name}' with `coupled_loss`: the second forward pass of a "
            "micro-batch computed other outputs than its first, so the cached loss "
            "gradient does not belong to them and the weights would silently move "
            "elsewhere than the big batch's. Its forward pass draws random numbers "
            "that are not replayed (a TensorFlow random op such as tf.random.uniform, "
            "or a Keras random op without a layer's SeedGenerator) or reads state that "
            "the first pass changed. Draw random numbers through a SeedGenerator that "
            "a layer owns (as Keras's Dropout and random layers do). Largest relative "
            "difference (tolerance 1e-3):"
        ),
    )


def _tensor_leaves(data):
    """The tensors of a batch's structure, and what :func:`_packed` puts them back into."""
    flat = tf.nest.flatten(data)
    template = tf.nest.pack_sequence_as(data, [None if t is None else 0 for t in flat])
    return [t for t in flat if t is not None], (template, [t is None for t in flat])


def _replicas_results(strategy, result):
    """Per local replica, its part of ``result`` (``strategy.run``'s, or a batch's tensors)."""
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


class CoupledGroup:
    """The replica-context steps of a group whose loss couples its samples.

    :meth:`group_function` runs them (the runner's case for ``coupled_loss``).

    Args:
        model: The ``GradientAccumulateModel``.
        steps: Its :class:`~gradient_accumulator.steps.ModelSteps` (the
            group's end).
    """

    def __init__(self, model, steps):
        self._model = model
        self._steps = steps
        self._output_structure = None  # the model's outputs, as the first pass traced them
        self._structure = None  # the batch's (`_tensor_leaves`), as the group's trace fetched it
        # The sums that the group's trace adds to: by its loss (`loss`) and
        # by its micro-steps (`backward`); the update applies their union.
        self._loss_slots = []
        self._step_slots = []

    def forward(self, data, is_first):
        """First pass of a micro-batch: its outputs (flat list), no tape kept.

        Its writes of layer state are made as in any micro-step
        (:meth:`~gradient_accumulator.state_writes.StateWrites.once_per_update`).
        """
        model = self._model
        self._steps.check_variables()
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        with (
            update_step_scope(tf.constant(False)),
            model._state_writes.once_per_update(x, is_first),
        ):
            y_pred = model(x, training=True)
        found = len(model.losses) - weight_only_loss_count(model)
        if found > 0:
            raise ValueError(
                f"Model '{model.name}' adds {found} loss term(s) computed from the data in "
                "its forward pass (an activity regularizer or `add_loss`): with "
                "`coupled_loss`, the loss is computed on the group's outputs, and these "
                "terms of each micro-batch's forward pass would not be part of it. Compute "
                "them from the outputs in the loss (an overridden `compute_loss`), or "
                f"train with coupled_loss=None. Received: coupled_loss={model.coupled_loss!r}"
            )
        self._output_structure = tf.nest.map_structure(lambda _: 0, y_pred)
        return [tf.stop_gradient(t) for t in tf.nest.flatten(y_pred)]

    def loss(self, data, outputs):
        """The group's loss, on its whole batch: ``(dL/d outputs, logs)``.

        With ``coupled_loss="global"`` under several replicas, the batch is
        the global one: the replicas' group outputs, targets and sample
        weights gathered, the loss computed on them in every replica, and
        each replica's gradient kept for its own rows. The logged loss is
        that batch's; the metrics are the replica's own rows' (summed over
        the replicas, as Keras's are).

        Args:
            data: The group's batch ``(x, y, sample_weight)``, its
                micro-batches' rows concatenated.
            outputs: Flat list of the group's outputs (:meth:`forward`'s,
                concatenated), cast to float32 here: the loss and its
                gradient are float32 under mixed precision.

        Returns:
            The float32 gradient of the loss with respect to each output,
            and the logs (the group's loss and compiled metrics).
        """
        model = self._model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        outputs = [ops.cast(t, "float32") for t in outputs]
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        gathered = model.coupled_loss == "global" and replicas > 1
        loss_x, loss_y, loss_weight, loss_outputs = x, y, sample_weight, outputs
        if gathered:
            # One all-gather, in replica order (and of the inputs, for an
            # overridden `compute_loss`).
            rows = tf.shape(outputs[0])[0]
            overridden = type(model).compute_loss is not keras.Model.compute_loss
            leaves, structure = _tensor_leaves(
                (x if overridden else None, y, sample_weight, outputs)
            )
            offset, leaves = _gather(leaves, rows, replicas)
            loss_x, loss_y, loss_weight, loss_outputs = _packed(structure, leaves)
        variables = model.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(loss_outputs)
            y_pred = tf.nest.pack_sequence_as(self._output_structure, loss_outputs)
            # The replica's share of the loss (divided by the replicas, whose
            # gradients are summed); each replica's is the whole global loss
            # where gathered, of which it back-propagates its own rows.
            share = compute_training_loss(model, loss_x, loss_y, y_pred, loss_weight)
            objective = share * replicas if gathered else share
            scaled_share = model.optimizer.scale_loss(share)
        grads = tape.gradient(objective, loss_outputs)
        # The loss's own dependence on weights, the outputs held fixed: what
        # `compute_loss` reads itself (a candidate tower, the regularizers).
        # It is the group's, not a micro-batch's: added to the sums once.
        self._loss_slots = self._steps.accumulator.add_group_gradients(
            tape.gradient(scaled_share, variables), variables
        )
        del tape
        grads = [ops.zeros_like(t) if g is None else g for t, g in zip(loss_outputs, grads)]
        if gathered:
            grads = [g[offset : offset + rows] for g in grads]
        batch_size = ops.shape(tf.nest.flatten(x)[0])[0]
        loss_tracker(model).update_state(share * replicas, sample_weight=batch_size)
        y_pred = tf.nest.pack_sequence_as(self._output_structure, outputs)
        build_compiled_metrics_outside_trace(model, y, y_pred)
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads, logs_for_keras(logs, model.distribute_strategy)

    def backward(self, data, output_grads, is_first, first_outputs):
        """Second pass of a micro-batch: its part of the group's gradient added to the sums.

        The gradient of ``sum(dL/dy * y)`` over its outputs ``y`` (``dL/dy``:
        ``output_grads``, its rows of :meth:`loss`'s); :meth:`loss` has added
        the rest of ``dL/dW``, the loss's own dependence on the weights. Its
        divisor is 1 at the first micro-step and 0 elsewhere: the sums are
        the group's gradient itself.

        Args:
            first_outputs: The outputs of its first pass (:meth:`forward`),
                which this pass must compute again.

        Returns:
            The accumulator's micro-step count, read after the adds, and the
            largest difference between this pass's outputs and
            ``first_outputs``, relative to their magnitude (:func:`check_replayed`).
        """
        model = self._model
        accumulator = self._steps.accumulator
        variables = model.trainable_variables
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        first = ops.cast(is_first, "float32")
        with (
            update_step_scope(tf.constant(False)),
            model._state_writes.replayed(),
            tf.GradientTape() as tape,
        ):
            y_pred = tf.nest.flatten(model(x, training=True))
            products = [ops.sum(ops.cast(t, "float32") * g) for t, g in zip(y_pred, output_grads)]
            objective = model.optimizer.scale_loss(ops.sum(ops.stack(products)))
        grads = tape.gradient(objective, variables)
        self._step_slots = accumulator.add([grads], [first])
        drift = [
            ops.max(ops.abs(ops.cast(t, "float32") - ops.cast(f, "float32")))
            / (ops.max(ops.abs(ops.cast(f, "float32"))) + 1e-30)
            for t, f in zip(y_pred, first_outputs)
        ]
        return accumulator.micro_step.read_value(), tf.stop_gradient(ops.max(ops.stack(drift)))

    def end_group(self, logs=None):
        """The group's end (replica context), once its last :meth:`backward` has added.

        Its update applies every sum the group added to (see ``__init__``);
        returns ``logs`` as they read after it (``None`` without).
        """
        present = sorted({*self._loss_slots, *self._step_slots})
        return self._steps.end_group(True, present=present, logs=logs)

    def group_function(self):
        """One whole group in the module's two passes: ``(iterator, length) -> logs``, to compile.

        The first pass, a ``tf.while_loop``, caches each micro-batch, its
        outputs and its seed generators' states in ``TensorArray`` s (the
        first micro-batch peeled off the loop: its outputs give the caches'
        types); the loss runs on the caches concatenated; the second loop
        puts back each micro-batch's seed states and adds its gradients.
        Both loops run one iteration at a time (``parallel_iterations=1``):
        one micro-batch's activations alive at a time. Under XLA, each step
        is a program of its own.
        """
        passes = self._passes()

        def group(iterator, length):
            def fetch(index, done):
                with tf.control_dependencies(done):
                    return next(iterator)

            logs, _, checked = self._two_passes(passes, fetch, length)
            with tf.control_dependencies([checked]):
                passes[-1]()
            return self._steps.with_update_logs(logs)

        return group

    def split_group_function(self, cut):
        """``micro_batch_size="auto"``: ``(data, count, size) -> marker``, passes, no update.

        ``cut(data, index, size, done)``: micro-batch ``index`` of the
        batch ``data`` (a per-replica value), read once ``done``'s tensors
        are. The update is :meth:`end_group`'s, a call of its own (a group
        that runs out of memory is run again); graph mode only.
        """
        passes = self._passes()

        def group(data, count, size):
            def fetch(index, done):
                return cut(data, index, size, done)

            _, marker, checked = self._two_passes(passes, fetch, count)
            with tf.control_dependencies([checked]):
                return tf.identity(marker)

        return group

    def _two_passes(self, passes, fetch, length):
        """The passes over ``length`` micro-batches from ``fetch(index, done)``.

        Returns ``(logs, marker, checked)``: ``marker`` the accumulator's
        count read once the last gradient is added, ``checked`` the replay
        check.
        """
        model = self._model
        strategy = model.distribute_strategy
        forward, loss, backward, _ = passes
        seeds = seed_generator_states(model)
        devices = _replica_devices(strategy)
        data = fetch(tf.constant(0, "int32"), [])
        flat, self._structure = _tensor_leaves(data)
        leaves = _replicas_results(strategy, flat)
        saved = [raw_value(seed) for seed in seeds]
        outputs = forward(leaves, tf.constant(True))
        # Per replica: its micro-batch's tensors, outputs, rows; the seed states.
        caches = [
            [_cache(t, length, device).write(0, t) for t in values]
            for values, device in zip(_cached_values(leaves, outputs), devices)
        ]
        seed_caches = [_cache(t, length).write(0, t) for t in saved]

        def first_pass(index, caches, seed_caches):
            flows = [c.flow for c in tf.nest.flatten(caches) + seed_caches]
            data = fetch(index, flows)
            leaves = _replicas_results(strategy, _tensor_leaves(data)[0])
            saved = [raw_value(seed) for seed in seeds]
            outputs = forward(leaves, tf.constant(False))
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
        output_grads, logs = loss(group_leaves, group_outputs)
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
            marker, step_drift = backward(leaves, grads, ops.equal(index, 0), first)
            return index + 1, marker, ops.maximum(drift, step_drift)

        _, marker, drift = tf.while_loop(
            lambda index, *_: index < length,
            second_pass,
            (tf.constant(0, "int32"), tf.zeros((), "int64"), tf.zeros(())),
            parallel_iterations=1,
        )
        return logs, marker, check_replayed(drift, model.name)

    def _passes(self):
        """The two-pass group's ``(forward, loss, backward, update)``, in graph or XLA mode.

        Called in cross-replica context with per-replica lists of the batch's
        tensors (packed by the structure the group's trace keeps), outputs and
        output gradients; ``forward`` returns the replicas' outputs, ``loss``
        their output gradients and the reduced logs, ``backward`` a marker
        computed after the adds and the largest drift.
        """
        model = self._model
        strategy = model.distribute_strategy
        xla = model.jit_compile and not model.run_eagerly

        def in_replica(method):
            def run(leaves, *args):
                return method(_packed(self._structure, leaves), *args)

            # One replica (XLA is refused with several): each a program of its own.
            if xla:
                return tf.function(run, reduce_retracing=True, jit_compile=True, autograph=False)
            return run

        forward_pass, loss_pass, backward_pass = map(
            in_replica, (self.forward, self.loss, self.backward)
        )

        def forward(leaves, is_first):
            result = strategy.run(forward_pass, args=(_distributed(leaves), is_first))
            return _replicas_results(strategy, result)

        def loss(leaves, outputs):
            grads, logs = strategy.run(
                loss_pass, args=(_distributed(leaves), _distributed(outputs))
            )
            return _replicas_results(strategy, grads), reduce_replica_logs(logs, strategy)

        def backward(leaves, grads, is_first, first_outputs):
            arguments = (_distributed(leaves), _distributed(grads), is_first)
            arguments += (_distributed(first_outputs),)
            marker, drift = strategy.run(backward_pass, args=arguments)
            marker = ops.sum(ops.stack(strategy.experimental_local_results(marker)))
            return marker, ops.max(ops.stack(strategy.experimental_local_results(drift)))

        def update():
            strategy.run(self.end_group)

        if xla:
            update = tf.function(update, jit_compile=True, autograph=False)
        return forward, loss, backward, update
