"""Runtime binding audit: after the adapters are applied, no loaded engine module may
still hold the original of anything the pack wrapped.

A wrapper replaces one binding. A name bound to the original before that (`from x import
f`, `alias = f`, a default argument `g(fn=f)`, `functools.partial(f)`, `B.run = A.run`, a
table `{"greedy": f}`) still calls the engine's code unwrapped, and the fix is partial.
This is gevent's "patched too late" check (the engine's own plugin loader learnt it as
`_propagate_patch`). Found one: the engine must not start.

Scope. A patch on the definition (the function's own module or class) is audited in
every `sglang` module. A patch on one consumer's binding of a helper defined elsewhere
(group_min_memory wraps only the probe modules' `get_available_gpu_memory`, on purpose:
every other importer keeps the helper) is audited in that consumer module only.
Not searched: closures, the attributes of instances, objects nested deeper than one
container, and classes defined outside the engine.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import wrapt

from .patching import Saved

ENGINE = "sglang"
_CONTAINERS = (dict, list, tuple, set, frozenset)


@dataclass(frozen=True)
class Target:
    saved: Saved
    label: str  # what was wrapped, e.g. sglang.a.b.Class.method
    scope: Optional[str]  # None: every engine module; else the one module to audit


def _label(saved: Saved) -> str:
    owner = saved.owner
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{saved.name}"
    return f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', owner)}.{saved.name}"


def _scope(saved: Saved) -> Optional[str]:
    owner = saved.owner
    if isinstance(owner, types.ModuleType) and getattr(saved.original, "__module__", owner.__name__) != owner.__name__:
        return owner.__name__  # a consumer's own binding of a helper defined elsewhere
    return None


def targets(saved: list[Saved]) -> dict[int, Target]:
    """id of every original object (and of the function inside a static/class method) ->
    what was wrapped."""
    found = {}
    for entry in saved:
        target = Target(entry, _label(entry), _scope(entry))
        found[id(entry.original)] = target
        if type(entry.original) in (staticmethod, classmethod):
            found[id(entry.original.__func__)] = target
    return found


def _inside(value, path: str, depth: int = 0) -> Iterator[tuple[str, object]]:
    """(where, object) for `value` and every object it holds that would call it unwrapped.
    Types are read with type(), never isinstance: a wrapt proxy answers isinstance for
    what it wraps, and the pack's own proxies hold originals legitimately."""
    yield path, value
    kind = type(value)
    if issubclass(kind, wrapt.ObjectProxy) or depth > 1:
        return
    if kind in (staticmethod, classmethod):
        yield from _inside(value.__func__, path, depth + 1)
    elif issubclass(kind, (functools.partial, functools.partialmethod)):
        yield from _inside(value.func, f"{path} (functools.partial)", depth + 1)
        for item in (*value.args, *value.keywords.values()):
            yield from _inside(item, f"{path} (functools.partial argument)", depth + 1)
    elif kind is types.FunctionType:
        for item in value.__defaults__ or ():
            yield from _inside(item, f"{path} (default argument)", depth + 1)
        for name, item in (value.__kwdefaults__ or {}).items():
            yield from _inside(item, f"{path} (default of {name})", depth + 1)
    elif kind is property:
        for item in (value.fget, value.fset, value.fdel):
            if item is not None:
                yield from _inside(item, f"{path} (property)", depth + 1)
    elif kind in _CONTAINERS and depth == 0:
        for item in (value.values() if kind is dict else value):
            yield from _inside(item, f"{path} (item)", depth + 1)


# What a value of each type can hold besides itself (decided once per type).
LEAF, FUNCTION, CONTAINER, HOLDER = range(4)
_kinds: dict[type, int] = {}
_leaves: set[type] = set()  # the LEAF types whose values are not classes (walk skips them at once)


def _kind(kind: type) -> int:
    found = _kinds.get(kind)
    if found is None:
        if issubclass(kind, wrapt.ObjectProxy):
            found = LEAF  # the pack's own wrappers hold originals legitimately
        elif kind is types.FunctionType:
            found = FUNCTION
        elif kind in _CONTAINERS:
            found = CONTAINER
        elif kind in (staticmethod, classmethod, property) or issubclass(kind, (functools.partial, functools.partialmethod)):
            found = HOLDER
        else:
            found = LEAF
        _kinds[kind] = found
        if found == LEAF and not issubclass(kind, type):
            _leaves.add(kind)
    return found


