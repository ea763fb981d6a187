"""Argument and set-up validation shared by every public class, with Keras-style messages."""

import difflib
import math
import numbers

import keras
import tensorflow as tf


def check_positive_integer(name, value):
    """Returns ``value`` as an ``int`` or raises a ValueError naming it unless it is >= 1.

    Booleans, floats (even ``4.0``), strings and ``None`` are refused.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    return int(value)


def check_accum_steps(accum_steps):
    """:func:`check_positive_integer` of ``accum_steps``: a coerced one changes the batch size."""
    return check_positive_integer("accum_steps", accum_steps)


def check_layer_accum_steps(accum_steps):
    """An AccumBatchNormalization's ``accum_steps``: an integer >= 1, or ``"auto"``."""
    if isinstance(accum_steps, str) and accum_steps == "auto":
        return accum_steps
    try:
        return check_accum_steps(accum_steps)
    except ValueError:
        raise ValueError(
            "`accum_steps` must be an integer >= 1, or 'auto' (the groups of the "
            f"GradientAccumulateModel it is in). Received: accum_steps={accum_steps!r}"
        ) from None


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


def check_noise_scale_arguments(noise_scale, smoothing, micro_batches, every, coupled_loss):
    """The noise scale's ``(smoothing, micro_batches, every)``, checked."""
    smoothing = check_unit_interval("noise_scale_smoothing", smoothing)
    if smoothing == 1.0:
        raise ValueError(
            "`noise_scale_smoothing` must be below 1: it is the weight an update's moving "
            "averages keep of the previous ones, and at 1 they never move. Received: "
            f"noise_scale_smoothing={smoothing!r}"
        )
    if micro_batches not in ("all", "last"):
        raise ValueError(
            '`noise_scale_micro_batches` must be "all" or "last" (which of a group\'s '
            "micro-batches the noise scale measures). Received: "
            f"noise_scale_micro_batches={micro_batches!r}"
        )
    every = check_positive_integer("noise_scale_every", every)
    if noise_scale and coupled_loss is not None:
        raise ValueError(
            "`noise_scale=True` compares each micro-batch's own gradient with its "
            "group's, and with `coupled_loss` a micro-batch has no gradient of its own "
            "(its loss is the group's). Received: noise_scale=True, "
            f"coupled_loss={coupled_loss!r}"
        )
    return smoothing, micro_batches, every


def check_strategy(model, created_under):
    """Refuses a model created outside the strategy scope it is used in.

    Keras would silently train such a model on one device.
    """
    if not tf.distribute.has_strategy():
        return
    current = tf.distribute.get_strategy()
    if created_under is not current:
        created = (
            "outside any strategy scope"
            if created_under is None
            else f"under another strategy ({type(created_under).__name__})"
        )
        raise ValueError(
            f"Model '{model.name}' was created {created} and is now used inside "
            f"`{type(current).__name__}.scope()`: its variables are not "
            "distributed, so it would train on one device. Create the model "
            "(layers included) inside `with strategy.scope():`, then compile "
            "and fit it there."
        )


def check_train_step_not_overridden(model, wrapper_class):
    """Refuses a subclass's own ``train_step``, which ``fit`` would not run on every path."""
    owner = next(c for c in type(model).__mro__ if "train_step" in vars(c))
    if owner is wrapper_class:
        return
    raise ValueError(
        f"Model '{model.name}' overrides `train_step` (in class {owner.__name__}): "
        "GradientAccumulateModel runs its own micro-steps and updates, so `fit` and "
        "`train_on_batch` would not run that step as written (on data of known length "
        "not at all; elsewhere with an optimizer update at every micro-batch). Override "
        "`compute_loss` to change the loss (it runs in every micro-step, or on the "
        "whole group with `coupled_loss`) and `compute_metrics` to change the metrics; "
        "for a training step of your own (a GAN's), subclass `keras.Model` and wrap "
        "its optimizer in `GradientAccumulateOptimizer`. Received: "
        f"{owner.__name__}.train_step"
    )


