"""The import path of gradient_accumulator 0.5's wrappers, kept: both are re-exported."""

from gradient_accumulator.model import GradientAccumulateModel
from gradient_accumulator.optimizer import GradientAccumulateOptimizer

__all__ = ["GradientAccumulateModel", "GradientAccumulateOptimizer"]
