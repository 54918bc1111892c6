"""Whether every TP rank will run the pack's plugin, shown with the engine's own code.

Two things must hold. The engine's plugin discovery, run under the environment the
ranks will have, selects the pack's entry point: this runs the installed engine's own
`load_plugins` (its SGLANG_PLUGINS / SGLANG_PLATFORM parsing and filtering, not a copy
of it) against a namespace in which listed entry points are recorded instead of loaded
and nothing is executed or hooked; what it would run is recorded by name, value and
distribution. The loader keeps one entry point per name (the last it loads), so another
distribution registering the pack's name decides by the order of sys.path which one the
ranks run: refused, in either order. And `run_scheduler_process` still calls that loader
before it builds the Scheduler (a source contract, read the same way for installed
engines and engines read from source).

An engine read from a release's sources (doctor --engine) cannot run its own discovery.
Its discovery is judged with the installed engine's code when its loader's source is
byte for byte the installed one (0.5.16 - 0.5.23 all are), so doctor --engine, doctor and
the launcher agree; otherwise it is reported as not checked. Either way the launcher
and every rank judge again with the engine that is really installed.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import textwrap
import types
from collections.abc import Mapping
from typing import NamedTuple, Optional

from ..engine import syntax

PLUGINS = "sglang.srt.plugins"
SCHEDULER = "sglang.srt.managers.scheduler"
RUNNER = "run_scheduler_process"
LOADER = "load_plugins"
GROUP = "sglang.srt.plugins"
TARGET = "sglang_dsv41_adapters.framework.plugin:register"

_quiet = logging.getLogger(f"{__name__}.discovery")
_quiet.disabled = True  # the engine's discovery logs "Loaded plugin ..." for every entry point


class Chosen(NamedTuple):
    """An entry point the engine's loader would run: its name, its value and the
    distribution that registers it (name, version, where)."""

    name: str
    value: str
    dist: str

    def __str__(self) -> str:
        return f"{self.name} = {self.value} from {self.dist}"


class DistFacts(NamedTuple):
    """What discovery reads of an entry point's distribution (its metadata parsed once)."""
    name: str
    version: str
    location: str


@functools.lru_cache(maxsize=None)
def _facts(dist) -> Optional[DistFacts]:
    return None if dist is None else DistFacts(dist.name, dist.version, str(dist.locate_file("")))


def _dist(ep) -> str:
    facts = ep.dist if isinstance(ep.dist, DistFacts) or ep.dist is None else _facts(ep.dist)
    if facts is None:
        return "no distribution"
    return f"{facts.name} {facts.version} ({facts.location})"


class _Listed:
    """An entry point as the engine's discovery sees it; `load()` hands back a callable
    that, when the engine runs it, records the entry point instead of doing anything."""

    def __init__(self, ep: importlib.metadata.EntryPoint, ran: list[Chosen]):
        self.name, self.value, self.group, self.dist = ep.name, ep.value, ep.group, _facts(ep.dist)
        self._ran = ran

    def load(self):
        chosen = Chosen(self.name, self.value, _dist(self))
        return lambda: self._ran.append(chosen)


class _NoHooks:
    @staticmethod
    def apply_hooks() -> None:
        pass


@contextlib.contextmanager
def _presented(environ: Mapping[str, str]):
    """os.environ as `environ` for the duration (the engine reads its switches from
    os.environ at call time); nothing changes when they already match."""
    if environ is os.environ:
        yield
        return
    saved = dict(os.environ)
    changed = {k for k in set(saved) | set(environ) if saved.get(k) != environ.get(k)}
    try:
        _copy_into_environ(changed, environ)
        yield
    finally:
        _copy_into_environ(changed, saved)


def _copy_into_environ(keys, values: Mapping[str, str]) -> None:
    for key in keys:
        if key in values:
            os.environ[key] = values[key]
        else:
            os.environ.pop(key, None)


_ENTRY_POINTS: dict = {}  # (sys.path, its folders' times) -> {selection: entry points}


def entry_points(**selection) -> tuple:
    """importlib.metadata.entry_points(**selection), read once per state of sys.path: a
    folder on it changes its modification time when a distribution is installed or removed."""
    def stamp(folder):
        try:
            return os.stat(folder or ".").st_mtime_ns
        except OSError:
            return None

    state = (tuple(sys.path), tuple(map(stamp, sys.path)))
    if state not in _ENTRY_POINTS:
        _ENTRY_POINTS.clear()  # only the current state is worth keeping
    found = _ENTRY_POINTS.setdefault(state, {})
    key = tuple(sorted(selection.items()))
    if key not in found:
        found[key] = tuple(importlib.metadata.entry_points(**selection))
    return found[key]


