"""The engine's own rank-0 broadcast (`SpecTpSync`, sglang 0.5.19+), as the adapters
judge it: which sites a value of its switch SGLANG_SPEC_TP_SYNC selects, and how the
pack's sites map onto that release's numbering.

One judgement for both adapters that meet it: rank0_broadcast hands its selection
over to it, group_min_memory relies on its memory sites.
"""

from __future__ import annotations

from .contract import POSITIONAL, Contract, from_source, sibling
from .sites import Site, parse_numbers

MODULE = "sglang.srt.speculative.spec_tp_sync"
ENGINE_FLAG = "SGLANG_SPEC_TP_SYNC"
DEFAULT_SOURCE = 'SGLANG_SPEC_TP_SYNC = EnvStr("all")'


def engine_sites(contract: Contract) -> dict[str, int]:
    """SpecTpSyncSite member name -> number, as this release defines them."""
    contract.attr("SpecTpSync")
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
        return frozenset(int(s) for s in parse(raw))
    except ValueError as exc:
        raise contract.refuse(ENGINE_FLAG, f"the engine cannot parse {raw!r}: {exc}")


def selected(contract: Contract, context) -> tuple[str, frozenset[int]]:
    """(what selects, the engine's site numbers) the engine's processes will run with:
    the pack's hand-over, else the user's value, else the release's default."""
    handed = context.handed.get(ENGINE_FLAG)
    if handed is not None:  # written by the pack itself: bare numbers
        source = f"DSV41_SPEC_TP_SYNC={context.environ.get('DSV41_SPEC_TP_SYNC')!r}"
        return f"{ENGINE_FLAG}={handed!r} (handed over from {source})", parse_numbers(handed)
    raw = context.environ.get(ENGINE_FLAG)
    if raw is not None:
        return f"{ENGINE_FLAG}={raw!r}", parse_user_value(contract, raw)
    environ_module = Contract(contract.adapter, sibling(contract.module, "sglang.srt.environ"))
    if DEFAULT_SOURCE not in environ_module.source():
        raise contract.refuse(f"sglang.srt.environ:{ENGINE_FLAG}", "its default is no longer 'all'")
    return f"{ENGINE_FLAG} unset (default 'all')", frozenset(engine_sites(contract).values())
