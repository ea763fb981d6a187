"""Refuses to import under anything but supported TensorFlow and Keras 3 on its backend."""

import os
import re

# The oldest releases CI tests (`.ci/run`'s floor job); docs/installation.rst
# lists the combinations. TensorFlow is not a dependency of the package (it
# comes in several distributions), so its version is checked here.
MIN_TENSORFLOW = (2, 16, 0)
MIN_KERAS = (3, 3, 3)

_SUPPORTED = (
    "gradient_accumulator supports TensorFlow >= {tf} with Keras >= {keras} on the "
    "TensorFlow backend.".format(
        tf=".".join(map(str, MIN_TENSORFLOW[:2])), keras=".".join(map(str, MIN_KERAS))
    )
)
_INSTALL_TENSORFLOW = (
    'pip install "gradient-accumulator[tensorflow]" (or [tensorflow-cpu], [and-cuda]), '
    'or install your TensorFlow distribution, e.g. pip install "tensorflow>=2.16"'
)


def _release(version):
    """The leading integers of a version string: ``"2.17.0rc1"`` -> ``(2, 17, 0)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check_backend():
    """Raises ImportError unless supported TensorFlow and Keras 3 versions are in use.

    Checked before Keras is imported where possible, so that the message names
    the version found, the versions supported and the command that fixes it,
    rather than a failure deep inside Keras.
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
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(
            f"{_SUPPORTED} No TensorFlow was found ({error}). Install it: {_INSTALL_TENSORFLOW}."
        ) from error
    if _release(tf.__version__) < MIN_TENSORFLOW:
        raise ImportError(
            f"{_SUPPORTED} Found tensorflow=={tf.__version__}. Upgrade it: "
            'pip install -U "tensorflow>=2.16" (or your distribution of it, e.g. '
            "tensorflow-cpu); for TensorFlow <= 2.15 (Keras 2), use gradient_accumulator 0.5."
        )
    import keras

    if _release(keras.__version__) < MIN_KERAS:
        minimum = ".".join(map(str, MIN_KERAS))
        raise ImportError(
            f"{_SUPPORTED} Found keras=={keras.__version__}. Upgrade it: "
            f'pip install -U "keras>={minimum}".'
        )
    if keras.backend.backend() != "tensorflow":
        raise ImportError(
            f"{_SUPPORTED} Keras is configured for the "
            f"{keras.backend.backend()!r} backend (see ~/.keras/keras.json); "
            "set KERAS_BACKEND=tensorflow."
        )
