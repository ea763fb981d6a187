"""The run-time micro-batch: ``fit`` splits each update's batch into the micro-batches that fit.

With ``GradientAccumulateModel(micro_batch_size="auto")`` the user states the
update's batch (``fit``'s ``batch_size``, or the dataset's batch) and
:class:`AutoMicroBatch` runs each batch as one group: the batch cut into
near-equal micro-batches of at most the micro-batch in force, their gradients
summed, one update. The first group tries the whole batch; whenever a group
runs out of memory (``tf.errors.ResourceExhaustedError``) it is run again
from its start, on the same samples, at the next smaller divisor of the
batch, which stays in force for the groups after it.

A failed try leaves nothing behind: a group writes no weight and no optimizer
variable before its last micro-step has added its gradients (the update is a
call of its own, after the group's), and what its micro-steps write (the
sums, the metrics, the group's logged loss, layers' statistics and random
seeds) is put back as it was before the try, per replica. The retry
therefore trains as if the failed try had not run: the same weights as the
big batch, whatever the sequence of fall-backs.
"""

import logging
from typing import NamedTuple

import keras
import tensorflow as tf

from gradient_accumulator._compat import optimizer_chain, stateless_scope_writes, tf_variable
from gradient_accumulator.writes import make_writes, read, writes_returned

AUTO = "auto"

LOGGER = logging.getLogger("gradient_accumulator")


class MicroBatchChange(NamedTuple):
    """One change of the micro-batch in force (``GradientAccumulateModel.micro_batch_changes``).

    Attributes:
        update: Integer, the optimizer's ``iterations`` when it happened (the
            update whose group was run again).
        old: Integer, the micro-batch that ran out of memory (all replicas').
        new: Integer, the micro-batch that replaced it (all replicas').
        reason: String, the error's first line.
    """

    update: int
    old: int
    new: int
    reason: str


def largest_divisor_below(rows, limit):
    """The largest divisor of ``rows`` below ``limit`` (``None`` if ``limit <= 1``)."""
    for candidate in range(min(limit, rows + 1) - 1, 0, -1):
        if rows % candidate == 0:
            return candidate
    return None


def _rows(value):
    """The samples of one replica's batch (eager tensors): its first tensor's rows."""
    return int(next(t for t in tf.nest.flatten(value) if t is not None).shape[0])


