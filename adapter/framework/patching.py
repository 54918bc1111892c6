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


class _BoundWrapper(wrapt.BoundFunctionWrapper):
    def __reduce_ex__(self, protocol):
        # as the plain function would: by reference, the attribute of its class (or of its instance)
        parent = self._self_parent
        holder = parent._self_patch_owner if self._self_instance is None else self._self_instance
        return getattr, (holder, parent._self_patch_name)


class Wrapper(wrapt.FunctionWrapper):
    """wrapt's FunctionWrapper that pickles as the engine's function does: by reference, the
    attribute of its owner (the engine pickles methods across processes; wrapt's proxy refuses)."""

    __bound_function_wrapper__ = _BoundWrapper

    def __init__(self, wrapped, wrapper, owner, name: str):
        super().__init__(wrapped, wrapper)
        self._self_patch_owner, self._self_patch_name = owner, name

    def __reduce_ex__(self, protocol):
        return getattr, (self._self_patch_owner, self._self_patch_name)


def _binding(patch: Patch, original):
    if patch.proxy:
        return patch.proxy(original)
    wrapper, make = _faster.get(id(patch.wrapper), (None, None))
    faster = make(original) if wrapper is patch.wrapper else None
    # wrapt's: signature and introspection survive
    return faster if faster is not None else Wrapper(original, patch.wrapper, patch.owner, patch.name)


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
    """Unwind the pack's own binding, if the pack replaced it. Where something wrapped it since
    (a later plugin), that wrapper stays: the pack's is taken out from beneath it where the chain
    can be rewired (a wrapt proxy's __wrapped__), else both stay and the binding stays recorded
    (False): putting the original back would drop the later wrapper."""
    saved = _saved.get(key(owner, name))
    if saved is None:
        return False
    current = vars(owner).get(name)
    if current is saved.replacement:
        setattr(owner, name, saved.original)
    elif not _unwind_beneath(current, saved.replacement, saved.original):
        return False
    del _saved[key(owner, name)]
    return True


_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)  # wrapt 2's base of every proxy (1.x: ObjectProxy)


def _unwind_beneath(outer, ours, original) -> bool:
    """Point the link of `outer`'s __wrapped__ chain that holds `ours` at `original` instead."""
    link, seen = outer, 0
    while isinstance(link, _PROXY) and seen < 32:
        if link.__wrapped__ is ours:
            link.__wrapped__ = original
            return True
        link, seen = link.__wrapped__, seen + 1
    return False


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
