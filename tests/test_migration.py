"""Code written for gradient_accumulator 0.5: every row of docs/migration.rst works or raises.

Each row of the migration table has an id; ``ROWS`` maps it to a check that
runs the 0.5 code. A row either works as it did (the check asserts what it
does) or raises with the way to do it now (the check matches the message,
value included). ``test_the_docs_table_lists_exactly_these_rows`` ties the
page to this table.
"""

import importlib
import re
import warnings

import keras
import numpy as np
import pytest

from tests.helpers import ROOT, build_dense

MIGRATION_PAGE = ROOT / "docs" / "migration.rst"


def _functional_with_batchnorm():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(momentum=0.9, name="bn")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def import_top_level():
    from gradient_accumulator import (
        AccumBatchNormalization,
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )

    assert issubclass(GradientAccumulateModel, keras.Model)
    assert issubclass(GradientAccumulateOptimizer, keras.optimizers.Optimizer)
    assert issubclass(AccumBatchNormalization, keras.layers.BatchNormalization)


def import_accumulators():
    import gradient_accumulator
    from gradient_accumulator.accumulators import (
        GradientAccumulateModel,
        GradientAccumulateOptimizer,
    )

    assert GradientAccumulateModel is gradient_accumulator.GradientAccumulateModel
    assert GradientAccumulateOptimizer is gradient_accumulator.GradientAccumulateOptimizer


def import_layers_and_utils():
    import gradient_accumulator
    from gradient_accumulator.layers import AccumBatchNormalization
    from gradient_accumulator.utils import replace_batchnorm_layers

    assert AccumBatchNormalization is gradient_accumulator.AccumBatchNormalization
    assert replace_batchnorm_layers is gradient_accumulator.replace_batchnorm_layers


