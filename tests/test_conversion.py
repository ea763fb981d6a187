"""replace_batchnorm_layers: same outputs and weights, every BatchNormalization replaced;
restore_batchnorm_layers: back to plain Keras, the same model without the package."""

import contextlib
import inspect
import io
import warnings

import keras
import numpy as np
import pytest

from gradient_accumulator import (
    GradientAccumulateModel,
    GradientAccumulateOptimizer,
    restore_batchnorm_layers,
)
from gradient_accumulator._compat import written_class
from gradient_accumulator.layers import AccumBatchNormalization
from gradient_accumulator.utils import replace_batchnorm_layers
from tests.helpers import assert_close, run_script_module, script_results

BN = keras.layers.BatchNormalization

# The accumulation state AccumBatchNormalization adds per layer (accum_steps > 1).
ACCUMULATION_NAMES = (
    "pending_count",
    "pending_shift",
    "pending_mean_offset",
    "pending_m2",
    "micro_step",
)

# Inference runs the same Keras ops on the same weights, so outputs are
# bit-identical (measured: 0.0 on every model below). The tolerance allows
# float32 noise relative to the output's magnitude (logits up to ~20 here).
OUTPUT_RTOL = 1e-6

# keras.applications families, at the smallest input each accepts cheaply,
# with the number of BatchNormalization layers each has (its architecture).
APPLICATIONS = [
    pytest.param("MobileNetV2", 52, id="MobileNetV2"),
    pytest.param("ResNet50V2", 49, id="ResNet50V2"),
    pytest.param("EfficientNetB0", 49, id="EfficientNetB0"),
    pytest.param("DenseNet121", 121, id="DenseNet121"),
]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _all_layers(model):
    # Keras's recursive walk (nested models included); no public equivalent.
    return list(model._flatten_layers(include_self=False))


def _batchnorms(model):
    return [layer for layer in _all_layers(model) if isinstance(layer, BN)]


def _randomize_batchnorms(model, seed=0):
    """Gives every BN non-trivial weights, far from Keras's initial 1/0/0/1."""
    rng = np.random.default_rng(seed)
    for layer in _batchnorms(model):
        channels = layer.moving_mean.shape[0]
        weights = []
        if layer.scale:
            weights.append(rng.uniform(0.5, 1.5, channels))  # gamma
        if layer.center:
            weights.append(rng.normal(0.0, 0.5, channels))  # beta
        weights.append(rng.normal(0.0, 3.0, channels))  # moving_mean
        weights.append(rng.uniform(0.5, 5.0, channels))  # moving_variance
        layer.set_weights([w.astype("float32") for w in weights])


def _keras_weights(model):
    """Weights without AccumBatchNormalization's accumulation state, in order."""
    return [v.numpy() for v in model.weights if v.name not in ACCUMULATION_NAMES]


def _assert_same_outputs(original, new, x):
    expected = keras.tree.flatten(original(x, training=False))
    got = keras.tree.flatten(new(x, training=False))
    expected = [np.asarray(e) for e in expected]
    scale = max(1.0, max(float(np.max(np.abs(e))) for e in expected))
    assert all(np.all(np.isfinite(e)) for e in expected)
    assert_close(expected, [np.asarray(g) for g in got], atol=OUTPUT_RTOL * scale)


def _assert_converted(original, new, accum_steps):
    """Every BN replaced with the same config and weights; nothing else changed."""
    old_bns, new_bns = _batchnorms(original), _batchnorms(new)
    assert len(new_bns) == len(old_bns)
    assert all(type(layer) is AccumBatchNormalization for layer in new_bns)
    for old, layer in zip(old_bns, new_bns):
        config = layer.get_config()
        assert config.pop("accum_steps") == accum_steps
        expected = old.get_config()
        expected.pop("accum_steps", None)
        expected.pop("synchronized")
        config.pop("synchronized")
        assert config == expected
    # Same weights, one for one; the only extra variables are the state
    # (whatever state an original AccumBatchNormalization had is not kept).
    keras_weights = _keras_weights(original)
    assert len(new.weights) == len(keras_weights) + 5 * len(old_bns) * (accum_steps > 1)
    extra = sum(4 * layer.moving_mean.shape[0] + 1 for layer in old_bns) * (accum_steps > 1)
    assert new.count_params() == sum(w.size for w in keras_weights) + extra
    for old, got in zip(keras_weights, _keras_weights(new)):
        np.testing.assert_array_equal(got, old)
    for v in new.weights:
        if v.name in ACCUMULATION_NAMES:
            assert not np.any(v.numpy()), v.path  # state starts empty
    # Other layers: same classes and names, fresh objects.
    assert [type(layer) for layer in _all_layers(new) if not isinstance(layer, BN)] == [
        type(layer) for layer in _all_layers(original) if not isinstance(layer, BN)
    ]
    assert [layer.name for layer in _all_layers(new)] == [
        layer.name for layer in _all_layers(original)
    ]
    assert not {id(v) for v in new.weights} & {id(v) for v in original.weights}


