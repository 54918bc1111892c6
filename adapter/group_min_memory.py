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

Groups, as upstream 0.5.19 chose them (`SpecTpSync.available_memory_gb`):
- DSpark (capture gate and folded sampling): the draft graph group, attn_tp_group
  when the draft DP context is on, else tp_group;
- DFlash capture gate: tp_group.
The group is resolved at probe time without ever reading a swapped `_TP`: the
sampler probe runs inside `DSparkWorkerV2._draft_context()`, which swaps `_TP` for
attn_tp_group (`parallel_state._TP_STATE_PATCHED`), and `get_parallel().tp_group` is
a live read of that swapped `_TP`, so neither is used there.

From 0.5.19 the engine does this itself; the adapter then reports superseded as
long as the engine's own switch SGLANG_SPEC_TP_SYNC keeps sites 1 (dspark-mem) and
12 (dflash-mem) on, and refuses otherwise.
"""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from . import patching
from .contract import KEYWORD_ONLY, POSITIONAL, Contract, Patch, Plan, calls, from_source, sibling
from .flags import parse_switch

NAME = "group_min_memory"
FLAG = "DSV41_GROUP_MIN_MEM"
SUMMARY = "free-memory probes gating DSpark/DFlash draft graph capture and DSpark folded sampling return the group minimum"
# The flag value doctor and the compatibility matrix check the engine with.
CHECK_VALUE = "1"

SPEC = "sglang.srt.speculative"
SPEC_TP_SYNC = f"{SPEC}.spec_tp_sync"  # 0.5.19+: the upstream fix
DSPARK_WORKER = f"{SPEC}.dspark_components.dspark_worker_v2"
DSPARK_SAMPLER = f"{SPEC}.dspark_components.dspark_draft_sampler"  # 0.5.17+
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
# (module, required). The upstream module comes first so that a refusal of the user's
# SGLANG_SPEC_TP_SYNC is the reason reported.
TARGETS = ((SPEC_TP_SYNC, False), (DSPARK_WORKER, True), (DSPARK_SAMPLER, False), (DFLASH_WORKER, True))

HELPER = "get_available_gpu_memory"
HELPER_HOME = "sglang.srt.utils.common"
HELPER_PARAMS = {name: POSITIONAL for name in ("device", "gpu_id", "distributed", "empty_cache", "cpu_group")}
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
DP_ATTENTION = "sglang.srt.layers.dp_attention"

# Upstream's sites and the slugs SGLANG_SPEC_TP_SYNC selects them by.
UPSTREAM_SITES = {"DSPARK_MEM": (1, "dspark-mem"), "DFLASH_MEM": (12, "dflash-mem")}
UPSTREAM_PROBE = "SpecTpSync.available_memory_gb"

# Collectives this adapter issued in this process, per probe site (one all_reduce
# per reduced probe call); read by the tests and handy in a debugger.
COLLECTIVES: collections.Counter = collections.Counter()


def parse(environ: Mapping[str, str] = os.environ) -> bool:
    return parse_switch(FLAG, environ)


# ---------------------------------------------------------------- groups


def _parallel_state():
    return importlib.import_module(PARALLEL_STATE)


def dspark_draft_graph_group():
    """The group that captures the DSpark draft graph (upstream 0.5.19:
    `attn_tp_group if self._draft_dp_context_enabled else tp_group`)."""
    ps = _parallel_state()
    if ps._TP_STATE_PATCHED:
        # Inside DSparkWorkerV2._draft_context() (the folded-sampling probe): it swaps
        # `_TP` only when the draft DP context is on, and swaps in attn_tp_group.
        return ps.get_attn_tp_group()
    attn = ps.get_attn_tp_group()
    is_dp_attention_enabled = importlib.import_module(DP_ATTENTION).is_dp_attention_enabled
    if is_dp_attention_enabled() and attn.world_size > 1:
        # DSparkWorkerV2.__init__ rejects a MoE draft under DP attention with attn_tp > 1,
        # so here the draft is dense and the draft DP context is on.
        return attn
    # No DP attention: tp_group. DP attention with attn_tp == 1: tp_group is exact for a
    # MoE draft; for a dense draft (attn group of one) it is a superset, whose minimum
    # is still one value per draft graph group. `_TP` is not swapped here.
    return ps.get_tp_group()


def dflash_group():
    """DFlash's capture gate belongs to the TP group (upstream: get_tp_group())."""
    ps = _parallel_state()
    if ps._TP_STATE_PATCHED:
        raise RuntimeError(
            f"{NAME}: the DFlash free-memory probe ran with the TP group swapped "
            "(patch_tensor_parallel_group); its group cannot be resolved, refusing to guess"
        )
    return ps.get_tp_group()


