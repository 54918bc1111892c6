"""The engine's own rank-0 broadcast (`SpecTpSync`, sglang 0.5.19+), as the adapters
judge it: which sites a value of its switch SGLANG_SPEC_TP_SYNC selects, how the
pack's sites map onto that release's numbering, and the proof that it does the job.

One judgement for the three adapters that meet it: rank0_broadcast hands its selection
over to it, group_min_memory relies on its memory probe, tp_divergence compares what
its `sync` broadcasts. SUPERSEDED needs a proof, the same for an installed engine and
one read from a release's sources:

- what the class does, shown by running it (spectpsync.behaviour: the installed class in
  this process, a tree's in a child interpreter): under the value the ranks will read it
  selects what the engine's own parser reads, its `sync` broadcasts the caller's tensor
  once from rank 0 and returns it at exactly those sites, and its `available_memory_gb`
  reduces over the group its caller passes (`probe_reach`: only where its own group has
  more than one rank, or whatever its own group, as upstream's fix #39954 does);
- what running it cannot show, read from the source: the class and its methods are plain
  (no decorator, metaclass or base); `GroupCoordinator.broadcast` broadcasts its input in
  place and returns it; nothing in the engine subclasses SpecTpSync, reassigns its methods
  or its sites, and every call of `.sync(...)` passes a tensor the caller holds or uses
  what `sync` returns; the engine sets its switch only where it is unset; the helper
  `get_available_gpu_memory` all_reduces MIN over the cpu_group it is given;
- the groups (`worker_groups`): each worker builds its SpecTpSync over the group that runs
  one batch (`get_dp_tp_group()`: attention-TP under DP attention, else TP), or, 0.5.19's
  DFlash, over the TP group in a release that refuses DFlash with DP attention.

On an installed engine the class attributes must also be the very functions of the checked
source (nothing wrapped them after import; the pack's own wrappers are looked through).
Whatever is not shown is named in the Refused it raises; where a tree's class cannot run
here, Undecided (decided at launch).
"""

from __future__ import annotations

import ast
import bisect
import functools
import json
import os
import re
import types
from typing import Optional

from ..engine import census, proofs
from ..engine import syntax
from ..engine.contract import Contract, Refused, Undecided, source_proof
from ..engine.installed import from_source, version_of
from . import behaviour
from .sites import MEMORY, Site

MODULE = "sglang.srt.speculative.spec_tp_sync"
ENGINE_FLAG = "SGLANG_SPEC_TP_SYNC"
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
EVERY, BATCH_ONLY = "every layout", "where a batch runs on several ranks"  # how far the engine's probe reaches


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


def engine_parse(contract: Contract, raw: str) -> frozenset[int]:
    """The sites `raw` selects by the engine's own parse_spec_tp_sync (its grammar and
    presets changed across releases and will again: only the release can say); Refused
    naming the engine's error where it cannot parse it."""
    seen = observed(contract, [raw])[raw]
    if seen["parse_error"]:
        raise _unparsed_value(contract, raw, seen["parse_error"])
    return frozenset(seen["parse"])


def _unparsed_value(contract: Contract, raw: str, error: str) -> Refused:
    """The engine's parser refusing `raw` (a ValueError: the value), or failing itself."""
    if error.startswith("ValueError"):
        return contract.refuse(ENGINE_FLAG, f"the engine cannot parse {raw!r}: {error}")
    return contract.refuse("parse_spec_tp_sync", f"cannot be run on {raw!r}: {error}")


def parse_user_value(contract: Contract, raw: str) -> frozenset[int]:
    """The sites a value the user set selects, as the engine's class selects them when built."""
    return selection(contract, raw)


def run_value(context) -> Optional[str]:
    """SGLANG_SPEC_TP_SYNC as the engine's processes will read it (None: unset)."""
    return context.handed.get(ENGINE_FLAG, context.environ.get(ENGINE_FLAG))


def selected(contract: Contract, context, engine=None) -> tuple[str, frozenset[int]]:
    """(what selects, the engine's site numbers) the engine's processes will run with:
    the pack's hand-over, else the user's value, else the class's own default (and, with
    `engine`, where the engine sets the switch itself when it is unset), each as the
    engine's class selects when built under it."""
    handed = context.handed.get(ENGINE_FLAG)
    if handed is not None:
        source = f"DSV41_SPEC_TP_SYNC={context.environ.get('DSV41_SPEC_TP_SYNC')!r}"
        return f"{ENGINE_FLAG}={handed!r} (handed over from {source})", selection(contract, handed)
    raw = context.environ.get(ENGINE_FLAG)
    if raw is not None:
        return f"{ENGINE_FLAG}={raw!r}", selection(contract, raw)
    own = "".join(f"; the engine sets {value} itself where it is unset ({where})"
                  for where, value in (engine_writes(engine) if engine is not None else ()))
    return f"{ENGINE_FLAG} unset (the class's own default{own})", selection(contract, None)