def _input_names(model):
    return [layer.name for layer in model.layers if isinstance(layer, keras.layers.InputLayer)]


def _output_structure(model):
    """The outputs' nesting (list, dict keys), each leaf replaced by 0."""
    # A Sequential model that was never called has `outputs` but no `output`.
    outputs = model.outputs if isinstance(model, keras.Sequential) else model.output
    return keras.tree.map_structure(lambda t: 0, outputs)


def _snapshot(model):
    return [(type(layer), layer.name) for layer in _all_layers(model)], model.get_weights()


def _assert_unchanged(model, snapshot):
    layers, weights = snapshot
    assert [(type(layer), layer.name) for layer in _all_layers(model)] == layers
    assert len(model.get_weights()) == len(weights)
    for got, old in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, old)


def _convert_quietly(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean conversion warns nothing
        return replace_batchnorm_layers(model, **kwargs)


def _restore_quietly(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with the package's parts: no warning
        return restore_batchnorm_layers(model)


def _assert_restored(original, restored):
    """``restored`` (back from a conversion of ``original``) is ``original`` again, plain Keras.

    Same layer classes and names at every depth, every BatchNormalization
    exactly Keras's, the same configurations and weights (the accumulation
    state gone), fresh objects.
    """
    assert not [x for x in _all_layers(restored) if isinstance(x, AccumBatchNormalization)]
    assert all(type(layer) is BN for layer in _batchnorms(restored))
    assert [(type(layer), layer.name) for layer in _all_layers(restored)] == [
        (type(layer), layer.name) for layer in _all_layers(original)
    ]
    for old, layer in zip(_batchnorms(original), _batchnorms(restored)):
        assert layer.get_config() == old.get_config()
    assert len(restored.weights) == len(_keras_weights(original))
    for got, old in zip(restored.get_weights(), _keras_weights(original)):
        np.testing.assert_array_equal(got, old)
    assert not {id(v) for v in restored.weights} & {id(v) for v in original.weights}


class _MovingStatsRecorder(keras.callbacks.Callback):
    """Records one layer's moving mean after every train call of fit (one per update)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.history = [layer.moving_mean.numpy().copy()]

    def on_train_batch_end(self, batch, logs=None):
        self.history.append(self.layer.moving_mean.numpy().copy())


def _assert_moved_at_each_update(history, updates):
    """One record per update (fit runs a whole group per call), the statistics moved at each.

    Between updates they do not move: ``tests/test_layers.py`` checks that
    micro-step by micro-step.
    """
    assert len(history) == updates + 1
    for step in range(1, len(history)):
        assert not np.array_equal(history[step], history[step - 1]), f"update {step}"


# --------------------------------------------------------------------------
# keras.applications: outputs and weights kept, every BN replaced
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name, batchnorms", APPLICATIONS)
def test_application_models_keep_outputs_and_weights(name, batchnorms):
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(
        input_shape=(32, 32, 3), weights=None, classes=10, classifier_activation=None
    )
    _randomize_batchnorms(model)
    snapshot = _snapshot(model)

    new = _convert_quietly(model, accum_steps=4)

    assert len(_batchnorms(model)) == batchnorms
    _assert_converted(model, new, accum_steps=4)
    x = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype("float32")
    _assert_same_outputs(model, new, x)
    assert new.name == model.name and new.output_names == model.output_names
    assert _input_names(new) == _input_names(model)
    _assert_unchanged(model, snapshot)
    # And back: restore_batchnorm_layers gives the original model again.
    new_snapshot = _snapshot(new)
    back = _restore_quietly(new)
    _assert_restored(model, back)
    _assert_same_outputs(model, back, x)
    assert back.name == model.name and back.output_names == model.output_names
    _assert_unchanged(new, new_snapshot)


@pytest.fixture(scope="module")
def trained():
    """The docstring example of ``replace_batchnorm_layers``, trained two updates by ``fit``.

    ``(original, wrapped, plain, x, history)``: the MobileNetV2 before the
    swap, the trained wrapper, ``restore_batchnorm_layers`` of it, the
    inputs, and the first BN layer's moving mean after each train call.
    One model for both ends of a run (tracing a MobileNetV2 group is most
    of each test's time).
    """
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10)
    new = _convert_quietly(model, accum_steps=4)
    wrapped = GradientAccumulateModel(
        accum_steps=4, inputs=new.input, outputs=new.output, name="trained"
    )
    wrapped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(16, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(16,))
    recorder = _MovingStatsRecorder(_batchnorms(wrapped)[0])
    wrapped.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    return model, wrapped, _restore_quietly(wrapped), x, recorder.history


@pytest.mark.heavy
def test_docs_example_mobilenetv2_trains_with_gradient_accumulate_model(trained):
    _, wrapped, _, x, history = trained
    assert int(wrapped.optimizer.iterations.numpy()) == 2  # 8 micro-steps
    _assert_moved_at_each_update(history, updates=2)
    assert wrapped.predict(x[:2], verbose=0).shape == (2, 10)


# --------------------------------------------------------------------------
# Graph structures
# --------------------------------------------------------------------------


def _branches_model():
    """Two inputs, a BN and a Dense shared between branches, list outputs."""
    a = keras.Input((6,), name="a")
    b = keras.Input((6,), name="b")
    shared_bn = BN(momentum=0.9, name="shared_bn")
    shared_dense = keras.layers.Dense(6, name="shared_dense")
    left = shared_dense(shared_bn(a))
    right = shared_dense(shared_bn(b))
    merged = keras.layers.Concatenate(name="concat")([left, right])
    merged = BN(axis=-1, center=False, name="merged_bn")(merged)
    first = keras.layers.Dense(2, name="first")(merged)
    second = keras.layers.Dense(3, name="second")(BN(name="right_bn")(right))
    return keras.Model([a, b], [first, second], name="branches"), [
        np.random.default_rng(i).normal(2.0, 3.0, (4, 6)).astype("float32") for i in (1, 2)
    ]


def _dict_model():
    """Dict inputs and dict outputs."""
    image = keras.Input((8, 8, 2), name="image")
    meta = keras.Input((3,), name="meta")
    h = keras.layers.Conv2D(4, 3, name="conv")(image)
    h = BN(axis=1, name="bn_axis1")(h)  # channels-first style axis
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    m = BN(scale=False, name="meta_bn")(meta)
    joined = keras.layers.Concatenate(name="join")([h, m])
    outputs = {
        "score": keras.layers.Dense(1, name="score")(joined),
        "label": keras.layers.Dense(4, activation="softmax", name="label")(joined),
    }
    rng = np.random.default_rng(3)
    x = {
        "image": rng.normal(size=(2, 8, 8, 2)).astype("float32"),
        "meta": rng.normal(size=(2, 3)).astype("float32"),
    }
    return keras.Model({"image": image, "meta": meta}, outputs, name="dicts"), x


def _sequential_model():
    model = keras.Sequential(
        [
            keras.Input((5,), name="features"),
            keras.layers.Dense(8, name="dense"),
            BN(name="bn"),
            keras.layers.Dense(2, name="out"),
        ],
        name="seq",
    )
    return model, np.random.default_rng(4).normal(size=(3, 5)).astype("float32")


def _sequential_built_by_call():
    model = keras.Sequential([keras.layers.Dense(8), BN(), keras.layers.Dense(2)])
    x = np.random.default_rng(5).normal(size=(3, 5)).astype("float32")
    model(x)  # built without an Input: Keras adds the InputLayer itself
    return model, x


def _nested_model(share_across_depths=True):
    """A Functional backbone (called with training=False) and a Sequential head,
    in a Functional; ``shared`` is used inside the backbone and outside."""
    inner_in = keras.Input((6,), name="inner_in")
    shared = keras.layers.Dense(6, name="shared")
    backbone = keras.Model(inner_in, BN(name="backbone_bn")(shared(inner_in)), name="backbone")
    head = keras.Sequential(
        [keras.Input((6,)), BN(name="head_bn"), keras.layers.Dense(2, name="head_dense")],
        name="head",
    )
    x = keras.Input((6,), name="x")
    outside = shared if share_across_depths else keras.layers.Dense(6, name="outside")
    features = keras.layers.Add(name="add")([backbone(x, training=False), outside(x)])
    model = keras.Model(x, head(features), name="nested")
    return model, np.random.default_rng(6).normal(size=(4, 6)).astype("float32")


STRUCTURES = [
    pytest.param(_branches_model, id="branches-shared-multi-io"),
    pytest.param(_dict_model, id="dict-io-axis1"),
    pytest.param(_sequential_model, id="sequential"),
    pytest.param(_sequential_built_by_call, id="sequential-built-by-call"),
    pytest.param(_nested_model, id="nested-functional-and-sequential"),
]


@pytest.mark.parametrize("build", STRUCTURES)
def test_structures_keep_outputs_weights_and_io(build):
    keras.utils.set_random_seed(0)
    model, x = build()
    _randomize_batchnorms(model)
    snapshot = _snapshot(model)

    new = _convert_quietly(model, accum_steps=3)

    assert type(new) is type(model)
    _assert_converted(model, new, accum_steps=3)
    _assert_same_outputs(model, new, x)
    assert new.name == model.name
    assert _input_names(new) == _input_names(model)
    assert _output_structure(new) == _output_structure(model)
    assert getattr(new, "output_names", None) == getattr(model, "output_names", None)
    assert len(new.layers) == len(model.layers)  # shared layers cloned once
    _assert_unchanged(model, snapshot)
    # And back to plain Keras, structure and sharing included.
    back = _restore_quietly(new)
    assert type(back) is type(model)
    _assert_restored(model, back)
    _assert_same_outputs(model, back, x)
    assert back.name == model.name
    assert _input_names(back) == _input_names(model)
    assert _output_structure(back) == _output_structure(model)
    assert len(back.layers) == len(model.layers)


def test_nested_models_keep_sharing_and_training_behaviour():
    """Shared across depths stays shared, and a training call collects
    statistics in exactly the layers whose moving statistics the original
    model updates (Keras decides which; the rewrite must not change that)."""
    model, x = _nested_model()
    _randomize_batchnorms(model)
    model.get_layer("head").trainable = False  # its BN runs in inference mode
    new = _convert_quietly(model, accum_steps=2)
    assert new.get_layer("backbone").get_layer("shared") is new.get_layer("shared")
    before = [layer.moving_mean.numpy() for layer in _batchnorms(model)]

    # Forward pass with batch statistics: float32, two moment algorithms
    # (Keras's, Chan's), outputs of magnitude ~1-10.
    expected = model(x, training=True)
    assert_close([np.asarray(expected)], [np.asarray(new(x, training=True))], atol=1e-5)

    updated = [
        not np.array_equal(layer.moving_mean.numpy(), old)
        for layer, old in zip(_batchnorms(model), before)
    ]
    collected = [bool(np.any(layer.pending_count.numpy())) for layer in _batchnorms(new)]
    assert collected == updated == [True, False]  # backbone_bn, head_bn


class _DenseBlock(keras.layers.Layer):
    """A custom layer building a sublayer of its own (no BatchNormalization)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, name="block_dense")

    def call(self, x):
        return self.dense(x)


def _frozen_nested_model():
    model, _ = _nested_model()
    model.trainable = False  # freezes every layer...
    model.get_layer("backbone").get_layer("backbone_bn").trainable = True  # ...but this one
    return model


def _frozen_accumulating_model_with_block():
    inputs = keras.Input((4,), name="x")
    block = _DenseBlock(name="block")
    h = BN(name="bn")(block(inputs))
    model = GradientAccumulateModel(accum_steps=2, inputs=inputs, outputs=h, name="gam")
    block.dense.trainable = False  # a sublayer frozen inside a trainable layer
    model.trainable = False
    model.get_layer("block").trainable = True
    model.get_layer("block").dense.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_frozen_nested_model, id="nested"),
        pytest.param(_frozen_accumulating_model_with_block, id="accumulating-custom-layer"),
    ],
)
def test_trainable_flags_are_kept_at_every_depth(build):
    model = build()
    new = _convert_quietly(model, accum_steps=2)
    flags = [(layer.name, layer.trainable) for layer in _all_layers(model)]
    assert [(layer.name, layer.trainable) for layer in _all_layers(new)] == flags
    assert not new.trainable and not new.trainable_weights


