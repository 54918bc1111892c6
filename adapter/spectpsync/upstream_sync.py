"""The engine's own rank-0 broadcast (`SpecTpSync`, sglang 0.5.19+), as the adapters
judge it: which sites a value of its switch SGLANG_SPEC_TP_SYNC selects, how the
pack's sites map onto that release's numbering, and the proof that it does the job.

One judgement for the three adapters that meet it: rank0_broadcast hands its selection
over to it, group_min_memory relies on its memory probe, tp_divergence compares what
its `sync` broadcasts. SUPERSEDED needs a proof, read from the engine's source (so an
installed engine and one read from a release's sources are judged alike):

- the broadcast (`prove_broadcast`): `SpecTpSync.__init__` reads SGLANG_SPEC_TP_SYNC live
  (`envs.SGLANG_SPEC_TP_SYNC.get()`, an EnvStr whose `get` reads os.environ) through
  `parse_spec_tp_sync` and keeps those sites when its group has more than one rank;
  `enabled` is membership of them; `sync` broadcasts `values` itself, in place, from
  rank 0, over the group it was built with, and returns `values`; that group's
  `GroupCoordinator.broadcast` broadcasts its input in place and returns it; nothing in
  the engine subclasses SpecTpSync, reassigns its methods or its sites, and every call of
  `.sync(...)` either passes a tensor the caller holds or uses what `sync` returns;
- the probe (`prove_probe`): `available_memory_gb` calls the engine helper with
  `distributed=enabled(site) and group.world_size > 1` and `cpu_group=group.cpu_group`,
  over the `group` its caller passes, and the helper all_reduces MIN over that cpu_group;
- the groups (`worker_groups`): each worker builds its SpecTpSync over the group that runs
  one batch (`get_dp_tp_group()`: attention-TP under DP attention, else TP), or, 0.5.19's
  DFlash, over the TP group in a release that refuses DFlash with DP attention.

The class and its methods must be plain (no decorator, metaclass or base); on an
installed engine the class attributes must also be the very functions of the checked
source (nothing wrapped them after import; the pack's own wrappers are looked through),
and the class is run once against its own code with a recording group under each value
the ranks may read (`_probe`): os.environ is presented for the call and restored,
nothing is patched. Whatever is not shown is named in the Refused it raises.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import functools
import inspect
import logging
import os
import types
from typing import Optional

from ..engine import census
from ..engine import syntax
from ..engine.contract import POSITIONAL, Contract, Refused
from ..engine.installed import from_source, sibling
from .sites import MEMORY, Site, parse_numbers

MODULE = "sglang.srt.speculative.spec_tp_sync"
ENGINE_FLAG = "SGLANG_SPEC_TP_SYNC"
DEFAULT_SOURCE = 'SGLANG_SPEC_TP_SYNC = EnvStr("all")'
CLASS = "SpecTpSync"
ENVIRON = "sglang.srt.environ"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
DP_ATTENTION = "sglang.srt.layers.dp_attention"
HELPER_HOME = "sglang.srt.utils.common"
HELPER = "get_available_gpu_memory"
SPECULATIVE_HOOK = "sglang.srt.arg_groups.speculative_hook"
WORKERS = {"sglang.srt.speculative.dspark_components.dspark_worker_v2": "DSparkWorkerV2",
           "sglang.srt.speculative.dflash_worker_v2": "DFlashWorkerV2"}
BATCH, TP = "batch", "tp"  # the group a worker builds its SpecTpSync over (worker_groups)


# ---------------------------------------------------------------- sites and selection


def engine_sites(contract: Contract) -> dict[str, int]:
    """SpecTpSyncSite member name -> number, as this release defines them."""
    contract.attr(CLASS)
    members = contract.attr("SpecTpSyncSite")
    if from_source(contract.module):  # read from source, the members are their literal numbers
        return {k: v for k, v in vars(members).items() if k.isupper() and isinstance(v, int)}
    return {s.name: int(s) for s in members}


def to_engine(contract: Contract, sites) -> frozenset[int]:
    """The engine's site numbers for the pack's `sites` (0.5.19-0.5.21 split the draft
    site into per-path sites 2-6)."""
    numbers = engine_sites(contract)
    mapped = set()
    for site in sites:
        if site.name in numbers:
            mapped.add(numbers[site.name])
        elif site is Site.DSPARK_DRAFT:
            per_path = [n for name, n in numbers.items() if name.startswith(("DSPARK_DRAFT_", "DSPARK_GRAPH_"))]
            if not per_path:
                raise contract.refuse("SpecTpSyncSite", "has neither DSPARK_DRAFT nor the per-path draft sites")
            mapped.update(per_path)
        else:
            raise contract.refuse("SpecTpSyncSite", f"has no site {site.name}")
    return frozenset(mapped)


def parse_user_value(contract: Contract, raw: str) -> frozenset[int]:
    """The sites a value the user set selects, by the engine's own parser: the grammar
    changed across releases, so only the release itself can say."""
    parse = contract.params("parse_spec_tp_sync", {"spec": POSITIONAL})
    if from_source(contract.module):
        raise contract.refuse(ENGINE_FLAG, f"={raw!r} is set; judging it needs the engine's own parser: "
                                           "run doctor on the installed engine")
    try:
        with _quiet(contract.module):  # retired tokens log a warning
            return frozenset(int(s) for s in parse(raw))
    except ValueError as exc:
        raise contract.refuse(ENGINE_FLAG, f"the engine cannot parse {raw!r}: {exc}")


def run_value(context) -> Optional[str]:
    """SGLANG_SPEC_TP_SYNC as the engine's processes will read it (None: unset)."""
    return context.handed.get(ENGINE_FLAG, context.environ.get(ENGINE_FLAG))


