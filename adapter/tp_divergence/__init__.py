"""Divergence report per rank-0 broadcast site (DSV41_TP_DIVERGENCE).

After a rank-0 broadcast every rank holds rank 0's value, which hides where and how
often the ranks disagreed. With this flag on, each rank compares, at every active
broadcast site, the value it computed with the one rank 0 broadcast, and counts per
site the calls, the calls that differed and the elements that differed, on the device
(adapter.tp_divergence.divergence), reporting them every DSV41_TP_DIVERGENCE_EVERY calls and at exit.
With DSV41_TP_DIVERGENCE=abort a rank also stops at the first divergence it sees: one line
naming the site, the rank, the site's call and both values, then `divergence.Diverged`
raised in the scheduler process, which the engine's run_scheduler_process catches, logs and
answers with SIGQUIT to its parent, the launcher, which kills the process tree (0.5.23
managers/scheduler.py:6370-6373, entrypoints/engine.py:1976-1982). The engine's watchdog dump
gains the report's state (watchdog_dump).

The sites are those broadcast on this deployment: on 0.5.16 - 0.5.18 the pack's own
(rank0_broadcast's selection, through its `broadcast`); on 0.5.19+ the engine's
`SpecTpSync.sync`, at the sites SGLANG_SPEC_TP_SYNC selects as the ranks will read it, and
the pack's `broadcast` at the pack's own sites rank0_broadcast selects (31:pack-dflash-draft-greedy).
On every release, beside them, the pack's report site 30:pack-decode-graph-key: the decode graph
key a target forward replays, rank 0's sent by the report itself (graph_key.py).
The memory sites (1, 12) reduce free memory to a group minimum at start-up and broadcast
no value: nothing to compare there. The broadcast values are left as they were.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from . import divergence
from ..spectpsync import broadcast_proof, engine_class, groups_proof, selected_sites
from ..engine.contract import Contract, Refused, target_modules
from ..framework.plan import Patch, Plan, combine
from ..engine.installed import version_of
from ..framework.flags import FlagError, parse_switch
from ..framework.ledger import Ledger
from ..framework.surface import HANDOVER, SETTING, Surface
from ..spectpsync import broadcast as pack
from ..spectpsync.sites import PACK, Site, labels, slug_of, spans

NAME = "tp_divergence"
FLAG = "DSV41_TP_DIVERGENCE"
EVERY_FLAG = "DSV41_TP_DIVERGENCE_EVERY"
EXTRA_FLAGS = (EVERY_FLAG,)
EXTRA_HELP = {EVERY_FLAG: "tp_divergence: site calls between two reports (a positive whole number; default 1000)"}
SUMMARY = "count, per rank-0 broadcast site and rank, the calls where this rank's own value differed from rank 0's"
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use
# Judged with the pack's broadcast at its broadest setting: without it there is nothing to
# compare on 0.5.16 - 0.5.18, so the engine check would say nothing about the engine.
CHECK_WITH = {"rank0_broadcast": "all,pack-dflash-draft-greedy"}
# Site calls between two reads of the counters; a read costs one copy to pinned host
# memory and no wait (bench/divergence_cost.py).
DEFAULT_EVERY = 1000

MEMORY_WHY = "a group minimum of free memory at start-up, no value broadcast"
NOT_COMPARED = {Site.DSPARK_MEM: MEMORY_WHY, Site.DFLASH_MEM: MEMORY_WHY}
NOT_COMPARED_BEFORE_19 = {**NOT_COMPARED, Site.DSPARK_PLAN: "broadcast by the engine itself before 0.5.19",
                          Site.DFLASH_SELECTOR: "does not exist before 0.5.19"}


ABORT = "abort"
# Why the engine's rank-consensus checker (0.5.19+) does not serve here: said in the abort's reason.
CONSENSUS_WHY = ("the engine's rank-consensus checker (sglang.srt.utils.rank_consensus_checker, upstream PR #34406) "
                 "is not used: it hashes scheduler-thread host state over its own gloo groups, while these sites are "
                 "device tensors on the forward path, some replayed in CUDA graphs (a host hash per call would wait "
                 "for the device)")


@dataclass(frozen=True)
class Setting:
    every: int
    abort: bool = False  # stop the rank at the first divergence it sees


def parse_every(environ: Mapping[str, str]) -> int:
    raw = environ.get(EVERY_FLAG)
    if raw is None:
        return DEFAULT_EVERY
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise FlagError(f"{EVERY_FLAG}={raw!r} is not understood; it takes a positive whole number of site calls "
                        f"between two reports (digits only, no spaces), or leave it unset for {DEFAULT_EVERY}")
    return int(raw)


def parse(environ: Mapping[str, str] = os.environ) -> Optional[Setting]:
    every = parse_every(environ)  # a bad value is refused even with the report off
    raw = environ.get(FLAG)
    if raw is not None and raw.lower() == ABORT:
        return Setting(every, abort=True)
    try:
        return Setting(every) if parse_switch(FLAG, environ) else None
    except FlagError:
        raise FlagError(f"{FLAG}={raw!r} is not understood; accepted values are 1/on/true/yes/y (report), {ABORT} (report "
                        "and stop the rank at the first divergence it sees), 0/off/false/none/no/n (off), any case, no "
                        f"spaces, or leave {FLAG} unset for off") from None


def abort_detail(setting: Setting, consensus: str) -> str:
    """What the reason line adds with abort: how the rank stops, and the engine's checker."""
    if not setting.abort:
        return ""
    return (f"; {ABORT}: stops the rank at the first divergence a read shows (a read every eager call; a captured "
            f"site's at the next eager call after its copy lands) with one line and an exception the engine's "
            f"scheduler turns into SIGQUIT to the launcher; {consensus}")


