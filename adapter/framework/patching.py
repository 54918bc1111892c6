"""The one place that changes the engine: wrapt wrappers, handed-over environment
variables, and the registry of what was changed (gevent's `saved`), so that every
change can be listed and reverted and none is made twice."""

from __future__ import annotations

import functools
import os
import types
from dataclasses import dataclass, replace
from typing import Optional

import wrapt

from .plan import Patch


@dataclass(frozen=True)
class Saved:
    adapter: str
    patch: Patch
    original: object
    replacement: object

    @property
    def owner(self):
        return self.patch.owner

    @property
    def name(self) -> str:
        return self.patch.name


# (id(owner), name) -> what was there before the pack; env name -> (adapter, value before or None)
_saved: dict[tuple[int, str], Saved] = {}
_saved_env: dict[str, tuple[str, Optional[str]]] = {}
# id(wrapper) -> (wrapper, make): make(original) is an object that does what wrapt's binding of
# `wrapper` to `original` does, at less cost per call, or None where it cannot stand in for that
# original (by identity: a wrapper need not be hashable; kept, so its id is not reused)
_faster: dict[int, tuple] = {}


def key(owner, name: str) -> tuple[int, str]:
    return id(owner), name


def apply(patch: Patch, adapter: str) -> bool:
    """Wrap `patch.owner.patch.name` once: the same patch already in place changes
    nothing, another one on the same binding is replaced (never stacked)."""
    saved = _saved.get(key(patch.owner, patch.name))
    if saved is not None:
        if saved.patch == patch:
            return False
        revert(patch.owner, patch.name)
    original = vars(patch.owner)[patch.name]  # the owner's own attribute: no binding, no inheritance
    replacement = _binding(patch, original)
    setattr(patch.owner, patch.name, replacement)
    _saved[key(patch.owner, patch.name)] = Saved(adapter, patch, original, replacement)
    return True


def _binding(patch: Patch, original):
    if patch.proxy:
        return patch.proxy(original)
    wrapper, make = _faster.get(id(patch.wrapper), (None, None))
    faster = make(original) if wrapper is patch.wrapper else None
    # wrapt's: signature and introspection survive
    return faster if faster is not None else wrapt.FunctionWrapper(original, patch.wrapper)


def for_functions(build):
    """A `make` for bind_faster: build(original) dressed as `original` (functools.update_wrapper:
    name, doc, __wrapped__) where `original` is a plain function; None for anything else."""
    def make(original):
        if type(original) is not types.FunctionType:
            return None
        return functools.update_wrapper(build(original), original)
    return make


def bind_faster(wrapper, make=None) -> None:
    """From now on, bind `wrapper` as make(original) wherever that gives an object (None: wrapt's
    binding again), the bindings already made included. A binding something else replaced since
    is left to the audit; each stays recorded and reverts as before."""
    if make is None:
        _faster.pop(id(wrapper), None)
    else:
        _faster[id(wrapper)] = (wrapper, make)
    for saved in list(_saved.values()):
        if saved.patch.wrapper is wrapper and not saved.patch.proxy and vars(saved.owner).get(saved.name) is saved.replacement:
            replacement = _binding(saved.patch, saved.original)
            setattr(saved.owner, saved.name, replacement)
            _saved[key(saved.owner, saved.name)] = replace(saved, replacement=replacement)


def revert(owner, name: str) -> bool:
    """Put the original back, if the pack replaced it."""
    saved = _saved.pop(key(owner, name), None)
    if saved is None:
        return False
    setattr(owner, name, saved.original)
    return True


def set_env(name: str, value: str, adapter: str) -> None:
    _saved_env.setdefault(name, (adapter, os.environ.get(name)))
    os.environ[name] = value


def revert_env(name: str) -> None:
    adapter, before = _saved_env.pop(name)
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


def applied() -> list[Saved]:
    """Every binding the pack replaced in this process."""
    return list(_saved.values())


def applied_env() -> dict[str, str]:
    """Environment variable -> adapter, for every variable the pack handed to the engine."""
    return {name: adapter for name, (adapter, _) in _saved_env.items()}


def original(owner, name: str):
    """What `owner.name` was before the pack, or None when the pack did not replace it."""
    saved = _saved.get(key(owner, name))
    return None if saved is None else saved.original
