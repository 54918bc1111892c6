"""Doctored copies of real engine modules, for drift tests.

A copy is the real module's source with a few exact replacements, loaded under the real
module name but not registered in sys.modules, so the real module stays as it was.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import pathlib
import shutil
import tempfile
from dataclasses import dataclass


@functools.cache
def _scratch() -> str:
    """This process's folder for copies made without a directory, removed when it exits."""
    folder = tempfile.mkdtemp(prefix="doctored-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def scratch_folder() -> pathlib.Path:
    """A new folder for one copy, inside this process's scratch folder."""
    return pathlib.Path(tempfile.mkdtemp(dir=_scratch()))


def doctored_module(real_name: str, *replacements: tuple[str, str], tail: str = "", directory=None):
    origin = importlib.util.find_spec(real_name).origin
    source = pathlib.Path(origin).read_text(encoding="utf-8")
    for old, new in replacements:
        assert source.count(old) == 1, f"doctoring {real_name}: {old!r} is not in the real source exactly once"
        source = source.replace(old, new)
    path = pathlib.Path(directory or scratch_folder()) / (real_name.rpartition(".")[2] + "_doctored.py")
    path.write_text(source + tail, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(real_name, path)
    module = importlib.util.module_from_spec(spec)
    # The engine registers named invariants at import and refuses duplicates; the copy's
    # registrations are kept apart so the real module's stay as they were.
    from sglang.srt.utils import invariants

    saved = dict(invariants._REGISTRY)
    invariants._REGISTRY.clear()
    try:
        spec.loader.exec_module(module)
    finally:
        invariants._REGISTRY.clear()
        invariants._REGISTRY.update(saved)
    return module


class DoctoredEngine:
    """The installed engine, with some of its modules replaced by doctored copies, and
    `added`: new source files (module name -> path) its census reads but nothing imports."""

    def __init__(self, modules: dict, added: dict = None):
        from sglang_dsv41_adapters.engine.installed import InstalledEngine

        self.installed, self.modules, self.added = InstalledEngine(), modules, dict(added or {})
        self.version = self.installed.version

    def module(self, name: str):
        return self.modules[name] if name in self.modules else self.installed.module(name)

    def files(self) -> dict:
        """The installed files, doctored copies in place of the real ones; a module mapped
        to None is gone (renamed: its new name is in `added`)."""
        files = dict(self.installed.files())
        for name, module in self.modules.items():
            if module is None:
                files.pop(name, None)
            else:
                files[name] = module.__file__
        files.update(self.added)
        return files


def new_module_file(name: str, text: str, directory=None) -> str:
    """A new engine module's source file (for DoctoredEngine's `added`)."""
    path = pathlib.Path(directory or scratch_folder()) / (name.replace(".", "_") + ".py")
    path.write_text(text, encoding="utf-8")
    return str(path)


@dataclass(frozen=True)
class Drift:
    """One refactor of a real engine module, as a drift test states it: `old` replaced by
    `new` in `module`; the refusal must name `symbol` (and the module)."""

    module: str
    old: str
    new: str
    symbol: str

    def engine(self, directory=None) -> DoctoredEngine:
        return DoctoredEngine({self.module: doctored_module(self.module, (self.old, self.new), directory=directory)})

    def outcome(self, adapter, value: str, directory=None):
        """The adapter's outcome, switched on with `value`, on the engine with this drift."""
        from sglang_dsv41_adapters.framework import runtime

        return runtime.decide({adapter.FLAG: value}, self.engine(directory), names=(adapter.NAME,)).outcomes[0]
