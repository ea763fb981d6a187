"""Adaptive gradient clipping against a numpy reference of the NFNets formula."""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import agc
from gradient_accumulator.agc import _unitwise_norm, adaptive_clip_gradients
from tests.helpers import numpy_agc

# float32 norms and scaling against a float64 reference: ~1e-7 relative.
RTOL = 1e-5

# Keras layouts: the output axis (one unit per index) is last.
SHAPES = {
    "scalar": (),
    "bias": (7,),
    "dense": (5, 4),
    "conv1d": (3, 4, 6),
    "conv2d": (3, 3, 2, 5),
    "conv3d": (2, 2, 2, 3, 4),
}


def _weight_and_grad(shape, seed):
    """Gradients whose per-unit norm ratio spans 1e-4..1e2 of the weights'."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(size=shape).astype("float32")
    units = shape[-1] if len(shape) > 1 else 1
    ratio = 10.0 ** rng.uniform(-4, 2, size=units)
    grad = rng.normal(size=shape) * (ratio if len(shape) > 1 else ratio[0])
    return weight, grad.astype("float32")


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("clip_factor, eps", [(0.01, 1e-3), (0.3, 0.5)])
def test_matches_numpynumpy_agc(shape, clip_factor, eps):
    clipped_units = kept_units = 0
    for seed in range(4):
        weight, grad = _weight_and_grad(shape, seed)
        (actual,) = adaptive_clip_gradients([grad], [weight], clip_factor, eps)
        expected = numpy_agc(grad, weight, clip_factor, eps)
        np.testing.assert_allclose(np.array(actual), expected, rtol=RTOL, atol=0)
        changed = ~np.isclose(expected, grad, rtol=0, atol=0)
        changed = changed.reshape(-1, grad.shape[-1] if grad.ndim > 1 else 1)
        clipped_units += int(changed.any(axis=0).sum())
        kept_units += int((~changed.any(axis=0)).sum())
    # The cases exercise both branches of the formula.
    assert clipped_units > 0 and kept_units > 0


def test_units_are_output_channels():
    assert tuple(_unitwise_norm(np.ones((3, 3, 2, 5), "float32")).shape) == (
        1,
        1,
        1,
        5,
    )
    assert tuple(_unitwise_norm(np.ones((7,), "float32")).shape) == ()
    kernel = np.array([[3.0, 0.0], [4.0, 1.0]], "float32")
    np.testing.assert_allclose(np.array(_unitwise_norm(kernel)), [[5.0, 1.0]])


def test_in_bound_units_are_bit_identical():
    weight = np.ones((4, 2), "float32")
    grad = np.array([[1e-3, 5.0]] * 4, "float32")  # unit 0 in bound, 1 not
    (clipped,) = adaptive_clip_gradients([grad], [weight], 0.01, 1e-3)
    clipped = np.array(clipped)
    np.testing.assert_array_equal(clipped[:, 0], grad[:, 0])
    np.testing.assert_allclose(np.linalg.norm(clipped[:, 1]), 0.01 * 2.0, rtol=RTOL)


def test_zero_gradient_and_zero_weights():
    zero_weight = np.zeros((3,), "float32")
    big = np.full((3,), 10.0, "float32")
    zero_grad = np.zeros((2, 2), "float32")
    clipped = adaptive_clip_gradients(
        [big, zero_grad], [zero_weight, np.zeros((2, 2), "float32")], 0.1, 1e-3
    )
    # Zero weights: bounded by clip_factor * eps, not frozen.
    np.testing.assert_allclose(np.linalg.norm(clipped[0]), 0.1 * 1e-3, rtol=RTOL)
    np.testing.assert_array_equal(np.array(clipped[1]), zero_grad)  # no NaN


def test_none_passes_through():
    weight = np.ones((2, 2), "float32")
    assert adaptive_clip_gradients([None], [weight]) == [None]


def test_indexed_slices_are_densified():
    table = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    slices = tf.IndexedSlices(
        values=tf.ones((3, 3)) * 4.0,
        indices=tf.constant([1, 1, 4]),  # a duplicate index is summed
        dense_shape=tf.constant([6, 3]),
    )
    (clipped,) = adaptive_clip_gradients([slices], [table], 0.05, 1e-3)
    expected = numpy_agc(tf.convert_to_tensor(slices).numpy(), table, 0.05, 1e-3)
    np.testing.assert_allclose(np.array(clipped), expected, rtol=RTOL)


def test_float16_gradient_keeps_its_dtype():
    weight, grad = _weight_and_grad((5, 4), seed=0)
    (clipped,) = adaptive_clip_gradients([grad.astype("float16")], [weight])
    assert clipped.dtype == tf.float16
    expected = numpy_agc(grad.astype("float16"), weight, 0.01, 1e-3)
    np.testing.assert_allclose(np.array(clipped, "float32"), expected, rtol=2e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip_factor=-1), r"`clip_factor` must be a float > 0. Received: clip_factor=-1"),
        (dict(clip_factor=0), r"Received: clip_factor=0$"),
        (dict(clip_factor=True), r"Received: clip_factor=True"),
        (dict(clip_factor=float("inf")), r"Received: clip_factor=inf"),
        (dict(eps=0.0), r"`eps` must be a float > 0. Received: eps=0.0"),
        (dict(eps="1e-3"), r"Received: eps='1e-3'"),
    ],
    ids=["clip_negative", "clip_zero", "clip_bool", "clip_inf", "eps_zero", "eps_str"],
)
def test_bad_arguments_are_refused(kwargs, message):
    weight = np.ones((2,), "float32")
    with pytest.raises(ValueError, match=message):
        adaptive_clip_gradients([weight], [weight], **kwargs)


def test_length_mismatch_is_refused():
    weight = np.ones((2,), "float32")
    with pytest.raises(ValueError, match=r"len\(grads\)=2, len\(variables\)=1"):
        adaptive_clip_gradients([weight, weight], [weight])


def test_docstring_example():
    result = doctest.testmod(agc, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_variables_passed_as_gradients_are_refused():
    # 0.5's adaptive_clip_grad(parameters, gradients) took the reverse order; a
    # call ported by renaming alone must not clip the weights by the gradients.
    variable = keras.Variable(np.ones((2, 2), "float32"), name="kernel")
    with pytest.raises(
        ValueError,
        match=r"`grads` holds variables.*adaptive_clip_grad\(parameters, gradients\).*"
        r"Received: grads=\['kernel', \.\.\.\] \(1 variables\)",
    ):
        adaptive_clip_gradients([variable], [np.ones((2, 2), "float32")])


@pytest.mark.parametrize(
    "name, instead",
    [
        ("adaptive_clip_grad", r"adaptive_clip_gradients\(grads, variables"),
        ("unitwise_norm", r"computes unit norms itself"),
        ("compute_norm", r"keras\.ops\.sqrt"),
    ],
)
def test_names_of_0_5_raise_with_the_way_to_do_it_now(name, instead):
    import gradient_accumulator

    for module in (agc, gradient_accumulator):  # both 0.5 import paths
        function = getattr(module, name)
        with pytest.raises(ValueError, match=rf"`{name}` of gradient_accumulator 0.5 .*{instead}"):
            function([np.ones((2,), "float32")], [np.ones((2,), "float32")])
