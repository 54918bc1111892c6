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

From 0.5.19 the engine probes through `SpecTpSync.available_memory_gb(site, ..., group=g)`,
which reduces over g only when SpecTpSync keeps its sites, i.e. when the group it was built
over (the one that runs a batch) has more than one rank. The adapter reports superseded
where that is shown from the engine's source (adapter.upstream_sync.prove_probe) for a
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
import importlib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from . import census, upstream_sync
from .contract import KEYWORD_ONLY, POSITIONAL, Contract, Hook, Patch, Plan, Refused, combine, sibling, target_modules
from .flags import FlagError, parse_switch
from .sites import MEMORY, Site, labels, parse_value

NAME = "group_min_memory"
FLAG = "DSV41_GROUP_MIN_MEM"
SUMMARY = "free-memory probes gating DSpark/DFlash draft graph capture and DSpark folded sampling return the group minimum"
CHECK_VALUE = "1"  # the setting doctor's engine check and the compatibility matrix use
AFTER = ("rank0_broadcast",)  # reads what it hands to SGLANG_SPEC_TP_SYNC

SPEC = "sglang.srt.speculative"
DSPARK_WORKER = f"{SPEC}.dspark_components.dspark_worker_v2"
DSPARK_SAMPLER = f"{SPEC}.dspark_components.dspark_draft_sampler"  # 0.5.17+
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
# (module, required); spec_tp_sync (0.5.19+) is the upstream fix.
TARGETS = ((upstream_sync.MODULE, False), (DSPARK_WORKER, True), (DSPARK_SAMPLER, False), (DFLASH_WORKER, True))

HELPER = "get_available_gpu_memory"
HELPER_HOME = "sglang.srt.utils.common"
HELPER_PARAMS = {name: POSITIONAL for name in ("device", "gpu_id", "distributed", "empty_cache", "cpu_group")}
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
DP_ATTENTION = "sglang.srt.layers.dp_attention"
UPSTREAM_PROBE = "SpecTpSync.available_memory_gb"

# Collectives this adapter issued in this process, per probe site (one all_reduce
# per reduced probe call).
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
class Probe:
    function: str  # qualified name of the function whose decision the probe gates
    site: Site  # the upstream site covering it from 0.5.19
    label: str  # key in COLLECTIVES
    group: Callable[[], object]


PROBES = {
    DSPARK_WORKER: Probe("DSparkWorkerV2.init_cuda_graphs", Site.DSPARK_MEM, "dspark-capture", dspark_draft_graph_group),
    DSPARK_SAMPLER: Probe("_resolve_folded_sampling", Site.DSPARK_MEM, "dspark-folded-sampling", dspark_draft_graph_group),
    DFLASH_WORKER: Probe("DFlashWorkerV2.init_cuda_graphs", Site.DFLASH_MEM, "dflash-capture", dflash_group),
}


def _group_minimum(probe: Probe):
    def wrapper(wrapped, instance, args, kwargs):
        group = probe.group()
        if group is None or group.world_size <= 1:
            return wrapped(*args, **kwargs)
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.arguments["distributed"] = True
        bound.arguments["cpu_group"] = group.cpu_group
        COLLECTIVES[probe.label] += 1
        return wrapped(*bound.args, **bound.kwargs)

    wrapper.__name__ = f"group_min_{probe.label.replace('-', '_')}"
    return wrapper


# The consumer modules' own bindings of the engine helper, one per probe site.
HOOKS = {module: Hook(module, HELPER, _group_minimum(probe), HELPER_PARAMS, (probe.function,))
         for module, probe in PROBES.items()}


# ---------------------------------------------------------------- census

