"""What an adapter needs from the engine, checked before anything is patched.

Each adapter states the engine symbols it relies on (names, parameter names and
kinds, struct fields) and, where the hazard can escape through call sites, every
call site it knows. A mismatch raises `Refused`, which names the adapter, the
symbol and the engine version: the engine must then not start.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


def installed_package() -> Optional[pathlib.Path]:
    """The sglang/ folder this interpreter imports (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(spec.submodule_search_locations[0])


def installed_label():
    """The installed engine's version label, read from the tree that is imported (its own
    version file or the dist-info that lists its files), never from whichever installation
    importlib.metadata finds first; without importing sglang (its import has side effects)."""
    from .source_engine import Label, read_label

    package = installed_package()
    return Label("not installed", None) if package is None else read_label(package.parent)


def engine_version() -> str:
    """The installed engine's release, as its label says (a label, not a verdict's input)."""
    return installed_label().version


# A module read from a source tree (adapter.source_engine) carries its SourceEngine as
# `__engine__`; the helpers below answer for that engine, else for the installed one.


def version_of(module) -> str:
    """The release a module belongs to."""
    engine = getattr(module, "__engine__", None)
    return engine.version if engine is not None else engine_version()


def installed(name: str) -> bool:
    """Whether the installed engine has module `name` (its parent packages get imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


class InstalledEngine:
    """The engine this interpreter imports: its modules are imported for real."""

    @property
    def label(self):
        return installed_label()

    @property
    def version(self) -> str:
        return self.label.version

    @property
    def origin(self) -> Optional[pathlib.Path]:
        """The folder that holds the imported sglang/ (site-packages, a --target folder)."""
        package = installed_package()
        return package.parent if package is not None else None

    def module(self, name: str):
        """The module, or None when this release does not have it."""
        return importlib.import_module(name) if installed(name) else None

    def files(self) -> dict:
        """Module name -> path of every .py file of the installed sglang package."""
        from .census import python_files

        return python_files(installed_package().parent)


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
    """One attribute an adapter replaces: `owner.name` wrapped by `wrapper` (wrapt style),
    or, with `proxy`, replaced by `proxy(original)` (a wrapt.ObjectProxy subclass)."""

    owner: object
    name: str
    wrapper: Optional[Callable] = None
    proxy: Optional[type] = None

    @property
    def where(self) -> str:
        return f"{getattr(self.owner, '__name__', str(self.owner)).rpartition('.')[2]}.{self.name}"


@dataclass
class Plan:
    """What an adapter would do to one engine, decided by its `check`; nothing done yet.

    state: "applied" or "superseded" for a whole adapter ("not needed" for one module);
    env: variables handed to the engine's own switches (the runtime sets them)."""

    state: str
    detail: str
    patches: list[Patch] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hook:
    """One binding an adapter wraps, declared: the checks and the patch derive from it.

    binding: "name" or "Class.attr" in `module`; params: the parameters the wrapper relies
    on (name -> kind); used_in: the functions where the bound name may be used in its
    module (a use anywhere else is a path the wrapper does not see); tag: what the hook
    serves (the rank-0 broadcast's sites)."""

    module: str
    binding: str
    wrapper: Optional[Callable] = None
    params: dict = field(default_factory=dict)
    used_in: tuple[str, ...] = ()
    proxy: Optional[type] = None
    tag: frozenset = frozenset()


class Contract:
    """Checks one engine module on behalf of one adapter; every failure is a `Refused`."""

    def __init__(self, adapter: str, module, *, name: Optional[str] = None, source: Optional[str] = None):
        """`name` and `source` stand in for another file of the same engine as `module`."""
        self.adapter = adapter
        self.module = module
        self.name = name or module.__name__
        self._source = source

    def refuse(self, symbol: str, problem: str) -> Refused:
        return Refused(self.adapter, f"{self.name}:{symbol}", problem, version_of(self.module))

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
        if self._source is None:
            try:
                self._source = inspect.getsource(self.module)
            except (OSError, TypeError) as exc:
                raise self.refuse("<source>", f"module source is unreadable ({exc}); call sites cannot be checked")
        return self._source

    def uses(self, name: str, *, attribute: bool = False) -> list["Found"]:
        """Every read of `name` in the module: as a bare name, or with `attribute`, as `x.name`."""
        index = _index(self.source())
        return list(index.attrs.get(name, ()) if attribute else index.names.get(name, ()))

    def all_calls(self) -> list["Found"]:
        return list(_index(self.source()).calls)

    def calls(self, name: str, *, method: bool) -> list["Found"]:
        """Calls `name(...)`, or with `method`, `<anything>.name(...)`."""
        return [f for f in _index(self.source()).calls
                if (isinstance(f.node.func, ast.Attribute) and f.node.func.attr == name if method
                    else isinstance(f.node.func, ast.Name) and f.node.func.id == name)]

    def only_used_in(self, name: str, functions: Iterable[str], *, attribute: bool = False, required: bool = True,
                     ignore: Callable[["Found"], bool] = lambda found: False) -> list["Found"]:
        """`name` is read only inside `functions` (and, if `required`, at least once): a read
        anywhere else is a path the adapter does not cover; a site that vanished has moved."""
        functions = tuple(functions)
        found = [f for f in self.uses(name, attribute=attribute) if not ignore(f)]
        if not found and required:
            raise self.refuse(name, f"no longer used in {', '.join(functions)}; the site moved")
        for f in found:
            if not within(f.function, functions):
                raise self.refuse(f.function, f"line {f.line} uses {name}, a path this adapter does not cover")
        return found

    def hook(self, hook: Hook) -> Patch:
        """Check one declared hook and return its patch."""
        owner_path, _, attr = hook.binding.rpartition(".")
        if hook.params:
            self.params(hook.binding, hook.params)
        else:
            self.attr(hook.binding)
        if hook.used_in:
            self.only_used_in(attr, hook.used_in)
        owner = self.attr(owner_path) if owner_path else self.module
        return Patch(owner, attr, hook.wrapper, hook.proxy)


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


@functools.lru_cache(maxsize=64)
def _index(source: str) -> Index:
    """The source parsed and indexed once, however many checks read it."""
    index = Index()
    for node, function in scoped_nodes(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            index.names.setdefault(node.id, []).append(Found(function, node.lineno, node))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            index.attrs.setdefault(node.attr, []).append(Found(function, node.lineno, node))
        elif isinstance(node, ast.Call):
            index.calls.append(Found(function, node.lineno, node))
    for found in (*index.names.values(), *index.attrs.values(), index.calls):
        found.sort(key=lambda f: (f.line, f.node.col_offset))
    return index


def target_modules(adapter: str, engine, targets) -> dict:
    """The adapter's target modules in `engine`, by name ((name, required) pairs); a
    required one that is missing, or any that no longer loads, is refused."""
    found = {}
    for name, required in targets:
        try:
            module = engine.module(name)
        except Exception as exc:  # a module that no longer loads cannot be checked
            raise Refused(adapter, name, f"import failed: {type(exc).__name__}: {exc}", engine.version) from exc
        if module is None:
            if required:
                raise Refused(adapter, name, "module is missing from this engine", engine.version)
            continue
        found[name] = module
    return found


def combine(adapter: str, version: str, plans: Iterable[Plan]) -> Plan:
    """One adapter's plan from its per-module plans. A module's "not needed" never makes
    the adapter applied on its own: something must be patched or already fixed upstream."""
    done = [p for p in plans if p.state in ("applied", "superseded")]
    if not done:
        raise Refused(adapter, "<engine>", "found nothing to patch and no upstream fix", version)
    state = "applied" if any(p.state == "applied" for p in done) else "superseded"
    env: dict[str, str] = {}
    for plan in done:
        env.update(plan.env)
    return Plan(state, "; ".join(p.detail for p in done), [x for p in done for x in p.patches], env)