def test_converted_model_round_trips_through_a_keras_file(tmp_path):
    # Keras 3.15 cannot reload a .keras file in which a layer is shared between
    # a nested model and its parent (the original fails too), so none here.
    model, x = _nested_model(share_across_depths=False)
    _randomize_batchnorms(model)
    new = _convert_quietly(model, accum_steps=2)
    new(x, training=True)  # pending statistics are saved too
    path = tmp_path / "converted.keras"
    new.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in _all_layers(loaded)] == [
        type(layer) for layer in _all_layers(new)
    ]
    assert_close(new.get_weights(), loaded.get_weights(), atol=1e-7)  # exact copy
    _assert_same_outputs(new, loaded, x)


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def test_configuration_is_kept(mixed_float16):
    inputs = keras.Input((4, 3), name="x")
    h = BN(
        axis=1,
        momentum=0.8,
        epsilon=0.01,
        center=False,
        gamma_initializer="he_normal",
        moving_variance_initializer="zeros",
        gamma_regularizer=keras.regularizers.L2(0.1),
        gamma_constraint=keras.constraints.NonNeg(),
        name="custom_bn",
    )(inputs)
    h = BN(beta_regularizer="l1", trainable=False, dtype="float32", name="frozen_bn")(h)
    model = keras.Model(inputs, h, name="configured")

    new = _convert_quietly(model, accum_steps=2)

    _assert_converted(model, new, accum_steps=2)
    custom, frozen = new.get_layer("custom_bn"), new.get_layer("frozen_bn")
    assert custom.dtype_policy.name == "mixed_float16"
    assert frozen.dtype_policy.name == "float32" and not frozen.trainable
    assert (custom.axis, custom.momentum, custom.epsilon) == (1, 0.8, 0.01)
    # Keras < 3.5 leaves `beta` unset (rather than None) without `center`.
    assert getattr(custom, "beta", None) is None
    assert isinstance(custom.gamma_constraint, keras.constraints.NonNeg)
    assert len(new.losses) == len(model.losses) > 0  # the regularizers
    np.testing.assert_allclose([float(v) for v in new.losses], [float(v) for v in model.losses])
    back = _restore_quietly(new)
    _assert_restored(model, back)  # configurations, dtype policies and flags included
    assert back.get_layer("custom_bn").dtype_policy.name == "mixed_float16"
    assert not back.get_layer("frozen_bn").trainable


