"""Sphinx configuration of the acp_jax documentation.

Sphinx with MyST markdown and autodoc/autosummary, the tool that JAX, optax
and Flax build their documentation with: the API pages are generated from
the docstrings, and the guides are markdown pages whose ```python blocks
``tests/test_docs.py`` runs. Build with
``sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "acp_jax"
author = "acp_jax authors"
copyright = "acp_jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' Args and Returns (Google style)
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

autosummary_generate = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "acp_jax"
html_static_path = ["_static"]
