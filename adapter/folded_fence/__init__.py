"""Folded-result fence (DSV41_FOLDED_FENCE).

On DSpark's folded path the accept kernels run inside the target-verify CUDA graph
and leave their results in `DsparkVerifyEpilogue`'s persistent buffers. The engine
hands views of those buffers to the scheduler, whose overlapped host readback runs
on a copy stream while the next verify replay already rewrites them, so TP ranks
can read different steps and commit different token counts (upstream #42465).

The fence copies each escaping result off the buffers on the forward stream, right
where it escapes, before anything else is queued; the readback then reads memory no
replay touches. `read_accept` itself is left alone: from 0.5.22 the captured graph
writes through it. The eager path already returns fresh tensors and is untouched.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import textwrap
import types
from collections.abc import Mapping
from typing import Optional

from ..engine import census
from ..engine import syntax
from ..engine.contract import KEYWORD_ONLY, POSITIONAL, Contract, source_proof, target_modules
from ..engine.installed import from_source
from ..framework import patching
from ..framework.flags import parse_switch
from ..framework.ledger import Ledger, UpstreamFix
from ..framework.plan import Patch, Plan, combine
from ..framework.surface import Surface
from . import accept_snapshot, fence_boundary, fence_forms, logits_readers

NAME = "folded_fence"
FLAG = "DSV41_FOLDED_FENCE"
SUMMARY = "detach DSpark folded verify results from the verify graph's persistent buffers"
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use

SPEC = "sglang.srt.speculative"
PACKAGE = f"{SPEC}.dspark_components"
VERIFY = f"{PACKAGE}.dspark_verify"
SAMPLING_ACCEPT_GRAPH = f"{PACKAGE}.dspark_sampling_accept_graph"
WORKER = f"{PACKAGE}.dspark_worker_v2"
# (module, required): the sampling-accept graph exists from 0.5.23 only.
TARGETS = ((VERIFY, True), (SAMPLING_ACCEPT_GRAPH, False), (WORKER, True))

FIELDS = ("correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens", "out_tokens")
# The epilogue's readers: each returns views of its persistent buffers.
READERS = ("read_accept", "read_block_accept_lens")
# The engine's own fix (upstream PR for #42465) snapshots instead of reading views.
UPSTREAM_SNAPSHOT = "snapshot_accept"


def parse(environ: Mapping[str, str] = os.environ) -> bool:
    return parse_switch(FLAG, environ)


def machine() -> str:
    """Which copy this machine's ranks will use (doctor, the per-rank line), told without
    opening a CUDA context (accept_snapshot.expected_mode)."""
    mode, why = accept_snapshot.expected_mode()
    return f"copy: {mode}" if mode == "one-launch" else f"copy: {mode} ({why})"


# Every function that calls an epilogue reader, per module. A reader call elsewhere
# (other than as an `out=` write target) is an escape route the fence does not
# cover, and the fence refuses rather than report a partial fix as applied.
ESCAPES = {
    VERIFY: ("TargetVerifyExecutor.accept_and_finalize",),
    SAMPLING_ACCEPT_GRAPH: ("DsparkSamplingAcceptGraph.run",),
    WORKER: ("DSparkWorkerV2._block_accept_lens",),
}
# Where each escaping function's instance holds the epilogue (set in its __init__, checked):
# the general form compares what the function returns with that epilogue's buffers.
ROUTE_EPILOGUE = {
    "TargetVerifyExecutor.accept_and_finalize": "verify_epilogue",
    "DsparkSamplingAcceptGraph.run": "_epilogue",
    "DSparkWorkerV2._block_accept_lens": "_verify_epilogue",
}
# Reader calls that are not escapes: a captured write through the views, and the
# upstream fix's snapshot, which copies them.
NOT_ESCAPES = {VERIFY: {"DsparkVerifyEpilogue._accept_static_greedy", f"DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT}"}}
# Parameters the wrappers rely on, per escaping function.
ESCAPE_PARAMS = {
    "TargetVerifyExecutor.accept_and_finalize": {"folded_accept": KEYWORD_ONLY, "bs": KEYWORD_ONLY},
    "DsparkSamplingAcceptGraph.run": {"bs": KEYWORD_ONLY},
    "DSparkWorkerV2._block_accept_lens": {"folded_accept": KEYWORD_ONLY, "bs": KEYWORD_ONLY},
}


@source_proof("folded-fence-reader-uses")
def _reader_uses(contract: Contract, allowed: tuple) -> tuple:
    """The functions that read an epilogue reader in the module, other than as a write target
    (passed as `out=`/`*_out=`: the callee writes through the views); a read outside
    `allowed` is an escape route the fence does not cover, and it refuses."""
    written = {id(kw.value.func) for found in contract.all_calls() for kw in found.node.keywords
               if kw.arg and (kw.arg == "out" or kw.arg.endswith("_out")) and isinstance(kw.value, ast.Call)}
    return tuple(function for reader in READERS for function, _ in contract.only_used_in(
        reader, allowed, attribute=True, required=False, ignore=lambda f: id(f.node) in written))


# The census (adapter.engine.census): every reference anywhere in the engine to an epilogue
# reader or to one of its persistent buffers must be at one of these sites.
EPILOGUE = "DsparkVerifyEpilogue"
# Reader calls whose views are written through (`out=` / `*_out=`), checked as such by
# _reader_uses in their module.
WRITE_TARGETS = {VERIFY: (f"{EPILOGUE}._accept",), SAMPLING_ACCEPT_GRAPH: ("sampling_accept_commit_lens",)}
# The epilogue's own methods that touch its buffers, reviewed on 0.5.16-0.5.23: they
# allocate them, pass them as write targets, copy out of them in place, or (the
# readers) hand out the views the escape routes return.
EPILOGUE_INTERNALS = ("__init__", "read_accept", "read_block_accept_lens", "_accept", "_accept_static_greedy",
                      "_static_accept_tail", "_scatter_future_relay", "run_static")
OVERLAP_UTILS = "sglang.srt.managers.overlap_utils"


def census_sites(buffers: frozenset) -> list:
    readers = frozenset(READERS)
    sites = [census.Site(module, function, readers, frozenset({census.ATTRIBUTE}), "escape route, fenced")
             for module, functions in ESCAPES.items() for function in functions]
    sites += [census.Site(module, function, readers, frozenset({census.ATTRIBUTE}), "checked not to escape")
              for module, functions in (*NOT_ESCAPES.items(), *WRITE_TARGETS.items()) for function in functions]
    sites.append(census.Site(VERIFY, EPILOGUE, readers, frozenset({census.DEFINITION}), "the readers' definitions"))
    sites += [census.Site(VERIFY, f"{EPILOGUE}.{method}", buffers, frozenset({census.ATTRIBUTE}),
                          "the epilogue's own use of its buffers", receiver="self") for method in EPILOGUE_INTERNALS]
    # FutureMap keeps a buffer of its own under one of these names (the epilogue scatters into
    # its relay by copy).
    sites.append(census.Site(OVERLAP_UTILS, "FutureMap", frozenset({"new_seq_lens_buf"}), frozenset({census.ATTRIBUTE}),
                             "FutureMap's own buffer of the same name", receiver="self"))
    # accept_and_finalize is followed only so that the cheap form sees its definitions.
    sites.append(census.Site("sglang.", "*", frozenset({FOLDED_METHOD}), frozenset(census.KINDS) - {census.UNPARSED},
                             "followed for the cheap form only (_defined_elsewhere)"))
    return sites


def epilogue_buffers(contract: Contract) -> frozenset:
    """The persistent buffers the readers hand out views of, read from their source."""
    buffers = set()
    for reader in READERS:
        if not hasattr(contract.attr(EPILOGUE), reader):
            continue  # read_block_accept_lens exists from 0.5.23
        tree = ast.parse(textwrap.dedent(contract.function_source(f"{EPILOGUE}.{reader}")))
        buffers |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
    if not buffers:
        raise contract.refuse(f"{EPILOGUE}.read_accept", "reads no buffer of the epilogue; what its views alias is unknown")
    return frozenset(buffers)


def _census_names(verify: Contract) -> set:
    """The names the census follows: the readers, their buffers, and accept_and_finalize
    (only to find a definition elsewhere, which the cheap form would not see)."""
    return set(READERS) | epilogue_buffers(verify) | {FOLDED_METHOD}


def _census(engine, verify) -> None:
    """No reference to a reader or a buffer outside the known sites (adapter.engine.census)."""
    contract = Contract(NAME, verify)
    census.refuse_unknown(NAME, engine, _census_names(contract), census_sites(epilogue_buffers(contract)),
                          "an epilogue reader or persistent buffer, whose views the fence may not cover,")


FOLDED_METHOD = "accept_and_finalize"
FOLDED = f"TargetVerifyExecutor.{FOLDED_METHOD}"
READ = f"DsparkVerifyEpilogue.{READERS[0]}"
SNAPSHOT = f"DsparkVerifyEpilogue.{UPSTREAM_SNAPSHOT}"
BOUNDARY = "DSparkWorkerV2.forward_batch_generation"


def _body(contract: Contract, dotted: str) -> list:
    """The statements of a function, its docstring left out."""
    node = ast.parse(textwrap.dedent(contract.function_source(dotted))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _folded_branch(contract: Contract) -> Optional[tuple[bool, str]]:
    """(notes, method) when accept_and_finalize opens with `if folded_accept:` whose body
    is exactly `[self.verify_epilogue.note_static_verify(bs)]` and
    `return self.verify_epilogue.<method>(bs)`; None for any other shape."""
    body = _body(contract, FOLDED)
    if not body or not isinstance(body[0], ast.If) or ast.unparse(body[0].test) != "folded_accept":
        return None
    lines = [ast.unparse(stmt) for stmt in body[0].body]
    notes = lines[:1] == ["self.verify_epilogue.note_static_verify(bs)"]
    found = re.fullmatch(r"return self\.verify_epilogue\.(\w+)\(bs\)", lines[-1]) if len(lines) == 1 + notes else None
    return (notes, found[1]) if found else None


def _returned_struct(body: list) -> Optional[ast.Call]:
    """The `AcceptOuts(...)` a function body ends by returning."""
    last = body[-1] if body else None
    if isinstance(last, ast.Return) and isinstance(last.value, ast.Call) and ast.unparse(last.value.func) == "AcceptOuts":
        return last.value
    return None


def _replicable(contract: Contract) -> Optional[tuple[str, ...]]:
    """The buffer attributes behind FIELDS, in order, when read_accept is exactly
    `return AcceptOuts(<field>=self.<buffer>[:bs], ...)` over every field: what the cheap
    form caches and snapshots. None for any other shape."""
    body = _body(contract, READ)
    call = _returned_struct(body)
    if len(body) != 1 or call is None or call.args:
        return None
    views = {kw.arg: re.fullmatch(r"self\.(\w+)\[:bs\]", ast.unparse(kw.value)) for kw in call.keywords}
    if set(views) != set(FIELDS) or not all(views.values()):
        return None
    return tuple(views[name][1] for name in FIELDS)


def _snapshot_detaches_every_field(contract: Contract) -> bool:
    """Whether the engine's snapshot_accept provably returns a clone of every field:
    `AcceptOuts(<field>=<expr>.clone(), ...)` over all FIELDS, or one `**{f: getattr(x,
    f).clone() for f in AcceptOuts.__struct_fields__}`; a local may hold read_accept(bs)."""
    body = _body(contract, SNAPSHOT)
    call = _returned_struct(body)
    if call is None or call.args or any(not isinstance(stmt, ast.Assign) for stmt in body[:-1]):
        return False
    if [kw.arg for kw in call.keywords] == [None]:
        spread = ast.unparse(call.keywords[0].value)
        return re.fullmatch(r"\{(\w+): getattr\(\w+, \1\)\.clone\(\) for \1 in AcceptOuts\.__struct_fields__\}", spread) is not None
    values = {kw.arg: ast.unparse(kw.value) for kw in call.keywords}
    return set(values) == set(FIELDS) and all(re.fullmatch(r".+\.clone\(\)", v) for v in values.values())


GENERAL_FOLDED = fence_forms.general(ROUTE_EPILOGUE[FOLDED])


def _folded_wrapper(contract: Contract, engine) -> tuple:
    """(wrapper, why not the cheap form): the cheap form only where every function it stands
    in for is exactly the checked source with nothing around it, else the general form."""
    branch, buffers = _folded_branch(contract), _replicable(contract)
    if branch is None or branch[1] != READERS[0]:
        return GENERAL_FOLDED, "the folded branch is not [note_static_verify(bs)] + return read_accept(bs)"
    if buffers is None:
        return GENERAL_FOLDED, "read_accept is not one AcceptOuts(<field>=self.<buffer>[:bs], ...)"
    if not _built_by_keywords(contract):
        return GENERAL_FOLDED, "AcceptOuts runs code of its own when it is built"
    elsewhere = _defined_elsewhere(engine, contract)
    if elsewhere:
        return GENERAL_FOLDED, f"{elsewhere[0].module}:{elsewhere[0].function} defines {elsewhere[0].name} too"
    folded, read = _plain_function(contract, FOLDED), _plain_function(contract, READ)
    if folded is None or read is None:
        return GENERAL_FOLDED, f"{FOLDED if folded is None else READ} is decorated, rebound or wrapped"
    return fence_forms.cheap_form(FIELDS, buffers, branch[0], contract.attr("AcceptOuts"), folded, read), None


@source_proof("folded-fence-built-by-keywords")
def _built_by_keywords(contract: Contract) -> bool:
    """AcceptOuts takes its fields as read_accept passes them, one keyword each, and runs
    nothing of its own (no __init__, __new__, __post_init__, init=False), nor do the bases
    it inherits from, each a class of the module down to msgspec.Struct: the cheap form
    builds it the same way."""
    classes, pending, seen = _classes(contract.source()), ["AcceptOuts"], set()
    while pending:
        name = pending.pop()
        cls = classes.get(name)
        if cls is None or name in seen:  # a base from elsewhere, or one met twice: not followed, general form
            return False
        seen.add(name)
        own = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__new__", "__post_init__")]
        if own or "init=False" in ast.unparse(cls):
            return False
        pending += [name for name in map(ast.unparse, cls.bases) if name != "msgspec.Struct"]
    return True


def _defined_elsewhere(engine, contract: Contract) -> list:
    """Definitions (or bindings) of accept_and_finalize or read_accept anywhere in the
    engine other than the checked ones: an override the cheap form would not run."""
    own = {(FOLDED_METHOD, "TargetVerifyExecutor"), (READERS[0], EPILOGUE)}
    return [ref for ref in census.references(engine, _census_names(contract))
            if ref.name in (FOLDED_METHOD, READERS[0]) and ref.kind in (census.DEFINITION, census.BIND)
            and not (ref.module == VERIFY and (ref.name, ref.function) in own)]


def _plain_function(contract: Contract, dotted: str):
    """The function `dotted` names when it is the class body's one binding of that name, a
    `def` with no decorator, and (on an installed engine) compiled from that very `def` in
    this module's file with nothing wrapped around it since; else None."""
    owner_name, _, name = dotted.rpartition(".")
    owner = contract.attr(owner_name)
    func = patching.original(owner, name) or vars(owner).get(name)
    cls = _classes(contract.source()).get(owner_name)
    nodes = [] if cls is None else [n for n in cls.body if name in _bound_names(n)]
    if len(nodes) != 1 or not isinstance(nodes[0], ast.FunctionDef) or nodes[0].decorator_list:
        return None
    if not isinstance(func, types.FunctionType) or hasattr(func, "__wrapped__"):
        return None
    if from_source(contract.module):
        return func  # read from source: never called, its text is what was checked
    code = func.__code__
    here = os.path.realpath(code.co_filename) == os.path.realpath(contract.module.__file__)
    return func if here and (code.co_name, code.co_firstlineno) == (name, nodes[0].lineno) else None


