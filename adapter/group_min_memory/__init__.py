"""Group-minimum memory probe (DSV41_GROUP_MIN_MEM).

Before 0.5.19 each TP rank decides on its own free memory whether to capture the
DSpark / DFlash draft CUDA graph and whether DSpark folds sampling into it (AUTO).
Free memory differs per GPU, so ranks can take different decisions and then run
different collectives (capture vs eager), which hangs or diverges the group.

The adapter makes each of those probes return the minimum over the group that
owns the decision: a blocking CPU all_reduce(MIN) on that group's gloo group,
done by the engine helper itself (`distributed=True, cpu_group=group.cpu_group`).
Only the consumer modules' own bindings of the helper are wrapped; the shared
helper and every other importer (model_runner, eagle workers, ...) keep theirs.

Which group owns each decision, and how it is read without a swapped `_TP`, is said in
before_0_5_19.py (the code for those releases).

From 0.5.19 the engine probes through `SpecTpSync.available_memory_gb(site, ..., group=g)`,
which reduces over g only when SpecTpSync keeps its sites, i.e. when the group it was built
over (the one that runs a batch) has more than one rank. The adapter reports superseded
where that is shown from the engine's source (adapter.spectpsync.memory_probe_proof) for a
deployment whose topology is known and keeps the sites; elsewhere (DP attention with
attention-TP 1, where DSpark's capture group can still span the TP group; or the topology
unknown) it wraps that class method so the probe is the minimum over the group its caller
passes (upstream's unreleased fix, sgl-project/sglang#39954). Either way it refuses when
the engine's own switch SGLANG_SPEC_TP_SYNC, as the engine will read it (the user's value,
what rank0_broadcast hands over, or what the engine sets itself where unset), leaves out
site 1 (dspark-mem) or 12 (dflash-mem).
"""

from __future__ import annotations

import ast
import collections
import inspect
import os
from collections.abc import Mapping
from typing import Optional

from ..engine.contract import KEYWORD_ONLY, POSITIONAL, Contract, Refused, source_proof, target_modules
from ..framework.flags import parse_switch
from ..framework.ledger import Ledger, UpstreamFix
from ..framework.plan import Patch, Plan, combine
from ..framework.surface import HANDOVER, Surface
from ..spectpsync import built_class, callers_proof, engine_class, groups_proof, memory_probe_proof, selected_sites
from ..spectpsync.sites import MEMORY, labels, spans

NAME = "group_min_memory"
FLAG = "DSV41_GROUP_MIN_MEM"
SUMMARY = "free-memory probes gating DSpark/DFlash draft graph capture and DSpark folded sampling return the group minimum"
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use

SPEC = "sglang.srt.speculative"
DSPARK_WORKER = f"{SPEC}.dspark_components.dspark_worker_v2"
DSPARK_SAMPLER = f"{SPEC}.dspark_components.dspark_draft_sampler"  # 0.5.17+
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
# (module, required); spec_tp_sync (0.5.19+) is the upstream fix.
TARGETS = ((engine_class.MODULE, False), (DSPARK_WORKER, True), (DSPARK_SAMPLER, False), (DFLASH_WORKER, True))

HELPER = "get_available_gpu_memory"
HELPER_HOME = "sglang.srt.utils.common"
HELPER_PARAMS = {name: POSITIONAL for name in ("device", "gpu_id", "distributed", "empty_cache", "cpu_group")}
UPSTREAM_PROBE = "SpecTpSync.available_memory_gb"

# Collectives this adapter issued in this process, per probe site (one all_reduce
# per reduced probe call).
COLLECTIVES: collections.Counter = collections.Counter()


def parse(environ: Mapping[str, str] = os.environ) -> bool:
    return parse_switch(FLAG, environ)


from . import before_0_5_19  # noqa: E402  (it reads the names above)
from .before_0_5_19 import PROBES, Probe  # noqa: E402


# ---------------------------------------------------------------- upstream (0.5.19+)


def _upstream_group_minimum(wrapped, instance, args, kwargs):
    """Around SpecTpSync.available_memory_gb(site, device, gpu_id, *, group) (0.5.19+):
    the minimum over `group` whenever it has more than one rank, through the engine helper
    as the engine's own reduction calls it (upstream's unreleased fix keeps the configured
    sites apart from the group SpecTpSync was built over, sgl-project/sglang#39954)."""
    bound = _bound(wrapped, args, kwargs)
    group = bound["group"]
    if group is None or group.world_size <= 1:
        return wrapped(*args, **kwargs)
    helper = getattr(wrapped, "__func__", wrapped).__globals__[HELPER]  # proven the engine helper at decide time
    COLLECTIVES[f"spec-tp-sync-{getattr(bound['site'], 'name', bound['site'])}"] += 1
    return helper(bound["device"], bound["gpu_id"], distributed=True, cpu_group=group.cpu_group)