# ---------------------------------------------------------------- probe sites


@dataclass(frozen=True)
class Site:
    function: str  # qualified name of the function whose decision the probe gates
    upstream_site: str  # SpecTpSyncSite member covering it from 0.5.19
    label: str  # key in COLLECTIVES
    group: Callable[[], object]


SITES = {
    DSPARK_WORKER: Site("DSparkWorkerV2.init_cuda_graphs", "DSPARK_MEM", "dspark-capture", dspark_draft_graph_group),
    DSPARK_SAMPLER: Site("_resolve_folded_sampling", "DSPARK_MEM", "dspark-folded-sampling", dspark_draft_graph_group),
    DFLASH_WORKER: Site("DFlashWorkerV2.init_cuda_graphs", "DFLASH_MEM", "dflash-capture", dflash_group),
}


def calls_of(source: str, name: str, *, method: bool = False):
    """Every call of the probe helper (or, with `method`, of `x.name(...)`) in the source."""
    return calls(ast.parse(source), name, method=method)


def _group_minimum(site: Site):
    def wrapper(wrapped, instance, args, kwargs):
        group = site.group()
        if group is None or group.world_size <= 1:
            return wrapped(*args, **kwargs)
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.arguments["distributed"] = True
        bound.arguments["cpu_group"] = group.cpu_group
        COLLECTIVES[site.label] += 1
        return wrapped(*bound.args, **bound.kwargs)

    wrapper.__name__ = f"group_min_{site.label.replace('-', '_')}"
    return wrapper


# ---------------------------------------------------------------- upstream (0.5.19+)


def _upstream_sites(contract: Contract) -> str:
    """SGLANG_SPEC_TP_SYNC, as the engine reads it, keeps both MEM sites on; else refuse."""
    site_enum = contract.attr("SpecTpSyncSite")
    source_only = from_source(contract.module)
    for member, (number, slug) in UPSTREAM_SITES.items():
        value = contract.attr(f"SpecTpSyncSite.{member}")
        # Read from source, a member is its literal number; its slug needs an import.
        found_slug = slug if source_only else getattr(value, "slug", None)
        if not isinstance(value, int) or int(value) != number or found_slug != slug:
            raise contract.refuse(f"SpecTpSyncSite.{member}", f"is {value!r}:{found_slug}, expected {number}:{slug}")
    parse_sites = contract.attr("parse_spec_tp_sync")
    if source_only:
        return _upstream_default(contract)
    envs = contract.attr("envs")
    raw = envs.SGLANG_SPEC_TP_SYNC.get()
    try:
        selected = parse_sites(raw)
    except ValueError as exc:
        raise contract.refuse("SGLANG_SPEC_TP_SYNC", f"the engine rejects {raw!r}: {exc}")
    missing = [m for m in UPSTREAM_SITES if getattr(site_enum, m) not in selected]
    if missing:
        names = ", ".join(f"{UPSTREAM_SITES[m][0]}:{UPSTREAM_SITES[m][1]}" for m in missing)
        raise contract.refuse(
            "SGLANG_SPEC_TP_SYNC",
            f"={raw!r} excludes {names}: the engine would then probe free memory per rank and "
            f"{FLAG}=1 could not be kept; keep those sites on (e.g. 'all', 'init', or drop "
            f"the '-' tokens) or switch {FLAG} off",
        )
    return raw


def _upstream_default(contract: Contract) -> str:
    """For an engine read from source: only the engine's default selection can be judged
    (parsing a set SGLANG_SPEC_TP_SYNC needs the engine's own parser, i.e. an import)."""
    if "SGLANG_SPEC_TP_SYNC" in os.environ:
        raise contract.refuse(
            "SGLANG_SPEC_TP_SYNC", "is set; judging it needs the engine's own parser: run doctor on the installed engine"
        )
    environ_source = Contract(NAME, sibling(contract.module, "sglang.srt.environ")).source()
    if 'SGLANG_SPEC_TP_SYNC = EnvStr("all")' not in environ_source:
        raise contract.refuse("sglang.srt.environ:SGLANG_SPEC_TP_SYNC", "its default is no longer 'all'")
    return "all"


def check_upstream(module) -> Plan:
    contract = Contract(NAME, module)
    contract.params(UPSTREAM_PROBE, {"site": POSITIONAL, "device": POSITIONAL, "gpu_id": POSITIONAL, "group": KEYWORD_ONLY})
    reductions = [
        c for c in calls_of(contract.source(), HELPER)
        if c.function == UPSTREAM_PROBE and {"distributed", "cpu_group"} <= {k.arg for k in c.node.keywords}
    ]
    if not reductions:
        raise contract.refuse(UPSTREAM_PROBE, f"no longer calls {HELPER}(..., distributed=..., cpu_group=...)")
    raw = _upstream_sites(contract)
    return Plan(
        "superseded",
        f"the engine reduces the probes to the group minimum itself ({module.__name__}:{UPSTREAM_PROBE}); "
        f"SGLANG_SPEC_TP_SYNC={raw!r} keeps 1:dspark-mem and 12:dflash-mem on",
    )