@pytest.mark.parametrize("synchronized", [False, True])
def test_synchronized_sets_the_flag(synchronized):
    model, _ = _sequential_model()
    new = _convert_quietly(model, accum_steps=2, synchronized=synchronized)
    assert [layer.synchronized for layer in _batchnorms(new)] == [synchronized]


def test_turning_off_a_layers_synchronized_flag_warns():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, BN(synchronized=True, name="sync_bn")(inputs))
    with pytest.warns(UserWarning, match=r"\['sync_bn'\] .* had synchronized=True"):
        new = replace_batchnorm_layers(model, accum_steps=2)
    assert new.get_layer("sync_bn").synchronized is False


def test_batchnorm_subclass_is_replaced_and_its_extra_arguments_reported():
    class ScaledBatchNormalization(BN):
        def __init__(self, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    inputs = keras.Input((3,))
    model = keras.Model(inputs, ScaledBatchNormalization(name="scaled")(inputs))
    with pytest.warns(UserWarning, match=r"dropped\): \{'scaled': \['factor'\]\}"):
        new = replace_batchnorm_layers(model, accum_steps=2)
    assert type(new.get_layer("scaled")) is AccumBatchNormalization


@pytest.mark.skipif(
    "renorm" not in inspect.signature(BN).parameters,
    reason="Keras's BatchNormalization takes `renorm` from Keras 3.14 on",
)
def test_renorm_with_accumulation_is_refused():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, BN(renorm=True, name="renorm_bn")(inputs))
    with pytest.raises(ValueError, match="'renorm_bn' uses batch renormalization.*accum_steps=2"):
        replace_batchnorm_layers(model, accum_steps=2)
    new = _convert_quietly(model, accum_steps=1)  # plain Keras behaviour: allowed
    _assert_converted(model, new, accum_steps=1)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def test_converted_model_trains_with_big_batch_statistics():
    """Golden: one update of the moving statistics per group, with numpy's
    mean and (biased) variance of the concatenated group."""
    accum_steps, micro_batch, momentum = 4, 8, 0.9
    inputs = keras.Input((3,), name="x")
    bn = BN(momentum=momentum, name="bn")
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(bn(inputs)))
    _randomize_batchnorms(model)
    original_weights = model.get_weights()
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 2.0, (accum_steps * micro_batch * 2, 3)).astype("float32")
    y = rng.normal(size=(len(x), 1)).astype("float32")

    new = replace_batchnorm_layers(model, accum_steps=accum_steps)
    wrapped = GradientAccumulateModel(accum_steps=accum_steps, inputs=new.input, outputs=new.output)
    wrapped.compile(optimizer="sgd", loss="mse")
    layer = wrapped.get_layer("bn")
    recorder = _MovingStatsRecorder(layer)
    wrapped.fit(
        x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]
    )

    _assert_moved_at_each_update(recorder.history, updates=2)
    mean, variance = original_weights[2].astype("float64"), original_weights[3].astype("float64")
    for group in np.split(x.astype("float64"), 2):
        mean = momentum * mean + (1 - momentum) * group.mean(axis=0)
        variance = momentum * variance + (1 - momentum) * group.var(axis=0)
    # float32 statistics of O(10) values: ~1e-6 relative.
    assert_close(
        [layer.moving_mean.numpy(), layer.moving_variance.numpy()], [mean, variance], atol=1e-5
    )
    for got, old in zip(model.get_weights(), original_weights):  # original untouched
        np.testing.assert_array_equal(got, old)