def _bound(wrapped, args, kwargs) -> dict:
    return inspect.signature(wrapped).bind(*args, **kwargs).arguments


def _engine_choice(contract, value: str):
    """The sites a literal the engine sets selects, by the engine's own parser; None where
    it cannot be read."""
    try:
        return selected_sites.engine_parse(contract, ast.literal_eval(value))
    except (ValueError, SyntaxError, Refused):
        return None


def check_upstream(engine, module, context) -> Plan:
    """0.5.19+: superseded where the engine's own reduction is shown to reach the capture
    group on this deployment; else the pack makes SpecTpSync's probe the minimum over the
    group its caller passes. Refused when the engine's switch drops a memory site."""
    contract = Contract(NAME, module)
    built, _ = built_class.of(contract, engine)  # the class the workers build, whatever its name and home
    owner, name = built_class.defining(contract, "available_memory_gb", engine)
    owner.params(f"{name}.available_memory_gb",
                 {"site": POSITIONAL, "device": POSITIONAL, "gpu_id": POSITIONAL, "group": KEYWORD_ONLY})
    engine_class.memory_numbers(contract)
    try:
        what, selected = selected_sites.selected(contract, context, engine)
    except Refused as exc:  # the class is not shown to select by its switch: the pack's probe serves every site
        if f":{built.name}" not in exc.symbol and f":{engine_class.CLASS}" not in exc.symbol:
            raise  # the value itself: the engine would refuse it on every rank
        return _pack_probe(contract, engine, context, f"{exc.symbol}: {exc.problem}",
                           "the pack's probe reduces whichever site asks")
    choices = [(what, selected)]
    if selected_sites.run_value(context) is None:  # what the engine may set itself where unset
        choices += [(f"{engine_class.ENGINE_FLAG}={value} (set by the engine at {where})", _engine_choice(contract, value))
                    for where, value in callers_proof.engine_writes(engine)]
    for said, chosen in choices:
        missing = frozenset(s for s in MEMORY if chosen is None or int(s) not in chosen)
        if missing:
            raise contract.refuse(
                engine_class.ENGINE_FLAG,
                f"{said} leaves out sites {labels(missing)}: the engine would then probe free memory per rank and "
                f"{FLAG}=1 could not be kept; keep those sites on (set {engine_class.ENGINE_FLAG} yourself) or "
                f"switch {FLAG} off")
    where = groups_proof.judged_for(context.topology)
    try:
        shown, reach = memory_probe_proof.probe_reach(contract, engine, selected_sites.run_value(context))
        groups = groups_proof.worker_groups(contract, engine)
        why_not = memory_probe_proof.memory_reached(context.topology, groups, reach)
    except Refused as exc:
        why_not = f"{exc.symbol}: {exc.problem}"
    if why_not is None:
        return Plan("superseded", f"the engine reduces the probes to the group minimum itself {where}, shown from its "
                                  f"source and by running it: {'; '.join(shown)}; {groups_proof.describe_groups(groups)}; {what} keeps "
                                  f"{labels(MEMORY)} on",
                    short_reason=f"the engine's SpecTpSync reduces sites {spans(MEMORY)} to the group minimum itself")
    return _pack_probe(contract, engine, context, why_not, f"{what} keeps {labels(MEMORY)} on")


def _pack_probe(contract: Contract, engine, context, why_not: str, sites: str) -> Plan:
    """The pack's group minimum in place of SpecTpSync's probe, where the engine's is not shown."""
    helper = memory_probe_proof.prove_helper(contract, engine)  # what the pack's probe calls
    home, name = built_class.defining(contract, "available_memory_gb", engine)  # the class whose probe runs
    owner = home.attr(name)
    return Plan("applied", f"{UPSTREAM_PROBE} made the minimum over the group its caller passes whenever that group "
                           f"has more than one rank (upstream's unreleased fix, sgl-project/sglang#39954) "
                           f"{groups_proof.judged_for(context.topology)}: the engine's own reduction is not shown to "
                           f"reach the capture group ({why_not}); {helper}; {sites}",
                [Patch(owner, "available_memory_gb", _upstream_group_minimum)],
                short_reason=f"the pack makes {UPSTREAM_PROBE} the group minimum: {why_not}")


