"""Conservative census: every reference in the engine's sources to a hazard's names.

A drift check that looks for `x.read_accept(` misses `read = x.read_accept`,
`functools.partial(x.read_accept)`, `getattr(x, "read_accept")` or a new module. The
census reads every .py file of the engine's `sglang/` package (installed or read from
source, through the engine's `files()`), keeps those whose text contains one of the
names (a plain substring: any alias site contains the name), parses them and records
every reference to a name: a bare name, an attribute (read, written, called or not),
an import (`from x import name as y`, `import x.name`), a definition, a parameter or
keyword, and a string literal that names it (`getattr(x, "name")`, attrgetter);
docstrings and comments excepted. Each adapter declares the sites it knows and
checks (`Site`); a reference anywhere else refuses, naming file, line and function.
It is an early warning, not a proof: a name built at run time (`f"read_{x}"`) is
not seen.
"""

from __future__ import annotations

import ast
import bisect
import functools
import gc
import re
import types
from dataclasses import dataclass
from typing import NamedTuple, Optional

from .contract import Refused
from . import proofs, syntax
from .syntax import scoped_nodes

# Kinds of reference (UNPARSED: a file holding a name that does not parse; never known).
NAME, BIND, ATTRIBUTE, IMPORT, DEFINITION, PARAMETER, KEYWORD, STRING, UNPARSED = (
    "name", "bind", "attribute", "import", "definition", "parameter", "keyword", "string", "unparsed")
KINDS = (NAME, BIND, ATTRIBUTE, IMPORT, DEFINITION, PARAMETER, KEYWORD, STRING, UNPARSED)


class Reference(NamedTuple):
    module: str
    path: str
    line: int
    function: str  # qualified enclosing scope (Class.method), or "<module>"
    name: str
    kind: str
    receiver: Optional[str]  # for an attribute: the expression it is read from


@dataclass(frozen=True)
class Site:
    """Where references to `names` are known and checked by the adapter.

    module: dotted module name, or a package prefix ending in "." (every module in it);
    function: qualified scope, references nested in it included ("*": any scope);
    kinds: the kinds of reference accepted there; receiver: for attributes, the only
    expression they may be read from (e.g. "self")."""

    module: str
    function: str
    names: frozenset
    kinds: frozenset
    why: str
    receiver: Optional[str] = None
    unless: tuple = ()  # words that void this site when the file holds any of them

    def covers(self, ref: Reference) -> bool:
        in_module = ref.module.startswith(self.module) if self.module.endswith(".") else ref.module == self.module
        in_function = self.function == "*" or ref.function == self.function or ref.function.startswith(self.function + ".")
        return (in_module and in_function and ref.name in self.names and ref.kind in self.kinds
                and (self.receiver is None or ref.receiver == self.receiver)
                and not (self.unless and _mentions(ref.path, self.unless)))


@functools.lru_cache(maxsize=128)
def _mentions(path: str, words: tuple) -> bool:
    with open(path, "rb") as handle:
        data = handle.read().lower()
    return any(word.encode() in data for word in words)


def sites(modules, functions, names, kinds, why: str) -> list[Site]:
    """One site per module and function: `modules` a name or several (a release moved it)."""
    modules = (modules,) if isinstance(modules, str) else modules
    functions = (functions,) if isinstance(functions, str) else functions
    return [Site(m, f, frozenset(names), frozenset(kinds), why) for m in modules for f in functions]


def references(engine, names) -> list[Reference]:
    """Every reference to `names` in the engine's sources, in file and line order."""
    files = _sorted_files(engine)
    names = tuple(sorted(set(names)))
    # Parsing builds many small objects; in a rank that has imported the engine, the
    # collector would walk its whole heap again and again (ten times the parse itself).
    collecting = gc.isenabled()
    gc.disable()
    try:
        holding = _holding(files, names)
        return list(_references(files, names, tuple(sorted(set().union(*holding.values())))))
    finally:
        if collecting:
            gc.enable()


def files_holding(engine, names) -> set:
    """The engine's source files (module, path) whose text holds any of `names`."""
    files = _sorted_files(engine)
    return set().union(*_holding(files, tuple(sorted(set(names)))).values())


_HOLDING: dict = {}  # file set -> {name: files whose text holds it}
_TREES: dict = {}    # file set -> its key in the proof cache (the modules' names and contents)
_SORTED: dict = {}   # id(an engine's files mapping) -> (the mapping, its items sorted)
_FOUND: dict = {}    # names -> {path: (the file's stat, which of the names its text holds)}
FOUND_FILES = 20_000  # files kept per set of names: a few engine trees' worth


def _sorted_files(engine) -> tuple:
    """The engine's (module, path) pairs, sorted (paths are str: python_files, __file__).
    python_files' mapping is cached and read-only: its sorted pairs are kept beside it."""
    files = engine.files()
    kept = _SORTED.get(id(files))
    if kept is None or kept[0] is not files:
        kept = (files, tuple(sorted(files.items())))
        if isinstance(files, types.MappingProxyType):
            _SORTED[id(files)] = kept
            while len(_SORTED) > 8:
                _SORTED.pop(next(iter(_SORTED)))
    return kept[1]


def reset() -> None:
    """Forget which files hold which names and the references found (tests that change files)."""
    _HOLDING.clear()
    _TREES.clear()
    _FOUND.clear()
    _references.cache_clear()