def test_gradient_accumulate_model_keeps_its_arguments():
    model, x = _sequential_model()
    model = keras.Model(model.inputs[0], model.outputs[0])  # a functional graph of it
    wrapped = GradientAccumulateModel(
        accum_steps=3,
        use_agc=True,
        clip_factor=0.05,
        eps=1e-2,
        inputs=model.input,
        outputs=model.output,
        name="wrapped",
    )
    wrapped.compile(optimizer="sgd", loss="mse")
    new = _convert_quietly(wrapped, accum_steps=3)

    assert written_class(new) is GradientAccumulateModel and new.name == "wrapped"
    assert (new.accum_steps, new.use_agc, new.clip_factor, new.eps) == (3, True, 0.05, 1e-2)
    assert new.compiled and new.optimizer is not wrapped.optimizer
    _assert_converted(wrapped, new, accum_steps=3)
    _assert_same_outputs(wrapped, new, x)


def test_gradient_accumulate_model_keeps_reduce_every_micro_step():
    model, _ = _sequential_model()
    wrapped = GradientAccumulateModel(
        accum_steps=3,
        reduce_every_micro_step=True,
        inputs=model.inputs[0],
        outputs=model.outputs[0],
    )
    new = _convert_quietly(wrapped, accum_steps=3)
    assert new.wrapper_config() == wrapped.wrapper_config()
    assert new.reduce_every_micro_step is True