# The engine probes free memory in many places besides DSpark/DFlash. The census
# (adapter.census) reads every reference to the probe in the engine's sources; the rule:
# - the hooked sites are known: in each consumer module the probe function's bare-name
#   calls (what the wrapped binding serves) and the module-level import; the helper's
#   definition in HELPER_HOME;
# - any other reference is accepted only where reviewed, on the releases this adapter
#   patches (0.5.16-0.5.18, whose sources are fixed): the (module, function) pairs below,
#   none of them DSpark/DFlash code; the free memory they read gates target-model, LoRA,
#   EAGLE/MTP or start-up choices that upstream's own fix (0.5.19 SpecTpSync) leaves per
#   rank as well, so they are outside what this flag claims;
# - the diffusion runtime `sglang.multimodal_gen` (and test code) are accepted as a
#   package: its `get_available_gpu_memory` is a method of its own Platform classes,
#   and it is never the srt engine; but not in a file that mentions speculative, dspark
#   or dflash, which counts as speculative code;
# - everything else refuses: a new module, a new function of a reviewed module, an
#   attribute call such as `common.get_available_gpu_memory(...)` at a hooked site (it
#   bypasses the wrapped binding), an alias or a string naming the probe.
C = census
SPECULATIVE_WORDS = ("speculative", "dspark", "dflash")
MODEL_EXECUTOR = "sglang.srt.model_executor"
REVIEWED_USERS = {
    "sglang.srt.distributed.bootstrap": ("init_torch_distributed",),
    "sglang.srt.hardware_backend.npu.utils": ("lazy_init_zbal_gva_mem",),
    "sglang.srt.layers.deep_gemm_wrapper.compile_utils": ("_compile_deep_gemm_one_type_all",),
    "sglang.srt.lora.lora_manager": ("LoRAManager.load_lora_adapter", "LoRAManager.unload_lora_adapter"),
    "sglang.srt.managers.scheduler": ("Scheduler.init_model_worker",),
    "sglang.srt.mem_cache.kv_cache_configurator": ("KVCacheConfigurator._profile_available_bytes",
                                                   "KVCacheConfigurator.configure"),
    f"{MODEL_EXECUTOR}.model_runner": ("ModelRunner.load_model",),
    f"{MODEL_EXECUTOR}.model_runner_components.cuda_graph_setup": ("capture_cuda_graphs", "capture_decode_graph",
                                                                   "capture_prefill_graph"),
    f"{MODEL_EXECUTOR}.model_runner_components.kv_pool_runtime": ("compute_post_capture_kv_resize",),
    f"{MODEL_EXECUTOR}.model_runner_components.weight_updater": ("WeightUpdater.update_weights_from_disk",),
    f"{MODEL_EXECUTOR}.runner.decode_cuda_graph_runner": ("DecodeCudaGraphRunner._capture_one_stream",),
    f"{MODEL_EXECUTOR}.runner.prefill_cuda_graph_runner": ("PrefillCudaGraphRunner._capture_one_stream",),
    "sglang.srt.model_loader.loader": ("DefaultModelLoader.load_weights_and_postprocess",),
    "sglang.srt.utils.triton_load_watch": ("_on_kernel_load",),
    # EAGLE / MTP workers: other speculative algorithms, not DSpark/DFlash.
    f"{SPEC}.eagle_worker_v2": ("EAGLEWorkerV2.build_adaptive_runtime_state", "EagleDraftWorker._capture_cuda_graphs"),
    f"{SPEC}.frozen_kv_mtp_worker_v2": ("FrozenKVMTPDraftWorker._capture_cuda_graphs",),
    f"{SPEC}.multi_layer_eagle_draft_extend_cuda_graph_runner": (
        "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner._init_and_capture",
        "OneGraphMultiLayerEagleMultiStepDraftExtendCudaGraphRunner._init_and_capture"),
    f"{SPEC}.multi_layer_eagle_worker_v2": ("MultiLayerEagleDraftWorker._capture_cuda_graphs",),
}
# Test kits that name the probe as a mock.patch target (a string) of a non-DSpark module.
REVIEWED_STRINGS = {
    "sglang.srt.platforms.cpu": ("CpuDeviceMixin.get_current_memory_usage",),
    "sglang.test.kits.attention_unittest.runner_modes.speculative_draft_runner": (
        "_capture_eagle_draft_graph_runner", "_capture_frozen_kv_mtp_graph_runner"),
    "sglang.test.kits.attention_unittest.runner_modes.speculative_draft_extend_runner": (
        "_capture_eagle_draft_extend_graph_runner",),
}
assert not any(w in m for m in (*REVIEWED_USERS, *REVIEWED_STRINGS) for w in ("dspark", "dflash"))
ANY_KIND = (C.NAME, C.BIND, C.ATTRIBUTE, C.IMPORT, C.DEFINITION, C.PARAMETER, C.KEYWORD, C.STRING)


