"""Argument validation shared by every public class, with Keras-style messages."""

import math
import numbers


def check_accum_steps(accum_steps):
    """Returns ``accum_steps`` as an ``int`` or raises a ValueError naming it.

    Booleans, floats (even ``4.0``), strings and ``None`` are refused: a
    silently coerced ``accum_steps`` changes the effective batch size.
    """
    if (
        isinstance(accum_steps, bool)
        or not isinstance(accum_steps, numbers.Integral)
        or accum_steps < 1
    ):
        raise ValueError(
            f"`accum_steps` must be an integer >= 1. Received: accum_steps={accum_steps!r}"
        )
    return int(accum_steps)


def check_positive_float(name, value):
    """Returns ``value`` as a ``float`` or raises a ValueError naming it.

    Booleans, strings, ``None``, NaN, infinities and numbers <= 0 are refused.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"`{name}` must be a float > 0. Received: {name}={value!r}")
    return float(value)


def check_bool(name, value):
    """Returns ``value`` or raises a ValueError naming it unless it is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a boolean. Received: {name}={value!r}")
    return value


def check_optimizer_does_not_accumulate(optimizer, accum_steps):
    """Refuses an optimizer that accumulates gradients itself.

    Keras 3 optimizers take ``gradient_accumulation_steps``; combined with this
    library's accumulation the effective batch would silently multiply.
    ``LossScaleOptimizer`` is looked through.
    """
    # Imported here: optimizer.py imports this module.
    from gradient_accumulator.optimizer import GradientAccumulateOptimizer

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for opt in (optimizer, inner):
        if isinstance(opt, GradientAccumulateOptimizer):
            raise ValueError(
                "The optimizer is a `GradientAccumulateOptimizer` "
                f"(accum_steps={opt.accum_steps!r}) and this model already "
                f"accumulates with `accum_steps={accum_steps}`. Keep one: compile "
                "with `optimizer.inner_optimizer` and keep `accum_steps` on the "
                "model. Received: optimizer=GradientAccumulateOptimizer("
                f"accum_steps={opt.accum_steps!r})"
            )
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "The optimizer accumulates gradients itself "
                f"(`gradient_accumulation_steps={steps}`), and this model "
                f"already accumulates with `accum_steps={accum_steps}`. Keep "
                "one: create the optimizer without "
                "`gradient_accumulation_steps` and set `accum_steps` on the "
                "model (exact under tf.distribute, schedules count updates). "
                "Received: optimizer="
                f"{type(opt).__name__}(gradient_accumulation_steps={steps})"
            )