def test_gradient_accumulate_model_with_other_accum_steps_is_refused():
    model, _ = _sequential_model()
    wrapped = GradientAccumulateModel(
        accum_steps=3, inputs=model.inputs[0], outputs=model.outputs[0], name="wrapped"
    )
    with pytest.raises(
        ValueError,
        match=r"'wrapped' is a GradientAccumulateModel with `accum_steps=3`.*"
        r"replace_batchnorm_layers\(model, accum_steps=3\).*Received: accum_steps=8",
    ):
        replace_batchnorm_layers(wrapped, accum_steps=8)


def test_converted_model_wrapped_with_other_accum_steps_is_refused_at_construction():
    model, _ = _sequential_model()
    new = _convert_quietly(model, accum_steps=8)
    with pytest.raises(ValueError, match=r"has `accum_steps=8` and model .* `accum_steps=4`"):
        GradientAccumulateModel(accum_steps=4, inputs=new.inputs[0], outputs=new.outputs[0])


@pytest.mark.parametrize("call", ["keyword", "positional"])
def test_position_replace_of_0_5_is_accepted(call):
    model, x = _sequential_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if call == "keyword":
            new = replace_batchnorm_layers(model, accum_steps=4, position="replace")
        else:
            new = replace_batchnorm_layers(model, 4, "replace")
    _assert_converted(model, new, accum_steps=4)
    _assert_same_outputs(model, new, x)


@pytest.mark.parametrize("position", ["after", True])
def test_other_positions_are_refused(position):
    model, _ = _sequential_model()
    with pytest.raises(
        ValueError, match=rf"`position` must be 'replace'.*Received: position={position!r}"
    ):
        replace_batchnorm_layers(model, 4, position)