@functools.lru_cache(maxsize=16)
def _classes(source: str) -> dict:
    """The module's top-level classes by name."""
    return {n.name: n for n in syntax.parse(source).body if isinstance(n, ast.ClassDef)}


def _bound_names(statement) -> set:
    """The names a class-body statement binds."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def _sets_epilogue(contract: Contract, owner: str, attribute: str, reader: str) -> None:
    """`owner.__init__` sets self.<attribute>, where `reader` finds the epilogue at run time."""
    init = f"{owner}.__init__"
    if not any(ast.unparse(t) == f"self.{attribute}" for stmt in ast.walk(ast.parse(textwrap.dedent(
            contract.function_source(init)))) if isinstance(stmt, ast.Assign) for t in stmt.targets):
        raise contract.refuse(init, f"no longer sets self.{attribute}, which {reader} reads")


def _boundary_patch(contract: Contract) -> Patch:
    """Where a verify step's results leave the worker for the scheduler: checked there at
    run time (fence_boundary), whatever route they took."""
    contract.params(BOUNDARY, {"self": POSITIONAL})
    _sets_epilogue(contract, "DSparkWorkerV2", fence_boundary.EPILOGUE, "the boundary check")
    return Patch(contract.attr("DSparkWorkerV2"), "forward_batch_generation", fence_boundary.check_results)


def _module_plan(contract: Contract, engine) -> Plan:
    """The escape routes of one module, each checked; patches nothing."""
    key = contract.module.__name__
    if key == VERIFY:
        contract.struct_fields("AcceptOuts", FIELDS)
        contract.params(READ, {"self": POSITIONAL, "bs": POSITIONAL})
        contract.params(FOLDED, ESCAPE_PARAMS[FOLDED])
    escapes = ESCAPES[key]
    found = _reader_uses(contract, tuple(escapes) + tuple(sorted(NOT_ESCAPES.get(key, ()))))
    seen = sorted({function for function in found if function in escapes})
    patches, notes, short = [], [], []
    for function in seen:
        owner_name, _, attr = function.rpartition(".")
        contract.params(function, ESCAPE_PARAMS[function])
        _sets_epilogue(contract, owner_name, ROUTE_EPILOGUE[function], "the fence")
        wrapper, why = fence_forms.general(ROUTE_EPILOGUE[function]), None
        if function == FOLDED:
            wrapper, why = _folded_wrapper(contract, engine)
        patches.append(Patch(contract.attr(owner_name), attr, wrapper))
        if why:
            notes.append(f"general form on {FOLDED}: {why}")
    if key == VERIFY and FOLDED not in seen:
        branch = _folded_branch(contract)
        if branch is None or branch[1] != UPSTREAM_SNAPSHOT:
            raise contract.refuse(FOLDED, "no longer returns read_accept(bs) on the folded path; what its result aliases is unknown")
        if _snapshot_detaches_every_field(contract):
            notes.append(f"the engine snapshots the folded result itself ({SNAPSHOT} clones every field)")
            short.append(f"the engine's {UPSTREAM_SNAPSHOT} clones the folded result itself")
        else:  # named like upstream's fix but not shown to detach every field: fence it
            _sets_epilogue(contract, "TargetVerifyExecutor", ROUTE_EPILOGUE[FOLDED], "the fence")
            patches.append(Patch(contract.attr("TargetVerifyExecutor"), FOLDED_METHOD, GENERAL_FOLDED))
            notes.append(f"{SNAPSHOT} is not shown to clone every field")
            short.append(f"the engine's {UPSTREAM_SNAPSHOT} is not shown to clone every field")
    if not patches:
        if notes:
            return Plan("superseded", notes[0], short_reason=short[0])
        return Plan("not needed", "no epilogue views escape here")
    fenced = "fenced " + ", ".join(p.where for p in patches)
    return Plan("applied", "; ".join([fenced] + notes), patches, short_reason="; ".join([fenced] + short))


def check(engine, enabled: bool, context) -> Plan:
    """What fencing every escape route takes on `engine`; patches nothing. Every reference
    to a reader or buffer must be at a known site (the census), and where the fence applies
    the results are also checked where they leave the worker (fence_boundary)."""
    modules = target_modules(NAME, engine, TARGETS)
    contracts = {name: Contract(NAME, module) for name, module in modules.items()}
    plan = combine(NAME, engine.version, [_module_plan(contract, engine) for contract in contracts.values()])
    _census(engine, modules[VERIFY])
    if plan.state == "applied":
        routes = len(plan.patches)
        plan.patches.append(_boundary_patch(contracts[WORKER]))
        logits = logits_readers.verdict(engine)
        decided = "left in place" if logits.unread else "copied"
        plan.detail += (f"; boundary check at {BOUNDARY}; the graph's logits {decided} where they leave the worker"
                        f"{' after a watched start' if logits.unread else ''}: {logits.why}")
        # doctor's one line: the routes counted (each named by `doctor folded_fence`), the engine's own
        # snapshot where a module has one, and what the boundary does with the graph's logits
        notes = [part for part in plan.short_reason.split("; ") if not part.startswith("fenced ")]
        plan.short_reason = "; ".join([f"fenced {routes} escape route{'s' if routes > 1 else ''}", *notes,
                                       f"graph logits {decided}"])
    return plan


LEDGER = Ledger(
    why="DSpark's folded accept hands the scheduler views of the verify graph's persistent buffers; the overlapped "
        "host readback can read the next step's values, so TP ranks commit different token counts and deadlock",
    upstream_issue="sgl-project/sglang#42465",
    fixes=(UpstreamFix("the folded path returning snapshot_accept(bs) (upstream's PR for #42465)", None),),
    retire_when="every supported release returns a snapshot from the folded path (the engine check then says "
                "superseded for accept_and_finalize) and no other route hands out the epilogue's views",
)
SURFACE = Surface(name=NAME, flag=FLAG, summary=SUMMARY, parse=parse, check=check, check_value=CHECK_VALUE,
                  ledger=LEDGER, machine=machine, commands={"build-kernel": accept_snapshot.build_command})
