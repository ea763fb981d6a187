"""Argument validation shared by every public class, with Keras-style messages."""

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


def check_optimizer_does_not_accumulate(optimizer, accum_steps):
    """Refuses an optimizer that accumulates gradients itself.

    Keras 3 optimizers take ``gradient_accumulation_steps``; combined with this
    library's accumulation the effective batch would silently multiply.
    ``LossScaleOptimizer`` is looked through.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for opt in (optimizer, inner):
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
