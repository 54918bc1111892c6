"""Rank-0 broadcast per decision site (DSV41_SPEC_TP_SYNC).

Each TP rank takes DSpark / DFlash speculative decisions on its own (draft tokens,
accept triple, prefill tokens, DFlash accept); when one rank decides differently the
ranks commit different token counts and the next collective hangs. Upstream 0.5.19
added `SpecTpSync`, which broadcasts every such decision from rank 0 before any state
derives from it. This adapter does the same on 0.5.16 - 0.5.18 by wrapping the
consumer bindings around each decision (HOOKS), and on 0.5.19+ hands its selection
to the engine's own switch SGLANG_SPEC_TP_SYNC (superseded where SpecTpSync is shown from
its source to do the job: adapter.spectpsync.broadcast_proof.prove_broadcast).

The flag takes upstream's site grammar (adapter.spectpsync.sites); unset or an off word is off.
The memory sites (1, 12) are served by DSV41_GROUP_MIN_MEM before 0.5.19, and the
verify plan (7) is broadcast by those releases themselves.

The pack's own site 31:pack-dflash-draft-greedy (DFlash's greedy draft proposal, which no
release broadcasts: dflash_draft) is selected by its own token, on every release; on
0.5.19+ the pack patches it beside the engine's SpecTpSync sites, which it hands over.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..engine.contract import Contract, Refused, target_modules
from ..framework.ledger import Ledger, UpstreamFix
from ..framework.plan import Plan
from ..framework.surface import SETTING, Surface
from ..spectpsync import broadcast_proof, engine_class, groups_proof, handover, memory_probe_proof, selected_sites
from ..framework.plan import combine
from ..spectpsync.sites import MEMORY, PACK, REPORT_ONLY, labels, parse_selector, slug_of, spans, tokens

NAME = "rank0_broadcast"
FLAG = "DSV41_SPEC_TP_SYNC"
SUMMARY = "broadcast every DSpark/DFlash speculative decision from TP rank 0 (upstream SpecTpSync grammar)"
# The setting doctor's engine check and the compatibility matrix use: every site, the pack's own too.
CHECK_VALUE = "all,pack-dflash-draft-greedy"

from . import before_0_5_19, dflash_draft  # noqa: E402  (they read NAME and FLAG above)
from .before_0_5_19 import DFLASH_WORKER, DRAFT, DRAFT_SAMPLER, DSPARK_WORKER, HOOKS, VERIFY  # noqa: E402,F401

# (module, required); spec_tp_sync exists from 0.5.19 (then superseded).
CLASS = engine_class.CLASS
TARGETS = ((engine_class.MODULE, False), (DRAFT, True), (DRAFT_SAMPLER, False), (VERIFY, True),
           (DSPARK_WORKER, True), (DFLASH_WORKER, True))


def parse(environ: Mapping[str, str] = os.environ) -> frozenset:
    return parse_selector(environ.get(FLAG), FLAG)


def _numbers(sites) -> str:
    return ",".join(str(n) for n in sorted(sites)) or "none"


def _memory_off(context) -> str:
    """What to add where DSV41_GROUP_MIN_MEM serves the memory sites and is off."""
    return "" if context.settings["group_min_memory"] else \
        ", which is off: switch it on (DSV41_GROUP_MIN_MEM=1) to cover them"


def memory_left(memory, context) -> str:
    """The short reason's words for the memory sites left to DSV41_GROUP_MIN_MEM."""
    return f"; {spans(memory)} left to DSV41_GROUP_MIN_MEM" + ("" if context.settings["group_min_memory"] else " (off)")


def _memory_unreached(contract, engine, run_with, topology, groups):
    """Why the engine's own probe is not shown to reduce the memory sites (None: shown)."""
    try:
        _, reach = memory_probe_proof.probe_reach(contract, engine, run_with)
    except Refused as exc:
        return f"{exc.symbol}: {exc.problem}"
    return memory_probe_proof.memory_reached(topology, groups, reach)


def _handover(engine, module, sites: frozenset, context) -> Plan:
    """0.5.19+: the engine's SpecTpSync does the job where it is shown to, for the
    deployment's topology; the selection is handed to SGLANG_SPEC_TP_SYNC in the engine's
    own grammar (spectpsync.handover), keeping every site the engine would keep under it."""
    contract = Contract(NAME, module)
    raw = context.environ.get(FLAG) or _numbers(int(s) for s in sites)
    _no_collision(contract, raw)
    value = handover.value(contract, raw, FLAG)
    mapped = selected_sites.selection(contract, value)
    theirs = context.environ.get(engine_class.ENGINE_FLAG)
    if theirs is not None:
        their_sites = selected_sites.selection(contract, theirs)
        if their_sites != mapped:
            raise contract.refuse(
                engine_class.ENGINE_FLAG,
                f"={theirs!r} selects sites {_numbers(their_sites)} but {FLAG}={raw!r} selects "
                f"{_numbers(mapped)} on this engine; set one of them or make them agree")
    run_with = value if theirs is None else theirs
    shown = broadcast_proof.prove_broadcast(contract, engine, run_with)
    groups = groups_proof.worker_groups(contract, engine)
    topology, memory = context.topology, sites & MEMORY
    where = groups_proof.judged_for(topology)
    unreached = _memory_unreached(contract, engine, run_with, topology, groups) if memory else None
    if unreached and not sites - MEMORY:
        raise contract.refuse(CLASS, f"{FLAG} selects only {labels(memory)}, whose probes the engine is not shown to "
                                     f"reduce {where}: {unreached}; unset {FLAG} and switch on DSV41_GROUP_MIN_MEM=1, "
                                     "which makes those probes the group minimum")
    alone = topology is not None and topology.batch_group_size == 1
    unknown = handover.unknown_sites(contract, mapped)
    detail = (f"{module.__name__}.{CLASS} broadcasts these decisions itself {where}"
              + (" (one rank runs each batch there: nothing to broadcast)" if alone else "")
              + f", shown from its source and by running it: {'; '.join(shown)}; {groups_proof.describe_groups(groups)}"
              + (f"; sites the pack does not know, kept on: {', '.join(unknown)}" if unknown else "")
              + (f"; sites {labels(memory)} are not shown to be reduced there ({unreached}): DSV41_GROUP_MIN_MEM "
                 f"serves them{_memory_off(context)}" if unreached else ""))
    short = (("one rank runs each batch: nothing to broadcast" if alone
              else f"the engine's SpecTpSync broadcasts sites {spans(mapped)}")
             + (f"; {len(unknown)} sites the pack does not know kept on" if unknown else "")
             + (memory_left(memory, context) if unreached else ""))
    handed = f"{FLAG} handed to {engine_class.ENGINE_FLAG}"
    if theirs is None:
        return Plan("superseded", f"{detail}; {handed}={value!r}", env={engine_class.ENGINE_FLAG: value},
                    short_reason=f"{short}; handed to {engine_class.ENGINE_FLAG}={value!r}")
    return Plan("superseded", f"{detail}; {handed} (already set to the same sites)",
                short_reason=f"{short}; {engine_class.ENGINE_FLAG} already selects the same sites")


