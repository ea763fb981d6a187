"""Reference helpers: the same model trained plainly on the big batch, and with accumulation.

Every equivalence test builds the model twice from the same seed (identical
initial weights, separate layers), trains one with plain Keras at batch
``accum_steps * micro_batch`` and one with ``GradientAccumulateModel`` at batch
``micro_batch`` on the same data in the same order, and compares weights.
"""

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

ROOT = Path(__file__).resolve().parent.parent

# float32: both runs compute the same sums in a different order, so weights
# differ by a few ulps (observed <= 1.2e-7 on weights of magnitude ~1).
FLOAT32_ATOL = 1e-6

# float16 compute (the mixed_float16 policy): each micro-batch's activations
# and gradients are rounded to float16 (an 11-bit significand, relative
# rounding ~5e-4) before they reach the float32 sums, and the big batch rounds
# its own sums differently; observed weight differences stay below 2e-4 after
# several updates. The one float16 tolerance of the tests and the docs.
FLOAT16_ATOL = 2e-3

# The installed Keras as (major, minor), for the few assertions about Keras's
# own behaviour that changed between the supported versions.
KERAS_VERSION = tuple(int(part) for part in keras.__version__.split(".")[:2])

# 76 samples at micro-batch 8: nine full micro-batches and one of 4. With
# accum_steps=4 the epoch ends with a shorter group (two micro-batches, 12
# samples), matching the reference's last batch of 76 - 2 * 32 = 12.
NUM_SAMPLES = 76
MICRO_BATCH = 8


def make_regression_data(num_samples=NUM_SAMPLES, features=5, outputs=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(num_samples, outputs))).astype("float32")
    return x, y


def build_dense(cls=keras.Model, seed=0, features=5, outputs=1, **kwargs):
    """A small MLP with fresh layers, identical weights for the same ``seed``."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,), name="x")
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    out = keras.layers.Dense(outputs, name="out")(hidden)
    return cls(inputs=inputs, outputs=out, **kwargs)


def build_wide_conv(cls=keras.Model, seed=0, size=48, batchnorm=False, **kwargs):
    """A convolutional net whose memory is its activations (288 KiB a sample per layer).

    Two 3x3 convolutions of 32 channels on ``size`` x ``size`` x 3 inputs,
    global pooling, 10 outputs; 10 k weights. At ``size=48`` one sample's
    activation is 288 KiB, above the 256 KiB from which TensorFlow's CPU
    allocator counts a tensor: its allocator peak grows with the batch from
    one sample on. ``batchnorm``: a BatchNormalization after each convolution.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((size, size, 3), name="image")
    hidden = inputs
    for index in range(2):
        hidden = keras.layers.Conv2D(32, 3, padding="same", name=f"conv{index}")(hidden)
        if batchnorm:
            hidden = keras.layers.BatchNormalization(name=f"bn{index}")(hidden)
        hidden = keras.layers.Activation("relu")(hidden)
    pooled = keras.layers.GlobalAveragePooling2D()(hidden)
    out = keras.layers.Dense(10, name="out")(pooled)
    return cls(inputs=inputs, outputs=out, **kwargs)


def make_image_data(num_samples, size=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, size, size, 3)).astype("float32")
    y = rng.normal(size=(num_samples, 10)).astype("float32")
    return x, y


# Keras divides an activity regularizer's loss by the batch size from 3.14 on;
# before, it is a sum over the batch, a loss that is not a mean over samples
# (not identical to the big batch), so the classifier has one only where
# Keras makes it a mean.
ACTIVITY_REGULARIZER_IS_A_MEAN = KERAS_VERSION >= (3, 14)


def build_classifier(cls=keras.Model, seed=0, **kwargs):
    """A 3-class classifier with kernel (and, where a mean, activity) regularizers."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        12,
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(1e-2),
        activity_regularizer=keras.regularizers.L2(1e-3)
        if ACTIVITY_REGULARIZER_IS_A_MEAN
        else None,
    )(inputs)
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def build_float8(cls=keras.Model, seed=0, use_bias=False, **kwargs):
    """A 16-32-4 MLP quantized with ``model.quantize("float8")`` (before compiling).

    Each Dense layer gets six variables marked ``overwrite_with_gradient``
    (the scales and amax histories of its inputs, kernel and outputs'
    gradient), which the optimizer assigns instead of updating. No biases
    unless ``use_bias``: under a float32 policy Keras's float8 Dense casts its
    bias through bfloat16, whose gradient is then rounded to 8 significant
    bits per micro-batch where the big batch's is rounded once (see
    :data:`FLOAT8_BIAS_RTOL`), and the activations that follow inherit it.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", use_bias=use_bias)(inputs)
    outputs = keras.layers.Dense(4, use_bias=use_bias)(hidden)
    model = cls(inputs=inputs, outputs=outputs, **kwargs)
    with warnings.catch_warnings():
        # "Layer InputLayer does not have a `quantize` method implemented."
        warnings.simplefilter("ignore", UserWarning)
        model.quantize("float8")
    return model