def chosen_plugins(environ: Mapping[str, str], plugins=None) -> list[Chosen]:
    """The general plugins the installed engine's `load_plugins()` would run in a process
    with `environ`, in its order: its own functions, rebound to a namespace where discovery
    lists instead of loads, with a fresh idempotence guard and no hook application. Of
    several entry points with one name, the engine keeps one (the last it loads)."""
    if plugins is None:
        plugins = importlib.import_module(PLUGINS)
    ran: list[Chosen] = []
    namespace = dict(vars(plugins))
    namespace.update(
        entry_points=lambda **kw: [_Listed(ep, ran) for ep in entry_points(**kw)],
        HookRegistry=_NoHooks, logger=_quiet, _plugins_loaded=False,
    )
    for name, value in vars(plugins).items():
        if isinstance(value, types.FunctionType) and value.__module__ == plugins.__name__:
            rebound = types.FunctionType(value.__code__, namespace, value.__name__, value.__defaults__, value.__closure__)
            rebound.__kwdefaults__ = value.__kwdefaults__
            namespace[name] = rebound
    with _presented(environ):
        namespace[LOADER]()
    return ran


def discovery_module(engine):
    """The installed plugin loader that runs `engine`'s discovery: the installed engine's,
    or, for an engine read from source, the installed one when its source is the same
    text; None when there is none."""
    from ..engine.installed import InstalledEngine

    if isinstance(engine, InstalledEngine):
        return engine.module(PLUGINS)
    theirs = engine.path(PLUGINS) if hasattr(engine, "path") else None
    try:
        ours = importlib.util.find_spec(PLUGINS)
    except (ImportError, ValueError):
        ours = None
    if theirs is None or ours is None or ours.origin is None:
        return None
    with open(theirs, "rb") as a, open(ours.origin, "rb") as b:
        if a.read() != b.read():
            return None
    return importlib.import_module(PLUGINS)


def _pack_name(registered) -> Optional[str]:
    """The name the pack's plugin is registered under (dsv41_adapters), if it is."""
    return next((ep.name for ep in registered if ep.value == TARGET), None)


def pack_entry_point(environ: Mapping[str, str], plugins=None) -> Optional[Chosen]:
    """What the engine's loader would run under the pack's name in a process with
    `environ`: the pack's entry point, another distribution's, or nothing."""
    name = _pack_name(entry_points(group=GROUP))
    try:
        return next((c for c in chosen_plugins(environ, plugins) if c.name == name), None)
    except Exception:  # discovery that cannot run shows nothing; discovery_problems says why
        return None


def installation_broken() -> bool:
    """The pack's installation fails its ranks whatever the environment: its entry point is
    not registered, or another distribution registers the same name. doctor --strict fails
    on it with every flag off too, so that docker build catches it (the reason is among
    discovery_problems)."""
    registered = list(entry_points(group=GROUP))
    name = _pack_name(registered)
    return name is None or sum(ep.name == name for ep in registered) > 1


def discovery_problems(environ: Mapping[str, str], plugins=None) -> list[str]:
    """Why ranks would not run the pack's plugin under `environ`, if they would not, judged
    by `plugins` (the installed engine's loader by default)."""
    registered = list(entry_points(group=GROUP))
    name = _pack_name(registered)
    if name is None:
        return [
            f"the pack's plugin ({TARGET}) is not registered in entry-point group "
            f"{GROUP}: install the pack with pip so that every TP rank loads it"
        ]
    try:
        chosen = chosen_plugins(environ, plugins)
    except Exception as exc:  # discovery that cannot run proves nothing: fail closed
        return [f"the engine's plugin discovery ({PLUGINS}.{LOADER}) could not be run to show that ranks load the pack: "
                f"{type(exc).__name__}: {exc}"]
    runs = next((c for c in chosen if c.name == name), None)
    same_name = [ep for ep in registered if ep.name == name]
    problems = [_shadowed(same_name, runs)] if len(same_name) > 1 else []
    if runs is not None:
        return problems
    runs = ", ".join(sorted(c.name for c in chosen)) or "no plugin at all"
    setting = ", ".join(f"{k}={environ[k]!r}" for k in ("SGLANG_PLUGINS", "SGLANG_PLATFORM") if k in environ)
    if "SGLANG_PLUGINS" in environ:
        return problems + [f"{setting} does not list the pack's plugin '{name}', so ranks would skip it (the engine's "
                           f"{PLUGINS}.{LOADER} would run {runs}); list '{name}' in SGLANG_PLUGINS or unset it"]
    return problems + [f"the engine's {PLUGINS}.{LOADER} would skip the pack's plugin '{name}' in the ranks"
                       f"{' under ' + setting if setting else ''} (it would run {runs})"]