# ---------------------------------------------------------------- the class as it behaves


_OBSERVED: dict = {}  # (the installed class and its functions, value) -> its observation


def observed(contract: Contract, values) -> dict:
    """value -> what the engine's SpecTpSync does built under it (spectpsync.behaviour): the
    installed class run here, the pack's own wrappers looked through; a tree's in a child
    interpreter. Undecided where the tree's class cannot run here."""
    module, values = contract.module, list(dict.fromkeys(values))
    if from_source(module):
        try:
            found = behaviour.observe_tree(str(module.__engine__.root), values)["values"]
        except behaviour.Unobservable as exc:
            raise Undecided(contract.adapter, f"{contract.name}:{CLASS}",
                            f"its class cannot be run from these sources in this interpreter ({exc}); each rank "
                            "runs it at launch", version_of(module)) from None
        return {value: found[json.dumps(value)] for value in values}
    cls = contract.attr(CLASS)
    originals = {name: _own(cls, name) for name in vars(cls)}
    # the objects themselves, held by the key: an id could be reused by another class after this one is gone
    key = (module, cls, tuple(sorted((name, value) for name, value in originals.items()
                                     if isinstance(value, types.FunctionType))))
    missing = [value for value in values if (key, value) not in _OBSERVED]
    if missing:
        found = behaviour.observe_module(module, missing, originals)["values"]
        _OBSERVED.update({(key, value): found[json.dumps(value)] for value in missing})
    return {value: _OBSERVED[(key, value)] for value in values}


def reset() -> None:
    """Forget what was observed of installed classes (tests); what was shown of source texts
    is kept by their content (engine.proofs)."""
    _OBSERVED.clear()


def _said(value: Optional[str]) -> str:
    return f"{ENGINE_FLAG} unset" if value is None else f"{ENGINE_FLAG}={value!r}"


def _seen(contract: Contract, value: Optional[str], part: str = "") -> dict:
    """The observation under `value`, refused where the class is not shown to select by the
    variable or (`part`: "sync" or "probe") where that part misbehaved."""
    seen = observed(contract, [value])[value]
    if value is not None and seen["parse_error"]:
        raise _unparsed_value(contract, value, seen["parse_error"])
    if seen["built_error"]:
        missing = re.search(rf"'{CLASS}' object has no attribute '(\w+)'", seen["built_error"])
        symbol = f"{CLASS}.{missing.group(1)}" if missing else CLASS  # a method it no longer has, named
        raise contract.refuse(symbol, f"built with {_said(value)} it raises {seen['built_error']}")
    if seen["problems"]:
        raise contract.refuse(CLASS, f"run against its own code ({_said(value)}): {seen['problems'][0]}")
    if part and seen[f"{part}_problems"]:
        method = {"sync": "sync", "probe": "available_memory_gb"}[part]
        raise contract.refuse(f"{CLASS}.{method}", f"run against its own code ({_said(value)}): "
                                                   f"{seen[f'{part}_problems'][0]}")
    chosen = seen["selected"]["2"]
    if value is not None and chosen != seen["parse"]:
        raise contract.refuse(CLASS, f"built with {_said(value)} over two ranks it selects {chosen}, not what its "
                                     f"parser reads ({seen['parse']}): it does not select by that variable")
    return seen


def selection(contract: Contract, value: Optional[str]) -> frozenset[int]:
    """The sites the engine's class selects over a group of more than one rank when built
    with the switch at `value` (None: unset)."""
    return frozenset(_seen(contract, value)["selected"]["2"])


# ---------------------------------------------------------------- the deployment


def judged_for(topology) -> str:
    """The server arguments a verdict used, for its reason."""
    return (f"for {topology.describe()}" if topology is not None
            else "for every deployment (server arguments unknown)")


def spec_group_ranks(topology, kind: str) -> int:
    """Ranks in the group a worker built its SpecTpSync over (`kind` from worker_groups)."""
    return topology.tp_size if kind == TP else topology.batch_group_size


def memory_reached(topology, groups: dict, reach: str = BATCH_ONLY) -> Optional[str]:
    """None when, on `topology`, the engine's probe reaches the capture group: everywhere
    (`reach` EVERY), or where every worker's SpecTpSync keeps its sites (its group has more
    than one rank) or nothing is distributed at all (TP 1); else why not."""
    if reach == EVERY:
        return None
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


