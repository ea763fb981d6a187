"""Argument validation shared by every public class, with Keras-style messages."""

import difflib
import math
import numbers


def check_positive_integer(name, value):
    """Returns ``value`` as an ``int`` or raises a ValueError naming it unless it is >= 1.

    Booleans, floats (even ``4.0``), strings and ``None`` are refused.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    return int(value)


def check_accum_steps(accum_steps):
    """Returns ``accum_steps`` as an ``int`` or raises a ValueError naming it.

    Booleans, floats (even ``4.0``), strings and ``None`` are refused: a
    silently coerced ``accum_steps`` changes the effective batch size.
    """
    return check_positive_integer("accum_steps", accum_steps)


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


def check_unit_interval(name, value):
    """Returns ``value`` as a ``float`` or raises a ValueError unless it is in [0, 1]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 <= value <= 1.0  # NaN fails too
    ):
        raise ValueError(f"`{name}` must be a float in [0, 1]. Received: {name}={value!r}")
    return float(value)


def check_bool(name, value):
    """Returns ``value`` or raises a ValueError naming it unless it is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a boolean. Received: {name}={value!r}")
    return value


def check_keyword_arguments(owner, kwargs, accepted, removed=None):
    """Refuses keyword arguments that ``owner`` does not take.

    Args:
        owner: String, the callable's name as the user writes it.
        kwargs: Dict of the keyword arguments received beyond the named ones.
        accepted: Iterable of the argument names ``owner`` takes (used for the
            "did you mean" suggestion too).
        removed: Optional dict mapping names that earlier releases (or other
            libraries) took to a sentence saying what to do instead, or to a
            callable returning that sentence for the value received.

    Raises:
        ValueError: For the first argument not in ``accepted``, naming it, the
            closest accepted name or the way to do it now, and its value.
    """
    accepted = set(accepted)
    removed = removed or {}
    for name, value in kwargs.items():
        if name in accepted:
            continue
        if name in removed:
            advice = removed[name](value) if callable(removed[name]) else removed[name]
            raise ValueError(
                f"`{owner}` does not take `{name}`: {advice} Received: {name}={value!r}"
            )
        close = difflib.get_close_matches(name, sorted(accepted), n=1, cutoff=0.6)
        hint = f"Did you mean `{close[0]}`? " if close else ""
        raise ValueError(
            f"`{owner}` does not take an argument `{name}`. {hint}Its arguments are: "
            f"{', '.join(sorted(accepted))}. Received: {name}={value!r}"
        )


# The defaults of `clip_factor` and `eps` everywhere (NFNets' values).
DEFAULT_CLIP_FACTOR = 0.01
DEFAULT_EPS = 1e-3


def check_agc_arguments(use_agc, clip_factor, eps):
    """Validates the AGC arguments of a wrapper; returns them normalised.

    ``clip_factor`` and ``eps`` only act with ``use_agc=True``: a value other
    than the default without it (AGC believed on while it is off) is refused.

    Returns:
        ``(use_agc, clip_factor, eps)`` as ``(bool, float, float)``.
    """
    use_agc = check_bool("use_agc", use_agc)
    clip_factor = check_positive_float("clip_factor", clip_factor)
    eps = check_positive_float("eps", eps)
    if not use_agc:
        for name, value, default in (
            ("clip_factor", clip_factor, DEFAULT_CLIP_FACTOR),
            ("eps", eps, DEFAULT_EPS),
        ):
            if value != default:
                raise ValueError(
                    f"`{name}` only acts with `use_agc=True` (adaptive gradient "
                    f"clipping); pass `use_agc=True` too, or leave `{name}` out. "
                    f"Received: {name}={value!r}, use_agc=False"
                )
    return use_agc, clip_factor, eps
