"""Loads a plain Keras model's ``.keras`` file and its ``model.export()`` where
``gradient_accumulator`` cannot be imported, and computes their outputs.

``python -m tests.scripts.without_library KERAS_FILE EXPORT_DIR INPUTS_NPY``:
prints whether importing the package failed, the layer classes of the loaded
model, and the largest difference of each of its two outputs (the loaded
model's ``predict`` and the export's ``serve``) from ``INPUTS_NPY``'s
neighbour ``expected.npy`` (the outputs computed in the test's process).
"""

import sys
from pathlib import Path

from tests.scripts import print_results


def main():
    # Blocked before anything imports it (here, not at import: pytest imports
    # this module to collect doctests): `import gradient_accumulator` raises
    # ImportError in this process, as where the package is not installed.
    sys.modules["gradient_accumulator"] = None
    keras_file, export_dir, inputs = sys.argv[1:4]
    import keras
    import numpy as np
    import tensorflow as tf

    try:
        import gradient_accumulator  # noqa: F401

        blocked = False
    except ImportError:
        blocked = True
    x = np.load(inputs)
    expected = np.load(Path(inputs).with_name("expected.npy"))
    model = keras.saving.load_model(keras_file)
    loaded = np.asarray(model.predict(x, verbose=0))
    exported = tf.saved_model.load(export_dir)  # kept: its functions use its variables
    served = np.asarray(exported.serve(tf.constant(x)))
    print_results(
        {
            "blocked": blocked,
            "modules": sorted(
                {type(layer).__module__.split(".")[0] for layer in model._flatten_layers()}
            ),
            "batchnorm_classes": sorted(
                {
                    type(layer).__name__
                    for layer in model._flatten_layers()
                    if isinstance(layer, keras.layers.BatchNormalization)
                }
            ),
            "loaded_max_abs_diff": float(np.max(np.abs(loaded - expected))),
            "served_max_abs_diff": float(np.max(np.abs(served - expected))),
            "imported": sorted(
                name
                for name, module in sys.modules.items()
                if name.startswith("gradient_accumulator") and module is not None
            ),
        }
    )


if __name__ == "__main__":
    main()
