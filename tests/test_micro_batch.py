"""choose_micro_batch: budgets that force each choice, against a training run measured apart.

The network (``build_wide_conv``) is activation-bound: its allocator peak
grows with the micro-batch from one sample on, so that every budget between
two micro-batches' peaks has one right answer. The tries' peaks are measured
here first, through the same training step (``_try``); the choice is then
checked against them and, independently, against the allocator's peak of a
real ``fit`` of the chosen split.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradient_accumulator import (
    GradientAccumulateModel,
    MicroBatchChoice,
    choose_micro_batch,
    replace_batchnorm_layers,
)
from gradient_accumulator.micro_batch import _memory_devices, _try, parse_memory_budget
from tests.helpers import (
    FLOAT32_ATOL,
    assert_diff_below,
    build_wide_conv,
    make_image_data,
    max_abs_diff,
    run_python,
    run_script_module,
    script_results,
)

BATCH = 8
X, Y = make_image_data(4 * BATCH)
DEVICES = _memory_devices()


def build_accumulating(accum_steps, steps_per_execution=1, optimizer="sgd"):
    model = build_wide_conv(GradientAccumulateModel, accum_steps=accum_steps)
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def allocator_peak_of_fit(model, micro_batch):
    """The allocator's peak over a real ``fit`` of four updates (measured apart from the tries).

    The data streamed, as from disk: ``fit`` on arrays would copy them whole
    into TensorFlow's memory, which is the data set's, not the training's.
    """
    count = len(X) // micro_batch

    def micro_batches():
        for index in range(count):
            rows = slice(index * micro_batch, (index + 1) * micro_batch)
            yield X[rows], Y[rows]

    signature = (
        tf.TensorSpec((micro_batch, *X.shape[1:]), tf.float32),
        tf.TensorSpec((micro_batch, *Y.shape[1:]), tf.float32),
    )
    stream = tf.data.Dataset.from_generator(micro_batches, output_signature=signature)
    stream = stream.apply(tf.data.experimental.assert_cardinality(count))
    for device in DEVICES:
        tf.config.experimental.reset_memory_stats(device)
    model.fit(stream, shuffle=False, verbose=0)
    return max(tf.config.experimental.get_memory_info(d)["peak"] for d in DEVICES)


@pytest.fixture(scope="module")
def peaks():
    """Each divisor of the batch: the allocator peak of its try (two updates)."""
    return {
        m: _try(build_accumulating, BATCH // m, m, (X[:BATCH], Y[:BATCH], None), DEVICES)[0]
        for m in (8, 4, 2, 1)
    }


def test_the_tries_peaks_grow_with_the_micro_batch(peaks):
    sizes = sorted(peaks)
    assert peaks[1] > 0
    for smaller, larger in zip(sizes, sizes[1:]):
        assert peaks[larger] > peaks[smaller], peaks


# The tries of batch 8 whose largest micro-batch within the budget is the key.
BISECTION = {8: [8], 4: [8, 4], 2: [8, 4, 1, 2], 1: [8, 4, 1, 2]}


@pytest.mark.parametrize("micro_batch", [8, 4, 2, 1])
def test_a_budget_between_two_peaks_chooses_the_smaller(peaks, micro_batch):
    larger = peaks.get(2 * micro_batch, 10 * peaks[micro_batch])
    budget = int(math.sqrt(peaks[micro_batch] * larger))
    choice = choose_micro_batch(
        build_accumulating, X, Y, batch_size=BATCH, memory_budget=budget, verbose=0
    )
    assert isinstance(choice, MicroBatchChoice)
    assert (choice.micro_batch, choice.accum_steps) == (micro_batch, BATCH // micro_batch)
    assert choice.accum_steps * choice.micro_batch == BATCH
    assert choice.peak_bytes <= budget < larger
    # The whole batch, the next divisor, then a bisection over 1 and 2.
    assert [t.micro_batch for t in choice.tries] == BISECTION[micro_batch]
    assert all(t.fits == (t.peak_bytes <= budget) for t in choice.tries)
    assert all(t.fits == (t.micro_batch <= micro_batch) for t in choice.tries)
    # The chosen split, trained for real, stays within the budget.
    assert allocator_peak_of_fit(build_accumulating(choice.accum_steps), micro_batch) <= budget


def test_the_choice_says_what_it_chose_and_measured(peaks, capsys):
    budget = int(math.sqrt(peaks[2] * peaks[4]))
    choice = choose_micro_batch(build_accumulating, X, Y, batch_size=BATCH, memory_budget=budget)
    printed = capsys.readouterr().out.strip()
    assert printed == str(choice)
    assert printed.startswith(f"Batch {BATCH} = accum_steps 4 x micro-batch 2: peak ")
    assert "(tried 8: " in printed and " over, 4: " in printed and " over, 1: " in printed
    assert " fits, 2: " in printed and " fits; 4 tries in " in printed


def test_even_micro_batch_one_not_fitting_raises_before_any_weight_moves():
    base = build_wide_conv()
    before = [w.copy() for w in base.get_weights()]

    def build(accum_steps):
        inputs = keras.Input((48, 48, 3))
        model = GradientAccumulateModel(
            accum_steps=accum_steps, inputs=inputs, outputs=base(inputs)
        )
        model.compile(optimizer="adam", loss="mse")
        return model

    with pytest.raises(ValueError, match="Even micro-batch 1 does not fit in memory_budget=1024 "):
        choose_micro_batch(build, X, Y, batch_size=4, memory_budget=1024)
    # The tries trained the shared layers, then put them back.
    assert max_abs_diff(before, base.get_weights()) == 0.0


class OutOfMemoryAbove4(GradientAccumulateModel):
    """Raises what TensorFlow raises on a GPU that runs out, for micro-batches above 4."""

    def fit(self, x, *args, **kwargs):
        if isinstance(x, tf.data.Dataset) and x.element_spec[0].shape[0] > 4:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
        return super().fit(x, *args, **kwargs)


def test_an_out_of_memory_try_is_passed_over():
    def build(accum_steps):
        model = build_wide_conv(OutOfMemoryAbove4, accum_steps=accum_steps)
        model.compile(optimizer="sgd", loss="mse")
        return model

    choice = choose_micro_batch(build, X, Y, batch_size=64, memory_budget="1 GiB", verbose=0)
    assert choice.micro_batch == 4
    # 64, 32, then a bisection over 1, 2, 4, 8, 16: four tries where a scan
    # from the largest down takes five.
    assert [(t.micro_batch, t.peak_bytes is None) for t in choice.tries] == [
        (64, True),
        (32, True),
        (4, False),
        (8, True),
    ]
    assert str(choice).count(": out of memory") == 3
    # The process goes on training.
    model = build(choice.accum_steps)
    model.fit(X, Y, batch_size=choice.micro_batch, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == math.ceil(len(X) / 64)  # one, shorter


@pytest.mark.heavy
def test_a_batchnorm_model_at_the_choice_keeps_the_batch_statistics(peaks):
    """A converted BN model at the chosen split: its first BN layer's moving statistics are
    Keras's at ``batch_size`` after one update (the layer's own claim: the deeper layer's
    input depends on the micro-batches' forward passes)."""

    def build(accum_steps):
        wrapped = build_wide_conv(GradientAccumulateModel, batchnorm=True, accum_steps=accum_steps)
        model = replace_batchnorm_layers(wrapped, accum_steps=accum_steps)
        model.compile(optimizer="adam", loss="mse")
        return model

    # Below the whole batch's peak without BN layers, so below the BN model's too.
    budget = int(math.sqrt(peaks[4] * peaks[8]))
    choice = choose_micro_batch(build, X, Y, batch_size=BATCH, memory_budget=budget, verbose=0)
    assert choice.accum_steps > 1
    model = build(choice.accum_steps)
    model.fit(X[:BATCH], Y[:BATCH], batch_size=choice.micro_batch, shuffle=False, verbose=0)
    reference = build_wide_conv(batchnorm=True)
    reference.compile(optimizer="adam", loss="mse")
    reference.fit(X[:BATCH], Y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    statistics = [
        np.asarray(getattr(m.get_layer("bn0"), name))
        for m in (model, reference)
        for name in ("moving_mean", "moving_variance")
    ]
    assert max_abs_diff(statistics[:2], [np.zeros(32), np.ones(32)]) > 1e-3  # they moved
    # float32 statistics against float32 Keras: relative 2e-6 (STATS_RTOL, test_layers.py).
    for ours, keras_own in zip(statistics[:2], statistics[2:]):
        assert np.max(np.abs(ours - keras_own) / np.maximum(np.abs(keras_own), 1.0)) <= 2e-6


def test_steps_per_execution_tries_whole_calls():
    tried = []

    def build(accum_steps):
        model = build_accumulating(accum_steps, steps_per_execution=2)
        tried.append(model)
        return model

    choice = choose_micro_batch(build, X, Y, batch_size=16, memory_budget="1 GiB", verbose=0)
    assert choice.micro_batch == 16
    # Two calls of two groups each: four updates.
    assert int(tried[0].optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize(
    "text, expected",
    [("1.5 GiB", 3 * 2**29), ("512MiB", 512 * 2**20), ("2 GB", 2 * 10**9), (4096, 4096)],
)
def test_memory_budget_units(text, expected):
    assert parse_memory_budget(text) == expected


def _refused(**overrides):
    arguments = dict(build=build_accumulating, x=X, y=Y, batch_size=8, memory_budget="1 GiB")
    arguments.update(overrides)
    return arguments


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 0}, r"`batch_size` must be an integer >= 1. Received: batch_size=0"),
        ({"batch_size": 8.0}, r"`batch_size` must be an integer >= 1. Received: batch_size=8.0"),
        ({"memory_budget": "lots"}, r"`memory_budget` must be .* Received: memory_budget='lots'"),
        ({"memory_budget": -1}, r"`memory_budget` must be .* Received: memory_budget=-1"),
        ({"memory_budget": "2 XB"}, r"`memory_budget` must be .* Received: memory_budget='2 XB'"),
        ({"verbose": 2}, r"`verbose` must be 0 or 1. Received: verbose=2"),
        ({"build": "model"}, r"`build` must be a callable .* Received: build of type str"),
        (
            {"build": lambda k: build_wide_conv()},
            r"`build` must return a GradientAccumulateModel .* Received: an object of type "
            r"Functional from build\(1\)",
        ),
        (
            {"build": lambda k: build_accumulating(2)},
            r"must return a model with that `accum_steps`. Received: accum_steps=2 from build\(1\)",
        ),
        (
            {"build": lambda k: build_wide_conv(GradientAccumulateModel, accum_steps=k)},
            r"`build` must return a compiled model .* "
            r"Received: an uncompiled model from build\(1\)",
        ),
        (
            {"x": tf.data.Dataset.from_tensor_slices(X)},
            r"`x` must be a NumPy array or tensor .* Received: x of type \w*Dataset",
        ),
        (
            {"y": Y[:5]},
            r"must have the same number of rows, at least one. Received: row counts \[5, 32\]",
        ),
    ],
)
def test_arguments_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        choose_micro_batch(**_refused(**overrides))


