"""The engine's Python files, found without importing anything of it."""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Mapping


def python_files(root) -> Mapping[str, str]:
    """Module name -> path of every regular .py file under `root`/sglang, in module order
    (cached per root, read-only: every check of a decision reads it)."""
    return _python_files(str(root))


@functools.lru_cache(maxsize=8)
def _python_files(root: str) -> Mapping[str, str]:
    found = []
    folders = [(os.path.join(root, "sglang"), "sglang")]
    while folders:
        folder, package = folders.pop()
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, f"{package}.{entry.name}"))
                elif entry.name.endswith(".py") and entry.is_file():  # regular files only (no FIFO)
                    found.append((package if entry.name == "__init__.py" else f"{package}.{entry.name[:-3]}", entry.path))
    return types.MappingProxyType(dict(sorted(found)))
