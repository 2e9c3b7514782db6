"""Sphinx configuration of the django-dbqueue documentation.

Build it with ``scripts/check_docs`` (warnings are errors) or
``sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The checkout's package, not an installed copy, so the reference matches the code next to it.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))
os.environ["DJANGO_SETTINGS_MODULE"] = "docs_settings"
django.setup()

import django_dbqueue  # noqa: E402

project = "django-dbqueue"
author = "django-dbqueue developers"
copyright = "django-dbqueue developers"
release = django_dbqueue.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "dbqueue_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
# Pages are reached through the toctrees; a page left out of every toctree is a warning.

# Help texts say "--hard"; keep two hyphens, not an en dash.
smartquotes = False

myst_enable_extensions = ["colon_fence", "deflist"]
# "## Heading" makes a target "#heading" that Markdown links ([text](page.md#heading)) resolve.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
# Type hints name Django and typing classes that have no page here (no intersphinx: nothing is
# downloaded during the build), so they are rendered as text, not as unresolved references.
nitpicky = False

html_theme = "furo"
html_title = f"django-dbqueue {release}"