def _only(items, kinds: tuple) -> bool:
    """Every item is of a type of one of `kinds` (each type of them looked up once)."""
    return all(_kind(kind) in kinds for kind in set(map(type, items)))


def _plain(value, ids: set[int]) -> bool:
    """True when `value` holds no target inside it: the fast path that keeps the audit
    cheap over every global and class attribute of ~1200 engine modules."""
    kind = _kind(type(value))
    if kind == LEAF:
        return True
    if kind == FUNCTION:
        defaults, kwdefaults = value.__defaults__, value.__kwdefaults__
        return ((defaults is None or (ids.isdisjoint(map(id, defaults)) and _only(defaults, (LEAF,))))
                and (kwdefaults is None or (ids.isdisjoint(map(id, kwdefaults.values()))
                                            and _only(kwdefaults.values(), (LEAF,)))))
    if kind == CONTAINER:  # an item is looked into one level deeper (a partial in a table)
        items = value.values() if type(value) is dict else value
        return ids.isdisjoint(map(id, items)) and _only(items, (LEAF, FUNCTION))
    return False


def stale_bindings(saved: list[Saved], modules: Optional[dict] = None) -> list[tuple[str, Target]]:
    """(holder, target) for every loaded engine module, class or function that still holds
    an original the pack wrapped. Each object is looked into once (most globals are the
    same imported objects seen from many modules); identity is checked at every holder."""
    wanted = targets(saved)
    if not wanted:
        return []
    ids = set(wanted)
    modules = dict(sys.modules if modules is None else modules)
    scoped = {t.scope for t in wanted.values() if t.scope}
    everywhere = any(t.scope is None for t in wanted.values())
    found, done = [], set(ids)

    def held(module_name: str, path: str, value) -> None:
        for where, obj in _inside(value, path):
            target = wanted.get(id(obj))
            if target is not None and target.scope in (None, module_name):
                found.append((where, target))

    def walk(module_name: str, prefix: str, namespace: dict) -> None:
        for key, value in list(namespace.items()):
            vid = id(value)
            if vid in ids:
                held(module_name, f"{prefix}.{key}", value)
                continue
            kind = type(value)
            if kind in _leaves or vid in done:  # a leaf holds nothing: not even remembered
                continue
            done.add(vid)
            if kind is types.FunctionType:
                if (value.__defaults__ is not None or value.__kwdefaults__ is not None) and not _plain(value, ids):
                    # named by its own module: an imported function is held, not defined, here
                    held(value.__module__, f"{value.__module__}.{value.__qualname__}", value)
            elif isinstance(value, type):
                home = str(getattr(value, "__module__", ""))
                if (home == ENGINE or home.startswith(ENGINE + ".")) and not issubclass(kind, wrapt.ObjectProxy):
                    walk(home, f"{home}.{value.__qualname__}", vars(value))
            elif _kinds.get(kind) != LEAF and not _plain(value, ids):
                held(module_name, f"{prefix}.{key}", value)

    for name, module in modules.items():
        if not (name == ENGINE or name.startswith(ENGINE + ".")) or not isinstance(module, types.ModuleType):
            continue
        if everywhere or name in scoped:
            walk(name, name, vars(module))
    return found


def problems(saved: list[Saved], version: str, modules: Optional[dict] = None) -> list[str]:
    """One refusal line per stale binding."""
    from .. import ADAPTERS, load

    lines = []
    for where, target in stale_bindings(saved, modules):
        adapter = target.saved.adapter
        what_to_do = "use a release this pack supports"
        if adapter in ADAPTERS:  # else the pack's own guard on Scheduler.__init__
            what_to_do = f"switch {load(adapter).flag} off or {what_to_do}"
        lines.append(
            f"{adapter} refused on sglang {version}: {where} holds the original {target.label} that {adapter} "
            f"wrapped: it was bound before the pack applied and would run unwrapped; {what_to_do}"
        )
    return lines
