"""Fine-tuning KerasHub tasks with accumulation: a CausalLM and a TextClassifier.

Builds two KerasHub tasks from small configurations with their tokenizers and
preprocessors (no download: a few words' vocabulary), a GPT-2 ``CausalLM`` and
a BERT ``TextClassifier``, and trains each with ``GradientAccumulateModel``
(``accum_steps=4`` at micro-batch 8) beside the task's own ``fit`` at the big
batch 32 on the same sentences, with AdamW and the usual weight-decay
exclusions (biases and LayerNormalization's ``gamma`` and ``beta``). The
causal LM's loss is per token, with the preprocessor's padding mask as sample
weights. Prints, per task, the largest weight difference from the big batch's
update (plain Keras at batch 32 with dense gradients: float32 rounding) and
from the task's own ``fit`` (which differs where a gradient is sparse: Keras's
Adam on an embedding's sparse gradient squares each occurrence of a token
before summing them, where the big batch's gradient sums them first), and
both runs' last loss; then the trained task generates (or predicts) as the
KerasHub task it is, is saved and loaded, and does the same again.

The wrapper shares the task's weights: it is built around the task, trained,
and the task itself is what you use, save and load afterwards. Dropout is 0
here so that the two runs can be compared number for number (with dropout,
the micro-batches draw other masks than the big batch, as two runs of the big
batch do).

Run: ``python examples/kerashub_finetune.py`` (``--quick`` for a short run).
Needs ``keras-hub`` (``pip install -e ".[kerashub]"``).
"""

import argparse
import tempfile
from pathlib import Path

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import keras_hub
import numpy as np
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel

MICRO_BATCH = 8
ACCUM_STEPS = 4
SEQUENCE_LENGTH = 12
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
# Both backbones' size; dropout 0 to compare number for number.
BACKBONE = {
    "num_layers": 2,
    "num_heads": 2,
    "hidden_dim": 32,
    "intermediate_dim": 64,
    "dropout": 0.0,
    "max_sequence_length": SEQUENCE_LENGTH,
}


def sentences(count, seed=0):
    """Sentences of 2 to 8 random words: their token counts differ."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, 9))) for _ in range(count)]


# --------------------------------------------------------------- the tasks --


def gpt2_tokenizer():
    """A byte-pair tokenizer whose merges spell out ``WORDS`` (with and without a space)."""
    merges = []
    for word in WORDS:
        for spelled in (word, "Ġ" + word):
            pieces = list(spelled)
            while len(pieces) > 1:
                merges.append(f"{pieces[0]} {pieces[1]}")
                pieces = [pieces[0] + pieces[1], *pieces[2:]]
    merges = list(dict.fromkeys(merges))
    vocabulary = {"<|endoftext|>": 0}
    for merge in merges:
        for piece in (*merge.split(" "), merge.replace(" ", "")):
            vocabulary.setdefault(piece, len(vocabulary))
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)


def causal_lm():
    keras.utils.set_random_seed(0)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=gpt2_tokenizer(), sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(), **BACKBONE
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def text_classifier():
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    )
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer=tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), **BACKBONE
    )
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0
    )


def adamw():
    """AdamW without weight decay on biases and LayerNormalization's scale and offset."""
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    return optimizer


# ------------------------------------------------------------ the training --


