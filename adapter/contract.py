"""What an adapter needs from the engine, checked before anything is patched.

Each adapter states the engine symbols it relies on (names, parameter names and
kinds, struct fields) and, where the hazard can escape through call sites, every
call site it knows. A mismatch raises `Refused`, which names the adapter, the
symbol and the engine version: the engine must then not start.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable, Optional

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


def engine_version() -> str:
    # Read from the distribution metadata: importing sglang itself has side effects.
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# A module read from a source tree (adapter.source_engine) carries its SourceEngine as
# `__engine__`; the helpers below answer for that engine, else for the installed one.


def version_of(module) -> str:
    """The release a module belongs to."""
    engine = getattr(module, "__engine__", None)
    return engine.version if engine is not None else engine_version()


def package_dir(module, package: str) -> pathlib.Path:
    """Folder of `package` in the engine that `module` comes from."""
    engine = getattr(module, "__engine__", None)
    if engine is not None:
        return pathlib.Path(engine.root, *package.split("."))
    return pathlib.Path(importlib.util.find_spec(package).submodule_search_locations[0])


def installed(name: str) -> bool:
    """Whether the installed engine has module `name` (its parent packages get imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def sibling(module, name: str):
    """Another module of the same engine as `module`: read from the same source tree
    for modules read from source, else imported."""
    engine = getattr(module, "__engine__", None)
    if engine is None:
        return importlib.import_module(name)
    found = engine.module(name)
    if found is None:
        raise ModuleNotFoundError(f"{name} is missing from the engine at {engine.root}")
    return found


def has_module(module, name: str) -> bool:
    """Whether the engine that `module` comes from has module `name` (nothing imported)."""
    engine = getattr(module, "__engine__", None)
    return engine.path(name) is not None if engine is not None else installed(name)


def from_source(module) -> bool:
    """True for modules read from a source tree: their functions cannot be called."""
    return getattr(module, "__engine__", None) is not None


class Refused(Exception):
    """The engine drifted from what an adapter needs; the engine must not start."""

    def __init__(self, adapter: str, symbol: str, problem: str, version: Optional[str] = None):
        self.adapter, self.symbol, self.problem = adapter, symbol, problem
        self.version = version or engine_version()
        super().__init__(f"{adapter} refused on sglang {self.version}: {symbol}: {problem}")


@dataclass(frozen=True)
class Patch:
    """One attribute an adapter replaces: `owner.name` wrapped by `wrapper` (wrapt style)."""

    owner: object
    name: str
    wrapper: Callable


@dataclass
class Plan:
    """What installing an adapter into one module would do, decided by `check`."""

    state: str  # "applied", "superseded" or "not needed"
    detail: str
    patches: list[Patch] = field(default_factory=list)


class Contract:
    """Checks one engine module on behalf of one adapter; every failure is a `Refused`."""

    def __init__(self, adapter: str, module):
        self.adapter = adapter
        self.module = module

    def refuse(self, symbol: str, problem: str) -> Refused:
        return Refused(self.adapter, f"{self.module.__name__}:{symbol}", problem, version_of(self.module))

    def attr(self, dotted: str):
        """Resolve `Class.attr` in the module. A class attribute must be defined on the
        class itself, since a wrapper set on a subclass would shadow, not replace, it."""
        owner, obj = None, self.module
        for part in dotted.split("."):
            source = vars(obj) if (owner is not None and inspect.isclass(obj)) else None
            if source is not None:
                if part not in source:
                    raise self.refuse(dotted, f"'{part}' is not defined on {obj.__name__}")
                owner, obj = obj, source[part]
            elif hasattr(obj, part):
                owner, obj = obj, getattr(obj, part)
            else:
                raise self.refuse(dotted, "missing")
        return obj

    def params(self, dotted: str, required: dict[str, inspect._ParameterKind]):
        """The function exists and takes each named parameter with the given kind."""
        func = self.attr(dotted)
        if not callable(func):
            raise self.refuse(dotted, "is no longer callable")
        sig = inspect.signature(func)
        for name, kind in required.items():
            param = sig.parameters.get(name)
            if param is None:
                raise self.refuse(dotted, f"parameter '{name}' is gone (signature now {sig})")
            if param.kind != kind:
                raise self.refuse(
                    dotted, f"parameter '{name}' is {param.kind.description}, expected {kind.description}"
                )
        return func

    def struct_fields(self, dotted: str, fields: tuple[str, ...]):
        """A msgspec struct or dataclass with exactly these fields: a new field would be
        one the adapter does not handle."""
        cls = self.attr(dotted)
        found = getattr(cls, "__struct_fields__", None)
        if found is None and hasattr(cls, "__dataclass_fields__"):
            found = tuple(cls.__dataclass_fields__)
        if found is None:
            raise self.refuse(dotted, "is no longer a struct with named fields")
        if tuple(found) != tuple(fields):
            raise self.refuse(dotted, f"fields are {tuple(found)}, expected {tuple(fields)}")
        return cls

    def function_source(self, dotted: str) -> str:
        func = self.attr(dotted)
        text = getattr(func, "__source_text__", None)  # a function read from source
        if text is not None:
            return text
        try:
            return inspect.getsource(func)
        except (OSError, TypeError) as exc:
            raise self.refuse(dotted, f"source is unreadable ({exc})")

    def source(self) -> str:
        try:
            return inspect.getsource(self.module)
        except (OSError, TypeError) as exc:
            raise self.refuse("<source>", f"module source is unreadable ({exc}); call sites cannot be checked")


@dataclass(frozen=True)
class Found:
    """A node found in a module's source, with the function that holds it."""

    function: str  # qualified name of the enclosing function (Class.method), or "<module>"
    line: int
    node: ast.AST


def find(tree: ast.AST, match: Callable[[ast.AST], bool]) -> list[Found]:
    """Every node of `tree` for which `match` is true, in source order, each with its
    enclosing function. Read from the source: nothing is imported or run."""
    found: list[Found] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if match(node):
            found.append(Found(".".join(scope) or "<module>", node.lineno, node))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = scope + (node.name,)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, ())
    return found


def calls(tree: ast.AST, name: str, *, method: bool) -> list[Found]:
    """Calls `name(...)`, or with `method`, `<anything>.name(...)`."""
    def match(node) -> bool:
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        return isinstance(func, ast.Attribute) and func.attr == name if method else isinstance(func, ast.Name) and func.id == name
    return find(tree, match)


@dataclass(frozen=True)
class CallSite:
    """A call of one of the watched methods, found in a module's source."""

    function: str  # qualified name of the enclosing function, or "<module>"
    line: int
    method: str
    write_target: bool  # passed as an `out=`/`*_out=` argument: the callee writes through it


def call_sites(source: str, methods: Iterable[str]) -> list[CallSite]:
    """Every call `<anything>.<method>(...)` for the given method names, with the
    function that makes it, and whether it is passed as a write target."""
    tree = ast.parse(source)
    out_args = {
        id(kw.value)
        for node in ast.walk(tree) if isinstance(node, ast.Call)
        for kw in node.keywords if kw.arg and (kw.arg == "out" or kw.arg.endswith("_out"))
    }
    found = [f for method in frozenset(methods) for f in calls(tree, method, method=True)]
    return [
        CallSite(f.function, f.line, f.node.func.attr, id(f.node) in out_args)
        for f in sorted(found, key=lambda f: (f.line, f.node.col_offset))
    ]
