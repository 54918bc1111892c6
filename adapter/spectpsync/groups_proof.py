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

from ..engine.contract import Contract, Refused
from .engine_class import CLASS, DP_ATTENTION, MODULE, SPECULATIVE_HOOK
from .plain_source import assigns, body, function, other, relevant

WORKERS = {"sglang.srt.speculative.dspark_components.dspark_worker_v2": "DSparkWorkerV2",
           "sglang.srt.speculative.dflash_worker_v2": "DFlashWorkerV2"}
BATCH, TP = "batch", "tp"  # the group a worker builds its SpecTpSync over (worker_groups)


def _batch_group_rule(contract: Contract, engine, expression: str) -> bool:
    """`expression` is the group that runs one batch: attention-TP under DP attention, else TP."""
    if expression == "get_dp_tp_group()":
        binding = getattr(contract.module, "get_dp_tp_group", None)
        if (getattr(binding, "__module__", None), getattr(binding, "__name__", None)) != (DP_ATTENTION, "get_dp_tp_group"):
            return False
        dp = other(contract, engine, DP_ATTENTION)
        returns = [ast.unparse(s.value) for s in body(function(dp, "get_dp_tp_group")) if isinstance(s, ast.Return)]
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
        hook = other(contract, engine, SPECULATIVE_HOOK)
        func = function(hook, "_handle_dflash")
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
        kept = [node for node, _ in relevant(found.source(), ("_tp_sync",)) if assigns(node, "_tp_sync", "self")]
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


def spec_group_ranks(topology, kind: str) -> int:
    """Ranks in the group a worker built its SpecTpSync over (`kind` from worker_groups)."""
    return topology.tp_size if kind == TP else topology.batch_group_size


def judged_for(topology) -> str:
    """The server arguments a verdict used, for its reason."""
    return (f"for {topology.describe()}" if topology is not None
            else "for every deployment (server arguments unknown)")