def _slices(rows, micro):
    """``(count, size)``: slices of ``size`` rows of at most ``micro``, for replicas of ``rows``.

    As few as ``micro`` allows, as equal as can be; the first slice the same
    size on every replica where each has that many rows (a shorter share
    ends in shorter slices): the micro-batch weights take a group's first
    micro-batch as their reference on each replica, which must agree for
    the update to be the batch's (an epoch's last batch that the replicas
    share unevenly).
    """
    largest, smallest = max(rows), min(rows)
    count = -(-largest // micro)
    size = -(-largest // count)
    while size > smallest > 0:
        count += 1
        size = -(-largest // count)
    return count, size


def _out_of_memory(message):
    return tf.errors.ResourceExhaustedError(None, None, message)


def _reason(error):
    """The line of ``error`` that says what ran out of memory (TensorFlow's "OOM when ...")."""
    lines = [line.strip() for line in str(getattr(error, "message", error)).splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if "OOM" in line or "out of memory" in line.lower():
            return line
    return lines[-1] if lines else type(error).__name__


def _components(variables, strategy):
    """The per-replica TensorFlow variables of ``variables``, each once."""
    seen, components = set(), []
    for variable in variables:
        for component in strategy.experimental_local_results(tf_variable(variable)):
            if id(component) not in seen:
                seen.add(id(component))
                components.append(component)
    return components


# Operations that write a variable: none may be in a program that can run out
# of memory under XLA (below).
_WRITES = ("Assign", "ResourceScatter", "ResourceStridedSliceAssign", "ResourceApply")


def _writes_in(concrete):
    """The operations of ``concrete`` (a traced function) that write variables, nested ones too."""
    graph = concrete.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return sorted({n.op for n in nodes if n.op.startswith(_WRITES)})


def xla_micro_step(model, steps, ends_group, measures):
    """Under XLA, a micro-step as a program that writes no variable, then its writes.

    An XLA program that runs out of memory frees the buffers of the
    variables it writes while they are in use (the process then crashes or
    trains on garbage); one that writes none fails cleanly. So the
    micro-step's forward and backward pass run as one XLA program whose
    writes (Keras's variables' in a ``keras.StatelessScope``, the
    accumulator's listed by :func:`~gradient_accumulator.writes.writes_returned`)
    are its outputs, and a graph-mode step after it makes them. The sums are
    not written after each micro-step: they go in and out of the programs
    (carried, added to inside the program, where XLA fuses the add with the
    gradient) and are written once per group (:func:`write_carried_sums`).
    With the update an XLA program too, this took the settled mode from
    1.04-1.05x a fixed ``accum_steps`` to 0.967-1.019x (CPU time,
    ``benchmarks.auto_micro_batch``).

    Returns:
        ``run(data, index, count, sums) -> (marker, sums)``, to call in a
        compiled function in cross-replica context: ``sums`` as the group's
        micro-steps so far leave them (:func:`carried_sums` at its start), the
        marker the accumulator's count read once the other writes are made.
    """
    strategy = model.distribute_strategy
    listed = []  # the writes, (variable, kind), as the last trace made them

    def replica(data, index, count, sums):
        micro = steps.accumulator.micro_step_at(index, count, ends_group, measures)
        scope = keras.StatelessScope()
        carried = steps.accumulator.all_sums()
        try:
            with scope, writes_returned(zip(carried, sums)) as raw:
                steps.micro_step(data, micro)
                sums = [read(variable) for variable in carried]
        finally:
            # Listed after the step, whose first trace builds the compiled metrics.
            restorable, emptied = steps.group_state()
            known = {id(v): v for v in [*restorable, *emptied]}
            caught = stateless_scope_writes(scope)
            names = {id(v): v.path for v in model.variables}
            weights = {id(v) for v in model.trainable_variables}
            unknown = [names.get(key, "?") for key in caught if key not in known or key in weights]
            if unknown:
                # A layer that writes a weight (Keras's SpectralNormalization) ends
                # the step with an error of the tape's (the weight read as a tensor).
                raise ValueError(
                    f"Model '{model.name}' writes variables in its training call that "
                    "micro_batch_size='auto' with jit_compile=True cannot return from the "
                    "micro-step's program (a weight, written by a layer such as "
                    "SpectralNormalization). Compile with jit_compile=False. Received: writes "
                    f"of {unknown}"
                )
        writes = [(known[key], "assign", value) for key, value in caught.items()]
        writes += raw
        listed[:] = [(variable, kind) for variable, kind, _ in writes]
        return [value for _, _, value in writes], sums

    program = tf.function(replica, jit_compile=True, reduce_retracing=True, autograph=False)
    checked = []

    def run(data, index, count, sums):
        values, sums = strategy.run(program, args=(data, index, count, sums))
        if not checked:
            writes = _writes_in(program.get_concrete_function(data, index, count, sums))
            if writes:
                raise ValueError(
                    f"Model '{model.name}' writes variables in its micro-step that Keras does "
                    "not track (a TensorFlow variable of a layer's): under XLA an out-of-memory "
                    "error would corrupt them, so micro_batch_size='auto' with "
                    "jit_compile=True cannot train it. Compile with jit_compile=False. "
                    f"Received: a program that writes variables ({', '.join(writes)})"
                )
            checked.append(True)

        def make(values):
            writes = [(variable, kind, value) for (variable, kind), value in zip(listed, values)]
            with tf.control_dependencies(make_writes(writes)):
                return steps.accumulator.micro_step.read_value()

        return strategy.run(make, args=(values,)), sums

    return run


def carried_sums(model, steps):
    """The accumulator's sums as values, to carry through a group's XLA micro-steps."""

    def replica():
        return [variable.read_value() for variable in steps.accumulator.all_sums()]

    return model.distribute_strategy.run(replica)


def write_carried_sums(model, steps, sums):
    """Writes the carried ``sums`` into the accumulator's; returns its count, read after."""

    def replica(sums):
        variables = steps.accumulator.all_sums()
        writes = [(variable, "assign", value) for variable, value in zip(variables, sums)]
        with tf.control_dependencies(make_writes(writes)):
            return steps.accumulator.micro_step.read_value()

    return model.distribute_strategy.run(replica, args=(sums,))


class AutoMicroBatch:
    """Runs ``fit``'s batches as whole groups, choosing their micro-batch at run time.

    Args:
        model: The ``GradientAccumulateModel`` (``micro_batch_size="auto"``).
        steps: Its :class:`~gradient_accumulator.steps.ModelSteps`.
        functions: ``measures -> (group, end)``, the runner's compiled
            functions of the groups the noise scale measures or skips
            (:meth:`~gradient_accumulator.runner.GroupRunner.split_group_functions`).
    """

    def __init__(self, model, steps, functions):
        self._model = model
        self._steps = steps
        self._functions = functions
        self.micro_batch_size = None  # per replica; None: the whole batch, not tried yet
        self.changes = []
        self._state = None
        self._warned_normalisation = False

    def reset(self):
        """Forgets the traced state lists (a new train function)."""
        self._state = None

    def train_function(self, iterator, batches):
        """Up to ``batches`` groups, one per batch of ``iterator``: the logs of the last."""
        logs = None
        for _ in range(batches):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    raise
                break
            logs = self.run_group(data)
        return logs

    def run_group(self, data):
        """One batch as one group, its micro-steps tried again smaller while out of memory."""
        strategy = self._model.distribute_strategy
        rows = [_rows(each) for each in strategy.experimental_local_results(data)]
        largest = max(rows)
        micro = min(self.micro_batch_size or largest, largest)
        accumulator = self._steps.accumulator
        measured = accumulator.noise_schedule.next_group(accumulator.update_count)
        while True:
            count, size = _slices(rows, micro)
            # The noise scale compares a micro-batch's gradient with the
            # batch's: a batch run whole on one replica has no smaller one.
            measures = self._model.noise_scale and measured and (count > 1 or len(rows) > 1)
            group, end = self._functions(measures)
            try:
                self._micro_steps(group, data, count, size)
                break
            except tf.errors.ResourceExhaustedError as error:
                smaller = largest_divisor_below(largest, micro)
                self._fall_back(micro, smaller, error)
                micro = self.micro_batch_size = smaller
        if self.micro_batch_size is None:
            self.micro_batch_size = micro
        try:
            logs = end()
        except tf.errors.ResourceExhaustedError as error:
            raise _out_of_memory(
                f"Model '{self._model.name}' ran out of memory in the optimizer's update, after "
                "its group's gradients were summed. The micro-batch does not change the "
                "update's memory (the weights, the sums and the optimizer's variables): the "
                "weights and the optimizer's variables may be partly updated (under XLA, "
                "whose update writes them in place, their memory lost: do not save them). "
                "Restore the last checkpoint (keras.callbacks.BackupAndRestore) and train with "
                "an optimizer of less state or a smaller model.",
            ) from error
        replicas = strategy.num_replicas_in_sync
        return {**logs, "micro_batch_size": self.micro_batch_size * replicas}

    def _micro_steps(self, group, data, count, size):
        """The group's micro-steps; if they run out of memory, what they wrote is put back."""
        count, size = tf.constant(count, "int32"), tf.constant(size, "int32")
        if self._state is None and hasattr(group, "get_concrete_function"):
            # Traced before the state is listed: the variables its first trace
            # creates (Keras builds some there) are put back too.
            group.get_concrete_function(data, count, size)
        restorable, emptied, read = self._state_components()
        saved = read()
        try:
            group(data, count, size)
        except tf.errors.ResourceExhaustedError:
            for variable, value in zip(restorable, saved):
                variable.assign(value)
            for variable in emptied:
                variable.assign(tf.zeros(variable.shape, variable.dtype))
            raise

    def _state_components(self):
        """``(restorable, emptied, read)``: per-replica variables, and a function reading the first.

        ``read()`` is one call (the snapshot of every group): its values
        share the variables' memory until the group writes them.
        """
        if self._state is None:
            strategy = self._model.distribute_strategy
            restorable, emptied = self._steps.group_state()
            restorable = _components(restorable, strategy)
            read = tf.function(
                lambda: [variable.read_value() for variable in restorable], autograph=False
            )
            self._state = (restorable, _components(emptied, strategy), read)
        return self._state

    def _fall_back(self, old, new, error):
        model = self._model
        replicas = model.distribute_strategy.num_replicas_in_sync
        reason = _reason(error)
        # The innermost optimizer's count: Keras 3.3.3's LossScaleOptimizer
        # keeps an `iterations` of its own that stays 0.
        update = int(optimizer_chain(model.optimizer)[-1].iterations.numpy())
        if new is None:
            raise _out_of_memory(
                f"Model '{model.name}' ran out of memory at micro-batch {old * replicas} "
                f"(update {update}), with micro_batch_size='auto': one sample per replica "
                "does not fit. Free memory on the device (another process, a smaller "
                "validation batch), make the model smaller, use mixed precision "
                "(keras.mixed_precision.set_global_policy('mixed_float16')), or spread the "
                f"batch over more devices. The error: {reason}",
            ) from error
        self.changes.append(MicroBatchChange(update, old * replicas, new * replicas, reason))
        LOGGER.warning(
            "gradient_accumulator: model '%s' ran out of memory at micro-batch %d (update %d); "
            "running its group again at micro-batch %d, in force from now on.",
            model.name,
            old * replicas,
            update,
            new * replicas,
        )
        if not self._warned_normalisation and self._steps.per_micro_batch_layers():
            self._warned_normalisation = True
            LOGGER.warning(
                "gradient_accumulator: model '%s' has Keras BatchNormalization layers, which "
                "normalise each micro-batch: from now on they see micro-batches of %d, not "
                "the batch. Use gradient_accumulator.AccumBatchNormalization(accum_steps='auto') "
                "(replace_batchnorm_layers(model, accum_steps='auto')) for the batch's "
                "statistics.",
                model.name,
                new * replicas,
            )
