"""Two-tower retrieval written the KerasRS way: in-batch negatives of the big batch.

A retrieval model as KerasRS's tutorial writes it: a subclassed model whose
``call`` is the query (user) tower and whose ``compute_loss`` runs the
candidate (movie) tower on the targets and scores every user of the batch
against every movie of the batch (in-batch softmax: each user's own movie is
the positive, the batch's other movies are its negatives). More negatives
train a better retriever, so the batch is what one wants large.

Trained from the same initial weights, on synthetic users whose tastes fall
in clusters of movies:

1. plain Keras at batch 64 (the reference),
2. the same class on ``GradientAccumulateModel(accum_steps=8,
   coupled_loss="replica")`` at micro-batch 8: the loss of each group of 64
   on its whole batch (63 negatives per user), the candidate tower trained
   through ``compute_loss`` as in plain Keras,
3. ``coupled_loss=None`` at micro-batch 8: each micro-batch's loss on its own
   (7 negatives per user), another objective.

Each is then evaluated with KerasRS's ``BruteForceRetrieval`` layer: the
top-10 movies of every user among all movies, and the share of held-out
watches found in them (recall@10).

Run: ``python examples/retrieval.py`` (``--quick`` for a short run; needs
``pip install -e ".[kerasrs]"``, Python >= 3.11). Prints each run's max
|weight difference| from the reference and its recall@10, then a verdict line
(``FAIL`` and exit status 1 if the accumulating model is not within float32
rounding of the reference).
"""

import argparse
import sys
import warnings

import _quiet_tensorflow  # noqa: F401  (before TensorFlow: hides its start-up log)
import keras
import keras_rs
import numpy as np
from keras import ops

from gradient_accumulator import GradientAccumulateModel

USERS = 300
MOVIES = 200
CLUSTERS = 10
EMBEDDING = 16
MICRO_BATCH = 8
ACCUM_STEPS = 8
LEARNING_RATE = 0.5
TOLERANCE = 1e-6  # float32, as in the tests (FLOAT32_ATOL)


def make_data(num_samples, seed=0):
    """``({"user": ids}, movie ids)``: each user watches movies of its taste cluster."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, USERS, size=num_samples)
    cluster_size = MOVIES // CLUSTERS
    movies = (users % CLUSTERS) * cluster_size + rng.integers(0, cluster_size, size=num_samples)
    return {"user": users.astype("int32")}, movies.astype("int32")


# --- model
class RetrievalTowers:
    """The two towers and the in-batch softmax loss (mixed into a model class)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.user_tower = keras.Sequential(
            [keras.layers.Embedding(USERS, EMBEDDING), keras.layers.Dense(EMBEDDING)],
            name="user_tower",
        )
        self.movie_tower = keras.Sequential(
            [keras.layers.Embedding(MOVIES, EMBEDDING), keras.layers.Dense(EMBEDDING)],
            name="movie_tower",
        )
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(self, input_shape=None):
        self.user_tower.build((None,))
        self.movie_tower.build((None,))

    def call(self, inputs):
        return self.user_tower(inputs["user"])

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        candidates = self.movie_tower(y)  # the candidate tower runs in the loss
        scores = ops.matmul(y_pred, ops.transpose(candidates))
        labels = ops.arange(ops.shape(scores)[0])  # each user's own movie: the diagonal
        return self.loss_fn(labels, scores, sample_weight)


class Retrieval(RetrievalTowers, keras.Model):
    pass


class AccumulatingRetrieval(RetrievalTowers, GradientAccumulateModel):
    pass


# --- train
class FirstEpochWeights(keras.callbacks.Callback):
    """Keeps the weights after the first epoch, where the runs are compared."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.first_epoch_weights = self.model.get_weights()


def build(cls, **kwargs):
    keras.utils.set_random_seed(0)  # the same initial weights for every run
    model = cls(**kwargs)
    model.build()
    return model


def train(model, x, y, batch_size, epochs):
    model.compile(optimizer=keras.optimizers.Adagrad(LEARNING_RATE))
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[FirstEpochWeights()],
    )
    return model


# --- evaluate
def recall_at_10(model, x, y):
    """The share of ``(user, movie)`` pairs whose movie is among the user's top 10."""
    retrieval = keras_rs.layers.BruteForceRetrieval(k=10, return_scores=False)
    retrieval.update_candidates(model.movie_tower(np.arange(MOVIES)))
    top = ops.convert_to_numpy(retrieval(model.predict(x, verbose=0)))
    return float(np.mean([movie in row for movie, row in zip(y, top)]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args(argv)
    samples, epochs = (64 * 20, 2) if args.quick else (64 * 60, 5)
    x, y = make_data(samples)
    test_x, test_y = make_data(1000, seed=1)
    big = MICRO_BATCH * ACCUM_STEPS

    reference = train(build(Retrieval), x, y, big, epochs)
    runs = {
        f"plain Keras, batch {big}": reference,
        f"coupled_loss='replica', accum_steps={ACCUM_STEPS}, batch {MICRO_BATCH}": train(
            build(AccumulatingRetrieval, accum_steps=ACCUM_STEPS, coupled_loss="replica"),
            x,
            y,
            MICRO_BATCH,
            epochs,
        ),
    }
    # Each micro-batch's loss on its own: the library warns that this loss
    # compares the samples of a batch (the warning is shown once, below).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        naive = train(
            build(AccumulatingRetrieval, accum_steps=ACCUM_STEPS), x, y, MICRO_BATCH, epochs
        )
    runs[f"coupled_loss=None, accum_steps={ACCUM_STEPS}, batch {MICRO_BATCH}"] = naive

    def diff(model):
        # After the first epoch: further on, as the softmax sharpens, training
        # amplifies float32 rounding (1e-6 at the first epoch's end, 0.15
        # after five; at learning rate 0.1, 1e-6 after five).
        pairs = zip(model.first_epoch_weights, reference.first_epoch_weights)
        return max(float(np.max(np.abs(a - b))) for a, b in pairs)

    initial = build(Retrieval)
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(reference.first_epoch_weights, initial.get_weights())
    )
    print(
        f"{len(y)} watches, {epochs} epochs; max |diff| after the first epoch, in which "
        f"the reference's weights moved by {moved:.3g}; recall@10 at the end:"
    )
    for name, model in runs.items():
        recall = recall_at_10(model, test_x, test_y)
        print(f"{name:48s} max |diff| {diff(model):.3g}, recall@10 {recall:.3f}")
    warned = [str(w.message) for w in caught if "compares the samples" in str(w.message)]
    if warned:
        print(f"coupled_loss=None warned: {warned[0][:150]}...")
    accumulated = diff(list(runs.values())[1])
    if accumulated < TOLERANCE:
        print(f"coupled_loss='replica': equal to plain batch {big} within float32 rounding")
        return 0
    print(f"FAIL: coupled_loss='replica' is {accumulated:.3g} from plain batch {big}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