def test_a_peak_the_cpu_allocator_did_not_count_is_refused(monkeypatch):
    """On a CPU TensorFlow's allocator counts tensors of 256 KiB and more: a
    try whose tensors are all smaller reads 0 bytes, which would "fit" any
    budget (here 1 byte) and is refused instead."""
    if DEVICES != ["/device:CPU:0"]:
        pytest.skip("a GPU's allocator counts every tensor")
    import gradient_accumulator.micro_batch as micro_batch

    monkeypatch.setattr(micro_batch, "_try", lambda *args: (0, 1))
    with pytest.raises(ValueError, match="counted no tensor while training micro-batch 8"):
        choose_micro_batch(build_accumulating, X, Y, batch_size=8, memory_budget=1, verbose=0)


def test_a_budget_is_required_without_a_gpu():
    assert DEVICES == ["/device:CPU:0"]
    message = "`memory_budget` is required without a GPU.*memory_budget=None"
    with pytest.raises(ValueError, match=message):
        choose_micro_batch(build_accumulating, X, Y, batch_size=8)


@pytest.mark.slow
def test_without_allocator_statistics_the_search_refuses_with_the_fix():
    """oneDNN off: TensorFlow keeps no CPU statistics; the error says so before any try."""
    code = (
        "from gradient_accumulator import choose_micro_batch\n"
        "from tests.test_micro_batch import X, Y, build_accumulating\n"
        "try:\n"
        "    choose_micro_batch(build_accumulating, X, Y, batch_size=8, memory_budget='1 GiB')\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    printed = run_python(["-c", code], env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert "keeps no memory statistics for /device:CPU:0" in printed, printed
    assert "set TF_ENABLE_ONEDNN_OPTS=1" in printed
    assert "Received: TF_ENABLE_ONEDNN_OPTS=0" in printed


def test_the_tries_leave_no_model_in_memory():
    """TensorFlow keeps a trained model's variables for good unless its custom gradients go."""
    x = np.ones((8, 512), "float32")
    y = np.ones((8, 10), "float32")

    def build(accum_steps):
        # A 2 MiB kernel: counted by the allocator (tensors >= 256 KiB).
        inputs = keras.Input((512,))
        outputs = keras.layers.Dense(10)(keras.layers.Dense(1024)(inputs))
        model = GradientAccumulateModel(accum_steps=accum_steps, inputs=inputs, outputs=outputs)
        model.compile(optimizer="adam", loss="mse")
        return model

    before = tf.config.experimental.get_memory_info(DEVICES[0])["current"]
    with pytest.raises(ValueError, match="Even micro-batch 1"):
        choose_micro_batch(build, x, y, batch_size=4, memory_budget=1, verbose=0)
    # Three models tried (4, 2, 1), each with 2 MiB of kernel, 4 of Adam's
    # moments and 2 of sums (above 1): none is left (within 1 MiB: tensors of
    # earlier tests may be freed meanwhile).
    assert tf.config.experimental.get_memory_info(DEVICES[0])["current"] < before + 2**20


def test_multi_worker_training_is_refused(monkeypatch):
    """Every worker would try on its own and could choose differently: refused, with the way."""
    monkeypatch.setattr("gradient_accumulator.micro_batch.in_multi_worker_mode", lambda s: True)
    with pytest.raises(ValueError, match="does not run under MultiWorkerMirroredStrategy"):
        choose_micro_batch(build_accumulating, X, Y, batch_size=8, memory_budget="1 GiB")


@pytest.mark.slow
def test_under_mirrored_strategy_the_batch_is_global():
    result = script_results(run_script_module("mirrored_micro_batch"))
    peaks = {int(m): peak for m, peak in result["peaks"].items()}
    assert peaks[8] > peaks[4]
    # The budget lies between the global micro-batches 4 and 8; odd sizes are never tried.
    assert result["choice"] == [4, 4, [16, 8, 2, 4]]
    assert_diff_below(result["diff"], FLOAT32_ATOL, result)
    assert result["moved"] > 1e-3
    assert result["too_small"].startswith("Even micro-batch 2 does not fit in memory_budget=1 ")
    assert "(tried 4: " in result["too_small"] and ", 2: " in result["too_small"]
    assert result["odd_batch"] == (
        "`batch_size` must be a multiple of the replicas (2): every micro-batch is split "
        "evenly over them. Received: batch_size=9"
    )


@pytest.mark.heavy
def test_mixed_float16_tries_under_the_policy(mixed_float16):
    """The tries build and train their models under the dtype policy set before them.

    Not a lower peak: on this CPU float16 convolutions fall back to Eigen
    kernels with temporaries of their own, and a weight-bound model adds the
    float16 copies of its weights (a try of the test's network measured
    51.4 MiB above the process's start under mixed_float16, 8.9 in float32).
    """
    built = []

    def build(accum_steps):
        built.append(build_accumulating(accum_steps))
        return built[-1]

    choice = choose_micro_batch(build, X, Y, batch_size=BATCH, memory_budget="1 GiB", verbose=0)
    assert (choice.accum_steps, choice.micro_batch) == (1, BATCH)
    [model] = built
    assert model.compute_dtype == "float16"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert choice.tries[0].peak_bytes == choice.peak_bytes > 0


def test_the_tries_stream_the_first_rows_of_every_input_repeated():
    from gradient_accumulator.micro_batch import _stream

    x = {"image": X[:6], "extra": np.arange(6.0)}
    batches = list(_stream((x, Y[:6], None), micro_batch=4, batches=2))
    inputs = [b[0] for b in batches]
    assert [list(b["extra"].numpy()) for b in inputs] == [[0, 1, 2, 3], [4, 5, 0, 1]]
    assert np.array_equal(inputs[1]["image"].numpy(), X[[4, 5, 0, 1]])
    assert np.array_equal(batches[0][1].numpy(), Y[:4])
