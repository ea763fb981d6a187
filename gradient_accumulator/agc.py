"""Adaptive gradient clipping (AGC), unit-wise, as in NFNets (Brock et al., 2021)."""

import functools

import keras
import tensorflow as tf
from keras import ops

# gradient_accumulator 0.5's names, importable from here as before.
from gradient_accumulator._v05 import adaptive_clip_grad, compute_norm, unitwise_norm  # noqa: F401
from gradient_accumulator.validation import DEFAULT_CLIP_FACTOR, DEFAULT_EPS, check_positive_float

# Floor under a gradient norm before dividing by it. Only reached when the
# gradient is (nearly) zero, where the clipping branch is not taken anyway;
# it keeps the unused branch of `ops.where` free of inf/NaN.
_NORM_FLOOR = 1e-12


def _unitwise_norm(x):
    """L2 norm of each unit of ``x``, in float32: a scalar for ranks 0 and 1, else ``(1, ..., n)``.

    Keras kernels put the output axis last (``Dense``: ``(in, out)``,
    ``ConvND``: ``(*window, in, out)``, ``Embedding``: ``(vocab, dim)``), so a
    unit is one index of the last axis and its norm runs over all other axes.
    Scalars and vectors (biases, BN scales) are one unit, as in the NFNets
    reference. That reference sums rank-3 tensors over axis 0 only (a
    multi-head linear layer, ``(in, heads, out)``); a Keras rank-3 kernel is
    usually ``Conv1D``'s ``(width, in, out)``, whose unit is an output channel.
    """
    x = ops.cast(x, "float32")
    axes = None if len(x.shape) <= 1 else tuple(range(len(x.shape) - 1))
    return ops.sqrt(ops.sum(ops.square(x), axis=axes, keepdims=axes is not None))


def adaptive_clip_gradients(grads, variables, clip_factor=DEFAULT_CLIP_FACTOR, eps=DEFAULT_EPS):
    """Clips each unit of each gradient relative to the norm of its weights.

    For every unit ``u`` (one output channel of a kernel, a whole bias or
    other vector: the norm runs over all axes but the last) of a variable ``W`` with gradient
    ``G``::

        max_norm_u = clip_factor * max(||W_u||, eps)
        G_u <- G_u * max_norm_u / ||G_u||   if ||G_u|| > max_norm_u
        G_u <- G_u                          otherwise

    Norms are L2 norms computed in float32; the result has the gradient's
    dtype. A unit whose gradient is within bounds is returned bit-identical.
    ``eps`` keeps zero-initialised weights (e.g. biases) trainable: their
    gradients are bounded by ``clip_factor * eps`` instead of zero.

    The NFNets paper does not clip the final classifier layer; pass only the
    ``(grads, variables)`` pairs you want clipped to reproduce that.

    Args:
        grads: List of gradient tensors (``None`` entries are passed through;
            ``tf.IndexedSlices`` are converted to dense tensors first;
            variables, the reverse order, are refused).
        variables: List of the variables (or tensors) the gradients belong
            to, in the same order and of the same shapes.
        clip_factor: Float > 0, the largest allowed ratio of gradient norm to
            weight norm per unit. Defaults to ``0.01``.
        eps: Float > 0, the weight norm assumed for units whose norm is
            smaller. Defaults to ``1e-3``.

    Returns:
        List of clipped gradients, in the order of ``grads``.

    Example:

    >>> import numpy as np
    >>> from gradient_accumulator.agc import adaptive_clip_gradients
    >>> kernel = np.ones((3, 2), "float32")       # unit norms: sqrt(3)
    >>> grad = np.full((3, 2), 10.0, "float32")   # unit norms: 10 * sqrt(3)
    >>> (clipped,) = adaptive_clip_gradients([grad], [kernel], clip_factor=0.5)
    >>> tuple(clipped.shape)
    (3, 2)
    >>> int(np.round(np.linalg.norm(clipped, axis=0)[0] / np.sqrt(3) * 100))
    50
    """
    clip_factor = check_positive_float("clip_factor", clip_factor)
    eps = check_positive_float("eps", eps)
    grads = list(grads)
    variables = list(variables)
    swapped = [g for g in grads if isinstance(g, (tf.Variable, keras.Variable))]
    if swapped:
        raise ValueError(
            "`grads` holds variables, not gradients: the arguments are "
            "`adaptive_clip_gradients(grads, variables)`, the reverse of "
            "gradient_accumulator 0.5's `adaptive_clip_grad(parameters, gradients)`. "
            f"Received: grads=[{swapped[0].name!r}, ...] ({len(swapped)} variables)"
        )
    if len(grads) != len(variables):
        raise ValueError(
            "`grads` and `variables` must have the same length. Received: "
            f"len(grads)={len(grads)}, len(variables)={len(variables)}"
        )
    return [
        None if grad is None else _clip_unitwise(grad, variable, clip_factor, eps)
        for grad, variable in zip(grads, variables)
    ]


def _clip_unitwise(grad, variable, clip_factor, eps):
    if isinstance(grad, tf.IndexedSlices):
        # Unit norms need every row of the unit; there is no sparse shortcut.
        grad = tf.convert_to_tensor(grad)
    dtype = grad.dtype
    max_norm = clip_factor * ops.maximum(_unitwise_norm(variable), eps)
    grad_norm = _unitwise_norm(grad)
    scale = max_norm / ops.maximum(grad_norm, _NORM_FLOOR)
    grad32 = ops.cast(grad, "float32")
    clipped = ops.where(grad_norm > max_norm, grad32 * scale, grad32)
    # `where` keeps in-bound units exactly: cast(cast(g, f32), dtype) == g.
    return ops.cast(clipped, dtype)


def agc_transform(use_agc, clip_factor, eps):
    """The update's gradient transform of a wrapper's AGC arguments: AGC, or ``None``."""
    if not use_agc:
        return None
    return functools.partial(adaptive_clip_gradients, clip_factor=clip_factor, eps=eps)
