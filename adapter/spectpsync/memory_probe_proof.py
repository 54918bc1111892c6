"""The proof that the engine's own memory probe, `SpecTpSync.available_memory_gb(site, ...,
group=g)`, is the minimum of free memory over the capture group g at the memory sites, and
how far it reaches on a deployment; group_min_memory stands aside only where it does.

By running the class (observation): it reduces the memory sites it selects over a capture
group of two ranks; EVERY where it does so whatever its own group (upstream's fix
sgl-project/sglang#39954, recognised by what it does), BATCH_ONLY where only when its own
group has more than one rank (0.5.19 - 0.5.23). From the source: the class is plain and,
installed, its own (plain_source); nothing in the engine changes it (callers_proof); the
engine helper get_available_gpu_memory all_reduces MIN over the cpu_group it is given.
On a deployment (`memory_reached`), with BATCH_ONLY the probe reaches the capture group
only where every worker's SpecTpSync keeps its sites (groups_proof).
"""

from __future__ import annotations

import ast
from typing import Optional

from ..engine.contract import Contract, source_proof
from ..engine.installed import from_source
from .callers_proof import prove_callers
from . import built_class
from .engine_class import HELPER, HELPER_HOME, listed, memory_numbers
from .groups_proof import spec_group_ranks
from .observation import checked, said
from .plain_source import body, function, live_class, live_function, other, params, plain_class, wrappers

EVERY, BATCH_ONLY = "every layout", "where a batch runs on several ranks"  # how far the engine's probe reaches


def prove_helper(contract: Contract, engine) -> str:
    """The engine helper get_available_gpu_memory(device, gpu_id, distributed, empty_cache,
    cpu_group) all_reduces MIN over `cpu_group` when `distributed`, and returns that."""
    home = other(contract, engine, HELPER_HOME)
    line = _helper_reduces(home)
    if not from_source(home.module):
        live_function(home, getattr(home.module, HELPER), HELPER, line)
    return f"{HELPER_HOME}.{HELPER} all_reduces MIN over the cpu_group it is given when distributed"


@source_proof("spectpsync-helper-reduces")
def _helper_reduces(home: Contract) -> int:
    """prove_helper from the helper's source: the line of its `def`."""
    func = function(home, HELPER)
    names = params(func)
    symbol = HELPER
    if names[:5] != ["device", "gpu_id", "distributed", "empty_cache", "cpu_group"]:
        raise home.refuse(symbol, f"takes {names}, not (device, gpu_id, distributed, empty_cache, cpu_group)")
    reduced = None
    for statement in body(func):
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "distributed":
            for node in ast.walk(statement):
                keywords = {k.arg: ast.unparse(k.value) for k in getattr(node, "keywords", ())}
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "all_reduce"
                        and keywords.get("op", "").endswith("ReduceOp.MIN") and keywords.get("group") == "cpu_group"
                        and node.args and isinstance(node.args[0], ast.Name)):
                    tensor = node.args[0].id
                    reduced = next((ast.unparse(s.targets[0]) for s in statement.body if isinstance(s, ast.Assign)
                                    and ast.unparse(s.value) == f"{tensor}.item()"), None)
    last = body(func)[-1]
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
    built, home = built_class.of(contract, engine)
    cls = plain_class(home, built.name)
    helper = prove_helper(contract, engine)
    prove_callers(contract, engine)
    if not from_source(contract.module):
        live_class(home, cls, built.name)
    seen = checked(contract, run_with, "probe", engine)
    memory = set(memory_numbers(contract).values()) & set(seen["selected"]["2"])
    symbol = f"{built.name}.available_memory_gb"
    missed = sorted(memory - set(seen["reduced"]["2x2"]))
    if missed:
        raise home.refuse(symbol, f"does not reduce site(s) {listed(missed)} over a capture group of two ranks "
                                      f"although it selects them ({said(run_with)}): the probe can stay per rank")
    every = not memory - set(seen["reduced"]["1x2"])
    how = ("over the capture group it is given whatever its own group, " if every else
           "over the capture group it is given where its own group has more than one rank (none in a group of one), ")
    wrapped = wrappers(home, built.name)
    return [f"its own class, run with {said(run_with)}, reduces sites {listed(memory)} {how}through the engine helper; "
            f"that class is the one the workers build, {built.said()}"
            + (f" (what runs wrapped as its source says: {'; '.join(wrapped)})" if wrapped else ""), helper], (
        EVERY if every else BATCH_ONLY)


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