def make_float8_data(num_samples=96, seed=0):
    """Inputs of 16 features whose rows' magnitudes span 0.2 to 5, targets of 4.

    Every micro-batch (and every replica's shard) has another largest
    magnitude, so that a group's amax is one micro-batch's, not all of theirs.
    """
    rng = np.random.default_rng(seed)
    magnitude = rng.uniform(0.2, 5.0, size=(num_samples, 1))
    x = (rng.normal(size=(num_samples, 16)) * magnitude).astype("float32")
    y = rng.normal(size=(num_samples, 4)).astype("float32")
    return x, y


# Float8 layers (`build_float8`) against the big batch. Scales and amax
# histories are the big batch's: its amax is the maximum of its
# micro-batches', and each micro-batch's outputs' gradient has the big batch's
# magnitude (its loss is weighted by its share), up to float32 rounding of
# the weights they come from: relative 1e-6. Kernels: float32 sums in another
# order, passed through float8 quantisation, relative 1e-4. Biases (with
# `use_bias=True`): Keras's float8 Dense casts the bias through bfloat16 under
# a float32 policy, so each micro-batch's bias gradient is rounded to 8
# significant bits (2^-8 = 3.9e-3 relative) where the big batch's is rounded
# once: relative 1e-2 (observed <= 1.5e-3 after 3 updates), and one bfloat16
# step of a bias moves the next layer's inputs amax by about 1e-5 relative.
FLOAT8_STATE_RTOL = 1e-6
FLOAT8_KERNEL_RTOL = 1e-4
FLOAT8_BIAS_RTOL = 1e-2


def float8_differences(reference, model):
    """Max relative differences from ``reference``'s weights, by kind of variable.

    Returns a dict ``{"state": ..., "kernel": ..., "bias": ...}``: the
    ``overwrite_with_gradient`` variables (scales, amax histories), the
    kernels and the biases, each ``max |a - b| / max |a|`` over its variables.
    """
    found = {"state": 0.0, "kernel": 0.0, "bias": 0.0}
    for a, b in zip(reference.weights, model.weights):
        kind = "state" if getattr(a, "overwrite_with_gradient", False) else a.name
        if kind not in found:
            continue
        a, b = np.asarray(a), np.asarray(b)
        diff = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))
        found[kind] = max(found[kind], diff)
    return found


# Every optimizer the equivalence tests train, by name: the one table of the
# test suite. The distributed feature tables (tests/scripts/mirrored_*.py) run
# the `DISTRIBUTED_OPTIMIZERS` among them, each a case against one device at
# the global big batch.
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    ),
    "use_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5),
    # Options the inner optimizer applies once per update.
    "adam_clipnorm_ema": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.5, use_ema=True, ema_momentum=0.9
    ),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
}
DISTRIBUTED_OPTIMIZERS = (
    "sgd_momentum",
    "adam",
    "adamw",
    "rmsprop",
    "schedule",
    "use_ema",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
)
CLIPPING_OPTIMIZERS = {"clipnorm", "global_clipnorm", "clipvalue"}


def make_classification_data(num_samples=NUM_SAMPLES, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 6)).astype("float32")
    y = rng.integers(0, 3, size=(num_samples,))
    return x, y