def _holding(files: tuple, names: tuple) -> dict:
    """For each name, the files (module, path) whose text holds it: a plain substring test
    (any alias site holds the name), all missing names in one read of each file not read since
    its stat changed; kept in the proof cache per name under the content of every file (engine.proofs)."""
    known = _HOLDING.setdefault(files, {})
    missing = set(names) - known.keys()
    if missing:
        tree = _TREES.get(files) or _TREES.setdefault(files, proofs.tree_digest(files))
        paths = dict(files)
        for name in sorted(missing):
            stored = proofs.get("census-holding", (tree, name))
            if stored is not proofs.MISSING:
                known[name] = [(module, paths[module]) for module in stored]
        missing -= known.keys()
    if missing:
        asked = tuple(sorted(missing))
        hits = {name: [] for name in missing}
        for module, path in files:
            for name in _names_in(path, asked):
                hits[name].append((module, path))
        known.update(hits)
        _TREES[files] = proofs.tree_digest(files)
        if _TREES[files] == tree:  # no file changed while it was read: the key is the scan's
            for name, found in sorted(hits.items()):
                proofs.put("census-holding", (tree, name), tuple(module for module, _ in found))
    for kept in (_HOLDING, _TREES):
        while len(kept) > 8:
            kept.pop(next(iter(kept)))
    return {name: known[name] for name in names}


def _names_in(path: str, names: tuple) -> frozenset:
    """Which of `names` the text of the file at `path` holds: read again only where the file's
    stat changed (engine.proofs.read_while_unchanged). A copy of the engine with one module
    changed (a doctored tree, a preview build) reads only that module."""
    def read() -> frozenset:
        with open(path, "rb") as handle:
            data = handle.read()
        return frozenset(name for key, members in _key_groups(names).items() if key in data
                         for name, needle in members if needle in data)

    return proofs.read_while_unchanged(_FOUND.setdefault(names, {}), path, read, keep=FOUND_FILES)


@functools.lru_cache(maxsize=64)
def _key_groups(names: tuple) -> dict:
    """Names grouped under a substring they share (at least 5 characters, or the whole
    name), each key tested on a file before its names: fewer passes over 60 MB of text,
    and a file without the key holds none of its names."""
    groups, left = {}, set(names)
    while left:
        counts: dict = {}
        for name in left:
            for size in range(min(5, len(name)), len(name) + 1):
                for start in range(len(name) - size + 1):
                    counts.setdefault(name[start:start + size], set()).add(name)
        key = max(counts, key=lambda k: (len(counts[k]), len(k), k))
        groups[key.encode()] = [(name, name.encode()) for name in sorted(counts[key])]
        left -= counts[key]
    return groups


@functools.lru_cache(maxsize=32)
def _references(files: tuple, names: tuple, holding: tuple) -> tuple:
    found = []
    for module, path in holding:
        with open(path, "rb") as handle:
            data = handle.read()
        hit = {name for name in names if name.encode() in data}
        found.extend(r._replace(name=min(hit)) if r.kind == UNPARSED else r
                     for r in map(Reference._make, _file_references(module, path, data, tuple(sorted(hit))))
                     if r.kind == UNPARSED or r.name in hit)
    return tuple(found)


@proofs.memo("census-references")
def _file_references(module: str, path: str, data: bytes, names: tuple) -> tuple:
    """The identifier-bearing nodes of one file on the lines that hold one of `names`,
    with their scope. Nodes whose lines hold none of them are not visited."""
    try:
        try:  # as the contracts read it (utf-8 text): one parse per process serves both (syntax.parse)
            tree = syntax.parse(data.decode("utf-8"))
        except UnicodeDecodeError:
            tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError) as exc:  # unreadable: a reference there cannot be judged
        return ((module, path, getattr(exc, "lineno", 0) or 0, "<module>", "", UNPARSED, None),)
    needles = [name.encode() for name in names]
    lines = [n for n, text in enumerate(data.split(b"\n"), 1) if any(needle in text for needle in needles)]
    found = []

    def add(node, function, name, kind, receiver=None):
        found.append(Reference(module, path, node.lineno, function, name, kind, receiver))

    def enter(node) -> bool:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return False  # a docstring or bare literal: inert
        first = getattr(node, "lineno", None)
        if first is None:
            return True
        # A definition's line is its `def`; its decorators come before it.
        first = min([first, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        at = bisect.bisect_left(lines, first)
        return at < len(lines) and lines[at] <= (node.end_lineno or first)  # a line of it holds a name

    for node, function in scoped_nodes(tree, enter):
        if isinstance(node, ast.Name):
            add(node, function, node.id, NAME if isinstance(node.ctx, ast.Load) else BIND)
        elif isinstance(node, ast.Attribute):
            add(node, function, node.attr, ATTRIBUTE, _receiver(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                for part in alias.name.split(".") + ([alias.asname] if alias.asname else []):
                    add(node, function, part, IMPORT)
            for part in (getattr(node, "module", None) or "").split("."):
                add(node, function, part, IMPORT)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node, function, node.name, DEFINITION)
        elif isinstance(node, ast.arg):
            add(node, function, node.arg, PARAMETER)
        elif isinstance(node, ast.keyword) and node.arg:
            add(node, function, node.arg, KEYWORD)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                add(node, function, name, BIND)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for word in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value)):
                add(node, function, word, STRING)
    found.sort(key=lambda r: r.line)
    return tuple(map(tuple, found))


def _receiver(node) -> Optional[str]:
    try:
        return ast.unparse(node)
    except Exception:  # an expression unparse cannot render: no receiver to match
        return None


def refuse_unknown(adapter: str, engine, names, sites, what: str) -> list[Reference]:
    """Every reference to `names` is at a known site, else Refused naming the first one
    outside them. Returns the references (all known)."""
    refs = references(engine, names)
    for ref in refs:
        if not any(site.covers(ref) for site in sites):
            raise Refused(adapter, f"{ref.module}:{ref.function}",
                          f"{ref.path}:{ref.line} refers to {ref.name} ({ref.kind}), {what} at a site this adapter "
                          f"does not know or check; review it and declare the site, or leave the flag off",
                          engine.version)
    return refs
