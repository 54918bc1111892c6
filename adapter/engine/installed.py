"""The engine this interpreter imports, and the engine a module belongs to.

A module read from a source tree (engine.source_engine) carries its SourceEngine as
`__engine__`; the helpers here answer for that engine, else for the installed one.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
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


class EngineImportError(RuntimeError):
    """The installed engine is there but raises while it is imported: the pack can judge
    nothing of it, and says so in one line (cli), never as a refusal of one adapter."""


def import_error(exc: BaseException, name: str = "sglang") -> EngineImportError:
    """`exc`, raised while importing `name`, as one line: the cause, then the fix."""
    cause = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.filename:
        fix = (f"{exc.filename} cannot be made or read: point HOME (or XDG_CACHE_HOME and TORCH_HOME) at a "
               "writable folder, e.g. -e HOME=/tmp")
    else:
        fix = f"`python3 -c 'import {name}'` in the same environment shows the whole traceback"
    return EngineImportError(f"the installed sglang cannot be imported ({name}: {cause}); fix: {fix}")


def installed(name: str) -> bool:
    """Whether the installed engine has module `name` (its parent packages get imported).
    A parent that raises while it is imported is no missing module: EngineImportError."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return False
        raise import_error(exc, name) from exc
    except Exception as exc:  # torch making its cache folder under an unwritable home, a broken build
        raise import_error(exc, name) from exc


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

    def require(self) -> None:
        """Import the engine's top package once, so that its failure is said with its own cause
        (a later import of a submodule finds the half-imported package and raises another)."""
        if "sglang" in sys.modules or installed_package() is None:
            return
        try:
            importlib.import_module("sglang")
        except Exception as exc:  # noqa: BLE001 - any failure of the engine's own import is said whole
            raise import_error(exc) from exc

    def module(self, name: str):
        """The module, or None when this release does not have it."""
        self.require()
        if not installed(name):
            return None
        try:
            return importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of the engine's own import is said whole
            raise import_error(exc, name) from exc

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


