"""Choosing the micro-batch: the largest divisor of the batch whose training fits in memory."""

import dataclasses
import gc
import numbers
import os
import re
import time

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator._compat import custom_gradients_dropped, in_multi_worker_mode
from gradient_accumulator.validation import check_positive_integer

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_MIB = 2**20
TRIED_CALLS = 2  # train-function calls per try


def _bytes(memory_budget):
    """``memory_budget`` in bytes, or ``None`` where it is not a budget."""
    if isinstance(memory_budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", memory_budget)
        if match is None or match.group(2).lower() not in _UNITS:
            return None
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral):
        return None
    return int(memory_budget)


def parse_memory_budget(memory_budget):
    """``memory_budget`` in bytes (``int``), ``None`` for none, or a ValueError naming it.

    Takes an integer number of bytes or a string: a number and a unit among
    B, KB, MB, GB (powers of 1000) and KiB, MiB, GiB (powers of 1024), e.g.
    ``"1.5 GiB"``.
    """
    if memory_budget is None:
        return None
    size = _bytes(memory_budget)
    if size is None or size <= 0:
        raise ValueError(
            "`memory_budget` must be an integer number of bytes > 0 or a string such as "
            "'512 MiB' or '2 GB' (units: B, KB, MB, GB, KiB, MiB, GiB). "
            f"Received: memory_budget={memory_budget!r}"
        )
    return size


@dataclasses.dataclass(frozen=True)
class MicroBatchTry:
    """One micro-batch tried: two updates of a model built for it.

    Attributes:
        micro_batch: Integer, the micro-batch tried (global, over replicas).
        peak_bytes: Integer, the allocator's peak during the try (the
            highest over the devices), or ``None`` if it ran out of memory.
        fits: Boolean, whether it ran and its peak is within the budget.
    """

    micro_batch: int
    peak_bytes: int | None
    fits: bool


@dataclasses.dataclass(frozen=True)
class MicroBatchChoice:
    """What :func:`choose_micro_batch` chose, and what it measured.

    ``accum_steps * micro_batch == batch_size``: training with
    ``build(accum_steps)`` and ``fit(batch_size=micro_batch)`` is training
    with ``batch_size``.

    Attributes:
        batch_size: Integer, the batch asked for.
        micro_batch: Integer, the largest micro-batch that fitted.
        accum_steps: Integer, ``batch_size // micro_batch``.
        peak_bytes: Integer, the chosen try's peak (see :class:`MicroBatchTry`).
        memory_budget: Integer bytes, or ``None`` (only out-of-memory errors decided).
        tries: Tuple of :class:`MicroBatchTry`, in the order tried.
        seconds: Float, the wall time the tries took.
    """

    batch_size: int
    micro_batch: int
    accum_steps: int
    peak_bytes: int
    memory_budget: int | None
    tries: tuple
    seconds: float

    def __str__(self):
        tried = ", ".join(_describe(t) for t in self.tries)
        budget = "" if self.memory_budget is None else f" of a {_mib(self.memory_budget)} budget"
        return (
            f"Batch {self.batch_size} = accum_steps {self.accum_steps} x micro-batch "
            f"{self.micro_batch}: peak {_mib(self.peak_bytes)}{budget} (tried {tried}; "
            f"{len(self.tries)} {'try' if len(self.tries) == 1 else 'tries'} in "
            f"{self.seconds:.1f} s)"
        )


def _mib(size):
    return f"{size / _MIB:.1f} MiB"


def _describe(attempt):
    if attempt.peak_bytes is None:
        return f"{attempt.micro_batch}: out of memory"
    verdict = "fits" if attempt.fits else "over"
    return f"{attempt.micro_batch}: {_mib(attempt.peak_bytes)} {verdict}"


