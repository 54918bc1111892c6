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
import os
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
    """The class's definition in the module's source: plain (no decorator, base or
    metaclass), so that what runs is what its body says."""
    found = [n for n in syntax.parse(contract.source()).body if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise contract.refuse(name, f"is defined {len(found)} times at module level; expected once")
    node = found[0]
    if node.decorator_list or node.keywords or any(ast.unparse(b) != "object" for b in node.bases):
        extra = [ast.unparse(x) for x in (*node.decorator_list, *node.bases, *node.keywords)]
        raise contract.refuse(name, f"is no longer a plain class ({', '.join(extra)}): what runs may not be its body")
    for method in node.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.decorator_list:
            decorators = ", ".join("@" + ast.unparse(d) for d in method.decorator_list)
            raise contract.refuse(f"{name}.{method.name}", f"is decorated ({decorators}): what runs is not the checked code")
    return node


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


def assigns(node, attr: str, receiver: str) -> bool:
    """`node` is an assignment to `<receiver>.attr` (among its targets)."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(isinstance(t, ast.Attribute) and t.attr == attr and ast.unparse(t.value) == receiver
               for target in targets for t in ast.walk(target))


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


def live_function(contract: Contract, func, node: ast.FunctionDef, qualname: Optional[str] = None) -> None:
    """`func` is the plain function compiled from `node` of the module's own file."""
    qualname = qualname or node.name
    code = getattr(func, "__code__", None)
    same = (type(func) is types.FunctionType and not hasattr(func, "__wrapped__") and code is not None
            and func.__qualname__ == qualname and func.__module__ == contract.module.__name__
            and os.path.realpath(code.co_filename) == os.path.realpath(contract.module.__file__)
            and code.co_firstlineno == node.lineno)
    if not same:
        raise contract.refuse(qualname, f"is {func!r}, not the function its source defines: something replaced "
                                        "or wrapped it after import")


def live_class(contract: Contract, cls_node: ast.ClassDef) -> None:
    """The installed class is the checked source's: its methods the functions compiled from
    it, nothing added since."""
    cls = contract.attr(CLASS)
    if type(cls) is not type or cls.__mro__[1:] != (object,):
        raise contract.refuse(CLASS, f"has another metaclass or base at run time ({type(cls)!r}, {cls.__mro__!r})")
    defined = {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}
    gone = sorted(set(defined) - set(vars(cls)))
    if gone:
        raise contract.refuse(f"{CLASS}.{gone[0]}", "was removed from the class at run time")
    for name, value in vars(cls).items():
        value = engine_defined(cls, name)
        if name in defined:
            live_function(contract, value, defined[name], f"{CLASS}.{name}")
        elif callable(value) or hasattr(value, "__get__") and not isinstance(value, (str, type(None))):
            if name not in ("__dict__", "__weakref__", "__doc__", "__module__"):
                raise contract.refuse(f"{CLASS}.{name}", "was added at run time; its source defines no such method")