def _assigns(node, attr: str, receiver: str) -> bool:
    """`node` is an assignment to `<receiver>.attr` (among its targets)."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(isinstance(t, ast.Attribute) and t.attr == attr and ast.unparse(t.value) == receiver
               for target in targets for t in ast.walk(target))


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


def _shown_once(key: tuple, prove) -> None:
    """Run a static proof once per set of source texts it reads (kept in the proof cache):
    its verdict depends on those texts alone (a refusal is not kept: it is raised again on
    the next call)."""
    proofs.cached("spectpsync-shown", proofs.key_of(key), lambda: prove() or True)


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


@proofs.memo("spectpsync-file-scan")
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


def _numbers(numbers) -> str:
    return ",".join(str(n) for n in sorted(numbers)) or "none"


def prove_broadcast(contract: Contract, engine, run_with: Optional[str] = None) -> list[str]:
    """What shows that SpecTpSync broadcasts rank 0's value into every rank's tensor at the
    sites it selects: from its source, that what runs is the class's own code and that
    nothing in the engine changes it or drops what it broadcasts; by running it, that over
    two ranks sync(site, t) broadcasts t itself once from rank 0 and returns it at exactly
    the sites enabled() selects under `run_with` (the value the ranks will read, None:
    unset). Refused naming what is not shown."""
    cls = _plain_class(contract, CLASS)
    _shown_once(("group broadcast", _other(contract, engine, PARALLEL_STATE).source()),
                lambda: _prove_group_broadcast(contract, engine))
    callers, _ = _scan(contract, engine)
    if not from_source(contract.module):
        _live(contract, cls)
    seen = _seen(contract, run_with, "sync")
    chosen, done = seen["selected"]["2"], seen["broadcast"]["2"]
    if chosen != done:
        raise contract.refuse(f"{CLASS}.sync", f"broadcasts sites {_numbers(done)} where enabled() selects "
                                               f"{_numbers(chosen)} ({_said(run_with)})")
    return [f"its own class, run over a group of two ranks with {_said(run_with)}, selects sites {_numbers(chosen)} and "
            "its sync(site, t) broadcasts t itself once from rank 0 and returns it at exactly those",
            f"no decorator, subclass or reassignment in the engine; its {callers} callers pass a tensor they hold or "
            "use what sync returns"]


# ---------------------------------------------------------------- the probe


def prove_helper(contract: Contract, engine) -> str:
    """The engine helper get_available_gpu_memory(device, gpu_id, distributed, empty_cache,
    cpu_group) all_reduces MIN over `cpu_group` when `distributed`, and returns that."""
    home = _other(contract, engine, HELPER_HOME)
    line = _helper_reduces(home)
    if not from_source(home.module):
        _live_function(home, getattr(home.module, HELPER), HELPER, line)
    return f"{HELPER_HOME}.{HELPER} all_reduces MIN over the cpu_group it is given when distributed"


@source_proof("spectpsync-helper-reduces")
def _helper_reduces(home: Contract) -> int:
    """prove_helper from the helper's source: the line of its `def`."""
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
    return func.lineno


def probe_reach(contract: Contract, engine, run_with: Optional[str] = None) -> tuple[list[str], str]:
    """(what shows it, how far it reaches) for SpecTpSync.available_memory_gb(site, ...,
    group=g) being the minimum over g at the memory sites selected under `run_with`:
    BATCH_ONLY where the class reduces only when its own group has more than one rank
    (0.5.19 - 0.5.23), EVERY where it reduces over a capture group of two whatever its own
    group (upstream's fix, sgl-project/sglang#39954, recognised by what it does); Refused
    naming what is not shown."""
    cls = _plain_class(contract, CLASS)
    helper = prove_helper(contract, engine)
    _scan(contract, engine)
    if not from_source(contract.module):
        _live(contract, cls)
    seen = _seen(contract, run_with, "probe")
    memory = set(memory_numbers(contract).values()) & set(seen["selected"]["2"])
    symbol = f"{CLASS}.available_memory_gb"
    missed = sorted(memory - set(seen["reduced"]["2x2"]))
    if missed:
        raise contract.refuse(symbol, f"does not reduce site(s) {_numbers(missed)} over a capture group of two ranks "
                                      f"although it selects them ({_said(run_with)}): the probe can stay per rank")
    every = not memory - set(seen["reduced"]["1x2"])
    how = ("over the capture group it is given whatever its own group, " if every else
           "over the capture group it is given where its own group has more than one rank (none in a group of one), ")
    return [f"its own class, run with {_said(run_with)}, reduces sites {_numbers(memory)} {how}through the engine "
            "helper", helper], (EVERY if every else BATCH_ONLY)


