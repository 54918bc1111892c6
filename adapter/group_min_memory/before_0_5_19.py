"""The group-minimum memory probe on sglang 0.5.16 - 0.5.18, which have no SpecTpSync: the
consumer modules' own bindings of the engine helper are wrapped (HOOKS) and the group that
owns each decision is resolved at probe time. Kept only for those releases (the adapter's
ledger): delete this file with them.

Groups, as upstream 0.5.19 chose them (`SpecTpSync.available_memory_gb`):
- DSpark (capture gate and folded sampling): the draft graph group, attn_tp_group
  when the draft DP context is on, else tp_group;
- DFlash capture gate: tp_group.
The group is resolved at probe time without ever reading a swapped `_TP`: the
sampler probe runs inside `DSparkWorkerV2._draft_context()`, which swaps `_TP` for
attn_tp_group (`parallel_state._TP_STATE_PATCHED`), and `get_parallel().tp_group` is
a live read of that swapped `_TP`, so neither is used there.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

from ..engine import census
from ..engine.contract import Contract
from ..engine.installed import sibling
from ..framework.plan import Hook, Plan, check_hook
from ..spectpsync.sites import Site
# The package defines these before it imports this file.
from . import (COLLECTIVES, DFLASH_WORKER, DSPARK_SAMPLER, DSPARK_WORKER, HELPER, HELPER_HOME, HELPER_PARAMS, NAME,
               SPEC)

PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
DP_ATTENTION = "sglang.srt.layers.dp_attention"


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
# (adapter.engine.census) reads every reference to the probe in the engine's sources; the rule:
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


def census_check(engine, consumers) -> None:
    census.refuse_unknown(NAME, engine, {HELPER}, census_sites(consumers),
                          "a free-memory probe that would not be reduced to the group minimum,")


# ---------------------------------------------------------------- contract


def _check_group_accessors(module) -> None:
    ps = Contract(NAME, sibling(module, PARALLEL_STATE))
    ps.attr("_TP_STATE_PATCHED")
    ps.attr("get_tp_group")
    ps.attr("get_attn_tp_group")
    Contract(NAME, sibling(module, DP_ATTENTION)).attr("is_dp_attention_enabled")


def consumer_plan(contract: Contract, module, probe: Probe) -> Plan:
    """0.5.16 - 0.5.18: the consumer module's own binding of the engine helper, wrapped."""
    name = module.__name__
    # The binding is the engine helper, with the parameters the wrapper fills in.
    patch = check_hook(contract, HOOKS[name])
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


