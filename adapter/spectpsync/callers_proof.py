"""Nothing in the engine changes SpecTpSync or drops what it broadcasts, read from the source
(running the class alone cannot show it): no subclass, no reassignment of its methods or
sites, every call of `.sync(...)` passes a tensor the caller holds or uses what `sync`
returns, and the engine sets its switch SGLANG_SPEC_TP_SYNC only where it is unset (where it
does, and to what, is `engine_writes`).

Only the engine's files that name the class, `tp_sync` or the switch are read (the census),
and of each only the statements on lines that can hold such a reference; each file's
findings are kept by its text, so the same file in another engine tree is read once.
"""

from __future__ import annotations

import ast
import functools
from typing import Optional

from ..engine import census, proofs
from ..engine.contract import Contract
from .engine_class import CLASS, ENGINE_FLAG, ENVIRON, MODULE
from . import built_class
from .plain_source import relevant

# Attributes of a SpecTpSync that nothing outside the class may write.
_OWN = ("_sites", "_tp_group", "sync", "enabled", "available_memory_gb")
_UNSET_GUARDS = (f"not envs.{ENGINE_FLAG}.is_set()", f"'{ENGINE_FLAG}' not in os.environ")
_NEEDLES = ("sync", "Sync", "SYNC", "setattr")


def _writes_switch(node) -> bool:
    """`envs.SGLANG_SPEC_TP_SYNC.set/override(...)`, or os.environ written under that name."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("set", "override") and _last_name(node.func.value) == ENGINE_FLAG:
            return True
        named = any(isinstance(a, ast.Constant) and a.value == ENGINE_FLAG for a in node.args)
        return named and node.func.attr in ("setdefault", "putenv", "pop", "__setitem__", "update")
    return (isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.slice, ast.Constant) and node.slice.value == ENGINE_FLAG)


def _guarded(node, parents) -> bool:
    """Inside `if not envs.SGLANG_SPEC_TP_SYNC.is_set():` (a value already set is kept)."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If) and any(child is c for c in parent.body) and any(
                guard in ast.unparse(parent.test) for guard in _UNSET_GUARDS):
            return True
        child, parent = parent, parents.get(parent)
    return False


@functools.lru_cache(maxsize=8)
def _engine_scan(files: tuple, built: tuple = (MODULE, CLASS)) -> tuple:
    """(problems, callers, writes): references in `files` (those holding SpecTpSync,
    tp_sync or the switch's name) that would change what SpecTpSync does; how many
    `.sync(...)` calls there are (each one passes a tensor the caller holds or uses the
    result); where the engine sets SGLANG_SPEC_TP_SYNC itself, only where it is unset
    ((place, literal value) pairs; a write that would replace a value set is a problem)."""
    problems, callers, writes = [], 0, []
    for module, path in files:
        if module in (MODULE, ENVIRON, built[0]):  # the class's own modules define it
            continue
        with open(path, "rb") as handle:
            found, calls, written = _file_scan(module, handle.read(), built[1])
        problems += [f"{path}:{line} {problem}" for line, problem in found]
        callers += calls
        writes += written
    return tuple(problems), callers, tuple(writes)


def _last_name(node) -> Optional[str]:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


@proofs.memo("spectpsync-file-scan")
def _file_scan(module: str, data: bytes, name: str = CLASS) -> tuple:
    """_engine_scan's findings in one file ((line, problem) pairs), by its text (the same
    file in another engine tree is read once)."""
    problems, callers, writes = [], 0, []
    try:
        nodes = relevant(data.decode("utf-8"), _NEEDLES + (name,))  # the parse the other checks of the file share
    except (SyntaxError, ValueError) as exc:
        return ((getattr(exc, "lineno", 0) or 0, "does not parse"),), 0, ()
    parents = dict(nodes)
    for node, _ in nodes:
        line = getattr(node, "lineno", 0)
        if _writes_switch(node):
            value = node.args[0] if isinstance(node, ast.Call) and node.args else None
            if not _guarded(node, parents):
                problems.append((line, f"sets {ENGINE_FLAG} even where it is already set: the ranks may not read "
                                       "the selection handed to them"))
            else:
                shown = repr(value.value) if isinstance(value, ast.Constant) else "a computed value"
                writes.append((f"{module.rpartition('.')[2]}.py:{line}", shown))
        elif isinstance(node, ast.ClassDef) and any(_last_name(b) in (CLASS, name) for b in node.bases):
            problems.append((line, f"subclasses {name} ({node.name}), which the workers do not build"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Attribute) and (target.attr in _OWN and "tp_sync" in ast.unparse(target.value)
                                                          or _last_name(target.value) in (CLASS, name)):
                    problems.append((line, f"assigns {ast.unparse(target)}"))
        elif isinstance(node, ast.Call) and _last_name(node.func) == "setattr" and node.args and (
                _last_name(node.args[0]) in (CLASS, name) or "tp_sync" in ast.unparse(node.args[0])):
            problems.append((line, f"sets an attribute of {ast.unparse(node.args[0])}"))
        elif isinstance(node, ast.Attribute) and node.attr == "sync" and isinstance(node.ctx, ast.Load):
            call = parents.get(node)
            if not (isinstance(call, ast.Call) and call.func is node):
                problems.append((line, f"refers to {ast.unparse(node)} without calling it"))
                continue
            callers += 1
            used = not isinstance(parents.get(call), ast.Expr)
            values = call.args[1] if len(call.args) == 2 and not call.keywords else None
            if values is None:
                problems.append((line, f"calls {ast.unparse(node)} with other than (site, values)"))
            elif not used and not _held(values):
                problems.append((line, f"broadcasts {ast.unparse(values)}, a temporary whose broadcast value nothing "
                                       "reads (the result of sync is dropped)"))
    return tuple(problems), callers, tuple(writes)


def _held(node) -> bool:
    """A tensor the caller holds: a name or an attribute of one, not a fresh expression."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _files(engine, name: str = CLASS) -> tuple:
    return tuple(sorted(census.files_holding(engine, tuple(dict.fromkeys((CLASS, name, "tp_sync", ENGINE_FLAG))))))


def prove_callers(contract: Contract, engine) -> int:
    """Nothing outside the class changes it; its callers read what it broadcasts; the engine
    sets its switch only where unset. How many callers there are; Refused naming the first
    place that breaks one of these. The class is the one the workers build (built_class),
    whatever it is called and wherever it lives."""
    built, _ = built_class.of(contract, engine)
    problems, callers, _ = _engine_scan(_files(engine, built.name), (built.module, built.name))
    if problems:
        raise contract.refuse(built.name, f"cannot be shown to broadcast to every caller: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return callers


def engine_writes(engine) -> tuple:
    """Where the engine sets SGLANG_SPEC_TP_SYNC itself when it is unset, and to what
    (0.5.23: MiniMax-M3 with DSpark, 'rng')."""
    return _engine_scan(_files(engine))[2]
