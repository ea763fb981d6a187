"""Fault tolerance under MultiWorkerMirroredStrategy: BackupAndRestore resumes a group.

Run on every worker: ``python -m tests.scripts.multi_worker_resume MODE BACKUP``.
``MODE=interrupt``: both workers stop (exit code 3) in the middle of epoch 2,
after its first group (``fit`` calls the batch callbacks once per update),
each once both have finished that group.
``MODE=resume``: restarted with the same
``keras.callbacks.BackupAndRestore`` directory (``BACKUP/worker<i>``), they
re-run the interrupted epoch from the backup taken at the end of epoch 1 and
train to the end. Prints one results line (see ``tests/scripts/__init__.py``):
``diff`` (max |weight difference| from plain Keras on one device at the global
batch 32, uninterrupted) and ``updates``.
"""

import os
import sys
import time

import keras
import tensorflow as tf

from gradient_accumulator import GradientAccumulateModel
from tests.helpers import build_dense, make_regression_data, max_abs_diff
from tests.scripts import print_results

INTERRUPTED = 3  # the exit code of an interrupted worker


class Interrupt(keras.callbacks.Callback):
    """Exits the process after the first update of epoch 2, once every worker is there.

    A worker that exits as soon as its own group returns can close its socket
    while another still pulls the group's last collective's buffer from it
    (``UnavailableError: Socket closed`` there, exit code 1): each worker
    first writes a file in ``folder`` and waits for the others' files, which
    they write only once their collectives have returned.
    """

    def __init__(self, folder, index, workers):
        super().__init__()
        self.folder, self.index, self.workers = folder, index, workers

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1:
            open(f"{self.folder}/interrupted{self.index}", "w").close()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not all(
                os.path.exists(f"{self.folder}/interrupted{i}") for i in range(self.workers)
            ):
                time.sleep(0.05)
            raise SystemExit(INTERRUPTED)


def main(mode, backup):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = strategy.cluster_resolver.task_id
    x, y = make_regression_data(num_samples=64)
    callbacks = [keras.callbacks.BackupAndRestore(f"{backup}/worker{index}")]
    if mode == "interrupt":
        callbacks.append(
            Interrupt(backup, index, strategy.cluster_resolver.cluster_spec().num_tasks("worker"))
        )
    with strategy.scope():
        model = build_dense(GradientAccumulateModel, accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    reference = build_dense()
    reference.compile(keras.optimizers.Adam(0.01), "mse")
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    print_results(
        {
            "diff": max_abs_diff(reference.get_weights(), model.get_weights()),
            "updates": int(model.optimizer.iterations.numpy()),
        }
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