class MeanActivationLoss(keras.layers.Layer):
    """Adds a per-sample-mean penalty with ``add_loss``."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def build_multi_io(cls=keras.Model, seed=0, **kwargs):
    """Two named inputs, two named outputs, and an ``add_loss`` in between."""
    keras.utils.set_random_seed(seed)
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    merged = keras.layers.Concatenate()([a, b])
    hidden = MeanActivationLoss()(keras.layers.Dense(8, activation="tanh")(merged))
    first = keras.layers.Dense(1, name="first")(hidden)
    second = keras.layers.Dense(2, activation="softmax", name="second")(hidden)
    return cls(inputs={"a": a, "b": b}, outputs={"first": first, "second": second}, **kwargs)


def make_multi_io_data(num_samples=NUM_SAMPLES, seed=3):
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.normal(size=(num_samples, 4)).astype("float32"),
        "b": rng.normal(size=(num_samples, 3)).astype("float32"),
    }
    y = {
        "first": rng.normal(size=(num_samples, 1)).astype("float32"),
        "second": rng.integers(0, 2, size=(num_samples,)),
    }
    return x, y


# The embedding model: VOCABULARY rows, of which the token data touch the
# first 30 only (rows 30-39 never get a gradient).
VOCABULARY = 40
SEQUENCE_LENGTH = 6


def build_embedding(cls=keras.Model, seed=0, **kwargs):
    """Embedding -> mean over the sequence -> Dense: its table gets sparse gradients."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SEQUENCE_LENGTH,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCABULARY, 4, name="embedding")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    return cls(inputs=inputs, outputs=keras.layers.Dense(1, name="out")(pooled), **kwargs)


