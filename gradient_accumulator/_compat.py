"""What differs between the Keras 3 versions this library supports."""

import inspect

import keras


def batchnorm_takes(argument):
    """Whether the installed ``keras.layers.BatchNormalization`` takes ``argument``.

    ``renorm``, ``renorm_clipping`` and ``renorm_momentum`` arrived in Keras 3.14.
    """
    return argument in inspect.signature(keras.layers.BatchNormalization.__init__).parameters