def _engine_sites_on(module, handed: Plan, context) -> dict:
    """The engine's sites its switch keeps on under what the hand-over left it (name -> label)."""
    contract = Contract(NAME, module)
    value = handed.env.get(engine_class.ENGINE_FLAG, context.environ.get(engine_class.ENGINE_FLAG))
    chosen = selected_sites.selection(contract, value)
    return {name: f"{number}:{slug_of(name)}" for name, number in engine_class.engine_sites(contract).items()
            if number in chosen}


def _no_collision(contract, raw: str) -> None:
    """The user's selection names no token that both the engine and the pack claim. The pack's
    own sites live under their own slugs ("pack-..."); where a release gives a site of its own
    one of the pack's numbers or slugs, only a selection that names that token is ambiguous:
    presets and every other token mean what they meant (adapter.spectpsync.sites)."""
    named = {token.lstrip("-") for token in tokens(raw)}
    for name, number in engine_class.engine_sites(contract).items():
        for site in PACK | REPORT_ONLY:
            clash = named & ({str(number)} & {str(int(site))} | {slug_of(name)} & {site.slug})
            if clash:
                raise contract.refuse(
                    f"SpecTpSyncSite.{name}", f"is {number}:{slug_of(name)}, and {FLAG}={raw!r} names "
                    f"{sorted(clash)[0]!r}, which is also the pack's own site {site.label}: name the pack's by its "
                    f"slug ({site.slug}), or the engine's site by a preset")


def check(engine, setting: frozenset, context) -> Plan:
    """What broadcasting the selected sites from rank 0 takes on `engine`; patches nothing."""
    modules = target_modules(NAME, engine, TARGETS)
    upstream, own = setting - PACK, setting & PACK
    plans = []
    if engine_class.MODULE in modules:  # the engine's sites handed over, "none" where only the pack's own are selected
        plans.append(_handover(engine, modules[engine_class.MODULE], upstream, context))
    elif upstream:
        plans.append(before_0_5_19.plan(engine, modules, upstream, _memory_off(context), memory_left(upstream & MEMORY, context)))
    if own:
        recorded = any(p.where == "DFlashWorkerV2.__init__" for plan in plans for p in plan.patches)
        on = _engine_sites_on(modules[engine_class.MODULE], plans[0], context) if engine_class.MODULE in modules else {}
        plans.append(dflash_draft.plan(engine, modules, recorded, engine_class.MODULE in modules, on))
    if len(plans) == 1:
        return plans[0]
    plan = combine(NAME, engine.version, plans)
    # what the pack patches first, then what it leaves to the engine
    plan.short_reason = "; ".join(p.short_reason for p in sorted(plans, key=lambda p: p.state != "applied"))
    return plan


LEDGER = Ledger(
    why="each TP rank takes DSpark/DFlash decisions on its own (draft tokens, accept triple, prefill tokens, DFlash "
        "accept, DFlash greedy draft); one rank deciding differently makes the ranks commit different token counts "
        "and hang",
    upstream_issue="sgl-project/sglang SpecTpSync (the per-site rank-0 broadcast, SGLANG_SPEC_TP_SYNC); "
                   "sgl-project/sglang#40246 (the DFlash greedy draft, the pack's own site 31)",
    # SpecTpSync (0.5.19) does upstream's sites; no release broadcasts site 31's decision, so at its
    # broadest setting the adapter is superseded nowhere.
    fixes=(UpstreamFix("sgl-project/sglang#40246 (DFlash greedy draft, site 31) on top of SpecTpSync "
                       "(sglang.srt.speculative.spec_tp_sync, 0.5.19: every other site)", None),),
    retire_when="no supported release is older than 0.5.19 and every one carries #40246: then only the hand-over to "
                "SGLANG_SPEC_TP_SYNC is left, which users can set themselves",
    legacy={"before_0_5_19.py": "0.5.16-0.5.18"},
    legacy_until="0.5.19",  # the engine's own SpecTpSync, which the upstream sites are handed to from then on
)
SURFACE = Surface(
    name=NAME, flag=FLAG, summary=SUMMARY, parse=parse, check=check, check_value=CHECK_VALUE, ledger=LEDGER,
    # whether the memory sites it cannot serve are served by that flag; it hands SGLANG_SPEC_TP_SYNC over itself
    reads={"group_min_memory": SETTING},
)
