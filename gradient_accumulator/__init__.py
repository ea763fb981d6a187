"""Gradient accumulation for Keras 3 that is exactly equivalent to big-batch training."""

from gradient_accumulator._backend import check_backend

check_backend()

from gradient_accumulator._version import __version__  # noqa: E402
from gradient_accumulator.model import GradientAccumulateModel  # noqa: E402

__all__ = ["GradientAccumulateModel", "__version__"]
