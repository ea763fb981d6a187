"""What differs between the Keras 3 versions this library supports."""

import inspect

import keras
import tensorflow as tf


def batchnorm_takes(argument):
    """Whether the installed ``keras.layers.BatchNormalization`` takes ``argument``.

    ``renorm``, ``renorm_clipping`` and ``renorm_momentum`` arrived in Keras 3.14.
    """
    return argument in inspect.signature(keras.layers.BatchNormalization.__init__).parameters


def compute_training_loss(model, x, y, y_pred, sample_weight):
    """``model.compute_loss(...)`` in training mode, divided by the replicas in sync.

    Keras 3.4 added ``compute_loss``'s ``training`` argument; it is passed
    only where ``compute_loss`` (Keras's or an override) takes it, as Keras's
    own train step does. Keras 3.8 made the loss the replica's share of the
    global loss (divided by the replicas in sync, whose gradients are
    summed); before, it is the replica's own mean, divided here.
    """
    kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = True
    loss = model.compute_loss(**kwargs)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if keras_version() < (3, 8) and replicas > 1:
        loss = loss / replicas
    return loss


def keras_version():
    """The installed Keras version as ``(major, minor)``."""
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)
