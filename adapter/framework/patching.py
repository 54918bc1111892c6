"""The one place that changes the engine: wrapt wrappers, handed-over environment
variables, and the registry of what was changed (gevent's `saved`), so that every
change can be listed and reverted and none is made twice."""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    replacement = patch.proxy(original) if patch.proxy else wrapt.FunctionWrapper(original, patch.wrapper)  # signature and introspection survive
    setattr(patch.owner, patch.name, replacement)
    _saved[key(patch.owner, patch.name)] = Saved(adapter, patch, original, replacement)
    return True


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
