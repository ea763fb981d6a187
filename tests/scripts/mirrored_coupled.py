"""``coupled_loss`` under two replicas against one device.

Run: ``python -m tests.scripts.mirrored_coupled`` (MirroredStrategy over 2
logical CPUs), or ``python -m tests.scripts.mirrored_coupled multi_worker`` on
each worker of a two-worker cluster described by ``TF_CONFIG``
(``tests.helpers.run_workers``; MultiWorkerMirroredStrategy, one CPU replica
each).

The dual encoder and InfoNCE loss of ``tests/test_coupled.py``, at the global
micro-batch 8 (4 per replica), accum_steps 4: a global big batch of 32,
three groups and a shorter one of two micro-batches. Cases:

- ``global``: the negatives are the global batch's; the reference is plain
  Keras on one device at batch 32.
- ``replica``: each replica's negatives are its own rows of the group (rows
  ``8j .. 8j+3`` of each global micro-batch ``j`` for the first, ``8j+4 ..
  8j+7`` for the second); the reference is plain Keras on one device at batch
  32 whose loss is each replica's InfoNCE on its rows, averaged
  (:func:`per_replica_info_nce`).

The same two cases (``retrieval_<case>_global``, ``retrieval_<case>_replica``)
for the KerasRS-style retrieval model of ``tests/test_coupled.py``, whose
candidate tower runs in ``compute_loss``, for each of its loss-side cases (the
reference of ``replica`` scores each query against its own replica's rows
only).

Prints one results line: per case ``diff`` (max |weight difference|),
``moved`` (the reference's distance from the initial weights), ``updates``,
``loss`` and ``reference_loss`` (the logged epoch loss), and ``other``: the
distance to the other case's reference (the two objectives differ).
"""

import contextlib
import sys

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import max_abs_diff
from tests.scripts import print_results, split_cpu, updates
from tests.test_coupled import (
    LOSS_SIDE_CASES,
    dual_encoder,
    info_nce,
    pairs,
    ratings,
    retrieval,
)

REPLICAS = 2
GLOBAL_MICRO_BATCH = 8
ACCUM_STEPS = 4
SAMPLES = 3 * 32 + 16


def per_replica_info_nce(y_true, y_pred):
    """InfoNCE within each replica's rows of a group's batch (in data order), per sample."""
    rows = ops.shape(y_pred)[0]
    index = ops.arange(rows)
    replica = (index % GLOBAL_MICRO_BATCH) // (GLOBAL_MICRO_BATCH // REPLICAS)
    losses = ops.zeros((rows,), "float32")
    for r in range(REPLICAS):
        mine = ops.nonzero(ops.equal(replica, r))[0]
        own = info_nce(None, ops.take(y_pred, mine, axis=0))
        losses = losses + ops.scatter(ops.expand_dims(mine, 1), own, (rows,))
    return losses


def train(model, x, y, batch_size, loss=None, strategy=None):
    """Trains one epoch; ``loss=None``: the model's own ``compute_loss`` (retrieval)."""
    learning_rate = 0.1 if loss is not None else 2.0
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.5), loss=loss)
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return history.history["loss"][-1]


def figures(model, loss, references, case, initial):
    """A case's results line entry: ``references`` maps each case to ``(model, loss)``."""
    reference, reference_loss = references[case]
    other = references["replica" if case == "global" else "global"][0]
    return {
        "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
        "other": max_abs_diff(other.get_weights(), model.get_weights()),
        "moved": max_abs_diff(reference.get_weights(), initial),
        "updates": updates(model.optimizer),
        "loss": loss,
        "reference_loss": reference_loss,
    }


def main(kind="mirrored"):
    if kind == "multi_worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.MirroredStrategy(split_cpu(REPLICAS))
    x, y = pairs(SAMPLES)
    y = np.zeros((SAMPLES, 1), "float32")
    initial = dual_encoder().get_weights()
    references = {}
    for case, loss in (("global", info_nce), ("replica", per_replica_info_nce)):
        reference = dual_encoder()
        reference_loss = train(reference, x, y, GLOBAL_MICRO_BATCH * ACCUM_STEPS, loss)
        references[case] = (reference, reference_loss)
    results = {}
    for case in ("global", "replica"):
        with strategy.scope():
            model = dual_encoder(
                GradientAccumulateModel, accum_steps=ACCUM_STEPS, coupled_loss=case
            )
        loss = train(model, x, y, GLOBAL_MICRO_BATCH, info_nce, strategy)
        results[case] = figures(model, loss, references, case, initial)
    # accum_steps=1: a group is one micro-batch per replica, its loss still the
    # global batch's (each replica's share alone was trained, silently).
    with strategy.scope():
        model = dual_encoder(GradientAccumulateModel, accum_steps=1, coupled_loss="global")
    loss = train(model, x, y, GLOBAL_MICRO_BATCH * ACCUM_STEPS, info_nce, strategy)
    results["accum_steps_1_global"] = figures(model, loss, references, "global", initial)
    # The KerasRS-style retrieval model: what its `compute_loss` reads besides
    # the outputs (tests/test_coupled.py's cases but the metric's, which trains
    # nothing; a loss-side BatchNormalization under 'global' only, where each
    # replica normalises the global batch as the reference does).
    movies_x, movies_y = ratings(SAMPLES)
    for loss_side in (*LOSS_SIDE_CASES[:-1], "reduce_every_micro_step"):
        scopes = ("global", "replica")
        if loss_side in ("loss_layer_with_state", "reduce_every_micro_step"):
            scopes = ("global",)
        options = {}
        if loss_side == "reduce_every_micro_step":
            # The candidate tower, its sums all-reduced at every micro-step.
            loss_side, options = "candidate_tower", {"reduce_every_micro_step": True}
        initial = retrieval(case=loss_side).get_weights()
        references = {}
        for case, blocks in (("global", None), ("replica", (GLOBAL_MICRO_BATCH, REPLICAS))):
            reference = retrieval(case=loss_side, blocks=blocks)
            big = GLOBAL_MICRO_BATCH * ACCUM_STEPS
            references[case] = (reference, train(reference, movies_x, movies_y, big))
        for case in scopes:
            with strategy.scope():
                model = retrieval(ACCUM_STEPS, case=loss_side, coupled_loss=case, **options)
            loss = train(model, movies_x, movies_y, GLOBAL_MICRO_BATCH, None, strategy)
            name = "reduce_every_micro_step" if options else loss_side
            results[f"retrieval_{name}_{case}"] = figures(model, loss, references, case, initial)
    print_results({"replicas": strategy.num_replicas_in_sync, "results": results})


if __name__ == "__main__":
    main(*sys.argv[1:])