class _ScaledOutputModel(keras.Model):
    """A functional subclass with a constructor argument of its own."""

    def __init__(self, inputs, outputs, scale=1.0, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.scale = scale


class _NamedModel(keras.Model):
    """A functional subclass with Keras's functional constructor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.note = "set in the constructor"


@pytest.mark.parametrize(
    "cls, kept, match",
    [
        pytest.param(
            _ScaledOutputModel,
            False,
            r"'scaled' is a _ScaledOutputModel, which .* rebuilds as a plain `Functional`",
            id="own-constructor",
        ),
        pytest.param(
            _NamedModel,
            True,
            r"'scaled' is a _NamedModel, which .* rebuilds as "
            r"`_NamedModel\(inputs, outputs, name=...\)`",
            id="functional-constructor",
        ),
    ],
)
def test_functional_subclass_is_rebuilt_by_keras_with_a_warning(cls, kept, match):
    inputs = keras.Input((3,), name="x")
    model = cls(inputs, BN(name="bn")(inputs), name="scaled")
    with pytest.warns(UserWarning, match=match):
        new = replace_batchnorm_layers(model, accum_steps=2)
    assert (type(new) is cls) == kept
    _assert_converted(model, new, accum_steps=2)
    _assert_same_outputs(model, new, np.ones((2, 3), "float32"))


# --------------------------------------------------------------------------
# Idempotence and models without BatchNormalization
# --------------------------------------------------------------------------


def test_already_converted_model_gets_new_accum_steps_with_a_warning():
    model, x = _nested_model()
    _randomize_batchnorms(model)
    once = _convert_quietly(model, accum_steps=2)
    once(x, training=True)  # leaves pending statistics in the head
    with pytest.warns(
        UserWarning,
        match=r"2 layer\(s\) .* already were AccumBatchNormalization "
        r"\(accum_steps=\[2\]\); their copies have accum_steps=4",
    ):
        twice = replace_batchnorm_layers(once, accum_steps=4)

    assert [layer.accum_steps for layer in _batchnorms(twice)] == [4, 4]
    _assert_converted(once, twice, accum_steps=4)  # state emptied, weights kept
    _assert_same_outputs(once, twice, x)
    with pytest.warns(UserWarning, match="already were"):
        plain = replace_batchnorm_layers(twice, accum_steps=1)  # drops the state
    assert len(plain.weights) == len(model.weights)
    _assert_same_outputs(twice, plain, x)


def test_model_without_batchnorm_comes_back_equivalent_with_a_warning():
    inputs = keras.Input((4,), name="x")
    outputs = keras.layers.Dense(2, name="out")(keras.layers.Dense(3, name="hidden")(inputs))
    model = keras.Model(inputs, outputs, name="plain")
    x = np.ones((2, 4), "float32")
    with pytest.warns(UserWarning, match="'plain' has no BatchNormalization layer"):
        new = replace_batchnorm_layers(model, accum_steps=4)
    assert new is not model and new.get_layer("out") is not model.get_layer("out")
    _assert_converted(model, new, accum_steps=4)
    _assert_same_outputs(model, new, x)


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------


class _SubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = BN()

    def call(self, x):
        return self.bn(x)


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = BN(name="hidden_bn")

    def call(self, x):
        return self.bn(x)


def _model_with_block():
    inputs = keras.Input((3,))
    return keras.Model(inputs, _Block(name="block")(inputs), name="with_block")


def _model_with_time_distributed():
    inputs = keras.Input((2, 3))
    outputs = keras.layers.TimeDistributed(BN(name="td_bn"), name="td")(inputs)
    return keras.Model(inputs, outputs, name="with_wrapper")


def _model_with_nested_subclassed():
    inputs = keras.Input((3,))
    return keras.Model(inputs, _SubclassedModel(name="sub")(inputs), name="with_sub")


@pytest.mark.parametrize(
    "build, match",
    [
        pytest.param(
            lambda: _SubclassedModel(name="sub"),
            r"subclassed model.*create its normalization layers as "
            r"`AccumBatchNormalization.*Received: model='sub' of type _SubclassedModel",
            id="subclassed",
        ),
        pytest.param(
            _model_with_block,
            r"in those layers' code.*Received: model='with_block' with "
            r"BatchNormalization inside \{'block \(_Block\)': \['hidden_bn'\]\}",
            id="custom-layer",
        ),
        pytest.param(
            _model_with_time_distributed,
            r"inside \{'td \(TimeDistributed\)': \['td_bn'\]\}",
            id="wrapper-layer",
        ),
        pytest.param(
            _model_with_nested_subclassed,
            r"inside \{'sub \(_SubclassedModel\)': \['batch_normalization",
            id="nested-subclassed",
        ),
    ],
)
def test_unreachable_batchnorm_is_refused_with_what_to_do(build, match):
    with pytest.raises(ValueError, match=match):
        replace_batchnorm_layers(build(), accum_steps=2)


@pytest.mark.parametrize(
    "model, match",
    [
        (keras.layers.Dense(2), r"Received: model=<Dense name=dense.*of type Dense"),
        ("model.keras", r"Received: model='model.keras' of type str"),
        (None, r"Received: model=None of type NoneType"),
    ],
    ids=["layer", "path", "none"],
)
def test_not_a_model_is_refused(model, match):
    with pytest.raises(
        ValueError, match=r"`model` must be a Keras Functional or Sequential.*" + match
    ):
        replace_batchnorm_layers(model, accum_steps=2)


@pytest.mark.parametrize("accum_steps", [0, -1, 2.0, True, "4", None])
def test_invalid_accum_steps_is_refused(accum_steps):
    model, _ = _sequential_model()
    with pytest.raises(
        ValueError,
        match=rf"`accum_steps` must be an integer >= 1, or 'auto' .*\. "
        rf"Received: accum_steps={accum_steps!r}",
    ):
        replace_batchnorm_layers(model, accum_steps=accum_steps)


@pytest.mark.parametrize("synchronized", [1, "yes", None])
def test_invalid_synchronized_is_refused(synchronized):
    model, _ = _sequential_model()
    with pytest.raises(
        ValueError,
        match=rf"`synchronized` must be a boolean\. Received: synchronized={synchronized!r}",
    ):
        replace_batchnorm_layers(model, accum_steps=2, synchronized=synchronized)


# --------------------------------------------------------------------------
# restore_batchnorm_layers: a trained model handed over as plain Keras
# --------------------------------------------------------------------------


@pytest.mark.heavy
def test_a_trained_model_comes_back_as_plain_keras_with_its_trained_state(trained):
    initial, wrapped, plain, x, _ = trained
    assert int(wrapped.optimizer.iterations.numpy()) == 2
    # Training moved the moving statistics away from the initial model's.
    trained_mean = _batchnorms(wrapped)[0].moving_mean.numpy()
    assert not np.array_equal(trained_mean, _batchnorms(initial)[0].moving_mean.numpy())
    assert type(plain) is type(initial)  # Functional, the wrapper dropped
    assert plain.name == wrapped.name
    assert all(type(layer) is BN for layer in _batchnorms(plain))
    assert len(_batchnorms(plain)) == 52
    assert len(plain.weights) == len(_keras_weights(wrapped))
    for got, expected in zip(plain.get_weights(), _keras_weights(wrapped)):
        np.testing.assert_array_equal(got, expected)
    _assert_same_outputs(wrapped, plain, x)
    # Compiled as the wrapper was, with a fresh optimizer.
    assert plain.compiled and type(plain.optimizer) is keras.optimizers.Adam
    assert plain.get_compile_config()["loss"] == wrapped.get_compile_config()["loss"]


@pytest.mark.slow
def test_a_restored_model_loads_and_serves_where_the_package_is_not_installed(trained, tmp_path):
    _, _, plain, x, _ = trained
    plain.save(tmp_path / "plain.keras")
    with contextlib.redirect_stdout(io.StringIO()):  # Keras < 3.6 has no `verbose`
        plain.export(str(tmp_path / "exported"))
    np.save(tmp_path / "inputs.npy", x)
    np.save(tmp_path / "expected.npy", np.asarray(plain.predict(x, verbose=0)))
    results = script_results(
        run_script_module(
            "without_library",
            [tmp_path / "plain.keras", tmp_path / "exported", tmp_path / "inputs.npy"],
            own_interpreter=True,  # the script host has imported the package
        )
    )
    assert results["blocked"], "gradient_accumulator was importable in the fresh process"
    assert results["imported"] == []
    assert results["batchnorm_classes"] == ["BatchNormalization"]
    assert "gradient_accumulator" not in results["modules"]
    # The same computation on the same weights: exact on this CPU, allowed
    # float32 rounding of the outputs' size (probabilities).
    assert results["loaded_max_abs_diff"] <= 1e-5
    assert results["served_max_abs_diff"] <= 1e-5


def _small_wrapper(accum_steps=2):
    keras.utils.set_random_seed(0)
    model, x = _nested_model(share_across_depths=False)
    converted = _convert_quietly(model, accum_steps=accum_steps)
    wrapped = GradientAccumulateModel(
        accum_steps=accum_steps, inputs=converted.input, outputs=converted.output
    )
    wrapped.compile("sgd", "mse")
    return wrapped, x, np.zeros((len(x), 2), "float32")


def test_a_group_in_progress_warns_and_applying_it_first_keeps_it():
    wrapped, x, y = _small_wrapper()
    wrapped.fit(x, y, batch_size=len(x), epochs=0, verbose=0)  # Keras < 3.5 builds in fit
    wrapped.train_on_batch(x, y)  # one micro-step of two
    with pytest.warns(
        UserWarning,
        match=r"group in progress: the gradients of 1 micro-step\(s\) and pending statistics "
        r"in 2 AccumBatchNormalization layer\(s\) \(backbone_bn, head_bn\), not in its "
        r"weights, are not carried over.*apply_accumulated_gradients",
    ):
        restore_batchnorm_layers(wrapped)
    wrapped.apply_accumulated_gradients()
    back = _restore_quietly(wrapped)
    for got, expected in zip(back.get_weights(), _keras_weights(wrapped)):
        np.testing.assert_array_equal(got, expected)


def test_the_optimizer_wrapper_is_unwrapped_from_the_compile_configuration():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="seq")
    model.compile(GradientAccumulateOptimizer(keras.optimizers.Adam(0.01), accum_steps=2), "mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, verbose=0)
    back = _restore_quietly(model)  # the optimizer is the package's part: no warning
    assert type(back) is keras.Sequential
    assert type(back.optimizer) is keras.optimizers.Adam
    assert back.optimizer.get_config()["learning_rate"] == pytest.approx(0.01)
    for got, expected in zip(back.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)


def test_a_model_without_the_package_s_parts_comes_back_equivalent_with_a_warning():
    model = _model_with_block()  # a Keras BatchNormalization hidden in a layer: nothing to do
    with pytest.warns(UserWarning, match="equivalent copy with the same layers and weights"):
        back = restore_batchnorm_layers(model)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype("float32")
    _assert_same_outputs(model, back, x)


class _AccumBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = AccumBatchNormalization(accum_steps=2, name="hidden_accum_bn")

    def call(self, x):
        return self.bn(x)


class _AccumSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = AccumBatchNormalization(accum_steps=2)

    def call(self, x):
        return self.bn(x)


def test_restoring_what_cloning_cannot_reach_is_refused_with_what_to_do():
    inputs = keras.Input((3,))
    hidden = keras.Model(inputs, _AccumBlock(name="block")(inputs), name="with_block")
    with pytest.raises(
        ValueError,
        match=r"Some AccumBatchNormalization layers sit inside.*keras.layers.BatchNormalization"
        r".*Received: model='with_block' with AccumBatchNormalization inside "
        r"\{'block \(_AccumBlock\)': \['hidden_accum_bn'\]\}",
    ):
        restore_batchnorm_layers(hidden)
    with pytest.raises(
        ValueError,
        match=r"a subclassed model.*build the same class with `keras.layers.BatchNormalization`"
        r".*Received: model='sub' of type _AccumSubclassed",
    ):
        restore_batchnorm_layers(_AccumSubclassed(name="sub"))
    with pytest.raises(ValueError, match=r"Received: model=None of type NoneType"):
        restore_batchnorm_layers(None)
