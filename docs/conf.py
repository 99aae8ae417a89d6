"""
Sphinx configuration of the salt-multimaster documentation (``make docs``).

No extension that needs the network: the docs build offline, with ``-W``
(every warning, a broken reference included, fails the build).
"""

import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent

project = "salt-multimaster"
author = "salt-multimaster contributors"
copyright = "salt-multimaster contributors"  # pylint: disable=redefined-builtin

# The package's version, read from its source (no import: building the docs
# needs no Salt).
_init = (HERE.parent / "_utils" / "salt_multimaster" / "__init__.py").read_text(encoding="utf-8")
release = re.search(r'^__version__ = "([^"]+)"', _init, re.M).group(1)
version = release

extensions = []
root_doc = "index"
exclude_patterns = ["_build"]
highlight_language = "none"
pygments_style = "sphinx"

html_theme = "alabaster"
html_theme_options = {
    "description": "Safe and boring Salt multi-master high availability",
    "fixed_sidebar": True,
}
html_static_path = []