def census_sites(consumers) -> list:
    """The hooked sites of `consumers` (module names) and the reviewed users."""
    found = [*C.sites(HELPER_HOME, "<module>", [HELPER], (C.DEFINITION,), "the engine helper")]
    for module in consumers:
        found += C.sites(module, PROBES[module].function, [HELPER], (C.NAME,), "the hooked probe")
        found += C.sites(module, "<module>", [HELPER], (C.IMPORT,), "the hooked binding's import")
    for module, functions in REVIEWED_USERS.items():
        found += C.sites(module, ("<module>", *functions), [HELPER], (C.IMPORT, C.NAME), "reviewed, not DSpark/DFlash")
    for module, functions in REVIEWED_STRINGS.items():
        found += C.sites(module, functions, [HELPER], (C.STRING,), "reviewed mock.patch target")
    found += [C.Site("sglang.multimodal_gen.", "*", frozenset({HELPER}), frozenset(ANY_KIND),
                     "the diffusion runtime's own Platform method", unless=SPECULATIVE_WORDS)]
    return found


def _census(engine, consumers) -> None:
    census.refuse_unknown(NAME, engine, {HELPER}, census_sites(consumers),
                          "a free-memory probe that would not be reduced to the group minimum,")


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


def _engine_choice(value: str):
    """The sites a literal the engine sets selects (the pack's grammar, upstream's 0.5.22+);
    None where it cannot be read."""
    try:
        return frozenset(int(s) for s in parse_value(ast.literal_eval(value)))
    except (ValueError, SyntaxError, FlagError):
        return None


def check_upstream(engine, module, context) -> Plan:
    """0.5.19+: superseded where the engine's own reduction is shown to reach the capture
    group on this deployment; else the pack makes SpecTpSync's probe the minimum over the
    group its caller passes. Refused when the engine's switch drops a memory site."""
    contract = Contract(NAME, module)
    contract.params(UPSTREAM_PROBE, {"site": POSITIONAL, "device": POSITIONAL, "gpu_id": POSITIONAL, "group": KEYWORD_ONLY})
    upstream_sync.memory_numbers(contract)
    what, selected = upstream_sync.selected(contract, context, engine)
    choices = [(what, selected)]
    if upstream_sync.run_value(context) is None:  # what the engine may set itself where unset
        choices += [(f"{upstream_sync.ENGINE_FLAG}={value} (set by the engine at {where})", _engine_choice(value))
                    for where, value in upstream_sync.engine_writes(engine)]
    for said, chosen in choices:
        missing = frozenset(s for s in MEMORY if chosen is None or int(s) not in chosen)
        if missing:
            raise contract.refuse(
                upstream_sync.ENGINE_FLAG,
                f"{said} leaves out sites {labels(missing)}: the engine would then probe free memory per rank and "
                f"{FLAG}=1 could not be kept; keep those sites on (set {upstream_sync.ENGINE_FLAG} yourself) or "
                f"switch {FLAG} off")
    where = upstream_sync.judged_for(context.topology)
    try:
        shown = upstream_sync.prove_probe(contract, engine, upstream_sync.run_value(context))
        groups = upstream_sync.worker_groups(contract, engine)
        why_not = upstream_sync.memory_reached(context.topology, groups)
    except Refused as exc:
        why_not = f"{exc.symbol}: {exc.problem}"
    if why_not is None:
        return Plan("superseded", f"the engine reduces the probes to the group minimum itself {where}, shown from its "
                                  f"source: {'; '.join(shown)}; {upstream_sync.describe_groups(groups)}; {what} keeps "
                                  f"{labels(MEMORY)} on")
    helper = upstream_sync.prove_helper(contract, engine)  # what the pack's probe calls
    owner = contract.attr(upstream_sync.CLASS)
    return Plan("applied", f"{UPSTREAM_PROBE} made the minimum over the group its caller passes whenever that group "
                           f"has more than one rank (upstream's unreleased fix, sgl-project/sglang#39954) {where}: the "
                           f"engine's own reduction is not shown to reach the capture group ({why_not}); {helper}; "
                           f"{what} keeps {labels(MEMORY)} on",
                [Patch(owner, "available_memory_gb", _upstream_group_minimum)])


