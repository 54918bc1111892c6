"""The engine this interpreter imports, and the engine a module belongs to.

A module read from a source tree (engine.source_engine) carries its SourceEngine as
`__engine__`; the helpers here answer for that engine, else for the installed one.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Optional

from .files import python_files
from .source_engine import Label, read_label


def installed_package() -> Optional[pathlib.Path]:
    """The sglang/ folder this interpreter imports (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(spec.submodule_search_locations[0])


def installed_label():
    """The installed engine's version label, read from the tree that is imported (its own
    version file or the dist-info that lists its files), never from whichever installation
    importlib.metadata finds first; without importing sglang (its import has side effects)."""
    package = installed_package()
    return Label("not installed", None) if package is None else read_label(package.parent)


def engine_version() -> str:
    """The installed engine's release, as its label says (a label, not a verdict's input)."""
    return installed_label().version


def version_of(module) -> str:
    """The release a module belongs to."""
    engine = getattr(module, "__engine__", None)
    return engine.version if engine is not None else engine_version()


def installed(name: str) -> bool:
    """Whether the installed engine has module `name` (its parent packages get imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


class InstalledEngine:
    """The engine this interpreter imports: its modules are imported for real."""

    @property
    def label(self):
        return installed_label()

    @property
    def version(self) -> str:
        return self.label.version

    @property
    def origin(self) -> Optional[pathlib.Path]:
        """The folder that holds the imported sglang/ (site-packages, a --target folder)."""
        package = installed_package()
        return package.parent if package is not None else None

    def module(self, name: str):
        """The module, or None when this release does not have it."""
        return importlib.import_module(name) if installed(name) else None

    def files(self) -> Mapping[str, str]:
        """Module name -> path of every .py file of the installed sglang package."""
        return python_files(installed_package().parent)


def sibling(module, name: str):
    """Another module of the same engine as `module`: read from the same source tree
    for modules read from source, else imported."""
    engine = getattr(module, "__engine__", None)
    if engine is None:
        return importlib.import_module(name)
    found = engine.module(name)
    if found is None:
        raise ModuleNotFoundError(f"{name} is missing from the engine at {engine.root}")
    return found


def from_source(module) -> bool:
    """True for modules read from a source tree: their functions cannot be called."""
    return getattr(module, "__engine__", None) is not None


