"""Sphinx configuration for the gradient_accumulator documentation."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.abspath(".."))

import gradient_accumulator  # noqa: E402

project = "gradient_accumulator"
author = "gradient_accumulator developers"
release = gradient_accumulator.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]
# Keras's own docstrings are not written for this site; show ours only.
autodoc_inherit_docstrings = False
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "furo"
html_title = "gradient_accumulator"
exclude_patterns = ["_build"]
doctest_global_setup = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
"""