def selected(contract: Contract, context, engine=None) -> tuple[str, frozenset[int]]:
    """(what selects, the engine's site numbers) the engine's processes will run with:
    the pack's hand-over, else the user's value, else the release's default (and, with
    `engine`, where the engine sets the switch itself when it is unset)."""
    handed = context.handed.get(ENGINE_FLAG)
    if handed is not None:  # written by the pack itself: bare numbers
        source = f"DSV41_SPEC_TP_SYNC={context.environ.get('DSV41_SPEC_TP_SYNC')!r}"
        return f"{ENGINE_FLAG}={handed!r} (handed over from {source})", parse_numbers(handed)
    raw = context.environ.get(ENGINE_FLAG)
    if raw is not None:
        return f"{ENGINE_FLAG}={raw!r}", parse_user_value(contract, raw)
    environ_module = Contract(contract.adapter, sibling(contract.module, ENVIRON))
    if DEFAULT_SOURCE not in environ_module.source():
        raise contract.refuse(f"{ENVIRON}:{ENGINE_FLAG}", "its default is no longer 'all'")
    own = "".join(f"; the engine sets {value} itself where it is unset ({where})"
                  for where, value in (engine_writes(engine) if engine is not None else ()))
    return f"{ENGINE_FLAG} unset (default 'all'{own})", frozenset(engine_sites(contract).values())


# ---------------------------------------------------------------- the deployment


def judged_for(topology) -> str:
    """The server arguments a verdict used, for its reason."""
    return (f"for {topology.describe()}" if topology is not None
            else "for every deployment (server arguments unknown)")


def spec_group_ranks(topology, kind: str) -> int:
    """Ranks in the group a worker built its SpecTpSync over (`kind` from worker_groups)."""
    return topology.tp_size if kind == TP else topology.batch_group_size


def memory_reached(topology, groups: dict) -> Optional[str]:
    """None when, on `topology`, every worker's SpecTpSync keeps its sites (its group has
    more than one rank) or nothing is distributed at all (TP 1); else why not."""
    if topology is None:
        return "under DP attention with attention-TP 1 SpecTpSync keeps no site"
    if topology.tp_size == 1:
        return None
    short = [worker for worker, kind in groups.items() if spec_group_ranks(topology, kind) == 1]
    if not short:
        return None
    return (f"{' and '.join(short)} build{'s' if len(short) == 1 else ''} SpecTpSync over a group of one rank there: "
            f"it keeps no site, so a probe over a capture group of up to {topology.tp_size} ranks stays per rank "
            "(sgl-project/sglang#39886)")


# ---------------------------------------------------------------- source shapes


def _other(contract: Contract, engine, name: str) -> Contract:
    """Another module of the engine being judged (a doctored copy where there is one)."""
    module = engine.module(name)
    if module is None:
        raise contract.refuse(name, "is missing from this engine")
    return Contract(contract.adapter, module)


def _body(func: ast.FunctionDef) -> list:
    """The statements, a leading docstring left out."""
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _params(func: ast.FunctionDef) -> list[str]:
    return [a.arg for a in func.args.posonlyargs + func.args.args]


def _plain_class(contract: Contract, name: str) -> ast.ClassDef:
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