def _superseded_consumer(contract: Contract, probe: Probe) -> Optional[Plan]:
    """0.5.19+: the consumer asks SpecTpSync for the memory (or, 0.5.19-0.5.21 sampler,
    receives it as a parameter). None when the module shows neither."""
    asked = contract.uses("available_memory_gb", attribute=True)
    for found in contract.calls("available_memory_gb", method=True):
        first = found.node.args[0] if found.node.args else None
        if not (isinstance(first, ast.Attribute) and first.attr == probe.site.name):
            raise contract.refuse(probe.function, f"line {found.line} no longer probes site {probe.site.name}")
        if len(found.node.args) != 3 or [k.arg for k in found.node.keywords] != ["group"]:
            raise contract.refuse(probe.function, f"line {found.line} no longer passes (site, device, gpu_id, group=...)")
    if asked:
        contract.only_used_in("available_memory_gb", (probe.function,), attribute=True)
        return Plan("superseded", f"{probe.function} probes through {upstream_sync.MODULE}:{UPSTREAM_PROBE}({probe.site.name})")
    func = getattr(contract.module, probe.function, None) if "." not in probe.function else None
    if func is not None and "available_memory_gb" in inspect.signature(func).parameters:
        return Plan("superseded", f"{probe.function} takes available_memory_gb from {UPSTREAM_PROBE}({probe.site.name})")
    return None


# ---------------------------------------------------------------- contract


def _check_group_accessors(module) -> None:
    ps = Contract(NAME, sibling(module, PARALLEL_STATE))
    ps.attr("_TP_STATE_PATCHED")
    ps.attr("get_tp_group")
    ps.attr("get_attn_tp_group")
    Contract(NAME, sibling(module, DP_ATTENTION)).attr("is_dp_attention_enabled")


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
    # The binding is the engine helper, with the parameters the wrapper fills in.
    patch = contract.hook(HOOKS[name])
    binding = getattr(module, HELPER)
    helper = getattr(sibling(module, HELPER_HOME), HELPER)
    if inspect.unwrap(binding) is not inspect.unwrap(helper):
        raise contract.refuse(HELPER, f"is not the engine helper {HELPER_HOME}.{HELPER} ({binding!r})")
    # The probe calls pass only (device, gpu_id): the wrapper sets distributed/cpu_group.
    for call in contract.calls(HELPER, method=False):
        if len(call.node.args) != 2 or call.node.keywords:
            raise contract.refuse(
                probe.function,
                f"line {call.line} calls {HELPER} with other than (device, gpu_id); the adapter sets distributed/cpu_group itself",
            )
    contract.attr(probe.function)
    if name == DSPARK_WORKER:
        if "attn_tp_group" not in contract.function_source("DSparkWorkerV2._draft_context"):
            raise contract.refuse("DSparkWorkerV2._draft_context", "no longer swaps in attn_tp_group; the draft graph group is unknown")
    _check_group_accessors(module)
    return Plan("applied", f"{name.rpartition('.')[2]}.{HELPER} in {probe.function} reduced to the group minimum", [patch])


def check(engine, enabled: bool, context) -> Plan:
    """What making every probe a group minimum takes on `engine`; patches nothing."""
    modules = target_modules(NAME, engine, TARGETS)
    plans = [check_upstream(engine, modules.pop(upstream_sync.MODULE), context)] if upstream_sync.MODULE in modules else []
    consumers = {name: _module_plan(module) for name, module in modules.items()}
    if not plans and any(p.state == "superseded" for p in consumers.values()):
        raise Refused(NAME, upstream_sync.MODULE, "is missing, yet a consumer probes through it", engine.version)
    plan = combine(NAME, engine.version, plans + list(consumers.values()))
    applied = [name for name, p in consumers.items() if p.state == "applied"]
    if applied:  # the helper's bindings wrapped (0.5.16-0.5.18); from 0.5.19 the class method, every caller's
        _census(engine, applied)
    return plan