def _shadowed(same_name: list, runs: Optional[Chosen]) -> str:
    """Several distributions register the pack's entry-point name. The engine loads every
    one of them (importing its module) and runs one per name, the last it loaded: which
    one is a matter of the order of sys.path, never a given."""
    name = same_name[0].name
    listed = "; ".join(str(Chosen(ep.name, ep.value, _dist(ep))) for ep in same_name)
    if runs is None:
        outcome = "which one ranks run depends on the order of sys.path"
    elif runs.value == TARGET:
        outcome = "ranks run the pack's only because its distribution is found last on sys.path"
    else:
        outcome = f"ranks would run {runs.value} from {runs.dist} instead of the pack's {TARGET}"
    return (f"entry point '{name}' in group {GROUP} is registered by {len(same_name)} distributions ({listed}); "
            f"the engine's {PLUGINS}.{LOADER} imports them all and keeps one per name: {outcome}; uninstall the "
            f"other distribution or have it register another name")


def loader_problems(engine) -> list[str]:
    """`run_scheduler_process` calls the engine's plugin loader, unconditionally, before the
    Scheduler is built: else the ranks never run the pack. Read from the source, so the
    installed engine and one read from a release's sources are judged alike."""
    from ..engine.contract import Contract, Refused

    module = engine.module(SCHEDULER)
    if module is None:
        return [f"delivery refused on sglang {engine.version}: {SCHEDULER} is missing, so ranks cannot be shown "
                f"to load the pack"]
    contract = Contract("delivery", module)
    try:
        text = contract.function_source(RUNNER)
        problem = _loader_problem(module, textwrap.dedent(text))
        if problem:
            raise contract.refuse(RUNNER, problem + "; ranks would not run the pack's plugin: use a release "
                                  "this pack supports (docs/COMPATIBILITY.md)")
    except Refused as exc:
        return [str(exc)]
    return []


def _is_loader(value) -> bool:
    return getattr(value, "__name__", None) == LOADER and getattr(value, "__module__", None) == PLUGINS


def _loader_problem(module, text: str) -> Optional[str]:
    # every decision asks; the answer changes only with the module, its source or its loader
    return _loader_problem_of(module, text, getattr(module, LOADER, None))


@functools.lru_cache(maxsize=16)
def _loader_problem_of(module, text: str, loader) -> Optional[str]:
    func = syntax.parse(text).body[0]
    start = _start(module)
    line = lambda node: module.__file__ + (f":{start + node.lineno - 1}" if start else "")  # noqa: E731
    local = any(isinstance(n, ast.ImportFrom) and n.module == PLUGINS and any(a.name == LOADER for a in n.names)
                for n in ast.walk(func))
    if not local and not _is_loader(loader):
        return f"{LOADER} is not the engine's {PLUGINS}.{LOADER} in {module.__name__}"
    loads = builds = None
    for index, statement in enumerate(func.body):
        calls = [n for n in ast.walk(statement) if isinstance(n, ast.Call)]
        if loads is None and isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) \
                and _called(statement.value) == LOADER and not statement.value.args:
            loads = index
        if builds is None and any(_called(c) == "Scheduler" for c in calls):
            builds = (index, next(c for c in calls if _called(c) == "Scheduler"))
    if builds is None:
        return "no longer builds Scheduler(...); where the ranks' scheduler is built is unknown"
    if loads is None:
        return f"no longer calls {LOADER}() as a statement of its own before Scheduler(...) ({line(builds[1])})"
    if loads > builds[0]:
        return f"calls {LOADER}() only after Scheduler(...) is built ({line(builds[1])})"
    return None


def _called(call: ast.Call) -> Optional[str]:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _start(module) -> Optional[int]:
    """The line of its file on which the text of `run_scheduler_process` that was checked
    (Contract.function_source: its decorators first, through any functools.wraps) starts."""
    func = getattr(module, RUNNER)
    start = getattr(func, "__source_line__", None)  # read from a release's sources: its own stub has a __code__
    if start is not None:
        return start
    code = getattr(inspect.unwrap(func), "__code__", None)
    return code.co_firstlineno if code is not None else None
