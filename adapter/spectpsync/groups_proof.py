"""The proof of the group each worker builds its SpecTpSync over, and that group on a
deployment.

Each worker must build its SpecTpSync over the group that runs one batch
(`get_dp_tp_group()`: attention-TP under DP attention, else TP), or, 0.5.19's DFlash, over
the TP group in a release that refuses DFlash with DP attention (then the TP group is the
batch group on every deployment the engine starts). The class keeps its sites only where
that group has more than one rank, so a verdict depends on the deployment: `judged_for`
says which one it used.
"""

from __future__ import annotations

import ast
import functools
import types

from ..engine.contract import Contract, Refused, source_proof
from ..engine.installed import from_source
from . import built_class
from .built_class import WORKERS
from .engine_class import DP_ATTENTION, SPECULATIVE_HOOK
from .plain_source import body, function, other
BATCH, TP = "batch", "tp"  # the group a worker builds its SpecTpSync over (worker_groups)


def _batch_group_rule(contract: Contract, engine, expression: str) -> bool:
    """`expression` is the group that runs one batch: attention-TP under DP attention, else TP."""
    if expression == "get_dp_tp_group()":
        binding = getattr(contract.module, "get_dp_tp_group", None)
        if (getattr(binding, "__module__", None), getattr(binding, "__name__", None)) != (DP_ATTENTION, "get_dp_tp_group"):
            return False
        returns = _returns(other(contract, engine, DP_ATTENTION), "get_dp_tp_group")
        return len(returns) == 1 and _batch_rule(returns[0])
    return _batch_rule(expression)


@source_proof("spectpsync-returns")
def _returns(contract: Contract, name: str) -> tuple:
    """What the module-level function `name` returns, one expression per return statement."""
    return tuple(ast.unparse(s.value) for s in body(function(contract, name)) if isinstance(s, ast.Return))


@functools.lru_cache(maxsize=64)  # a pure reading of one expression, asked by every decision
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
        return _raises_under_dp(other(contract, engine, SPECULATIVE_HOOK))
    except (Refused, ModuleNotFoundError):
        return False


@source_proof("spectpsync-dflash-under-dp")
def _raises_under_dp(hook: Contract) -> bool:
    """_handle_dflash raises where DP attention is on."""
    func = function(hook, "_handle_dflash")
    return any(isinstance(n, ast.If) and "enable_dp_attention" in ast.unparse(n.test)
               and any(isinstance(s, ast.Raise) for s in n.body) for n in ast.walk(func))


def worker_groups(contract: Contract, engine) -> dict[str, str]:
    """Worker class -> the group it builds its SpecTpSync over: BATCH (the group that runs
    one batch) or TP (the TP group, where the release refuses the worker under DP
    attention, so that it is the batch group on every deployment the engine starts);
    Refused when a worker builds it any other way."""
    groups = {}
    built, home = built_class.of(contract, engine)
    for name, worker in WORKERS.items():
        module = engine.module(name)
        if module is None:
            continue
        found = Contract(contract.adapter, module)
        callee, call = built_class.construction(found, worker)
        if not callee:
            raise found.refuse(f"{worker}.__init__", call)
        group = _group_passed(call)
        if group is None:
            raise found.refuse(f"{worker}.__init__", f"builds {call}: expected one argument, the group")
        if not from_source(module):  # what the worker's name holds at run time is the class shown
            _holds_built(found, callee, home.attr(built.name), built)
        if _batch_group_rule(found, engine, group):
            groups[worker] = BATCH
        elif group in ("get_tp_group()", "get_parallel().tp_group", "parallel.tp_group") and worker == "DFlashWorkerV2" \
                and _refuses_dflash_under_dp(found, engine):
            groups[worker] = TP
        else:
            raise found.refuse(f"{worker}.__init__", f"builds {call}: not shown to be the group that runs "
                                                     "one batch (get_dp_tp_group())")
    return groups


@functools.lru_cache(maxsize=64)  # a pure reading of one call, asked by every decision
def _group_passed(call: str):
    """The one positional argument of the construction `call`, None where there is not one."""
    node = ast.parse(call, mode="eval").body
    return ast.unparse(node.args[0]) if len(node.args) == 1 and not node.keywords else None


def _holds_built(found: Contract, callee: str, cls, built) -> None:
    """Installed: the worker module's `callee` is the class shown, by its module and name (or,
    a factory, an engine function of the module the sources name), not something put there
    after import."""
    value = found.module
    for part in callee.split("."):
        value = getattr(value, part, None)
    if value is cls or isinstance(value, type) and (value.__module__, value.__qualname__) == (built.module, built.name):
        return  # the class the sources build (a copy of its module, in a drift test, holds its own)
    if isinstance(value, types.FunctionType) and built.via and any(
            hop.endswith(f"{value.__module__}.{value.__name__}()") for hop in built.via):
        return
    raise found.refuse(callee, f"is {value!r} at run time, not {built.module}.{built.name} its sources build")


def describe_groups(groups: dict) -> str:
    """The groups worker_groups found, for a reason."""
    said = {BATCH: "the group that runs one batch (get_dp_tp_group(): attention-TP under DP attention, else TP)",
            TP: "the TP group (this release refuses DFlash with DP attention, so that is the batch group)"}
    by_kind = {kind: [w for w, k in groups.items() if k == kind] for kind in said}
    return "; ".join(f"{' and '.join(workers)} build{'s' if len(workers) == 1 else ''} it over {said[kind]}"
                     for kind, workers in by_kind.items() if workers)


def spec_group_ranks(topology, kind: str) -> int:
    """Ranks in the group a worker built its SpecTpSync over (`kind` from worker_groups)."""
    return topology.tp_size if kind == TP else topology.batch_group_size


def judged_for(topology) -> str:
    """The server arguments a verdict used, for its reason."""
    return (f"for {topology.describe()}" if topology is not None
            else "for every deployment (server arguments unknown)")
