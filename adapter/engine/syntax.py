"""One engine module's source, parsed and indexed once: the functions that hold each name,
attribute and call (what the contracts and the census look up)."""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


def within(function: str, functions: Iterable[str]) -> bool:
    """`function` is one of `functions` or nested in one of them."""
    return any(function == f or function.startswith(f + ".") for f in functions)


class Found(NamedTuple):
    """A node found in a module's source, with the function that holds it."""

    function: str  # qualified name of the enclosing function (Class.method), or "<module>"
    line: int
    node: ast.AST


@dataclass
class Index:
    """What the checks look up in a module's source, gathered in one walk: reads of bare
    names and of attributes (by name), and every call, each with its enclosing function."""

    names: dict[str, list[Found]] = field(default_factory=dict)
    attrs: dict[str, list[Found]] = field(default_factory=dict)
    calls: list[Found] = field(default_factory=list)
    # calls by what they call: (True, "name") for `<anything>.name(...)`, (False, "name") for `name(...)`
    calls_of: dict[tuple[bool, str], list[Found]] = field(default_factory=dict)


def scoped_nodes(tree, enter=None):
    """Every node of `tree` in source order, with the qualified name of the class or
    function holding it (Class.method) or "<module>"; a node for which `enter(node)` is
    false is skipped with everything inside it."""
    stack = [(tree, "<module>")]
    while stack:
        node, function = stack.pop()
        if enter is not None and not enter(node):
            continue
        yield node, function
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name if function == "<module>" else f"{function}.{node.name}"
        stack.extend((child, function) for child in reversed(list(ast.iter_child_nodes(node))))


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the engine's sources are parsed and followed,
    and while a check decides: that work makes millions of syntax nodes and tokens, none of them
    cyclic garbage, and each full collection walks every one of them again, and every object of
    a rank that imported the engine (about 700,000) besides: three quarters of a parse, half of
    following the engine's code. The few cycles left are collected after it, where collection
    was on."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@functools.lru_cache(maxsize=128)
def parse(source) -> ast.Module:
    """A source text (str, or a file's bytes) parsed once per process, whichever check reads
    it: a decision reads the same engine modules from several adapters, and nothing here
    changes a tree. Raises what ast.parse raises (not cached). The engine's own invalid escapes
    are its matter, not a warning of the pack's (reading them runs nothing)."""
    with warnings.catch_warnings(), collector_paused():
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        return ast.parse(source)


@functools.lru_cache(maxsize=64)
def index(source: str) -> Index:
    """The source parsed and indexed once, however many checks read it."""
    index = Index()
    for node, function in scoped_nodes(parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            index.names.setdefault(node.id, []).append(Found(function, node.lineno, node))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            index.attrs.setdefault(node.attr, []).append(Found(function, node.lineno, node))
        elif isinstance(node, ast.Call):
            index.calls.append(Found(function, node.lineno, node))
    for found in (*index.names.values(), *index.attrs.values(), index.calls):
        found.sort(key=lambda f: (f.line, f.node.col_offset))
    for found in index.calls:  # in source order, as `calls`
        func = found.node.func
        if isinstance(func, ast.Attribute):
            index.calls_of.setdefault((True, func.attr), []).append(found)
        elif isinstance(func, ast.Name):
            index.calls_of.setdefault((False, func.id), []).append(found)
    return index