def prove_probe(contract: Contract, engine, run_with: Optional[str] = None) -> list[str]:
    """probe_reach's proof alone."""
    return probe_reach(contract, engine, run_with)[0]


# ---------------------------------------------------------------- the groups


def _batch_group_rule(contract: Contract, engine, expression: str) -> bool:
    """`expression` is the group that runs one batch: attention-TP under DP attention, else TP."""
    if expression == "get_dp_tp_group()":
        binding = getattr(contract.module, "get_dp_tp_group", None)
        if (getattr(binding, "__module__", None), getattr(binding, "__name__", None)) != (DP_ATTENTION, "get_dp_tp_group"):
            return False
        returns = _returns(_other(contract, engine, DP_ATTENTION), "get_dp_tp_group")
        return len(returns) == 1 and _batch_rule(returns[0])
    return _batch_rule(expression)


@source_proof("spectpsync-returns")
def _returns(contract: Contract, name: str) -> tuple:
    """What the module-level function `name` returns, one expression per return statement."""
    return tuple(ast.unparse(s.value) for s in _body(_function(contract, name)) if isinstance(s, ast.Return))


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
        return _raises_under_dp(_other(contract, engine, SPECULATIVE_HOOK))
    except (Refused, ModuleNotFoundError):
        return False


@source_proof("spectpsync-dflash-under-dp")
def _raises_under_dp(hook: Contract) -> bool:
    """_handle_dflash raises where DP attention is on."""
    func = _function(hook, "_handle_dflash")
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
        count, once, kept, group = _tp_sync_built(found, worker)
        if not once:
            raise found.refuse(CLASS, f"is built {count} times in {name}; expected once, with one group")
        binding = getattr(module, CLASS, None)
        if (getattr(binding, "__module__", None), getattr(binding, "__qualname__", None)) != (MODULE, CLASS):
            raise found.refuse(CLASS, f"is not {MODULE}.{CLASS} in {name} ({binding!r})")
        if not kept:
            raise found.refuse(f"{worker}.__init__", f"no longer builds its one self._tp_sync = {CLASS}(...)")
        if _batch_group_rule(found, engine, group):
            groups[worker] = BATCH
        elif group in ("get_tp_group()", "get_parallel().tp_group", "parallel.tp_group") and worker == "DFlashWorkerV2" \
                and _refuses_dflash_under_dp(found, engine):
            groups[worker] = TP
        else:
            raise found.refuse(f"{worker}.__init__", f"builds {CLASS}({group}): not shown to be the group that runs "
                                                     "one batch (get_dp_tp_group())")
    return groups


@source_proof("spectpsync-tp-sync-built")
def _tp_sync_built(found: Contract, worker: str) -> tuple:
    """From the worker module's source: (how many times it calls SpecTpSync(...), whether that
    is once with one argument and never as a method, whether `worker.__init__` keeps exactly
    that call as its one self._tp_sync, the group expression passed)."""
    built = found.calls(CLASS, method=False)
    once = len(built) == 1 and not found.calls(CLASS, method=True) and len(built[0].node.args) == 1
    if not once:
        return len(built), False, False, None
    kept = [node for node, _ in _relevant(found.source(), ("_tp_sync",)) if _assigns(node, "_tp_sync", "self")]
    alone = built[0].function == f"{worker}.__init__" and len(kept) == 1 and ast.dump(kept[0].value) == ast.dump(built[0].node)
    return 1, True, alone, ast.unparse(built[0].node.args[0])


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


def _live_function(contract: Contract, func, name: str, line: int, qualname: Optional[str] = None) -> None:
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
            _live_function(contract, value, name, defined[name].lineno, f"{CLASS}.{name}")
        elif callable(value) or hasattr(value, "__get__") and not isinstance(value, (str, type(None))):
            if name not in ("__dict__", "__weakref__", "__doc__", "__module__"):
                raise contract.refuse(f"{CLASS}.{name}", "was added at run time; its source defines no such method")


def memory_numbers(contract: Contract) -> dict:
    """Site -> the engine's number of the memory sites, checked to be the pack's."""
    numbers = engine_sites(contract)
    for site in MEMORY:
        if numbers.get(site.name) != int(site):
            raise contract.refuse(f"SpecTpSyncSite.{site.name}", f"is {numbers.get(site.name)!r}, expected {int(site)}")
    return {site: int(site) for site in MEMORY}