def check_micro_batch_size(micro_batch_size, accum_steps):
    """Returns ``micro_batch_size`` (``None`` or ``"auto"``), or refuses it by name."""
    if micro_batch_size is None:
        return None
    if micro_batch_size != "auto":
        raise ValueError(
            "`micro_batch_size` must be None (fit's batch is the micro-batch) or 'auto' (fit's "
            "batch is the update's, cut into the micro-batches that fit). Received: "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if accum_steps != 1:
        raise ValueError(
            "`accum_steps` states the update's micro-batches, and micro_batch_size='auto' "
            "chooses them: state the update's batch as fit's `batch_size` and leave "
            f"accum_steps at 1. Received: accum_steps={accum_steps!r}, micro_batch_size='auto'"
        )
    return micro_batch_size


def check_auto_micro_batch(model, statistics_layers, multi_worker):
    """Refuses what ``micro_batch_size="auto"`` does not run: workers, XLA's coupled loss, ..."""
    if model.micro_batch_size is None:
        return
    fixed = [layer for layer in statistics_layers if layer.accum_steps not in (1, "auto")]
    strategy = model.distribute_strategy
    name = type(strategy).__name__
    if "MultiWorker" in name or multi_worker:
        reason = (
            f"under {name} a worker that runs out of memory stops alone while the others wait "
            "in the update's reduction"
        )
    elif model.coupled_loss is not None and model.jit_compile and not model.run_eagerly:
        reason = (
            "a coupled loss's passes under XLA are programs that write variables, which an "
            "out-of-memory error would corrupt; compile with jit_compile=False"
        )
    elif fixed:
        reason = (
            f"layer '{fixed[0].name}' (AccumBatchNormalization) has accum_steps="
            f"{fixed[0].accum_steps}, a fixed group, and a run-time micro-batch changes the "
            "group's length: give it accum_steps='auto' (replace_batchnorm_layers(model, "
            "accum_steps='auto')), which follows the model's groups"
        )
    else:
        return
    raise ValueError(
        f"Model '{model.name}' has micro_batch_size='auto', which cannot run here: {reason}. "
        "Use accum_steps with the micro-batch as fit's batch_size "
        "(gradient_accumulator.choose_micro_batch finds one that fits). Received: "
        f"micro_batch_size='auto', strategy={name}, jit_compile={model.jit_compile!r}"
    )


def check_jit_compile(model):
    """Refuses XLA over several replicas, which TensorFlow fails obscurely."""
    strategy = model.distribute_strategy
    if model.run_eagerly or not model.jit_compile or strategy.num_replicas_in_sync == 1:
        return
    replicas = strategy.num_replicas_in_sync
    raise ValueError(
        f"`jit_compile=True` with {replicas} replicas ({type(strategy).__name__}): XLA "
        "compiles a program for one device, and the replicas' variables live on "
        f"{replicas}, so TensorFlow would fail at the first step (plain Keras's `fit` "
        "fails alike). "
        "Compile with `jit_compile=False`, or leave it at 'auto', which Keras "
        "resolves to False under tf.distribute."
    )


def check_statistics_layers(model, layers):
    """Refuses AccumBatchNormalization layers whose accum_steps differ ("auto" follows any)."""
    if getattr(model, "micro_batch_size", None) is not None:
        return  # refused by `check_auto_micro_batch` when training starts
    for layer in layers:
        if layer.accum_steps not in (model.accum_steps, "auto"):
            raise ValueError(
                f"Layer '{layer.name}' has `accum_steps={layer.accum_steps}` and "
                f"model '{model.name}' has `accum_steps={model.accum_steps}`: its "
                "moving statistics would not follow the optimizer updates. Give "
                "both the same value, e.g. `replace_batchnorm_layers(model, "
                f"accum_steps={model.accum_steps})` before wrapping. Received: "
                f"accum_steps={layer.accum_steps} (layer), "
                f"accum_steps={model.accum_steps} (model)"
            )


def refuse_double_loss_scale(received):
    raise ValueError(
        "This `GradientAccumulateOptimizer` wraps a `LossScaleOptimizer` and is "
        "being wrapped in another (`model.compile()` does so under the "
        "'mixed_float16' policy): the loss would be scaled twice. Compile with "
        "`auto_scale_loss=False`, or let `compile` wrap a "
        "`GradientAccumulateOptimizer` of the plain optimizer. Received: "
        f"{received}"
    )


def check_optimizer_does_not_accumulate(chain, accum_steps, owner):
    """Refuses an optimizer that already accumulates gradients, which would multiply the batch.

    Looks through ``chain`` (``_compat.optimizer_chain``) for a ``GradientAccumulateOptimizer``
    or Keras's ``gradient_accumulation_steps``. ``owner`` (``"GradientAccumulateModel"`` or
    ``"GradientAccumulateOptimizer"``, with its ``accum_steps``) decides the advice.
    """
    in_model = owner == "GradientAccumulateModel"
    for opt in chain:
        if hasattr(type(opt), "accumulation_variables"):  # a GradientAccumulateOptimizer
            fix = (
                "compile with `optimizer.inner_optimizer` and keep `accum_steps` on the model"
                if in_model
                else "wrap the inner optimizer once, with `accum_steps` the product of both"
            )
            raise ValueError(
                "The optimizer is already a `GradientAccumulateOptimizer` "
                f"(accum_steps={opt.accum_steps!r}) and `{owner}` accumulates too "
                f"(`accum_steps={accum_steps!r}`): the effective batch would multiply. "
                f"Keep one: {fix}. Received: optimizer=GradientAccumulateOptimizer("
                f"accum_steps={opt.accum_steps!r})"
            )
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            fix = (
                "create the optimizer without `gradient_accumulation_steps` and set "
                "`accum_steps` on the model"
                if in_model
                else "create it without `gradient_accumulation_steps` and pass "
                f"`accum_steps={steps}` to `GradientAccumulateOptimizer`"
            )
            raise ValueError(
                "The optimizer accumulates gradients itself "
                f"(`gradient_accumulation_steps={steps}`) and `{owner}` accumulates too "
                f"(`accum_steps={accum_steps!r}`): the effective batch would multiply. "
                f"Keep one: {fix} (exact under tf.distribute, schedules count "
                f"updates). Received: optimizer={type(opt).__name__}"
                f"(gradient_accumulation_steps={steps})"
            )


def check_accum_steps_or_schedule(accum_steps):
    """An integer >= 1 (validated) or a callable schedule (kept as is)."""
    if callable(accum_steps):
        return accum_steps
    return check_accum_steps(accum_steps)


def check_optimizer(optimizer):
    """Returns ``optimizer`` as a Keras optimizer instance or raises naming it."""
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as error:
            raise ValueError(
                "`optimizer` must be a `keras.optimizers.Optimizer` instance or the name of "
                f"one, such as 'adam'. Received: optimizer={optimizer!r}"
            ) from error
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "`optimizer` must be a `keras.optimizers.Optimizer` instance or the name of one, "
            f"such as 'adam'. Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}"
        )
    return optimizer
