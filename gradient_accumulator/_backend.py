"""Refuses to import under anything but Keras 3 on the TensorFlow backend."""

import os

_SUPPORTED = "gradient_accumulator supports Keras 3 with the TensorFlow backend (tensorflow>=2.16)."


def check_backend():
    """Raises ImportError unless Keras 3 runs on the TensorFlow backend.

    Checked before Keras is imported where possible, so that the message names
    the environment variable to change rather than a failure deep inside Keras.
    """
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower()
    if legacy in ("1", "true", "yes"):
        raise ImportError(
            f"{_SUPPORTED} Keras 2 was requested with "
            f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']!r}; "
            "unset it (or set TF_USE_LEGACY_KERAS=0) to use Keras 3."
        )
    requested = os.environ.get("KERAS_BACKEND")
    if requested is not None and requested != "tensorflow":
        raise ImportError(
            f"{_SUPPORTED} Received: KERAS_BACKEND={requested!r}; "
            "set KERAS_BACKEND=tensorflow or unset it."
        )
    import keras

    major = int(keras.__version__.split(".")[0])
    if major < 3:
        raise ImportError(f"{_SUPPORTED} Received: keras=={keras.__version__}.")
    if keras.backend.backend() != "tensorflow":
        raise ImportError(
            f"{_SUPPORTED} Keras is configured for the "
            f"{keras.backend.backend()!r} backend (see ~/.keras/keras.json); "
            "set KERAS_BACKEND=tensorflow."
        )