def _superseded_consumer(contract: Contract, site: Site) -> Optional[Plan]:
    """0.5.19+: the consumer asks SpecTpSync for the memory (or, 0.5.19-0.5.21 sampler,
    receives it as a parameter). None when the module shows neither."""
    source = contract.source()
    probed = False
    for call in calls_of(source, "available_memory_gb", method=True):
        if call.function != site.function:
            raise contract.refuse(call.function, f"line {call.line} calls available_memory_gb() outside {site.function}")
        first = call.node.args[0] if call.node.args else None
        if not (isinstance(first, ast.Attribute) and first.attr == site.upstream_site):
            raise contract.refuse(site.function, f"line {call.line} no longer probes site {site.upstream_site}")
        probed = True
    if probed:
        _upstream_sites(Contract(NAME, sibling(contract.module, SPEC_TP_SYNC)))
        return Plan("superseded", f"{site.function} probes through {SPEC_TP_SYNC}:{UPSTREAM_PROBE}({site.upstream_site})")
    func = getattr(contract.module, site.function, None) if "." not in site.function else None
    if func is not None and "available_memory_gb" in inspect.signature(func).parameters:
        _upstream_sites(Contract(NAME, sibling(contract.module, SPEC_TP_SYNC)))
        return Plan(
            "superseded",
            f"{site.function} takes available_memory_gb from {UPSTREAM_PROBE}({site.upstream_site})",
        )
    return None


# ---------------------------------------------------------------- contract


def _check_group_accessors(module) -> None:
    ps = Contract(NAME, sibling(module, PARALLEL_STATE))
    ps.attr("_TP_STATE_PATCHED")
    ps.attr("get_tp_group")
    ps.attr("get_attn_tp_group")
    Contract(NAME, sibling(module, DP_ATTENTION)).attr("is_dp_attention_enabled")


def check(module) -> Plan:
    """Check the contract in `module` and say what installing would do; patches nothing."""
    key = module.__name__
    contract = Contract(NAME, module)
    if key == SPEC_TP_SYNC:
        return check_upstream(module)
    site = SITES.get(key)
    if site is None:
        raise contract.refuse("<module>", f"not a module this adapter patches ({', '.join([SPEC_TP_SYNC, *SITES])})")
    if HELPER not in vars(module):
        plan = _superseded_consumer(contract, site)
        if plan is not None:
            return plan
        if calls_of(contract.source(), HELPER):
            raise contract.refuse(HELPER, "is called but no longer bound in the module")
        return Plan("not needed", f"{key} makes no free-memory probe")
    # The binding is the engine helper, with the parameters the wrapper fills in.
    binding = contract.params(HELPER, HELPER_PARAMS)
    helper = getattr(sibling(module, HELPER_HOME), HELPER)
    if inspect.unwrap(binding) is not inspect.unwrap(helper):
        raise contract.refuse(HELPER, f"is not the engine helper {HELPER_HOME}.{HELPER} ({binding!r})")
    # The probe calls sit where the decision is taken, and pass only (device, gpu_id).
    calls = calls_of(contract.source(), HELPER)
    for call in calls:
        if call.function != site.function:
            raise contract.refuse(
                call.function,
                f"line {call.line} probes free memory outside {site.function}: a decision whose group this adapter does not know",
            )
        if len(call.node.args) != 2 or call.node.keywords:
            raise contract.refuse(
                site.function,
                f"line {call.line} calls {HELPER} with other than (device, gpu_id); the adapter sets distributed/cpu_group itself",
            )
    if not calls:
        raise contract.refuse(site.function, f"no longer calls {HELPER}: the decision it gated moved")
    contract.attr(site.function)
    if key == DSPARK_WORKER:
        if "attn_tp_group" not in contract.function_source("DSparkWorkerV2._draft_context"):
            raise contract.refuse("DSparkWorkerV2._draft_context", "no longer swaps in attn_tp_group; the draft graph group is unknown")
    _check_group_accessors(module)
    return Plan(
        "applied",
        f"{key.rpartition('.')[2]}.{HELPER} in {site.function} reduced to the group minimum",
        [Patch(module, HELPER, _group_minimum(site))],
    )


def install(module) -> Plan:
    return patching.install_plan(check(module), NAME)


def uninstall(module) -> None:
    if HELPER in vars(module):
        patching.remove(module, HELPER, NAME)
