"""The import path of ``replace_batchnorm_layers`` since gradient_accumulator 0.5, kept.

The conversion lives in :mod:`gradient_accumulator.conversion`.
"""

from gradient_accumulator.conversion import replace_batchnorm_layers, restore_batchnorm_layers

__all__ = ["replace_batchnorm_layers", "restore_batchnorm_layers"]
