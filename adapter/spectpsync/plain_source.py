"""What running SpecTpSync cannot show, the part its proofs share: the engine's definitions,
read from its source, are plain (no decorator, base or metaclass), so that what runs is
what their bodies say; on an installed engine, the class and functions are the very ones
compiled from that source (nothing replaced or wrapped them after import; the pack's own
wrappers are looked through). Also the small readers of engine source the proofs share.
"""

from __future__ import annotations

import ast
import bisect
import functools
import importlib.util
import os
import sys
import types
from typing import Optional

from ..engine import syntax
from ..engine.contract import Contract
from .engine_class import CLASS
from .observation import engine_defined


def other(contract: Contract, engine, name: str) -> Contract:
    """Another module of the engine being judged (a doctored copy where there is one)."""
    module = engine.module(name)
    if module is None:
        raise contract.refuse(name, "is missing from this engine")
    return Contract(contract.adapter, module)


def body(func: ast.FunctionDef) -> list:
    """The statements, a leading docstring left out."""
    statements = list(func.body)
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]
    return statements


def params(func: ast.FunctionDef) -> list[str]:
    return [a.arg for a in func.args.posonlyargs + func.args.args]


def plain_class(contract: Contract, name: str) -> ast.ClassDef:
    """The class's one definition in the module's source. Its decorators, bases and its
    methods' decorators refuse nothing: what runs is judged by running it (observation), and,
    installed, by what the class really holds (live_class)."""
    found = [n for n in syntax.parse(contract.source()).body if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise contract.refuse(name, f"is defined {len(found)} times at module level; expected once")
    return found[0]


def wrappers(contract: Contract, name: str) -> list[str]:
    """What wraps the class and its methods in its source (decorators, bases), for reasons."""
    node = plain_class(contract, name)
    found = [f"{name}: {', '.join(ast.unparse(x) for x in (*node.decorator_list, *node.bases, *node.keywords))}"
             ] if node.decorator_list or node.keywords or any(ast.unparse(b) != "object" for b in node.bases) else []
    found += [f"{name}.{m.name}: " + ", ".join("@" + ast.unparse(d) for d in m.decorator_list)
              for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.decorator_list]
    found += [f"{name}.{ast.unparse(t)} = {ast.unparse(m.value)}" for m in node.body if isinstance(m, ast.Assign)
              and isinstance(m.value, ast.Call) for t in m.targets]
    return found


def method(contract: Contract, cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if len(found) != 1 or not isinstance(found[0], ast.FunctionDef) or found[0].decorator_list:
        raise contract.refuse(f"{cls.name}.{name}", "is missing, decorated or defined more than once")
    return found[0]


def function(contract: Contract, name: str) -> ast.FunctionDef:
    """A module-level function's definition, undecorated."""
    found = [n for n in syntax.parse(contract.source()).body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise contract.refuse(name, "is missing or defined more than once at module level")
    if found[0].decorator_list:
        raise contract.refuse(name, "is decorated: what runs is not the checked code")
    return found[0]


@functools.lru_cache(maxsize=64)
def relevant(text: str, needles: tuple) -> tuple:
    """(node, parent) for the nodes of `text` whose lines hold one of `needles`, and the
    nodes enclosing them; other subtrees are not visited (most of a large file)."""
    lines = [n for n, line in enumerate(text.split("\n"), 1) if any(needle in line for needle in needles)]
    found, stack = [], [(syntax.parse(text), None)]
    while stack:
        node, parent = stack.pop()
        first = getattr(node, "lineno", None)
        if first is not None:
            first = min([first, *(d.lineno for d in getattr(node, "decorator_list", ()))])
            at = bisect.bisect_left(lines, first)
            if at == len(lines) or lines[at] > (node.end_lineno or first):
                continue
        found.append((node, parent))
        stack.extend((child, node) for child in ast.iter_child_nodes(node))
    return tuple(found)


def live_function(contract: Contract, func, name: str, line: int, qualname: Optional[str] = None) -> None:
    """`func` is the plain function compiled from the `def name` at `line` of the module's own file."""
    qualname = qualname or name
    code = getattr(func, "__code__", None)
    same = (type(func) is types.FunctionType and not hasattr(func, "__wrapped__") and code is not None
            and func.__qualname__ == qualname and func.__module__ == contract.module.__name__
            and os.path.realpath(code.co_filename) == os.path.realpath(contract.module.__file__)
            and code.co_firstlineno == line)
    if not same:
        raise contract.refuse(qualname, f"is {func!r}, not the function its source defines: something replaced "
                                        "or wrapped it after import")


def _layers(value) -> list:
    """A class attribute and what it wraps: a staticmethod's or classmethod's function, each
    `__wrapped__`, and the functions a decorator's closure holds."""
    found, todo = [], [value]
    while todo:
        item = todo.pop()
        if any(item is seen for seen in found):
            continue
        found.append(item)
        if isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
        if getattr(item, "__wrapped__", None) is not None:
            todo.append(item.__wrapped__)
        for cell in getattr(item, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:
                continue
            if isinstance(held, types.FunctionType):
                todo.append(held)
    return found


def live_class(contract: Contract, cls_node: ast.ClassDef, name: str = CLASS) -> None:
    """The installed class is what the engine's sources make of it: each class of its MRO and
    each function it holds (what decorators wrap included) compiled from a file of the engine's
    own package, its `def`s those of the checked source; nothing replaced, wrapped or added
    from outside the engine after import (the pack's own wrappers looked through)."""
    cls = contract.attr(name)
    package = os.path.dirname(os.path.realpath(importlib.util.find_spec("sglang").origin)) + os.sep
    homes = {os.path.realpath(getattr(sys.modules.get(c.__module__), "__file__", None) or "") for c in cls.__mro__[:-1]}
    homes.add(os.path.realpath(contract.module.__file__))  # a copy of an engine module is its own home
    # the engine's package, or the very file an engine module of the class was loaded from
    engine_file = lambda path: os.path.realpath(path).startswith(package) or os.path.realpath(path) in homes  # noqa: E731
    for owner in cls.__mro__[:-1]:
        source = getattr(sys.modules.get(owner.__module__), "__file__", None)
        if not owner.__module__.startswith("sglang.") or not source:
            raise contract.refuse(name, f"has {owner!r} in its MRO, which is not the engine's own code")
    defined = {n.name: n for n in cls_node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    gone = sorted(set(defined) - set(vars(cls)))
    if gone:
        raise contract.refuse(f"{name}.{gone[0]}", "was removed from the class at run time")
    for owner in cls.__mro__[:-1]:
        for attr in vars(owner):
            value = engine_defined(owner, attr)
            for layer in _layers(value):
                code = getattr(layer, "__code__", None)
                if code is not None and not engine_file(code.co_filename):
                    raise contract.refuse(f"{owner.__qualname__}.{attr}", f"is {value!r}, compiled from "
                                          f"{code.co_filename}: not the function its source defines, nor the "
                                          "engine's own code (something replaced or wrapped it after import)")
            if owner is cls and attr in defined:
                node = defined[attr]
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                inner = [layer for layer in _layers(value) if getattr(layer, "__code__", None) is not None
                         and layer.__code__.co_firstlineno == first and layer.__name__ == attr]
                if not inner:
                    raise contract.refuse(f"{name}.{attr}", f"is {value!r}, not the function its source defines at "
                                                            f"line {node.lineno}: something replaced it after import")