def _method(contract: Contract, cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if len(found) != 1 or not isinstance(found[0], ast.FunctionDef) or found[0].decorator_list:
        raise contract.refuse(f"{cls.name}.{name}", "is missing, decorated or defined more than once")
    return found[0]


def _function(contract: Contract, name: str) -> ast.FunctionDef:
    """A module-level function's definition, undecorated."""
    found = [n for n in syntax.parse(contract.source()).body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise contract.refuse(name, "is missing or defined more than once at module level")
    if found[0].decorator_list:
        raise contract.refuse(name, "is decorated: what runs is not the checked code")
    return found[0]


def _stores(tree, attr: str, receiver: str) -> list:
    """Assignments to `<receiver>.attr` in `tree`."""
    return [node for node in ast.walk(tree) if _assigns(node, attr, receiver)]


def _assigns(node, attr: str, receiver: str) -> bool:
    """`node` is an assignment to `<receiver>.attr` (among its targets)."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(isinstance(t, ast.Attribute) and t.attr == attr and ast.unparse(t.value) == receiver
               for target in targets for t in ast.walk(target))


def _unparsed(statements) -> list[str]:
    return [ast.unparse(s) for s in statements]


@functools.lru_cache(maxsize=64)
def _relevant(text: str, needles: tuple) -> tuple:
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


# ---------------------------------------------------------------- the broadcast


SITES_KEPT = (f"{CLASS} reads {ENGINE_FLAG} live (envs.{ENGINE_FLAG}.get(), parse_spec_tp_sync) and keeps those "
              "sites when its group has more than one rank; enabled(site) is membership of them")
ENV_READS = (f"envs.{ENGINE_FLAG}.get()",)


_SHOWN: set = set()  # (proof, the source texts it read) shown in this process


def _shown_once(key: tuple, prove) -> None:
    """Run a static proof once per set of source texts it reads: its verdict depends on
    those texts alone (a refusal is not kept: it is raised again on the next call)."""
    if key not in _SHOWN:
        prove()
        _SHOWN.add(key)


def _prove_init(contract: Contract, engine, cls: ast.ClassDef) -> None:
    """__init__(self, group): keeps the group, reads the switch live, keeps its sites when
    the group has more than one rank."""
    _shown_once(("init", contract.source()), lambda: _prove_init_shape(contract, cls))
    _prove_env_read(contract, engine)


def _prove_init_shape(contract: Contract, cls: ast.ClassDef) -> None:
    init = _method(contract, cls, "__init__")
    params = _params(init)
    symbol = f"{CLASS}.__init__"
    if len(params) != 2:
        raise contract.refuse(symbol, f"takes {params}, not (self, group)")
    group = params[1]
    kept = _stores(cls, "_tp_group", "self")
    if len(kept) != 1 or _unparsed(kept) != [f"self._tp_group = {group}"]:
        raise contract.refuse(symbol, f"no longer keeps the group it is built with as its only self._tp_group "
                                      f"({'; '.join(_unparsed(kept)) or 'never set'})")
    sites = _stores(cls, "_sites", "self")
    if len(sites) != 1 or not any(sites[0] is s for s in ast.walk(init)):
        raise contract.refuse(symbol, "no longer sets self._sites once, in __init__")
    value = sites[0].value
    locals_ = {ast.unparse(s.targets[0]): ast.unparse(s.value) for s in _body(init)
               if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)}
    kept_when_plural = (isinstance(value, ast.IfExp) and ast.unparse(value.orelse) == "frozenset()"
                        and ast.unparse(value.test) in (f"{group}.world_size > 1", "self._tp_group.world_size > 1"))
    if not kept_when_plural:
        raise contract.refuse(symbol, f"self._sites = {ast.unparse(value)}: its sites are no longer kept exactly when "
                                      "its group has more than one rank")
    head = ast.unparse(value.body)
    assigned = [n for n in ast.walk(init) if isinstance(n, ast.Name) and n.id == head and isinstance(n.ctx, ast.Store)]
    parsed = locals_.get(head, head) if len(assigned) <= 1 else f"{head}, assigned {len(assigned)} times"
    reads = [f"parse_spec_tp_sync({read})" for read in ENV_READS]
    if parsed not in reads:
        raise contract.refuse(symbol, f"its sites come from {parsed}, not from {ENGINE_FLAG} read live "
                                      f"(parse_spec_tp_sync(envs.{ENGINE_FLAG}.get()))")
    _function(contract, "parse_spec_tp_sync")


def _prove_env_read(contract: Contract, engine) -> None:
    """`envs.SGLANG_SPEC_TP_SYNC.get()` reads os.environ[SGLANG_SPEC_TP_SYNC] when called."""
    environ = _other(contract, engine, ENVIRON)
    _shown_once(("env read", contract.source(), environ.source()), lambda: _prove_env_read_in(contract, environ))


def _prove_env_read_in(contract: Contract, environ: Contract) -> None:
    imported = [n for n in syntax.parse(contract.source()).body if isinstance(n, ast.ImportFrom) and n.module == ENVIRON
                and any(a.name == "envs" and a.asname is None for a in n.names)]
    rebound = [n for n in ast.walk(syntax.parse(contract.source())) if isinstance(n, ast.Name) and n.id == "envs"
               and isinstance(n.ctx, ast.Store)]
    if len(imported) != 1 or rebound:
        raise contract.refuse("envs", f"is not {ENVIRON}.envs, imported once")
    symbol = f"{ENVIRON}:{ENGINE_FLAG}"
    tree = syntax.parse(environ.source())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    declared = [s for s in getattr(classes.get("Envs"), "body", ()) if isinstance(s, ast.Assign)
                and _unparsed(s.targets) == [ENGINE_FLAG]]
    if len(declared) != 1 or not ast.unparse(declared[0].value).startswith("EnvStr("):
        raise contract.refuse(symbol, "is no longer declared once in Envs as an EnvStr")
    plain = [s for s in tree.body if isinstance(s, ast.Assign) and _unparsed(s.targets) == ["envs"]]
    if _unparsed(plain) != ["envs = Envs()"] or any(
            isinstance(s, ast.FunctionDef) and s.name in ("__getattr__", "__getattribute__") for s in classes["Envs"].body):
        raise contract.refuse(symbol, "envs is no longer a plain Envs()")
    field, text = classes.get("EnvField"), classes.get("EnvStr")
    get = next((s for s in getattr(field, "body", ()) if isinstance(s, ast.FunctionDef) and s.name == "get"), None)
    set_name = next((s for s in getattr(field, "body", ()) if isinstance(s, ast.FunctionDef) and s.name == "__set_name__"), None)
    reads_live = get is not None and any(ast.unparse(n) in ("os.getenv(self.name)", "os.environ.get(self.name)")
                                         for n in ast.walk(get))
    names = set_name is not None and "self.name = name" in _unparsed(ast.walk(set_name))
    parse = next((s for s in getattr(text, "body", ()) if isinstance(s, ast.FunctionDef) and s.name == "parse"), None)
    own = (text is not None and _unparsed(text.bases) == ["EnvField"] and parse is not None
           and _unparsed(_body(parse)) == [f"return {_params(parse)[-1]}"]
           and not any(isinstance(s, ast.FunctionDef) and s.name == "get" for s in text.body))
    if not (reads_live and names and own):
        raise contract.refuse(symbol, "EnvStr.get no longer reads os.environ[<its name>] when called")


def _selected_test(test: str, site: str) -> bool:
    return test in (f"{site} in self._sites", f"self.enabled({site})")


def _prove_enabled(contract: Contract, cls: ast.ClassDef) -> None:
    enabled = _method(contract, cls, "enabled")
    params = _params(enabled)
    if len(params) != 2 or _unparsed(_body(enabled)) != [f"return {params[1]} in self._sites"]:
        raise contract.refuse(f"{CLASS}.enabled", "is no longer `return site in self._sites`")


def _prove_sync(contract: Contract, cls: ast.ClassDef) -> None:
    """sync(self, site, values): if the site is selected, self._tp_group.broadcast(values,
    src=0), then return values."""
    sync = _method(contract, cls, "sync")
    symbol = f"{CLASS}.sync"
    params = _params(sync)
    if len(params) != 3:
        raise contract.refuse(symbol, f"takes {params}, not (self, site, values)")
    site, values = params[1:]
    calls = [n for n in ast.walk(sync) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "broadcast"]
    if not calls:
        raise contract.refuse(symbol, f"no longer broadcasts `{values}`: no rank receives rank 0's value")
    if len(calls) > 1:
        raise contract.refuse(symbol, f"broadcasts {len(calls)} times; the checked shape broadcasts once")
    call = calls[0]
    receiver = ast.unparse(call.func.value)
    if receiver != "self._tp_group":
        raise contract.refuse(symbol, f"broadcasts over {receiver}, not the group it was built with (self._tp_group)")
    first = ast.unparse(call.args[0]) if call.args else None
    if first != values:
        raise contract.refuse(symbol, f"broadcasts {first}, not `{values}` itself: the tensor the caller holds "
                                      "keeps its own value")
    src = next((ast.unparse(k.value) for k in call.keywords if k.arg == "src"),
               ast.unparse(call.args[1]) if len(call.args) > 1 else None)
    if src != "0":
        raise contract.refuse(symbol, f"broadcasts from src={src}, not from rank 0")
    returns = [ast.unparse(r.value) if r.value is not None else "None" for r in ast.walk(sync) if isinstance(r, ast.Return)]
    if returns != [values]:
        raise contract.refuse(symbol, f"returns {', '.join(returns) or 'nothing'}, not `{values}`")
    body = _body(sync)
    shape = (len(body) == 2 and isinstance(body[0], ast.If) and not body[0].orelse
             and _selected_test(ast.unparse(body[0].test), site)
             and _unparsed(body[0].body) in ([ast.unparse(call)], [f"{values} = {ast.unparse(call)}"]))
    if not shape:
        raise contract.refuse(symbol, f"is no longer `if {site} in self._sites: self._tp_group.broadcast({values}, "
                                      f"src=0)` then `return {values}`: {' | '.join(_unparsed(body))}")


def _prove_group_broadcast(contract: Contract, engine) -> None:
    """GroupCoordinator.broadcast(input_, src) broadcasts input_ in place and returns it."""
    ps = _other(contract, engine, PARALLEL_STATE)
    cls = next((n for n in syntax.parse(ps.source()).body if isinstance(n, ast.ClassDef) and n.name == "GroupCoordinator"), None)
    symbol = "GroupCoordinator.broadcast"
    if cls is None:
        raise ps.refuse("GroupCoordinator", "is missing")
    func = _method(ps, cls, "broadcast")
    params = _params(func)
    tensor = params[1] if len(params) > 1 else None
    returns = [ast.unparse(r.value) if r.value is not None else "None" for r in ast.walk(func) if isinstance(r, ast.Return)]
    sends = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "broadcast" and n.args and ast.unparse(n.args[0]) == tensor]
    rebinds = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == tensor and isinstance(n.ctx, ast.Store)]
    if not returns or set(returns) != {tensor} or not sends or rebinds:
        raise ps.refuse(symbol, f"no longer broadcasts its input ({tensor}) in place and returns it")


# Attributes of a SpecTpSync that nothing outside the class may write.
_OWN = ("_sites", "_tp_group", "sync", "enabled", "available_memory_gb")


_UNSET_GUARDS = (f"not envs.{ENGINE_FLAG}.is_set()", f"'{ENGINE_FLAG}' not in os.environ")


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
def _engine_scan(files: tuple) -> tuple:
    """(problems, callers, writes): references in `files` (those holding SpecTpSync,
    tp_sync or the switch's name) that would change what SpecTpSync does; how many
    `.sync(...)` calls there are (each one passes a tensor the caller holds or uses the
    result); where the engine sets SGLANG_SPEC_TP_SYNC itself, only where it is unset
    ((place, literal value) pairs; a write that would replace a value set is a problem)."""
    problems, callers, writes = [], 0, []
    for module, path in files:
        if module in (MODULE, ENVIRON):
            continue
        with open(path, "rb") as handle:
            found, calls, written = _file_scan(module, handle.read())
        problems += [f"{path}:{line} {problem}" for line, problem in found]
        callers += calls
        writes += written
    return tuple(problems), callers, tuple(writes)


_NEEDLES = ("sync", "Sync", "SYNC", "setattr")


def _last_name(node) -> Optional[str]:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


@functools.lru_cache(maxsize=256)
def _file_scan(module: str, data: bytes) -> tuple:
    """_engine_scan's findings in one file ((line, problem) pairs), by its text (the same
    file in another engine tree is read once)."""
    problems, callers, writes = [], 0, []
    try:
        nodes = _relevant(data.decode("utf-8"), _NEEDLES)  # the parse the other checks of the file share
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
        elif isinstance(node, ast.ClassDef) and any(_last_name(b) == CLASS for b in node.bases):
            problems.append((line, f"subclasses {CLASS} ({node.name})"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Attribute) and (target.attr in _OWN and "tp_sync" in ast.unparse(target.value)
                                                          or _last_name(target.value) == CLASS):
                    problems.append((line, f"assigns {ast.unparse(target)}"))
        elif isinstance(node, ast.Call) and _last_name(node.func) == "setattr" and node.args and (
                _last_name(node.args[0]) == CLASS or "tp_sync" in ast.unparse(node.args[0])):
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


def _scan(contract: Contract, engine) -> tuple[int, tuple]:
    """Nothing outside the class changes it; its callers read what it broadcasts; the engine
    sets its switch only where unset. (callers, the engine's own writes of the switch)."""
    problems, callers, writes = _engine_scan(tuple(sorted(census.files_holding(engine, (CLASS, "tp_sync", ENGINE_FLAG)))))
    if problems:
        raise contract.refuse(CLASS, f"cannot be shown to broadcast to every caller: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return callers, writes


def engine_writes(engine) -> tuple:
    """Where the engine sets SGLANG_SPEC_TP_SYNC itself when it is unset, and to what
    (0.5.23: MiniMax-M3 with DSpark, 'rng')."""
    return _engine_scan(tuple(sorted(census.files_holding(engine, (CLASS, "tp_sync", ENGINE_FLAG)))))[2]


def prove_broadcast(contract: Contract, engine, run_with: Optional[str] = None) -> list[str]:
    """What shows that SpecTpSync broadcasts rank 0's value into every rank's tensor at the
    selected sites (module docstring); Refused naming what is not shown. `run_with`: the
    SGLANG_SPEC_TP_SYNC value the ranks will read (None: unset), for the run-time probe."""
    cls = _plain_class(contract, CLASS)
    _prove_init(contract, engine, cls)
    _shown_once(("enabled, sync", contract.source()), lambda: (_prove_enabled(contract, cls), _prove_sync(contract, cls)))
    _shown_once(("group broadcast", _other(contract, engine, PARALLEL_STATE).source()),
                lambda: _prove_group_broadcast(contract, engine))
    callers, _ = _scan(contract, engine)
    if not from_source(contract.module):
        _live(contract, cls)
        _probe(contract, run_with, "sync")
    return [SITES_KEPT,
            "sync(site, values) broadcasts `values` itself, in place, from rank 0 over that group when "
            "enabled(site) and returns it",
            f"no decorator, subclass or reassignment in the engine; its {callers} callers pass a tensor they hold or "
            "use what sync returns"]


# ---------------------------------------------------------------- the probe


def prove_helper(contract: Contract, engine) -> str:
    """The engine helper get_available_gpu_memory(device, gpu_id, distributed, empty_cache,
    cpu_group) all_reduces MIN over `cpu_group` when `distributed`, and returns that."""
    home = _other(contract, engine, HELPER_HOME)
    func = _function(home, HELPER)
    params = _params(func)
    symbol = HELPER
    if params[:5] != ["device", "gpu_id", "distributed", "empty_cache", "cpu_group"]:
        raise home.refuse(symbol, f"takes {params}, not (device, gpu_id, distributed, empty_cache, cpu_group)")
    reduced = None
    for statement in _body(func):
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "distributed":
            for node in ast.walk(statement):
                keywords = {k.arg: ast.unparse(k.value) for k in getattr(node, "keywords", ())}
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "all_reduce"
                        and keywords.get("op", "").endswith("ReduceOp.MIN") and keywords.get("group") == "cpu_group"
                        and node.args and isinstance(node.args[0], ast.Name)):
                    tensor = node.args[0].id
                    reduced = next((ast.unparse(s.targets[0]) for s in statement.body if isinstance(s, ast.Assign)
                                    and ast.unparse(s.value) == f"{tensor}.item()"), None)
    last = _body(func)[-1]
    if reduced is None or not (isinstance(last, ast.Return) and any(
            isinstance(n, ast.Name) and n.id == reduced for n in ast.walk(last))):
        raise home.refuse(symbol, "no longer all_reduces MIN over cpu_group when distributed and returns that minimum")
    if not from_source(home.module):
        _live_function(home, getattr(home.module, HELPER), func)
    return f"{HELPER_HOME}.{HELPER} all_reduces MIN over the cpu_group it is given when distributed"


def prove_probe(contract: Contract, engine, run_with: Optional[str] = None) -> list[str]:
    """What shows that SpecTpSync.available_memory_gb(site, device, gpu_id, group=g) is the
    minimum over g whenever the site is selected, g has more than one rank and the
    SpecTpSync's own group has more than one rank; Refused naming what is not shown."""
    cls = _plain_class(contract, CLASS)
    _prove_init(contract, engine, cls)
    _shown_once(("enabled", contract.source()), lambda: _prove_enabled(contract, cls))
    func = _method(contract, cls, "available_memory_gb")
    symbol = f"{CLASS}.available_memory_gb"
    params = _params(func)
    kwonly = [a.arg for a in func.args.kwonlyargs]
    if len(params) != 4 or kwonly != ["group"]:
        raise contract.refuse(symbol, f"takes {params} and {kwonly}, not (self, site, device, gpu_id, *, group)")
    site, device, gpu_id = params[1:]
    body = _body(func)
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and ast.unparse(n.func) == HELPER]
    if len(calls) != 1 or not isinstance(body[-1], ast.Return) or body[-1].value is not calls[0]:
        raise contract.refuse(symbol, f"no longer returns what one call of {HELPER} gives")
    call = calls[0]
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    distributed = keywords.get("distributed")
    locals_ = {ast.unparse(s.targets[0]): ast.unparse(s.value) for s in body[:-1]
               if isinstance(s, ast.Assign) and len(s.targets) == 1}
    reduces = locals_.get(distributed, distributed)
    wanted = [f"{test} and group.world_size > 1" for test in (f"self.enabled({site})", f"{site} in self._sites")]
    if _unparsed(call.args) != [device, gpu_id] or set(keywords) - {"distributed", "cpu_group"}:
        raise contract.refuse(symbol, f"calls {ast.unparse(call)}, not {HELPER}({device}, {gpu_id}, distributed=..., "
                                      "cpu_group=...)")
    if reduces not in wanted:
        raise contract.refuse(symbol, f"reduces when {reduces}, not whenever the site is selected and the group it is "
                                      "given has more than one rank: the probe can stay per rank")
    if keywords.get("cpu_group") not in ("group.cpu_group", f"group.cpu_group if {distributed} else None"):
        raise contract.refuse(symbol, f"reduces over {keywords.get('cpu_group')}, not the group its caller passes "
                                      "(group.cpu_group)")
    if len(body) != len(locals_) + 1:
        raise contract.refuse(symbol, f"has statements besides the reduction: {' | '.join(_unparsed(body))}")
    binding = getattr(contract.module, HELPER, None)
    if (getattr(binding, "__module__", None), getattr(binding, "__name__", None)) != (HELPER_HOME, HELPER):
        raise contract.refuse(HELPER, f"is not the engine helper {HELPER_HOME}.{HELPER} ({binding!r})")
    helper = prove_helper(contract, engine)
    _scan(contract, engine)
    if not from_source(contract.module):
        _live(contract, cls)
        _probe(contract, run_with, "probe")
    return [SITES_KEPT, f"{symbol}(site, ..., group=g) calls the engine helper with distributed=enabled(site) and "
                        "g.world_size > 1, cpu_group=g.cpu_group (the group its caller passes)", helper]


# ---------------------------------------------------------------- the groups


def _batch_group_rule(contract: Contract, engine, expression: str) -> bool:
    """`expression` is the group that runs one batch: attention-TP under DP attention, else TP."""
    if expression == "get_dp_tp_group()":
        binding = getattr(contract.module, "get_dp_tp_group", None)
        if (getattr(binding, "__module__", None), getattr(binding, "__name__", None)) != (DP_ATTENTION, "get_dp_tp_group"):
            return False
        dp = _other(contract, engine, DP_ATTENTION)
        returns = [ast.unparse(s.value) for s in _body(_function(dp, "get_dp_tp_group")) if isinstance(s, ast.Return)]
        return len(returns) == 1 and _batch_rule(returns[0])
    return _batch_rule(expression)


def _batch_rule(expression: str) -> bool:
    try:
        node = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return False
    return (isinstance(node, ast.IfExp) and ast.unparse(node.test).split(".")[-1] in ("attn_dp_enabled", "enable_dp_attention")
            and ast.unparse(node.body).endswith("attn_tp_group")
            and (ast.unparse(node.orelse).endswith(".tp_group") or ast.unparse(node.orelse) == "get_tp_group()"))


def _refuses_dflash_under_dp(contract: Contract, engine) -> bool:
    """The release rejects DFlash with DP attention at start-up (0.5.19's _handle_dflash)."""
    try:
        hook = _other(contract, engine, SPECULATIVE_HOOK)
        func = _function(hook, "_handle_dflash")
    except (Refused, ModuleNotFoundError):
        return False
    return any(isinstance(n, ast.If) and "enable_dp_attention" in ast.unparse(n.test)
               and any(isinstance(s, ast.Raise) for s in n.body) for n in ast.walk(func))


def worker_groups(contract: Contract, engine) -> dict[str, str]:
    """Worker class -> the group it builds its SpecTpSync over: BATCH (the group that runs
    one batch) or TP (the TP group, where the release refuses the worker under DP
    attention, so that it is the batch group on every deployment the engine starts);
    Refused when a worker builds it any other way."""
    groups = {}
    for name, worker in WORKERS.items():
        module = engine.module(name)
        if module is None:
            continue
        found = Contract(contract.adapter, module)
        built = found.calls(CLASS, method=False)
        if len(built) != 1 or found.calls(CLASS, method=True) or len(built[0].node.args) != 1:
            raise found.refuse(CLASS, f"is built {len(built)} times in {name}; expected once, with one group")
        binding = getattr(module, CLASS, None)
        if (getattr(binding, "__module__", None), getattr(binding, "__qualname__", None)) != (MODULE, CLASS):
            raise found.refuse(CLASS, f"is not {MODULE}.{CLASS} in {name} ({binding!r})")
        kept = [node for node, _ in _relevant(found.source(), ("_tp_sync",)) if _assigns(node, "_tp_sync", "self")]
        if built[0].function != f"{worker}.__init__" or len(kept) != 1 or ast.dump(kept[0].value) != ast.dump(built[0].node):
            raise found.refuse(f"{worker}.__init__", f"no longer builds its one self._tp_sync = {CLASS}(...)")
        group = ast.unparse(built[0].node.args[0])
        if _batch_group_rule(found, engine, group):
            groups[worker] = BATCH
        elif group in ("get_tp_group()", "get_parallel().tp_group", "parallel.tp_group") and worker == "DFlashWorkerV2" \
                and _refuses_dflash_under_dp(found, engine):
            groups[worker] = TP
        else:
            raise found.refuse(f"{worker}.__init__", f"builds {CLASS}({group}): not shown to be the group that runs "
                                                     "one batch (get_dp_tp_group())")
    return groups


def describe_groups(groups: dict) -> str:
    """The groups worker_groups found, for a reason."""
    said = {BATCH: "the group that runs one batch (get_dp_tp_group(): attention-TP under DP attention, else TP)",
            TP: "the TP group (this release refuses DFlash with DP attention, so that is the batch group)"}
    by_kind = {kind: [w for w, k in groups.items() if k == kind] for kind in said}
    return "; ".join(f"{' and '.join(workers)} build{'s' if len(workers) == 1 else ''} it over {said[kind]}"
                     for kind, workers in by_kind.items() if workers)


# ---------------------------------------------------------------- installed engines


def _own(owner, name: str):
    """owner.name as the engine defined it: the pack's own wrapper looked through."""
    from ..framework import patching

    current = vars(owner).get(name)
    for saved in patching.applied():
        if saved.owner is owner and saved.name == name and current is saved.replacement:
            return saved.original
    return current


def _live_function(contract: Contract, func, node: ast.FunctionDef, qualname: Optional[str] = None) -> None:
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


def _live(contract: Contract, cls_node: ast.ClassDef) -> None:
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
        value = _own(cls, name)
        if name in defined:
            _live_function(contract, value, defined[name], f"{CLASS}.{name}")
        elif callable(value) or hasattr(value, "__get__") and not isinstance(value, (str, type(None))):
            if name not in ("__dict__", "__weakref__", "__doc__", "__module__"):
                raise contract.refuse(f"{CLASS}.{name}", "was added at run time; its source defines no such method")


class _RecordingGroup:
    """A group of `world_size` ranks as SpecTpSync sees it (this process is a rank other than
    0); `broadcast` records the call and writes rank 0's value, like the real one, in place."""

    RANK0 = 7

    def __init__(self, world_size: int):
        self.world_size, self.rank_in_group, self.cpu_group = world_size, 1, object()
        self.calls: list = []

    def broadcast(self, tensor, src=0):
        self.calls.append((tensor, src))
        tensor.fill_(self.RANK0)
        return tensor


@contextlib.contextmanager
def _quiet(module):
    """The module's logger silenced for the duration (a probe must print nothing)."""
    logger = logging.getLogger(module.__name__)
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


@contextlib.contextmanager
def _presented(value: Optional[str]):
    """os.environ with SGLANG_SPEC_TP_SYNC = value (None: unset) for the duration."""
    before = os.environ.get(ENGINE_FLAG)
    if value is None:
        os.environ.pop(ENGINE_FLAG, None)
    else:
        os.environ[ENGINE_FLAG] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENGINE_FLAG, None)
        else:
            os.environ[ENGINE_FLAG] = before


def _probe(contract: Contract, run_with: Optional[str], part: str) -> None:
    """The installed class run against its own code: built over recording groups of two
    ranks and of one under each value probed, its `sync` must broadcast exactly the sites
    that value selects (and none in a group of one), rank 0's value must reach the
    returned tensor, and available_memory_gb must reduce over the group it is given
    exactly there. Nothing is patched; os.environ is restored."""
    import torch

    cls, sites = contract.attr(CLASS), contract.attr("SpecTpSyncSite")
    methods = {name: _own(cls, name) for name in ("__init__", "enabled", "sync", "available_memory_gb")}
    numbers = {int(s) for s in sites}
    probes = {"off": frozenset(), str(min(numbers)): frozenset({min(numbers)})}
    if run_with is None:
        probes[None] = frozenset(numbers)
    else:
        probes[run_with] = None  # what the engine's own parser makes of it
    for value, expected in probes.items():
        key = (cls, *methods.values(), value, part)  # the objects, held: an id would be another class's once this one died
        if key in _PROBED:
            continue
        problem = _probe_one(cls, sites, methods, value, expected, torch, part)
        if problem:
            raise contract.refuse(CLASS, f"run against its own code with {ENGINE_FLAG}={value!r}: {problem}")
        _PROBED.add(key)


_PROBED: set = set()


def reset() -> None:
    """Forget which engines were run once against their own code and which sources were
    shown (tests)."""
    _PROBED.clear()
    _SHOWN.clear()


def _probe_one(cls, sites, methods, value, expected, torch, part: str) -> Optional[str]:
    """`part`: "sync" (what prove_broadcast claims) or "probe" (what prove_probe claims)."""
    helper_calls = []

    def helper(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):
        helper_calls.append((distributed, cpu_group))
        return 1.0

    probe = methods["available_memory_gb"]
    available = types.FunctionType(probe.__code__, {**probe.__globals__, HELPER: helper}, probe.__name__,
                                   probe.__defaults__, probe.__closure__)
    available.__kwdefaults__ = probe.__kwdefaults__
    module = inspect.getmodule(cls)
    built = {}
    with _quiet(module), _presented(value):
        for ranks in (2, 1):
            group = _RecordingGroup(ranks)
            instance = cls.__new__(cls)
            methods["__init__"](instance, group)
            built[ranks] = (instance, group)
    if expected is None:
        with _quiet(module):
            expected = frozenset(int(s) for s in module.parse_spec_tp_sync(value))
    for ranks, (instance, group) in built.items():
        chosen = {int(site) for site in sites if methods["enabled"](instance, site)}
        want = expected if ranks > 1 else frozenset()
        if chosen != want:
            return (f"in a group of {ranks} rank(s) it selects sites {sorted(chosen)}, not {sorted(want)}: it does "
                    "not select by that variable")
        for site in sites:
            if part == "sync":
                tensor = torch.zeros(2, dtype=torch.int64)
                returned = methods["sync"](instance, site, tensor)
                calls, group.calls = group.calls, []
                if returned is not tensor:
                    return f"sync({site.name}) returned another tensor than the one it was given"
                if bool(calls) != (int(site) in chosen):
                    return f"sync({site.name}) {'broadcast' if calls else 'did not broadcast'} where enabled() says " \
                           f"{int(site) in chosen}"
                if calls and (len(calls) != 1 or calls[0][0] is not tensor or calls[0][1] != 0
                              or not bool((tensor == group.RANK0).all())):
                    return f"sync({site.name}) did not leave rank 0's value in the tensor it was given"
            else:
                del helper_calls[:]
                available(instance, site, "cpu", 0, group=group)
                reduce = int(site) in chosen and group.world_size > 1
                wanted = [(True, group.cpu_group)] if reduce else [(False, None)]
                if [(bool(d), g if d else None) for d, g in helper_calls] != wanted:
                    return f"available_memory_gb({site.name}) called the helper as {helper_calls} over a group of {ranks}"
    return None


def memory_numbers(contract: Contract) -> dict:
    """Site -> the engine's number of the memory sites, checked to be the pack's."""
    numbers = engine_sites(contract)
    for site in MEMORY:
        if numbers.get(site.name) != int(site):
            raise contract.refuse(f"SpecTpSyncSite.{site.name}", f"is {numbers.get(site.name)!r}, expected {int(site)}")
    return {site: int(site) for site in MEMORY}
