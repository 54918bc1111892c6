"""The proof that the engine's own `SpecTpSync` (sglang 0.5.19+) broadcasts rank 0's value
into every rank's tensor at the sites it selects.

rank0_broadcast hands its selection over to it and tp_divergence compares what its `sync`
broadcasts; both rest on this proof, the same for an installed engine and one read from a
release's sources (group_min_memory's is memory_probe_proof). SUPERSEDED needs it whole:

- what the class does, shown by running it (observation): under the value the ranks will
  read it selects what the engine's own parser reads, and its `sync` broadcasts the
  caller's tensor once from rank 0 and returns it at exactly those sites;
- what running it cannot show, read from the source: the class and its methods are plain
  and, installed, the very functions of that source (plain_source);
  `GroupCoordinator.broadcast` broadcasts its input in place and returns it; nothing in the
  engine changes the class or drops what it broadcasts (callers_proof).

Over which group each worker builds it is groups_proof's. Whatever is not shown is named in
the Refused it raises; where a tree's class cannot run here, Undecided (decided at launch).
"""

from __future__ import annotations

import ast
from typing import Optional

from ..engine import proofs, syntax
from ..engine.contract import Contract
from ..engine.installed import from_source
from .callers_proof import prove_callers
from . import built_class
from .engine_class import PARALLEL_STATE, listed
from .observation import checked, said
from .plain_source import live_class, method, other, params, plain_class, wrappers

def _shown_once(key: tuple, prove) -> None:
    """Run a static proof once per set of source texts it reads (kept in the proof cache):
    its verdict depends on those texts alone (a refusal is not kept: it is raised again on
    the next call)."""
    proofs.cached("spectpsync-shown", proofs.key_of(key), lambda: prove() or True)


def _prove_group_broadcast(contract: Contract, engine) -> None:
    """GroupCoordinator.broadcast(input_, src) broadcasts input_ in place and returns it."""
    ps = other(contract, engine, PARALLEL_STATE)
    cls = next((n for n in syntax.parse(ps.source()).body if isinstance(n, ast.ClassDef) and n.name == "GroupCoordinator"), None)
    symbol = "GroupCoordinator.broadcast"
    if cls is None:
        raise ps.refuse("GroupCoordinator", "is missing")
    func = method(ps, cls, "broadcast")
    names = params(func)
    tensor = names[1] if len(names) > 1 else None
    returns = [ast.unparse(r.value) if r.value is not None else "None" for r in ast.walk(func) if isinstance(r, ast.Return)]
    sends = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "broadcast" and n.args and ast.unparse(n.args[0]) == tensor]
    rebinds = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == tensor and isinstance(n.ctx, ast.Store)]
    if not returns or set(returns) != {tensor} or not sends or rebinds:
        raise ps.refuse(symbol, f"no longer broadcasts its input ({tensor}) in place and returns it")


def prove_broadcast(contract: Contract, engine, run_with: Optional[str] = None) -> list[str]:
    """What shows that SpecTpSync broadcasts rank 0's value into every rank's tensor at the
    sites it selects: from its source, that what runs is the class's own code and that
    nothing in the engine changes it or drops what it broadcasts; by running it, that over
    two ranks sync(site, t) broadcasts t itself once from rank 0 and returns it at exactly
    the sites enabled() selects under `run_with` (the value the ranks will read, None:
    unset). Refused naming what is not shown."""
    built, home = built_class.of(contract, engine)
    cls = plain_class(home, built.name)
    _shown_once(("group broadcast", other(contract, engine, PARALLEL_STATE).source()),
                lambda: _prove_group_broadcast(contract, engine))
    callers = prove_callers(contract, engine)
    if not from_source(contract.module):
        live_class(home, cls, built.name)
    seen = checked(contract, run_with, "sync", engine)
    chosen, done = seen["selected"]["2"], seen["broadcast"]["2"]
    if chosen != done:
        raise home.refuse(f"{built.name}.sync", f"broadcasts sites {listed(done)} where enabled() selects "
                                                f"{listed(chosen)} ({said(run_with)})")
    wrapped = wrappers(home, built.name)
    return [f"its own class, run over a group of two ranks with {said(run_with)}, selects sites {listed(chosen)} and "
            "its sync(site, t) broadcasts t itself once from rank 0 and returns it at exactly those; that class is "
            f"the one the workers build, {built.said()}"
            + (f" (what runs wrapped as its source says: {'; '.join(wrapped)})" if wrapped else ""),
            f"no other subclass or reassignment in the engine; its {callers} callers pass a tensor they hold or "
            "use what sync returns"]
