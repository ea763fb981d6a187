"""What gradient_accumulator 0.5 had and this release dropped, each refused with what to do now.

Its import paths stay: ``gradient_accumulator.accumulators`` (the wrappers),
``gradient_accumulator.agc`` and ``gradient_accumulator`` (the functions
below), ``gradient_accumulator.utils`` (``replace_batchnorm_layers``).
``docs/migration.rst`` is the user's side of this module.
"""


def _removed_in_this_release(name, instead):
    """A function of gradient_accumulator 0.5 that now raises, saying what to use."""

    def removed(*args, **kwargs):
        raise ValueError(
            f"`{name}` of gradient_accumulator 0.5 is gone: {instead} "
            f"Received: {name}(...) with {len(args)} positional and "
            f"{len(kwargs)} keyword argument(s)"
        )

    removed.__name__ = name
    removed.__doc__ = f"Removed: raises a ValueError saying {instead}"
    return removed


# The 0.5 names, importable as before (`gradient_accumulator.agc.X` and
# `gradient_accumulator.X`), each raising with the way to do it now. Not
# aliases: 0.5's argument order was the reverse, and its norm of rank-3
# tensors ran over axis 0 only (1.0: all axes but the last).
adaptive_clip_grad = _removed_in_this_release(
    "adaptive_clip_grad",
    "use `adaptive_clip_gradients(grads, variables, clip_factor, eps)` (note the "
    "reversed argument order; rank-3 kernels such as Conv1D's are clipped per "
    "output channel), or `use_agc=True` on GradientAccumulateModel / "
    "GradientAccumulateOptimizer, which clip the accumulated gradient.",
)
unitwise_norm = _removed_in_this_release(
    "unitwise_norm",
    "`adaptive_clip_gradients` computes unit norms itself (over all axes but the "
    "last; 0.5 used axis 0 only for rank-3 tensors). For a norm of your own, use "
    "`keras.ops.norm`.",
)
compute_norm = _removed_in_this_release(
    "compute_norm",
    "use `keras.ops.sqrt(keras.ops.sum(keras.ops.square(x), axis=axis, keepdims=keepdims))`.",
)


def _mixed_precision_advice(value):
    if value is False:
        return (
            "delete the argument: `False` was gradient_accumulator 0.5's default, and "
            "the dtype policy now decides (float32 unless one is set)."
        )
    return (
        "set the dtype policy before building the model, "
        "`keras.mixed_precision.set_global_policy('mixed_float16')`; `compile()` then "
        "wraps the optimizer in a `LossScaleOptimizer` by itself (an argument of "
        "gradient_accumulator 0.5)."
    )


# Arguments of gradient_accumulator 0.5 (and a slip of its README) that
# `GradientAccumulateModel` no longer takes, with what to do instead.
REMOVED_MODEL_ARGUMENTS = {
    "agc": "enable adaptive gradient clipping with `use_agc=True` (and `clip_factor`, `eps`).",
    "mixed_precision": _mixed_precision_advice,
    "experimental_distributed_support": "distribution needs no flag: create and "
    "compile the model inside `strategy.scope()` (an argument of gradient_accumulator 0.5).",
}


def check_position(position):
    """Accepts 0.5's ``position="replace"`` (its only working value) and nothing else."""
    if position != "replace":
        raise ValueError(
            "`position` must be 'replace' (replacing each BatchNormalization in "
            "place, the only mode gradient_accumulator 0.5 had); leave it out. "
            f"Received: position={position!r}"
        )


# Arguments that `GradientAccumulateOptimizer` of gradient_accumulator 0.5
# took (its `reduction`, and Keras 2's `lr` and `decay` it passed on), with
# what to do instead.
REMOVED_OPTIMIZER_ARGUMENTS = {
    "lr": "set `learning_rate` on the inner optimizer, e.g. "
    "`GradientAccumulateOptimizer(keras.optimizers.SGD(learning_rate=...), accum_steps=k)`.",
    "decay": "Keras 3 optimizers have no `decay`; give the inner optimizer a "
    "learning-rate schedule, e.g. `keras.optimizers.schedules.InverseTimeDecay`.",
    "reduction": "micro-batch gradients are always averaged, so that an update "
    "equals one step on the concatenated batch (in gradient_accumulator 0.5 "
    "the argument had no effect). Remove the argument.",
}