class DenseGradientsModel(keras.Model):
    """Plain Keras's train step with every gradient dense: the big batch's defined update."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        dense = [tf.convert_to_tensor(g) for g in gradients]
        self.optimizer.apply(dense, self.trainable_variables)
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(y)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


# --- wrap
def accumulating(task):
    """``GradientAccumulateModel`` around ``task``: same weights, ``fit`` accumulates."""
    return GradientAccumulateModel(
        accum_steps=ACCUM_STEPS, inputs=task.input, outputs=task(task.input)
    )


# --- end of wrap


def max_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


def fine_tune(build, compile_kwargs, texts, labels, epochs):
    """The task trained with accumulation, and at the big batch twice.

    Returns ``(task, differences, losses)``: the task trained by the wrapper;
    its largest weight difference from the big batch's defined update and
    from the task's own ``fit`` at the big batch; the last loss of the
    wrapper's ``fit`` and of the big batch's. The task's ``fit`` takes raw
    text (its preprocessor maps it); the others take what that preprocessor
    returns, ``(x, y, sample_weight)``.
    """
    raw = (texts,) if labels is None else (texts, labels)
    fit_kwargs = {"epochs": epochs, "shuffle": False, "verbose": 0}
    own = build()
    own.compile(optimizer=adamw(), **compile_kwargs)
    own.fit(*raw, batch_size=MICRO_BATCH * ACCUM_STEPS, **fit_kwargs)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(own.preprocessor(*raw))

    big_task = build()
    big = DenseGradientsModel(inputs=big_task.input, outputs=big_task(big_task.input))
    big.compile(optimizer=adamw(), **compile_kwargs)
    big_history = big.fit(
        x, y, sample_weight=sample_weight, batch_size=MICRO_BATCH * ACCUM_STEPS, **fit_kwargs
    )

    # --- train
    task = build()
    model = accumulating(task)
    model.compile(optimizer=adamw(), **compile_kwargs)
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=MICRO_BATCH, **fit_kwargs)
    # --- end of train
    weights = task.get_weights()
    differences = (
        max_difference(big_task.get_weights(), weights),
        max_difference(own.get_weights(), weights),
    )
    return task, differences, (history.history["loss"][-1], big_history.history["loss"][-1])


def report(name, differences, losses):
    print(
        f"{name}: max |weight difference| from the big batch's update {differences[0]:.1e}, "
        f"from the task's own fit {differences[1]:.1e}; loss {losses[0]:.6f} "
        f"(big batch {losses[1]:.6f})"
    )


def saved_and_loaded(task, folder):
    path = Path(folder) / f"{task.name}.keras"
    task.save(path)
    return keras.saving.load_model(path, compile=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sentences and epochs")
    args = parser.parse_args()
    epochs = 2 if args.quick else 10
    texts = sentences(64 if args.quick else 256)
    # The classifier's label: whether the sentence mentions the fox.
    labels = np.array(["fox" in text.split() for text in texts], "int32")
    print(
        f"accum_steps={ACCUM_STEPS} at micro-batch {MICRO_BATCH} against the task's own fit "
        f"at batch {MICRO_BATCH * ACCUM_STEPS}, {len(texts)} sentences, {epochs} epochs"
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tempfile.TemporaryDirectory() as folder:
        # CausalLM: the loss per token, the padding mask as sample weights.
        lm, differences, losses = fine_tune(
            causal_lm,
            {"loss": loss, "weighted_metrics": ["sparse_categorical_accuracy"]},
            texts,
            None,
            epochs,
        )
        report("CausalLM", differences, losses)
        prompt = ["the quick"]
        generated = lm.generate(prompt, max_length=SEQUENCE_LENGTH)
        loaded = saved_and_loaded(lm, folder)
        again = loaded.generate(prompt, max_length=SEQUENCE_LENGTH)
        same = again == generated
        print(f"generate({prompt[0]!r}): {generated[0]!r}; after save and load, the same: {same}")

        classifier, differences, losses = fine_tune(
            text_classifier, {"loss": loss, "metrics": ["accuracy"]}, texts, labels, epochs
        )
        report("TextClassifier", differences, losses)
        logits = classifier.predict(texts[:4], verbose=0)
        loaded = saved_and_loaded(classifier, folder)
        same = bool(np.allclose(loaded.predict(texts[:4], verbose=0), logits, atol=1e-6))
        predicted = np.argmax(logits, axis=-1).tolist()
        print(f"predict: {predicted}; after save and load, the same: {same}")


if __name__ == "__main__":
    main()
