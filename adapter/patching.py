"""Wrapping engine attributes with wrapt: idempotent, reversible, introspection kept."""

from __future__ import annotations

from typing import Optional

import wrapt

from .contract import Patch, Plan


class AdapterWrapper(wrapt.FunctionWrapper):
    """A wrapt FunctionWrapper that remembers which adapter put it there."""

    def __init__(self, wrapped, wrapper, adapter: str):
        super().__init__(wrapped, wrapper)
        self._self_adapter = adapter


def _current(owner, name):
    # Read the owner's own attribute (no binding, no inheritance).
    return vars(owner)[name]


def wrapped_by(owner, name: str) -> Optional[str]:
    """The adapter whose wrapper sits on `owner.name`, or None."""
    current = vars(owner).get(name)
    return current._self_adapter if isinstance(current, AdapterWrapper) else None


def apply(patch: Patch, adapter: str) -> bool:
    """Wrap `patch.owner.patch.name`; a second call for the same adapter wraps nothing."""
    if wrapped_by(patch.owner, patch.name) == adapter:
        return False
    setattr(patch.owner, patch.name, AdapterWrapper(_current(patch.owner, patch.name), patch.wrapper, adapter))
    return True


def remove(owner, name: str, adapter: str) -> bool:
    """Restore the original under the adapter's wrapper, if that wrapper is there."""
    if wrapped_by(owner, name) != adapter:
        return False
    setattr(owner, name, _current(owner, name).__wrapped__)
    return True


def install_plan(plan: Plan, adapter: str) -> Plan:
    """Apply every patch of a checked plan (each idempotently); the plan is returned."""
    for patch in plan.patches:
        apply(patch, adapter)
    return plan