# ---------------------------------------------------------------- wrappers


def _site_and_values(site, values):
    return site, values


def compare_sync(every: int, abort: bool = False):
    """The wrapper around SpecTpSync.sync(site, values) (0.5.19+), acting only where sync
    broadcasts. sync is shown (broadcast_proof) to broadcast its argument in place from rank 0
    of its group and return it: rank 0 sends its own value; another rank has sync receive
    rank 0's into a tensor of its own (divergence.receiver), and one launch compares it with
    the caller's and copies it there. A closure, not a partial: this runs at every eager call;
    with abort off, its common eager call runs in C once the kernel library serves
    (divergence.with_c_form)."""
    observe, receiver, label = divergence.observe, divergence.receiver, divergence.label

    def around_sync(wrapped, instance, args, kwargs):
        site, values = args if len(args) == 2 and not kwargs else _site_and_values(*args, **kwargs)
        if not instance.enabled(site):
            return wrapped(*args, **kwargs)
        divergence.raise_if_stopped()
        number, slug = label(site)
        if instance._tp_group.rank_in_group == 0:
            result = wrapped(site, values)
            observe(number, slug, (values,), (result,), every, abort)  # counts the call: rank 0's own value
            return result
        received = wrapped(site, receiver(values))  # contiguous, whatever the caller's layout
        observe(number, slug, (values,), (received,), every, abort, True)
        return values

    return around_sync if abort else divergence.with_c_form(around_sync, every)


# ---------------------------------------------------------------- declaration


def one_rank(context, engine) -> None:
    """Refused where one rank runs each batch: nothing is broadcast there (the engine's
    SpecTpSync keeps no site in a group of one rank, the pack's broadcast is a no-op)."""
    topology = context.topology
    if topology is not None and topology.batch_group_size == 1:
        raise Refused(NAME, FLAG, f"one rank runs each batch {groups_proof.judged_for(topology)}: no site is "
                                  f"broadcast there, so there is nothing to compare; unset {FLAG}", engine.version)


def when(context) -> str:
    """The deployment the report is judged for, and what a rank with one rank per batch does."""
    if context.topology is not None:
        return groups_proof.judged_for(context.topology)
    return (f"{groups_proof.judged_for(None)}; a rank where one rank runs each batch (TP 1, or DP attention with "
            "attention-TP 1) refuses: nothing is broadcast there")