def model_accum_steps():
    from gradient_accumulator import GradientAccumulateModel

    model = build_dense(GradientAccumulateModel, accum_steps=4)
    model.compile("sgd", "mse")
    x = np.ones((16, 5), "float32")
    model.fit(x, np.ones((16, 1), "float32"), batch_size=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1  # 4 micro-batches, 1 update


def model_agc_arguments():
    from gradient_accumulator import GradientAccumulateModel

    model = build_dense(
        GradientAccumulateModel, accum_steps=4, use_agc=True, clip_factor=0.05, eps=1e-2
    )
    assert (model.use_agc, model.clip_factor, model.eps) == (True, 0.05, 1e-2)


def model_mixed_precision():
    from gradient_accumulator import GradientAccumulateModel

    _raises(
        lambda: build_dense(GradientAccumulateModel, accum_steps=4, mixed_precision=True),
        r"set_global_policy\('mixed_float16'\).*Received: mixed_precision=True",
    )


def model_experimental_distributed_support():
    from gradient_accumulator import GradientAccumulateModel

    _raises(
        lambda: build_dense(
            GradientAccumulateModel, accum_steps=4, experimental_distributed_support=True
        ),
        r"strategy\.scope\(\).*Received: experimental_distributed_support=True",
    )


def model_mixed_precision_false():
    from gradient_accumulator import GradientAccumulateModel

    _raises(
        lambda: build_dense(GradientAccumulateModel, accum_steps=4, mixed_precision=False),
        r"does not take `mixed_precision`: delete the argument: `False` was "
        r"gradient_accumulator 0\.5's default.*Received: mixed_precision=False",
    )


class SubclassedModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(3, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def model_wrap_existing():
    from gradient_accumulator import GradientAccumulateModel

    keras.utils.set_random_seed(0)
    sequential = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    sequential.build((None, 5))
    # 0.5's way fails on a Keras 3 Sequential model (Keras's own error).
    with pytest.raises((AttributeError, ValueError), match="has never been called"):
        GradientAccumulateModel(accum_steps=4, inputs=sequential.input, outputs=sequential.output)
    functional = build_dense()
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.ones((16, 1), "float32")
    for existing in (sequential, functional, SubclassedModel()):
        # The one way for every kind of model: call it on new inputs.
        inputs = keras.Input((5,))
        model = GradientAccumulateModel(accum_steps=4, inputs=inputs, outputs=existing(inputs))
        before = model.predict(x, verbose=0)
        np.testing.assert_array_equal(before, existing.predict(x, verbose=0))
        model.compile("sgd", "mse")
        model.fit(x, y, batch_size=4, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 1  # 4 micro-batches, 1 update
        # The existing model's own weights are the ones trained.
        np.testing.assert_array_equal(model.predict(x, verbose=0), existing.predict(x, verbose=0))
        assert not np.array_equal(before, existing.predict(x, verbose=0))


def model_agc_of_the_readme():
    from gradient_accumulator import GradientAccumulateModel

    _raises(
        lambda: build_dense(GradientAccumulateModel, accum_steps=4, agc=True),
        r"use_agc=True.*Received: agc=True",
    )


def optimizer_name_and_accum_steps():
    from gradient_accumulator import GradientAccumulateOptimizer

    optimizer = GradientAccumulateOptimizer(optimizer="SGD", accum_steps=4)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.SGD)
    assert optimizer.accum_steps == 4


def optimizer_reduction():
    from gradient_accumulator import GradientAccumulateOptimizer

    _raises(
        lambda: GradientAccumulateOptimizer("SGD", accum_steps=4, reduction="MEAN"),
        r"always averaged.*Remove the argument\. Received: reduction='MEAN'",
    )


def optimizer_lr_decay_clipnorm():
    from gradient_accumulator import GradientAccumulateOptimizer

    for name, value, message in [
        ("lr", 1e-3, r"set `learning_rate` on the inner optimizer"),
        ("decay", 1e-4, r"learning-rate schedule"),
        ("clipnorm", 1.0, r"set it on the inner optimizer"),
    ]:
        _raises(
            lambda name=name, value=value: GradientAccumulateOptimizer(
                "SGD", accum_steps=4, **{name: value}
            ),
            rf"{message}.*Received: {name}={value!r}",
        )


def batchnorm_arguments():
    from gradient_accumulator import AccumBatchNormalization

    layer = AccumBatchNormalization(accum_steps=4, momentum=0.9, epsilon=1e-3)
    assert (layer.accum_steps, layer.momentum, layer.epsilon) == (4, 0.9, 1e-3)


def batchnorm_default_momentum():
    from gradient_accumulator import AccumBatchNormalization

    # Unchanged: 0.5.0 to 0.5.2 defaulted to 0.99 too (as Keras does).
    assert AccumBatchNormalization(accum_steps=4).momentum == 0.99


def batchnorm_one_layer_several_ranks():
    from gradient_accumulator import AccumBatchNormalization

    images = np.ones((2, 4, 4, 3), "float32")
    vectors = np.ones((2, 3), "float32")
    errors = []
    for layer_class in (keras.layers.BatchNormalization, AccumBatchNormalization):
        shared = layer_class()
        shared(images)
        with pytest.raises(ValueError, match="expected ndim=4, found ndim=2") as raised:
            shared(vectors)
        errors.append(str(raised.value).replace(shared.name, "<layer>"))
    assert errors[1] == errors[0]  # refused as Keras's own layer refuses it
    # The fix: one layer per input.
    assert AccumBatchNormalization()(images).shape == images.shape
    assert AccumBatchNormalization()(vectors).shape == vectors.shape


def replace_with_position():
    from gradient_accumulator import AccumBatchNormalization
    from gradient_accumulator.utils import replace_batchnorm_layers

    model = _functional_with_batchnorm()
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        by_keyword = replace_batchnorm_layers(model, accum_steps=4, position="replace")
        by_position = replace_batchnorm_layers(model, 4, "replace")
    for new in (by_keyword, by_position):
        layer = new.get_layer("bn")
        assert isinstance(layer, AccumBatchNormalization) and layer.momentum == 0.9
        np.testing.assert_array_equal(new.predict(x, verbose=0), model.predict(x, verbose=0))


def agc_adaptive_clip_grad():
    from gradient_accumulator.agc import adaptive_clip_grad

    weight = keras.Variable(np.ones((2, 2), "float32"))
    _raises(
        lambda: adaptive_clip_grad([weight], [np.ones((2, 2), "float32")], 0.01, 1e-3),
        r"`adaptive_clip_grad` of gradient_accumulator 0\.5 is gone: use "
        r"`adaptive_clip_gradients\(grads, variables, clip_factor, eps\)` \(note the reversed",
    )


def agc_norm_helpers():
    from gradient_accumulator import compute_norm, unitwise_norm

    x = np.ones((3, 2), "float32")
    _raises(lambda: unitwise_norm(x), r"`unitwise_norm` of gradient_accumulator 0\.5 is gone")
    _raises(lambda: compute_norm(x, 0, True), r"`compute_norm` .* is gone: .*keras\.ops\.sqrt")


ROWS = {
    function.__name__: function
    for function in [
        import_top_level,
        import_accumulators,
        import_layers_and_utils,
        model_accum_steps,
        model_agc_arguments,
        model_mixed_precision,
        model_mixed_precision_false,
        model_wrap_existing,
        model_experimental_distributed_support,
        model_agc_of_the_readme,
        optimizer_name_and_accum_steps,
        optimizer_reduction,
        optimizer_lr_decay_clipnorm,
        batchnorm_arguments,
        batchnorm_default_momentum,
        batchnorm_one_layer_several_ranks,
        replace_with_position,
        agc_adaptive_clip_grad,
        agc_norm_helpers,
    ]
}


@pytest.mark.parametrize("row", list(ROWS))
def test_code_of_0_5(row):
    ROWS[row]()


def test_the_docs_table_lists_exactly_these_rows():
    # Each table row of the page starts with its id in double back-quotes
    # inside the first cell: "   * - ``model_accum_steps``".
    ids = re.findall(r"^\s*\* - ``(\w+)``", MIGRATION_PAGE.read_text(), flags=re.MULTILINE)
    assert sorted(ids) == sorted(ROWS), set(ids) ^ set(ROWS)
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    "old, new, names",
    [
        (
            "gradient_accumulator.utils",
            "gradient_accumulator.conversion",
            ["replace_batchnorm_layers", "restore_batchnorm_layers"],
        ),
        (
            "gradient_accumulator.distribute",
            "gradient_accumulator.batchnorm_averaging",
            ["average_batchnorm_statistics", "AverageBatchNormStatistics"],
        ),
        (
            "gradient_accumulator.agc",
            "gradient_accumulator._v05",
            ["adaptive_clip_grad", "unitwise_norm", "compute_norm"],
        ),
        (
            "gradient_accumulator.accumulators",
            "gradient_accumulator",
            ["GradientAccumulateModel", "GradientAccumulateOptimizer"],
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_moved_names_stay_importable_from_their_earlier_modules(old, new, names):
    """Each name an earlier module held is the same object at its present home."""
    earlier, present = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(earlier, name) is getattr(present, name), name