def make_token_data(num_samples=72, shard_size=None, seed=0):
    """Token ids that repeat inside every micro-batch, and regression targets.

    Each sample draws its 6 tokens from 15 ids, so any 4 samples repeat ids.
    With ``shard_size=s`` (the per-replica micro-batch of 2 replicas), the
    samples a first replica receives (``i // s`` even) use ids 0-14 and the
    second replica's ids 15-29: the replicas' shards touch different rows.
    Without it every sample draws from ids 0-29.
    """
    rng = np.random.default_rng(seed)
    index = np.arange(num_samples)
    if shard_size is None:
        low = np.zeros(num_samples, "int32")
        width = 30
    else:
        low = np.where((index // shard_size) % 2 == 0, 0, 15).astype("int32")
        width = 15
    x = (low[:, None] + rng.integers(0, width, size=(num_samples, SEQUENCE_LENGTH))).astype("int32")
    y = rng.normal(size=(num_samples, 1)).astype("float32")
    return x, y


# Padded sequences: token ids 1..TAG_VOCABULARY-1, 0 pads; every sequence
# holds 1 to TAG_LENGTH tokens, so micro-batches hold different token counts.
TAG_VOCABULARY = 30
TAG_LENGTH = 12
TAG_CLASSES = 5


def make_padded_sequences(num_samples=64, seed=0, shard_size=None):
    """Padded token sequences, per-token tags, and per-token (temporal) weights.

    With ``shard_size=s`` (the per-replica micro-batch of 2 replicas), the
    samples a first replica receives (``i // s`` even) hold 1-3 tokens and
    the second replica's 8-12: the replicas' shards hold different token
    counts in every micro-step. Returns ``(x, tags, temporal_weights)``.
    """
    rng = np.random.default_rng(seed)
    if shard_size is None:
        lengths = rng.integers(1, TAG_LENGTH + 1, size=num_samples)
    else:
        first = (np.arange(num_samples) // shard_size) % 2 == 0
        short = rng.integers(1, 4, size=num_samples)
        long = rng.integers(8, TAG_LENGTH + 1, size=num_samples)
        lengths = np.where(first, short, long)
    positions = np.arange(TAG_LENGTH)[None, :]
    valid = positions < lengths[:, None]
    x = np.where(valid, rng.integers(1, TAG_VOCABULARY, size=(num_samples, TAG_LENGTH)), 0)
    tags = rng.integers(0, TAG_CLASSES, size=(num_samples, TAG_LENGTH))
    weights = rng.uniform(0.2, 3.0, size=(num_samples, TAG_LENGTH))
    return x.astype("int32"), tags.astype("int32"), weights.astype("float32")


def _tagger_trunk(seed, regularizer):
    """Token ids -> Embedding(mask_zero=True) -> Dense(tanh) per token: ``(inputs, hidden)``."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((TAG_LENGTH,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(TAG_VOCABULARY, 8, mask_zero=True, name="embedding")(inputs)
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=regularizer, name="hidden"
    )(embedded)
    return inputs, hidden


def build_tagger(cls=keras.Model, seed=0, regularizer=None, **kwargs):
    """Embedding(mask_zero=True) -> Dense per token: a tagger whose loss is masked."""
    inputs, hidden = _tagger_trunk(seed, regularizer)
    outputs = keras.layers.Dense(TAG_CLASSES, name="tags")(hidden)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def build_two_heads(cls=keras.Model, seed=0, pooled_head=False, regularizer=None, **kwargs):
    """The tagger with a second output: per token (same mask), or per sequence (no mask).

    With ``pooled_head``, the second head's loss (one value per sequence) has
    another normaliser than the masked per-token head's (valid tokens).
    """
    inputs, hidden = _tagger_trunk(seed, regularizer)
    tags = keras.layers.Dense(TAG_CLASSES, name="tags")(hidden)
    if pooled_head:
        second = keras.layers.Dense(1, name="second")(keras.layers.GlobalAveragePooling1D()(hidden))
    else:
        second = keras.layers.Dense(1, name="second")(hidden)
    return cls(inputs=inputs, outputs=[tags, second], **kwargs)


class BatchLogs(keras.callbacks.Callback):
    """Every per-update (per-batch) log of ``fit``, as floats, in ``batches``."""

    def on_train_begin(self, logs=None):
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append({key: float(value) for key, value in logs.items()})


def unknown_length_dataset(x, y, micro_batch):
    """``(x, y)`` in micro-batches from a generator: data whose length TensorFlow does not know."""
    spec = (
        tf.TensorSpec((None, *x.shape[1:]), x.dtype),
        tf.TensorSpec((None, *y.shape[1:]), y.dtype),
    )
    batches = [
        (x[i : i + micro_batch], y[i : i + micro_batch]) for i in range(0, len(x), micro_batch)
    ]
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)


class GradientNormLogging(keras.Model):
    """Plain Keras's train step, logging its gradient's global norm: the big batch's reference.

    Subclasses change the gradients the optimizer receives in :meth:`gradients`.
    """

    def gradients(self, grads):
        return grads

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = self.gradients(tape.gradient(loss, self.trainable_variables))
        self.optimizer.apply(grads, self.trainable_variables)
        squares = [keras.ops.sum(keras.ops.square(g)) for g in grads]
        norm = keras.ops.sqrt(keras.ops.sum(keras.ops.stack(squares)))
        return {"loss": loss, "gradient_norm": norm}


# The gradient noise scale's reference (tests/test_noise_scale.py): linear
# regression at fixed weights, whose gradient noise is known in closed form.
NOISE_DIM = 4
NOISE_SIGMA = 0.5
NOISE_TRUE_W = np.array([[1.0], [-0.5], [0.25], [2.0]], "float32")


def noise_closed_form():
    """``(tr(Sigma), |G|^2)`` of the regression's mean squared error at ``w = 0``."""
    delta = -NOISE_TRUE_W[:, 0]
    signal = 4.0 * float(delta @ delta)
    trace = 4.0 * ((NOISE_DIM + 1) * float(delta @ delta) + NOISE_SIGMA**2 * NOISE_DIM)
    return trace, signal


def noise_regression_data(num_samples, seed=0):
    """``(x, y)`` of the noise-scale regression: ``y = x . w* + e``, ``e ~ N(0, sigma^2)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, NOISE_DIM)).astype("float32")
    y = (x @ NOISE_TRUE_W + NOISE_SIGMA * rng.normal(size=(len(x), 1))).astype("float32")
    return x, y


def noise_regression(
    accum_steps,
    micro_batch,
    updates,
    seed=0,
    strategy=None,
    jit_compile=False,
    unknown_length=False,
    **kwargs,
):
    """``(model, logs)``: ``noise_scale=True`` on the regression, SGD(0), one epoch.

    ``micro_batch`` is global (split over ``strategy``'s replicas);
    ``unknown_length``: the micro-batches from a generator (the runner's
    micro-steps case).
    """
    x, y = noise_regression_data(updates * accum_steps * micro_batch, seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        inputs = keras.Input((NOISE_DIM,))
        dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
        model = GradientAccumulateModel(
            accum_steps=accum_steps,
            noise_scale=True,
            inputs=inputs,
            outputs=dense(inputs),
            **kwargs,
        )
        model.compile(keras.optimizers.SGD(0.0), "mse", jit_compile=jit_compile)
    logs = BatchLogs()
    if unknown_length:
        model.fit(unknown_length_dataset(x, y, micro_batch), verbose=0, callbacks=[logs])
    else:
        model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0, callbacks=[logs])
    return model, logs.batches


def noise_estimates_numpy(group, small_batches, small_batch, measured, num_samples):
    """Group ``group``'s noise-scale estimates on ``noise_regression_data(num_samples)``, in numpy.

    At zero weights (SGD(0)) a small batch's mean gradient is
    ``-2 x^T y / b``. The group is ``small_batches`` consecutive small
    batches of ``small_batch`` samples (micro-batches; under a strategy each
    replica's share of one: a global micro-batch's first half is replica
    0's); its last ``measured`` ones are measured (all of them, or the
    group's last micro-batch: one small batch per replica). The estimates are
    noise_scale.py's formulas from the group's gradient and the measured
    small batches'.
    """
    x, y = noise_regression_data(num_samples)
    x, y = x.astype("float64"), y.astype("float64")
    start = group * small_batches * small_batch
    stop = start + small_batches * small_batch
    grads = [
        -2.0 * x[i : i + small_batch].T @ y[i : i + small_batch] / small_batch
        for i in range(start, stop, small_batch)
    ]
    small = np.mean([np.sum(g**2) for g in grads[-measured:]])
    big = np.sum(np.mean(grads, axis=0) ** 2)
    inverse_small, inverse_big = 1.0 / small_batch, 1.0 / (small_batches * small_batch)
    gap = inverse_small - inverse_big
    return {
        "noise_scale_trace": (small - big) / gap,
        "noise_scale_signal": (inverse_small * big - inverse_big * small) / gap,
    }


def mean_and_error(values):
    """The mean of ``values`` and its standard error."""
    values = np.asarray(values, dtype="float64")
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))


def train_big_batches(build, make_optimizer, x, y, batch_size, epochs=1, densify=False, clip=None):
    """A plain-Keras reference trained step by step: one update per batch of ``batch_size``.

    Loss: the mean squared error over the batch (as ``loss="mse"``). For
    references that ``fit`` cannot give:

    - ``densify``: each gradient is densified before the optimizer sees it.
      Keras's optimizers, given raw ``tf.IndexedSlices`` (an Embedding's
      gradient), may treat a row repeated in the batch differently from the
      densified gradient: Adam squares each repeat's slice before summing,
      where the dense gradient, which the accumulating wrappers hand the
      optimizer, is squared after. SGD's sparse update is a scatter-add,
      which sums repeats as densifying does: it needs no densifying.
    - ``clip(grads, variables) -> grads``: applied to each batch's gradient
      before the optimizer (e.g. :func:`numpy_agc`).

    Returns:
        ``(model, optimizer)``, trained.
    """
    model = build(keras.Model)
    optimizer = make_optimizer()
    variables = model.trainable_variables
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, variables)
            if densify:
                grads = [tf.convert_to_tensor(g) for g in grads]
            if clip is not None:
                grads = clip(grads, variables)
            optimizer.apply(grads, variables)
    return model, optimizer


def numpy_agc_all(clip_factor, eps):
    """``clip(grads, variables)`` for :func:`train_big_batches`: :func:`numpy_agc` on each."""

    def clip(grads, variables):
        return [
            numpy_agc(np.asarray(g), np.asarray(w), clip_factor, eps).astype("float32")
            for g, w in zip(grads, variables)
        ]

    return clip


def control_flow(graph, accumulator=None):
    """Types of ``graph``'s top-level conditionals and loops.

    With ``accumulator``: without the update's one conditional that skips
    the division where every divisor is 1 (recognised by its branches, which
    write ``accumulator``'s gradient sums and nothing else, and its second
    branch's divisions).
    """
    kinds = {"If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile"}
    found = [op for op in graph.get_operations() if op.type in kinds]
    if accumulator is not None:
        found = [op for op in found if not _is_division(graph, op, accumulator)]
    return [op.type for op in found]


def conditional_branch(graph, cond, name, tensors=()):
    """``cond``'s branch ``name`` (its graph), and the branch's inputs fed by ``tensors``.

    ``tensors``: tensors of ``graph`` (e.g. a variable's captured handle).
    """
    taken = graph._get_function(cond.get_attr(name).name).graph
    # The If op's inputs after the condition are the branch's inputs, in order.
    fed = [k for k, t in enumerate(cond.inputs[1:]) if any(t is u for u in tensors)]
    return taken, [taken.inputs[k] for k in fed]


def _is_division(graph, cond, accumulator):
    if cond.type not in ("If", "StatelessIf"):
        return False
    handles = {id(acc.handle) for acc in accumulator.all_sums()}
    internal = [inside for outside, inside in graph.captures if id(outside) in handles]
    for name in ("then_branch", "else_branch"):
        branch, sums = conditional_branch(graph, cond, name, internal)
        writes = [op for op in branch.get_operations() if op.type.startswith("Assign")]
        if not all(any(op.inputs[0] is t for t in sums) for op in writes):
            return False
    return any(op.type == "DivNoNan" for op in branch.get_operations())


# Measured max |diff| of every equivalence assertion, written to a file by
# conftest's terminal summary (and printed with -v) so that the figures come
# from the test run itself.
MEASURED = {}


def max_abs_diff(weights_a, weights_b):
    """Max |a - b| over paired arrays (or variables)."""
    assert len(weights_a) == len(weights_b)
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(weights_a, weights_b)
    )


def assert_close(weights_a, weights_b, atol):
    """Asserts max |a - b| < atol over all arrays, and records the figure."""
    assert_diff_below(max_abs_diff(weights_a, weights_b), atol)


def assert_diff_below(diff, atol, context=None):
    """Asserts a measured max |diff| (e.g. a script's figure) < atol, and records it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    MEASURED[test] = max(diff, MEASURED.get(test, 0.0))
    assert diff < atol, f"max |diff| = {diff:.3g} >= {atol:.3g}" + (
        f": {context}" if context is not None else ""
    )


_SHARED_REFERENCES = {}


def shared_reference(key, compute):
    """``compute()``'s result, computed once per ``key`` in a test process.

    For a reference that several parametrizations compare with: plain Keras
    trained on the same data with the same arguments (``key`` holds them:
    the data's bytes, not their shape). Under pytest-xdist a module's tests
    share a worker (``--dist loadfile``), so they share its references;
    ``compute`` returns arrays, not a model, so that no test's changes to
    it reach another.
    """
    if key not in _SHARED_REFERENCES:
        _SHARED_REFERENCES[key] = compute()
    return _SHARED_REFERENCES[key]


def train_pair(
    build,
    make_optimizer,
    x,
    y,
    accum_steps=4,
    micro_batch=MICRO_BATCH,
    epochs=2,
    compile_kwargs=None,
    fit_kwargs=None,
):
    """Trains the plain big-batch reference and the accumulating model.

    Returns ``(reference, accumulating)``, both trained.
    """
    compile_kwargs = {"loss": "mse", **(compile_kwargs or {})}
    fit_kwargs = {"epochs": epochs, "shuffle": False, "verbose": 0, **(fit_kwargs or {})}

    reference = build(keras.Model)
    reference.compile(optimizer=make_optimizer(), **compile_kwargs)
    reference.fit(x, y, batch_size=accum_steps * micro_batch, **fit_kwargs)

    accumulating = build(GradientAccumulateModel, accum_steps=accum_steps)
    accumulating.compile(optimizer=make_optimizer(), **compile_kwargs)
    accumulating.fit(x, y, batch_size=micro_batch, **fit_kwargs)
    return reference, accumulating


def numpy_agc(grad, weight, clip_factor, eps):
    """Adaptive gradient clipping (Brock et al. 2021), unit by unit, in float64.

    A unit is one index of the last (output) axis; scalars and vectors are one
    unit. Each unit's gradient is scaled down to at most
    ``clip_factor * max(||weight unit||, eps)``.
    """
    grad = np.asarray(grad, "float64")
    weight = np.asarray(weight, "float64")
    if weight.ndim <= 1:
        units = [(Ellipsis,)]  # one unit: the whole tensor
    else:
        units = [(Ellipsis, u) for u in range(weight.shape[-1])]
    out = grad.copy()
    for unit in units:
        max_norm = clip_factor * max(np.linalg.norm(weight[unit]), eps)
        grad_norm = np.linalg.norm(grad[unit])
        if grad_norm > max_norm:
            out[unit] = grad[unit] * (max_norm / grad_norm)
    return out


def free_ports(count):
    """``count`` distinct free TCP ports on the loopback interface."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_workers(module, num_workers=2, timeout=600, args=(), check=True):
    """Runs ``python -m tests.scripts.<module> *args`` as a MultiWorkerMirroredStrategy cluster.

    Each worker is a fresh process (:func:`_start_script`) with its own
    ``TF_CONFIG``, the workers on free loopback ports; returns the
    ``(returncode, stdout, stderr)`` of each, in worker order. With ``check``,
    a worker that fails fails the test with its outputs.
    """
    ports = free_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    started = []
    try:
        for index in range(num_workers):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            started.append(
                _start_script(f"tests.scripts.{module}", args, {"TF_CONFIG": json.dumps(tf_config)})
            )
        results = [wait(timeout) for wait in started]
    finally:
        for wait in started:
            wait.stop()
    if check:
        for index, (code, out, err) in enumerate(results):
            if code != 0:
                raise AssertionError(f"worker {index} failed ({code}):\n{out}\n{err[-5000:]}")
    return results


class _ScriptHost:
    """The ``tests.scripts._host`` process of this pytest process: forks the scripts' runs."""

    def __init__(self):
        import atexit

        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.scripts._host"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        atexit.register(self.close)
        self._reply()  # {"ready": pid}, once its imports are done

    def close(self):
        """Ends the host (its stdin closed) and waits for it."""
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def _reply(self):
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the script host ended ({self._process.wait()})")
        return json.loads(line)

    def request(self, **message):
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()
        return self._reply()


@functools.cache
def _script_host():
    return _ScriptHost()


def _start_script(module, args, env, own_interpreter=False):
    """Starts ``python -m module *args`` (``env`` over this process's); returns its waiter.

    The waiter, called with a timeout in seconds, returns ``(returncode,
    stdout, stderr)`` or kills the run and raises ``subprocess.TimeoutExpired``;
    its ``stop()`` kills a run not yet waited for. The run is forked from the
    script host (``tests/scripts/_host.py``): a process whose TensorFlow, Keras
    and package are imported and nothing initialised, so each run is still the
    first use of TensorFlow in its process, without the ~4.5 s of CPU of the
    imports. With ``own_interpreter`` (a script that must import everything
    itself) or ``GA_TESTS_NO_SCRIPT_HOST=1``, the run is an interpreter of its own.
    """
    command = [sys.executable, "-m", module, *map(str, args)]
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    if own_interpreter or os.environ.get("GA_TESTS_NO_SCRIPT_HOST") == "1":
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )

        def wait(timeout):
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
            return process.returncode, out, err

        wait.stop = lambda: process.poll() is None and process.kill()
        return wait
    host = _script_host()
    folder = Path(tempfile.mkdtemp(prefix="script-"))
    outputs = folder / "stdout", folder / "stderr"
    pid = host.request(
        op="start",
        module=module,
        args=[str(a) for a in args],
        env=environment,
        stdout=str(outputs[0]),
        stderr=str(outputs[1]),
    )["pid"]
    waited = []

    def wait(timeout):
        waited.append(True)
        try:
            reply = host.request(op="wait", pid=pid, timeout=timeout)
            if reply.get("timeout"):
                raise subprocess.TimeoutExpired(command, timeout)
            out, err = (path.read_text(errors="replace") for path in outputs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return reply["returncode"], out, err

    def stop():
        if not waited:
            with contextlib.suppress(subprocess.TimeoutExpired):
                wait(0)  # kills the run if it is still going, and removes the folder

    wait.stop = stop
    return wait


def _succeeded(run, label):
    """``run()``'s stdout, run once more if a signal killed it; fails the test if it fails.

    ``run`` returns ``(returncode, stdout, stderr)``; the message names
    ``label``, the status and both outputs (and a first run's signal).
    """
    code, out, err = run()
    first = ""
    if code < 0:
        first = f", after a first run killed by signal {-code}"
        code, out, err = run()
    assert code == 0, f"{label} failed ({code}{first}):\n{out}\n{err}"
    return out


def run_python(args, timeout=600, env=None, label=None):
    """Runs ``python *args`` from the repository root in a fresh process; returns its stdout.

    Fails the test, with both outputs, if the process fails. ``label`` names
    the run in that message (default: the arguments). A process killed by a
    signal (a segmentation fault in TensorFlow's runtime: once in a CI run of
    ``tests.scripts.mirrored_counted`` under TensorFlow 2.21, not reproduced
    in seven) is run once more, and the test fails if that one fails too,
    naming both.
    """

    def run():
        completed = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
        )
        return completed.returncode, completed.stdout, completed.stderr

    return _succeeded(run, label or " ".join(args))


def run_script_module(name, args=(), timeout=600, own_interpreter=False):
    """Runs ``python -m tests.scripts.<name> *args`` from the repository root; returns its stdout.

    A fresh process (:func:`_start_script`: forked from the script host, or
    with ``own_interpreter`` an interpreter of its own): logical devices and
    strategies can be set up only once per process (see
    ``tests/scripts/__init__.py``). Fails the test, with both outputs, if the
    script fails; a run killed by a signal is run once more (:func:`_succeeded`).
    """
    label = f"tests.scripts.{name}"
    return _succeeded(lambda: _start_script(label, args, {}, own_interpreter)(timeout), label)


def script_results(stdout):
    """The results a script printed (``tests.scripts.print_results``), parsed."""
    import json

    from tests.scripts import RESULTS

    line = next(line for line in reversed(stdout.splitlines()) if line.startswith(RESULTS))
    return json.loads(line[len(RESULTS) :])


def install_keras_test_cases(namespace, module_names, import_module, wrap):
    """Puts wrapped copies of the test cases of Keras's test modules into ``namespace``.

    For every ``unittest.TestCase`` class with tests defined in each module of
    ``module_names`` (imported by ``import_module(name)``), each class of
    ``wrap(case, name)`` is set in ``namespace`` (a test module's
    ``globals()``) under its own name, for pytest to collect. Keras ships its
    tests in the wheel from 3.15 on; without them nothing is installed.

    Returns:
        The number of classes installed.
    """
    if importlib.util.find_spec(module_names[0]) is None:
        return 0
    installed = 0
    for name in module_names:
        module = import_module(name)
        for _, case in inspect.getmembers(module, inspect.isclass):
            if not (
                issubclass(case, unittest.TestCase)
                and case.__module__ == module.__name__
                and any(attribute.startswith("test") for attribute in dir(case))
            ):
                continue
            for wrapped in wrap(case, name):
                namespace[wrapped.__name__] = wrapped
                installed += 1
    return installed


# ----------------------------------------------------------------------------
# Out-of-memory errors on demand (micro_batch_size="auto"): a MemoryError raised
# in a `tf.py_function`, which TensorFlow turns into the
# `tf.errors.ResourceExhaustedError` a device's allocator raises, at once (a
# real allocation that fails first waits 10 s in a pooled allocator, oneDNN's
# on a CPU: tests/scripts/auto_micro_batch_oom.py makes those).
# ----------------------------------------------------------------------------


def _raise_memory_error():
    raise MemoryError("injected: out of memory")


def out_of_memory_if(condition):
    """A float32 0, computed where ``condition`` is False; out of memory where it is True."""
    return tf.cond(
        condition,
        lambda: tf.reshape(tf.py_function(_raise_memory_error, [], tf.float32), ()),
        lambda: tf.constant(0.0),
    )


class OutOfMemoryAbove(keras.layers.Layer):
    """The identity, which runs out of memory on a batch of more than ``rows`` rows.

    ``replica``: only in that replica (``None``: every one).
    """

    def __init__(self, rows, replica=None, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.replica = rows, replica

    def call(self, x):
        condition = tf.shape(x)[0] > self.rows
        context = tf.distribute.get_replica_context()  # None when built, in cross-replica context
        if self.replica is not None and context is not None:
            replica = context.replica_id_in_sync_group
            condition = tf.logical_and(condition, tf.equal(replica, self.replica))
        return x + tf.cast(out_of_memory_if(condition), x.dtype)


class OutOfMemoryAtCalls(keras.layers.Layer):
    """The identity, which runs out of memory at its ``calls``-th training passes (0-based).

    Counted in Python as they run (a ``tf.py_function``), whether or not
    their step then fails: each listed pass fails once. Inference passes
    (``training=False``) are not counted.
    """

    def __init__(self, calls, **kwargs):
        super().__init__(**kwargs)
        self.calls, self.count = set(calls), 0

    def _fails(self):
        fails = self.count in self.calls
        self.count += 1
        return fails

    def call(self, x, training=None):
        if not training:
            return x
        fails = tf.py_function(self._fails, [], tf.bool)
        return x + tf.cast(out_of_memory_if(tf.reshape(fails, ())), x.dtype)


class OutOfMemoryInUpdate(keras.constraints.Constraint):
    """A kernel constraint (run by the optimizer's update) that runs out of memory once armed."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def _fails(self):
        return self.armed

    def __call__(self, w):
        fails = tf.py_function(self._fails, [], tf.bool)
        return w + tf.cast(out_of_memory_if(tf.reshape(fails, ())), w.dtype)