def _engine_plan(engine, module, setting: Setting, context) -> Plan:
    """0.5.19+: SpecTpSync.sync, shown to broadcast `values` in place from rank 0 and
    return it at the sites it selects (the wrapper keeps a copy of the caller's value
    before and compares it with what sync returns)."""
    contract = Contract(NAME, module)
    one_rank(context, engine)
    names = {number: name for name, number in engine_class.engine_sites(contract).items()}
    if max(names) >= divergence.ROWS:
        raise contract.refuse("SpecTpSyncSite", f"numbers reach {max(names)}; the counters hold {divergence.ROWS} rows")
    what, selected = selected_sites.selected(contract, context, engine)
    shown = broadcast_proof.prove_broadcast(contract, engine, selected_sites.run_value(context))
    groups = groups_proof.worker_groups(contract, engine)
    memory = {int(s) for s in NOT_COMPARED}
    compared = sorted(n for n in selected if n not in memory)
    # Labelled from the engine's own names: it may number sites the pack's Site does not know.
    label = lambda n: f"{n}:{slug_of(names[n])}"  # noqa: E731
    own = sorted(frozenset(context.settings["rank0_broadcast"] or ()) & PACK)  # the pack's own sites, its broadcast
    if not compared and not own:
        raise Refused(NAME, FLAG, f"no site broadcasts a value ({what}): there is nothing to compare; "
                                  f"select broadcast sites or unset {FLAG}", version_of(module))
    off = sorted(set(names) - set(compared) - memory)
    detail = (f"compares {', '.join(label(n) for n in compared)} at {module.__name__}.SpecTpSync.sync, as {what} "
              f"selects; not compared: {', '.join(label(n) for n in sorted(memory & set(names)))} ({MEMORY_WHY})"
              + (f"; off: {', '.join(label(n) for n in off)}" if off else "")
              + f"; report every {setting.every} calls and at exit, {when(context)}; shown from its source: "
              + "; ".join(shown) + f"; {groups_proof.describe_groups(groups)}")
    owner = contract.attr("SpecTpSync")
    patches = [Patch(owner, "sync", compare_sync(setting.every, setting.abort))]
    short = f"compares sites {spans(compared)} (SpecTpSync.sync)"
    if own:  # beside the engine's sites: the pack's broadcast, which serves only its own sites here
        patches.append(Patch(pack, "broadcast", before_0_5_19.compare_broadcast(setting.every, setting.abort)))
        detail += f"; the pack's own {labels(own)} compared at {pack.__name__}.broadcast"
        short += f", {spans(own)} (the pack's broadcast)"
    dump, dump_detail = watchdog_dump.patch(engine)
    detail += abort_detail(setting, CONSENSUS_WHY) + f"; {dump_detail}"
    return Plan("applied", detail, patches + [dump], short_reason=short)


def short_tail(setting: Setting) -> str:
    """How often the report is read, and the abort, in the short reason's words."""
    return f"; reports every {setting.every} calls" + ("; abort: stops at the first divergence" if setting.abort else "")


def check(engine, setting: Setting, context) -> Plan:
    """What comparing every active broadcast site takes on `engine`; patches nothing."""
    modules = target_modules(NAME, engine, ((engine_class.MODULE, False),))
    if engine_class.MODULE in modules:
        sites = _engine_plan(engine, modules[engine_class.MODULE], setting, context)
    else:
        sites = before_0_5_19.plan(engine, setting, context)
    # the pack's report site 30, beside the broadcast sites on every release
    graph = graph_key.plan(engine, setting.every, setting.abort)
    plan = combine(NAME, engine.version, [sites, graph])
    plan.short_reason = f"{sites.short_reason}, {graph.short_reason}{short_tail(setting)}"
    return plan



from . import before_0_5_19, graph_key, watchdog_dump  # noqa: E402  (before_0_5_19 reads the names above)

LEDGER = Ledger(
    why="after a rank-0 broadcast every rank holds rank 0's value, which hides where and how often the ranks "
        "disagreed: a diagnostic that counts it per site and rank, fixing nothing",
    upstream_issue="none: a diagnostic of this pack (upstream's rank-consensus checker, PR #34406, hashes other "
                   "state; the decode graph key, site 30, is what sgl-project/sglang#31195 compares in logs)",
    fixes=(),
    retire_when="the engine reports per-site divergence of its own SpecTpSync broadcasts and compares the decode "
                "graph key across ranks (site 30; sgl-project/sglang#31195)",
    legacy={"before_0_5_19.py": "0.5.16-0.5.18"},
    legacy_until="0.5.19",  # the engine's own SpecTpSync, which it compares at from then on
)
SURFACE = Surface(
    name=NAME, flag=FLAG, summary=SUMMARY, parse=parse, check=check, check_value=CHECK_VALUE, ledger=LEDGER,
    # the sites it compares: the selection before 0.5.19, the engine's switch as handed over from 0.5.19
    reads={"rank0_broadcast": f"{SETTING},{HANDOVER}"}, check_with=CHECK_WITH,
    extra_flags=EXTRA_HELP,
)