def _memory_devices():
    """The allocators to read: every GPU's, else the CPU's (logical CPUs share it)."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in gpus] if gpus else ["/device:CPU:0"]


def _check_memory_statistics(devices):
    """Refuses, before any try, where TensorFlow keeps no allocator statistics to read."""
    for device in devices:
        try:
            tf.config.experimental.reset_memory_stats(device)
        except ValueError as error:
            raise RuntimeError(
                "`choose_micro_batch` reads the allocator's peak, and TensorFlow keeps no "
                f"memory statistics for {device} in this process. On a CPU it keeps them "
                "only with oneDNN on, which TensorFlow turns on by default only on some "
                "CPUs: set TF_ENABLE_ONEDNN_OPTS=1 in the environment before TensorFlow is "
                "imported (or choose on a GPU). Received: TF_ENABLE_ONEDNN_OPTS="
                f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(not set)')}"
            ) from error


def _stream(data, micro_batch, batches):
    """``batches`` micro-batches of ``data``'s rows (repeated as needed), made as they are read.

    A stream, as a pipeline reading from disk: ``fit`` on the arrays
    themselves would copy them whole into TensorFlow's memory, and the peak
    would be the data set's as much as the training's.
    """

    count = len(next(a for a in tf.nest.flatten(data) if a is not None))

    def rows(index):
        picked = np.arange(index * micro_batch, (index + 1) * micro_batch) % count
        return tf.nest.map_structure(
            lambda a: None if a is None else np.take(np.asarray(a), picked, 0), data
        )

    def generate():
        for index in range(batches):
            yield keras.utils.pack_x_y_sample_weight(*rows(index))

    first = keras.utils.pack_x_y_sample_weight(*rows(0))
    signature = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, a.dtype), first)
    stream = tf.data.Dataset.from_generator(generate, output_signature=signature)
    return stream.apply(tf.data.experimental.assert_cardinality(batches))


def _check_arrays(x, y, sample_weight):
    for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for leaf in tf.nest.flatten(value):
            if leaf is not None and not isinstance(leaf, (np.ndarray, tf.Tensor)):
                raise ValueError(
                    f"`{name}` must be a NumPy array or tensor (or a list or dict of them): "
                    "each try trains on a whole batch cut from it. Pass arrays, or a "
                    f"sample of your data as arrays. Received: {name} of type "
                    f"{type(leaf).__name__}"
                )
    rows = {len(a) for a in tf.nest.flatten((x, y, sample_weight)) if a is not None}
    if len(rows) != 1 or 0 in rows:
        raise ValueError(
            "`x`, `y` and `sample_weight` must have the same number of rows, at least "
            f"one. Received: row counts {sorted(rows)}"
        )


def _built(build, accum_steps):
    """``build(accum_steps)``, checked: a compiled GradientAccumulateModel with ``accum_steps``."""
    from gradient_accumulator.model import GradientAccumulateModel

    model = build(accum_steps)
    if not isinstance(model, GradientAccumulateModel):
        raise ValueError(
            "`build` must return a GradientAccumulateModel (build(accum_steps) -> "
            f"model). Received: an object of type {type(model).__name__} from "
            f"build({accum_steps})"
        )
    if model.accum_steps != accum_steps:
        raise ValueError(
            "`build(accum_steps)` must return a model with that `accum_steps`. "
            f"Received: accum_steps={model.accum_steps} from build({accum_steps})"
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`build` must return a compiled model (call `model.compile(...)` in it). "
            f"Received: an uncompiled model from build({accum_steps})"
        )
    return model


def _try(build, accum_steps, micro_batch, data, devices):
    """Builds the model for ``accum_steps`` and trains it for two calls of its train function.

    Returns ``(peak, replicas)``: the allocator's peak (``None`` if out of
    memory) and the model's replicas. The model's variables are put back
    afterwards, so that a ``build`` that reuses layers (a pretrained base)
    finds them as they were.
    """
    model = _built(build, accum_steps)
    strategy = model.distribute_strategy
    if in_multi_worker_mode(strategy):
        raise ValueError(
            "`choose_micro_batch` does not run under MultiWorkerMirroredStrategy: every "
            "worker would try on its own and could choose differently. Choose on one "
            "machine of the cluster's kind (MirroredStrategy over its devices, the batch "
            "divided by the workers), then build every worker's model with the chosen "
            f"`accum_steps`. Received: a model under {type(strategy).__name__}"
        )
    replicas = strategy.num_replicas_in_sync
    # The first try is the whole batch; later ones skip what replicas do not divide.
    if micro_batch % replicas:
        raise ValueError(
            f"`batch_size` must be a multiple of the replicas ({replicas}): every "
            f"micro-batch is split evenly over them. Received: batch_size={micro_batch}"
        )
    # Two calls: the peak moves from one update to the next (the order in
    # which TensorFlow runs a step's operations), the first also traces.
    stream = _stream(data, micro_batch, TRIED_CALLS * accum_steps * model.steps_per_execution)
    saved = [v.numpy() for v in model.variables]
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    try:
        model.fit(stream, epochs=1, shuffle=False, verbose=0)
    except tf.errors.ResourceExhaustedError:
        return None, replicas
    finally:
        for variable, value in zip(model.variables, saved):
            variable.assign(value)
    return max(tf.config.experimental.get_memory_info(d)["peak"] for d in devices), replicas


def choose_micro_batch(
    build,
    x,
    y=None,
    *,
    batch_size: int,
    memory_budget=None,
    sample_weight=None,
    verbose: int = 1,
) -> MicroBatchChoice:
    """Finds the largest micro-batch dividing ``batch_size`` whose training fits in memory.

    Tries the whole batch (``accum_steps=1``) first, then the next divisor
    of ``batch_size`` down, then bisects over the smaller ones (the peak
    grows with the micro-batch): at most 6 tries for batch 1024, whose 10
    other divisors a scan from the largest down takes up to 11 tries for.
    Each try builds ``build(batch_size // micro_batch)`` and runs
    two calls of its train function in ``fit`` (two updates, each
    ``steps_per_execution`` ones if compiled so) on micro-batches cut from
    ``x``'s rows (with the model's settings:
    ``jit_compile``, dtype policy, strategy), then puts the model's variables
    back. A try fits when it raises no out-of-memory error and the
    allocator's peak (the highest over the GPUs, else the CPU's) is within
    ``memory_budget``. The largest that fits is the choice: train with::

        model = build(choice.accum_steps)
        model.fit(x, y, batch_size=choice.micro_batch, ...)

    which is training with ``batch_size`` (the model's equivalence), its
    progress bar counting micro-batches. Only the batch's split changes,
    never the batch. Under a ``tf.distribute`` strategy the batch is global
    and a micro-batch is a multiple of the replicas.

    Args:
        build: Callable ``accum_steps -> GradientAccumulateModel``,
            compiled, built inside the strategy's scope if any. Called once
            per try; a model it returns is trained for two updates, then its
            variables are restored (layers it shares with a model of yours
            are unchanged).
        x, y, sample_weight: NumPy arrays or tensors (or lists or dicts of
            them) as ``fit`` takes them; the tries train on their first rows,
            repeated if fewer than the try needs.
        batch_size: Integer >= 1, the batch to train with (samples per
            update, over all replicas).
        memory_budget: Integer bytes, a string such as ``"2 GiB"``, or
            ``None``: only out-of-memory errors decide, which needs a GPU
            (on CPU, running out of memory is no error that a process
            survives). The budget bounds the allocator's peak: the tensors
            TensorFlow allocates, not the process's memory.
        verbose: ``0`` silent, ``1`` prints the choice (``str(choice)``).

    Returns:
        A :class:`MicroBatchChoice`.

    Raises:
        ValueError: If not even micro-batch ``replicas`` fits (raised after
            the tries, with their figures; none of your weights moved), if
            on a CPU a try's tensors are all too small for the allocator to
            count (its peak reads 0 bytes), or if an argument is out of
            range.

    Example:

    >>> import keras, numpy as np
    >>> from gradient_accumulator import GradientAccumulateModel, choose_micro_batch
    >>> def build(accum_steps):
    ...     inputs = keras.Input((128,))
    ...     outputs = keras.layers.Dense(10)(keras.layers.Dense(2048)(inputs))
    ...     model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     return model
    >>> x, y = np.ones((64, 128), "float32"), np.ones((64, 10), "float32")
    >>> choice = choose_micro_batch(build, x, y, batch_size=64, memory_budget="1 GiB", verbose=0)
    >>> choice.micro_batch, choice.accum_steps
    (64, 1)
    >>> model = build(choice.accum_steps)
    >>> history = model.fit(x, y, batch_size=choice.micro_batch, verbose=0)
    """
    batch_size = check_positive_integer("batch_size", batch_size)
    budget = parse_memory_budget(memory_budget)
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    if not callable(build):
        raise ValueError(
            "`build` must be a callable `accum_steps -> GradientAccumulateModel`. "
            f"Received: build of type {type(build).__name__}"
        )
    devices = _memory_devices()
    if budget is None and devices == ["/device:CPU:0"]:
        raise ValueError(
            "`memory_budget` is required without a GPU: only a GPU's out-of-memory "
            "error stops a try that does not fit (a CPU process swaps or is killed). "
            "Pass the memory training may use, e.g. memory_budget='8 GiB'. "
            "Received: memory_budget=None"
        )
    _check_memory_statistics(devices)
    _check_arrays(x, y, sample_weight)
    start = time.perf_counter()
    tries = []
    replicas = 1  # the strategy's, known from the first model built

    def attempt(micro_batch):
        # TensorFlow would keep every tried model's variables in memory.
        nonlocal replicas
        with custom_gradients_dropped():
            peak, replicas = _try(
                build, batch_size // micro_batch, micro_batch, (x, y, sample_weight), devices
            )
        gc.collect()
        if peak == 0 and devices == ["/device:CPU:0"]:
            raise ValueError(
                "The CPU's allocator counted no tensor while training micro-batch "
                f"{micro_batch}: on a CPU TensorFlow counts tensors of 256 KiB and more, "
                "and every tensor of this model's training is smaller, so its peak "
                "cannot be compared with `memory_budget`. A model this small needs no "
                f"split of its batch on a CPU: train with accum_steps=1 at "
                f"batch_size={batch_size}, or search on the GPU you will train on. "
                f"Received: a peak of 0 bytes for micro-batch {micro_batch}"
            )
        fits = peak is not None and (budget is None or peak <= budget)
        tries.append(MicroBatchTry(micro_batch, peak, fits))
        return fits

    # The order of the docstring, over the divisors that the replicas divide.
    best = batch_size if attempt(batch_size) else None
    smaller = [m for m in range(1, batch_size) if not batch_size % m and not m % replicas]
    if best is None and smaller:
        best = smaller[-1] if attempt(smaller[-1]) else None
    if best is None:
        low, high = 0, len(smaller) - 2
        while low <= high:
            middle = (low + high) // 2
            if attempt(smaller[middle]):
                best, low = smaller[middle], middle + 1
            else:
                high = middle - 1
    if best is not None:
        choice = MicroBatchChoice(
            batch_size,
            best,
            batch_size // best,
            next(t.peak_bytes for t in tries if t.micro_batch == best),
            budget,
            tuple(tries),
            time.perf_counter() - start,
        )
        if verbose:
            print(choice)
        return choice
    tried = ", ".join(_describe(t) for t in tries)
    smallest = min(t.micro_batch for t in tries)
    budget_text = "no memory left" if budget is None else f"memory_budget={budget} bytes"
    raise ValueError(
        f"Even micro-batch {smallest} does not fit in {budget_text} "
        f"(tried {tried}). Raise `memory_budget`, or make one sample's training "
        f"smaller (input size, model width, mixed precision). Received: "
        f"batch_size={batch_size}, memory_budget={memory_budget!r}"
    )
