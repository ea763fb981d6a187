"""Gradient accumulation for Keras 3 that is exactly equivalent to big-batch training."""

from gradient_accumulator._backend import check_backend

check_backend()

# adaptive_clip_grad, compute_norm, unitwise_norm: names that
# gradient_accumulator 0.5 exported here, kept importable; calling one raises
# with the way to do it now (see docs/migration.rst). Not in __all__.
from gradient_accumulator._v05 import (  # noqa: E402, F401
    adaptive_clip_grad,
    compute_norm,
    unitwise_norm,
)
from gradient_accumulator._version import __version__  # noqa: E402
from gradient_accumulator.agc import adaptive_clip_gradients  # noqa: E402
from gradient_accumulator.batchnorm_averaging import (  # noqa: E402
    AverageBatchNormStatistics,
    average_batchnorm_statistics,
)
from gradient_accumulator.conversion import (  # noqa: E402
    replace_batchnorm_layers,
    restore_batchnorm_layers,
)
from gradient_accumulator.layers import AccumBatchNormalization  # noqa: E402
from gradient_accumulator.micro_batch import (  # noqa: E402
    MicroBatchChoice,
    choose_micro_batch,
)
from gradient_accumulator.model import GradientAccumulateModel  # noqa: E402
from gradient_accumulator.optimizer import GradientAccumulateOptimizer  # noqa: E402
from gradient_accumulator.remat import install as _install_remat  # noqa: E402
from gradient_accumulator.remat import remat  # noqa: E402

__all__ = [
    "AccumBatchNormalization",
    "AverageBatchNormStatistics",
    "GradientAccumulateModel",
    "GradientAccumulateOptimizer",
    "MicroBatchChoice",
    "adaptive_clip_gradients",
    "average_batchnorm_statistics",
    "choose_micro_batch",
    "remat",
    "replace_batchnorm_layers",
    "restore_batchnorm_layers",
    "__version__",
]

# keras.RematScope and keras.remat work on TensorFlow, exactly (gradient_accumulator.remat).
_install_remat()
