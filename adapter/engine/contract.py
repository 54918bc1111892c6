"""What an adapter needs from the engine, checked before anything is patched.

Each adapter states the engine symbols it relies on (names, parameter names and
kinds, struct fields) and, where the hazard can escape through call sites, every
call site it knows. A mismatch raises `Refused`, which names the adapter, the
symbol and the engine version: the engine must then not start.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Callable, Optional

from . import proofs
from .installed import engine_version, version_of
from .source_engine import SourceOnly
from .syntax import Found, index, within

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


class Refused(Exception):
    """The engine drifted from what an adapter needs; the engine must not start."""

    def __init__(self, adapter: str, symbol: str, problem: str, version: Optional[str] = None):
        self.adapter, self.symbol, self.problem = adapter, symbol, problem
        self.version = version or engine_version()
        super().__init__(f"{adapter} refused on sglang {self.version}: {symbol}: {problem}")


class Undecided(Exception):
    """What a verdict rests on cannot be shown where it is asked (a release read from its
    sources whose class cannot run in this interpreter): the ranks decide it at launch,
    where the engine is imported. Never a pass and never a refusal."""

    def __init__(self, adapter: str, symbol: str, problem: str, version: Optional[str] = None):
        self.adapter, self.symbol, self.problem = adapter, symbol, problem
        self.version = version or engine_version()
        super().__init__(f"{adapter} decided at launch on sglang {self.version}: {symbol}: {problem}")




class Contract:
    """Checks one engine module on behalf of one adapter; every failure is a `Refused`."""

    def __init__(self, adapter: str, module, *, name: Optional[str] = None, source: Optional[str] = None,
                 version: Optional[str] = None):
        """`name` and `source` stand in for another file of the same engine as `module`;
        `version`, for the release of a contract without a module (detached)."""
        self.adapter = adapter
        self.module = module
        self.name = name or module.__name__
        self._source = source
        self.version = version

    def refuse(self, symbol: str, problem: str) -> Refused:
        return Refused(self.adapter, f"{self.name}:{symbol}", problem, self.version or version_of(self.module))

    def detached(self) -> "Contract":
        """This contract on its module's source alone: a check given it reads nothing of the
        live module (its `module` is None)."""
        return Contract(self.adapter, None, name=self.name, source=self.source(),
                        version=self.version or version_of(self.module))

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
            raise self.refuse(dotted, _not_callable(func))
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
            return _function_source(func)
        except (OSError, TypeError) as exc:
            raise self.refuse(dotted, f"source is unreadable ({exc})")

    def source(self) -> str:
        if self._source is None:
            try:
                self._source = module_source(self.module)
            except (OSError, TypeError) as exc:
                raise self.refuse("<source>", f"module source is unreadable ({exc}); call sites cannot be checked")
        return self._source

    def uses(self, name: str, *, attribute: bool = False) -> list["Found"]:
        """Every read of `name` in the module: as a bare name, or with `attribute`, as `x.name`."""
        found = index(self.source())
        return list(found.attrs.get(name, ()) if attribute else found.names.get(name, ()))

    def all_calls(self) -> list["Found"]:
        return list(index(self.source()).calls)

    def calls(self, name: str, *, method: bool) -> list["Found"]:
        """Calls `name(...)`, or with `method`, `<anything>.name(...)`."""
        return list(index(self.source()).calls_of.get((method, name), ()))

    def only_used_in(self, name: str, functions: Iterable[str], *, attribute: bool = False, required: bool = True,
                     ignore: Optional[Callable[["Found"], bool]] = None) -> list[tuple[str, int]]:
        """`name` is read only inside `functions` (and, if `required`, at least once): a read
        anywhere else is a path the adapter does not cover; a site that vanished has moved.
        The reads, (function, line) each, `ignore`d ones left out."""
        functions = tuple(functions)
        if ignore is None:
            found = _reads(self, name, attribute)
        else:
            found = tuple((f.function, f.line) for f in self.uses(name, attribute=attribute) if not ignore(f))
        if not found and required:
            raise self.refuse(name, f"no longer used in {', '.join(functions)}; the site moved")
        for function, line in found:
            if not within(function, functions):
                raise self.refuse(function, f"line {line} uses {name}, a path this adapter does not cover")
        return list(found)


_SOURCES: dict = {}  # a module's source file -> (its stat signature, the text read)
KEEP_SOURCES = 256  # files whose text this process keeps (the oldest go first): one tree's checked modules, many times over


def module_source(module) -> str:
    """inspect.getsource(module), read again only where the file's stat changed (as
    proofs.content_digest): a decision builds dozens of contracts on the same few modules,
    and one text object keeps their digests and proof look-ups cheap. A file changed within
    proofs.RACY_NS of its reading, or a module without a .py file, is read every time."""
    path = getattr(module, "__file__", None)
    if not (isinstance(path, str) and path.endswith(".py")):
        return inspect.getsource(module)
    return proofs.read_while_unchanged(_SOURCES, path, lambda: inspect.getsource(module), keep=KEEP_SOURCES)


@functools.lru_cache(maxsize=32)
def _source_digest(text: str) -> str:
    """A module source's sha256, kept by its text: a decision asks it of the same few sources
    dozens of times (a str hashes once, and a kept one is found by identity first)."""
    return proofs.digest(text)


def source_proof(kind: str):
    """A check of one module's source alone, kept in the proof cache (engine.proofs):
    `check(contract, *plain)` runs on the contract detached from the live module, and what it
    returns (plain data) is kept under the source's sha256, the contract's adapter and module
    name, and the plain arguments. A refusal is not kept: it is raised again (with the release
    it names)."""
    def decorate(check):
        @functools.wraps(check)
        def kept(contract: Contract, *args):
            key = (contract.adapter, contract.name, ("sha256", _source_digest(contract.source())), *args)
            return proofs.cached(kind, key, lambda: check(contract.detached(), *args))
        return kept
    return decorate


@source_proof("contract-reads")
def _reads(contract: Contract, name: str, attribute: bool) -> tuple:
    """(function, line) of every read of `name` in the module (Contract.uses)."""
    return tuple((f.function, f.line) for f in contract.uses(name, attribute=attribute))


def _not_callable(value) -> str:
    """Why `value`, found where a function was expected, is refused. A descriptor (a property,
    a functools.partialmethod) still answers a call through an instance, but it is no plain
    function whose signature and source could be checked; nor is an expression read from source."""
    if isinstance(value, SourceOnly) and value.expression is not None:  # a class-body assignment read from source
        return f"is bound to `{value.expression}`, not a plain function: its signature and source cannot be checked"
    if hasattr(type(value), "__get__"):
        kind = type(value)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return f"is a {name}, not a plain function: its signature and source cannot be checked"
    return "is no longer callable"


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


def _function_source(func) -> str:
    """inspect.getsource(func): the `def` block at the code's first line in its file, kept in
    the proof cache under that file's content and that line (what getsource reads)."""
    code = getattr(inspect.unwrap(func), "__code__", None)
    content = proofs.content_digest(code.co_filename) if code is not None else None
    if content is None:  # not a file (linecache may still hold it)
        return inspect.getsource(func)
    return proofs.cached("function-source", (content, code.co_firstlineno), lambda: inspect.getsource(func))
