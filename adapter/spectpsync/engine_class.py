"""The engine's own rank-0 broadcast (`SpecTpSync`, sglang 0.5.19+): where it and the modules
its proofs read live, and how a release numbers its sites.

Every release so far renumbered or split some sites (0.5.19 - 0.5.21 split the draft site
into per-path sites 2-6), so the pack's sites are mapped onto each release's own numbering
by name, read from the release; the memory sites must keep the pack's numbers.
"""

from __future__ import annotations

from ..engine.contract import Contract
from ..engine.installed import from_source
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


def memory_numbers(contract: Contract) -> dict:
    """Site -> the engine's number of the memory sites, checked to be the pack's."""
    numbers = engine_sites(contract)
    for site in MEMORY:
        if numbers.get(site.name) != int(site):
            raise contract.refuse(f"SpecTpSyncSite.{site.name}", f"is {numbers.get(site.name)!r}, expected {int(site)}")
    return {site: int(site) for site in MEMORY}


def listed(numbers) -> str:
    """Site numbers as a reason lists them."""
    return ",".join(str(n) for n in sorted(numbers)) or "none"
