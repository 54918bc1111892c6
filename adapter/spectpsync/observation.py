"""What the engine's SpecTpSync does, observed by running it (spectpsync.behaviour), and
that observation checked before any proof rests on it.

The installed class runs in this process, the pack's own wrappers looked through, and is
remembered per class, functions and value (running it costs a group set-up each time); a
tree's class runs in a child interpreter (behaviour keeps that child), and what it did is kept
in the proof cache (engine.proofs) under the content of the files that decide it: another
process judging the same sources does not start an interpreter again. Where a tree's class
cannot run here the verdict is Undecided (never kept): each rank decides it at launch.

`checked` refuses an observation that shows the class does not select by its switch (it
selects other than its own parser reads), or where a part the caller relies on (`sync`,
`available_memory_gb`) misbehaved, naming the method.
"""

from __future__ import annotations

import json
import re
import types
from typing import Optional

from ..engine import proofs
from ..engine.contract import Contract, Refused, Undecided
from ..engine.installed import from_source, version_of
from . import behaviour, built_class
from .engine_class import ENGINE_FLAG

_OBSERVED: dict = {}  # (the installed class and its functions, value) -> its observation


def observed(contract: Contract, values, engine=None) -> dict:
    """value -> what the engine's SpecTpSync does built under it (spectpsync.behaviour): the
    installed class run here, the pack's own wrappers looked through; a tree's in a child
    interpreter. Undecided where the tree's class cannot run here."""
    module, values = contract.module, list(dict.fromkeys(values))
    built, home = built_class.of(contract, engine)
    if from_source(module):
        try:
            return _tree_observed(str(module.__engine__.root), values, (built.module, built.name))
        except behaviour.Unobservable as exc:
            raise Undecided(contract.adapter, f"{built.module}:{built.name}",
                            f"its class cannot be run from these sources in this interpreter ({exc}); each rank "
                            "runs it at launch", version_of(module)) from None
    cls = home.attr(built.name)
    originals = {name: engine_defined(cls, name) for name in vars(cls)}
    # the objects themselves, held by the key: an id could be reused by another class after this one is gone
    key = (module, cls, tuple((owner, name, value) for owner in cls.__mro__[:-1] for name, value in sorted(
        (originals if owner is cls else vars(owner)).items(), key=lambda item: item[0])
        if isinstance(value, types.FunctionType)))
    missing = [value for value in values if (key, value) not in _OBSERVED]
    if missing:
        found = behaviour.observe_module(module, missing, originals, cls)["values"]
        _OBSERVED.update({(key, value): found[json.dumps(value)] for value in missing})
    return {value: _OBSERVED[(key, value)] for value in values}


def _tree_observed(tree: str, values, target: tuple) -> dict:
    """value -> the observation of the tree's class `target` for it, each kept in the proof cache
    under behaviour's content key (the files that decide the class, and which class); the values
    no process has observed yet run in one child. Unobservable where the class cannot run."""
    content, kind = behaviour.content_key(tree, target), "spectpsync-tree-behaviour"
    found = {value: proofs.get(kind, (content, json.dumps(value))) for value in values}
    missing = [value for value, seen in found.items() if seen is proofs.MISSING]
    if missing:
        fresh = behaviour.observe_tree(tree, missing, target, content)["values"]
        for value in missing:
            found[value] = fresh[json.dumps(value)]
            proofs.put(kind, (content, json.dumps(value)), found[value])
    return found


def reset() -> None:
    """Forget what was observed of installed classes (tests)."""
    _OBSERVED.clear()


def engine_defined(owner, name: str):
    """owner.name as the engine defined it: the pack's own wrapper looked through."""
    from ..framework import patching

    current = vars(owner).get(name)
    for saved in patching.applied():
        if saved.owner is owner and saved.name == name and current is saved.replacement:
            return saved.original
    return current


def said(value: Optional[str]) -> str:
    """The switch at `value`, as a reason says it."""
    return f"{ENGINE_FLAG} unset" if value is None else f"{ENGINE_FLAG}={value!r}"


def unparsed(contract: Contract, raw: str, error: str) -> Refused:
    """The engine's parser refusing `raw` (a ValueError: the value), or failing itself."""
    if error.startswith("ValueError"):
        return contract.refuse(ENGINE_FLAG, f"the engine cannot parse {raw!r}: {error}")
    return contract.refuse("parse_spec_tp_sync", f"cannot be run on {raw!r}: {error}")


def checked(contract: Contract, value: Optional[str], part: str = "", engine=None) -> dict:
    """The observation under `value`, refused where the class is not shown to select by the
    variable or (`part`: "sync" or "probe") where that part misbehaved."""
    seen = observed(contract, [value], engine)[value]
    if value is not None and seen["parse_error"]:
        raise unparsed(contract, value, seen["parse_error"])
    built, home = built_class.of(contract, engine)
    name = built.name
    if seen["built_error"]:
        missing = re.search(rf"'{name}' object has no attribute '(\w+)'", seen["built_error"])
        symbol = f"{name}.{missing.group(1)}" if missing else name  # a method it no longer has, named
        raise home.refuse(symbol, f"built with {said(value)} it raises {seen['built_error']}")
    if seen["problems"]:
        raise home.refuse(name, f"run against its own code ({said(value)}): {seen['problems'][0]}")
    if part and seen[f"{part}_problems"]:
        method = {"sync": "sync", "probe": "available_memory_gb"}[part]
        raise home.refuse(f"{name}.{method}", f"run against its own code ({said(value)}): "
                                              f"{seen[f'{part}_problems'][0]}")
    chosen = seen["selected"]["2"]
    if value is not None and chosen != seen["parse"]:
        raise home.refuse(name, f"built with {said(value)} over two ranks it selects {chosen}, not what its "
                                f"parser reads ({seen['parse']}): it does not select by that variable")
    return seen
