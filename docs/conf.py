"""Sphinx configuration for the gradient_accumulator documentation.

Build (warnings are errors) and run every doctest::

    sphinx-build -W -q -b html docs docs/_build/html
    sphinx-build -W -q -b doctest docs docs/_build/doctest
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# choose_micro_batch's examples read the CPU allocator's statistics, which
# TensorFlow keeps only with oneDNN on (on by default only on some CPUs): set
# before anything imports TensorFlow, as the micro-batch guide tells users to.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_ext"))

import gradient_accumulator  # noqa: E402

project = "gradient_accumulator"
author = "gradient_accumulator developers"
copyright = "gradient_accumulator developers"
release = gradient_accumulator.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    # MathJax served from the built site's _static/mathjax (the package
    # bundles MathJax 3 and sets mathjax_path), not from a CDN: the pages
    # render their formulas offline too. tests/test_docs.py checks it.
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",
    # Local (docs/_ext): fails the build if a public name has no API entry;
    # shows Keras subclasses with their constructor's signature.
    "api_coverage",
    "keras_signatures",
]

# -- API reference -----------------------------------------------------------
# Every name in these modules' __all__ (but __version__), and every extra
# name, must be documented on the API page; see docs/_ext/api_coverage.py.
api_coverage_modules = ["gradient_accumulator"]
api_coverage_extra_names = [
    "gradient_accumulator.utils.replace_batchnorm_layers",
    # The methods a user calls, beyond Keras's own.
    "gradient_accumulator.GradientAccumulateModel.apply_accumulated_gradients",
    "gradient_accumulator.GradientAccumulateModel.wrapper_config",
    "gradient_accumulator.GradientAccumulateOptimizer.apply_gradients",
    "gradient_accumulator.GradientAccumulateOptimizer.apply",
    "gradient_accumulator.GradientAccumulateOptimizer.apply_accumulated_gradients",
    "gradient_accumulator.GradientAccumulateOptimizer.accumulation_variables",
    "gradient_accumulator.AccumBatchNormalization.apply_pending_statistics",
    "gradient_accumulator.AccumBatchNormalization.accumulation_variables",
]

# Keras's own docstrings are not written for this site; show ours only.
autodoc_inherit_docstrings = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Keras's section for the arguments of a layer's `call`.
napoleon_custom_sections = [("Call arguments", "params_style")]

# -- HTML --------------------------------------------------------------------
html_theme = "furo"
html_title = "gradient_accumulator"
exclude_patterns = ["_build", "_ext"]

# -- Doctests (sphinx-build -b doctest) ------------------------------------
# Every group of every page starts from float32, a fresh Keras session and
# the same seed, and leaves the global Keras state as it found it.
# The pages' own examples are `.. doctest::` blocks. Docstring examples pulled
# in by autodoc are bare `>>>` blocks: pytest runs them already
# (`--doctest-modules`), and one of them trains MobileNetV2, so they are not
# run a second time here.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
keras.mixed_precision.set_global_policy("float32")
keras.backend.clear_session()
keras.utils.set_random_seed(0)
"""
doctest_global_cleanup = """
keras.mixed_precision.set_global_policy("float32")
keras.backend.clear_session()
"""