def _superseded_consumer(contract: Contract, probe: Probe) -> Optional[Plan]:
    """0.5.19+: the consumer asks SpecTpSync for the memory (or, 0.5.19-0.5.21 sampler,
    receives it as a parameter). None when the module shows neither."""
    asked, calls = _probe_calls(contract)
    for line, site, arguments, keywords in calls:
        if site != probe.site.name:
            raise contract.refuse(probe.function, f"line {line} no longer probes site {probe.site.name}")
        if arguments != 3 or keywords != ("group",):
            raise contract.refuse(probe.function, f"line {line} no longer passes (site, device, gpu_id, group=...)")
    if asked:
        contract.only_used_in("available_memory_gb", (probe.function,), attribute=True)
        return Plan("superseded", f"{probe.function} probes through {engine_class.MODULE}:{UPSTREAM_PROBE}({probe.site.name})")
    func = getattr(contract.module, probe.function, None) if "." not in probe.function else None
    if func is not None and "available_memory_gb" in inspect.signature(func).parameters:
        return Plan("superseded", f"{probe.function} takes available_memory_gb from {UPSTREAM_PROBE}({probe.site.name})")
    return None


@source_proof("group-min-memory-probe-calls")
def _probe_calls(contract: Contract) -> tuple:
    """From the module's source: whether it reads `.available_memory_gb`, and each
    `.available_memory_gb(...)` call as (line, the attribute its first argument reads or
    None, how many positional arguments, its keywords)."""
    calls = []
    for found in contract.calls("available_memory_gb", method=True):
        first = found.node.args[0] if found.node.args else None
        calls.append((found.line, first.attr if isinstance(first, ast.Attribute) else None, len(found.node.args),
                      tuple(k.arg for k in found.node.keywords)))
    return bool(contract.uses("available_memory_gb", attribute=True)), tuple(calls)


def _module_plan(module) -> Plan:
    """The probe in one consumer module: reduced by the adapter, or by the engine itself."""
    name = module.__name__
    contract = Contract(NAME, module)
    probe = PROBES[name]
    if HELPER not in vars(module):
        plan = _superseded_consumer(contract, probe)
        if plan is not None:
            return plan
        if contract.uses(HELPER):
            raise contract.refuse(HELPER, "is called but no longer bound in the module")
        return Plan("not needed", f"{name} makes no free-memory probe")
    return before_0_5_19.consumer_plan(contract, module, probe)


def check(engine, enabled: bool, context) -> Plan:
    """What making every probe a group minimum takes on `engine`; patches nothing."""
    modules = target_modules(NAME, engine, TARGETS)
    plans = [check_upstream(engine, modules.pop(engine_class.MODULE), context)] if engine_class.MODULE in modules else []
    consumers = {name: _module_plan(module) for name, module in modules.items()}
    if not plans and any(p.state == "superseded" for p in consumers.values()):
        raise Refused(NAME, engine_class.MODULE, "is missing, yet a consumer probes through it", engine.version)
    plan = combine(NAME, engine.version, plans + list(consumers.values()))
    applied = [name for name, p in consumers.items() if p.state == "applied"]
    # the consumers only show where the probes go; the engine's class (0.5.19+) decides
    plan.short_reason = plans[0].short_reason if plans else (
        f"the pack makes the {', '.join(PROBES[name].label for name in applied)} probes the group minimum "
        "(the engine has no SpecTpSync)")
    if applied:  # the helper's bindings wrapped (0.5.16-0.5.18); from 0.5.19 the class method, every caller's
        before_0_5_19.census_check(engine, applied)
    return plan


LEDGER = Ledger(
    why="each rank decides from its own free GPU memory whether to capture the DSpark/DFlash draft graph (and whether "
        "DSpark folds sampling into it); ranks that decide differently run different collectives and hang at start-up",
    upstream_issue="sgl-project/sglang#39886",
    fixes=(UpstreamFix("SpecTpSync.available_memory_gb (sites dspark-mem, dflash-mem), reducing over the capture "
                       "group where a batch runs on several ranks", "0.5.19", ("tp", "dp-attention-tp2")),
           UpstreamFix("sgl-project/sglang#39954 (the configured sites kept apart from the group)", None)),
    retire_when="every supported release carries #39954 (or the engine's probe is shown to reach the capture group "
                "on every layout)",
    legacy={"before_0_5_19.py": "0.5.16-0.5.18"},
)
SURFACE = Surface(
    name=NAME, flag=FLAG, summary=SUMMARY, parse=parse, check=check, check_value=CHECK_VALUE, ledger=LEDGER,
    reads={"rank0_broadcast": HANDOVER},  # what it hands to SGLANG_SPEC_TP_SYNC decides the engine's memory sites
)
