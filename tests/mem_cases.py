"""Rank and subprocess code for tests/test_group_min_memory.py (runs on sglang 0.5.18).

Rank functions run under harness.ranks.run_ranks: a fresh interpreter per rank with the
default gloo process group already initialised. The adapter is switched on and off the
way the engine's ranks do it: one decision (`runtime.decide`), carried out by
`runtime.apply`, undone by `runtime.revert`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import types

from harness.doctored import Drift

GIB = 1 << 30

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
SAMPLER = "sglang.srt.speculative.dspark_components.dspark_draft_sampler"
DFLASH = "sglang.srt.speculative.dflash_worker_v2"
CONSUMERS = (WORKER, SAMPLER, DFLASH)
HELPER = "get_available_gpu_memory"
# The bindings the adapter replaces on 0.5.18: each consumer module's own import of the helper.
REPLACED = sorted(f"{name}.{HELPER}" for name in CONSUMERS)


def _switch_on():
    """DSV41_GROUP_MIN_MEM=1 as a rank decides and applies it; the decision is returned."""
    from sglang_dsv41_adapters import group_min_memory as gm
    from sglang_dsv41_adapters.framework import runtime

    decision = runtime.decide({gm.FLAG: "1"}, names=(gm.NAME,))
    runtime.apply(decision)
    return decision


def _replaced(adapter: str) -> list[str]:
    """The bindings `adapter` has replaced in this process, from the runtime's registry."""
    from sglang_dsv41_adapters.framework import patching

    return sorted(f"{s.owner.__name__}.{s.name}" for s in patching.applied() if s.adapter == adapter)


# ---------------------------------------------------------------- rank side


def _groups(rank: int, world_size: int, attn_tp_size: int):
    """Real sglang GroupCoordinators on real gloo groups. initialize_model_parallel()
    cannot be used on CPU: it builds the TP group with pynccl (CUDA only), so the
    same constructor it uses (init_model_parallel_group) is called with the CUDA
    communicators off, and the module globals are set as it would set them."""
    from sglang.srt.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=world_size, rank=rank, local_rank=rank, backend="gloo", distributed_init_method="env://"
    )
    off = dict(use_pynccl=False, use_custom_allreduce=False, use_mscclpp_allreduce=False,
               use_torch_symm_mem_allreduce=False)
    ps._TP = ps.init_model_parallel_group([list(range(world_size))], rank, "gloo", group_name="tp", **off)
    if attn_tp_size == world_size:
        ps._ATTN_TP = ps._TP  # as initialize_model_parallel does when attn_tp == tp
    else:
        blocks = [list(range(i, i + attn_tp_size)) for i in range(0, world_size, attn_tp_size)]
        ps._ATTN_TP = ps.init_model_parallel_group(blocks, rank, "gloo", group_name="attn_tp", **off)
    return ps


def _inject_free_memory(gb: float) -> float:
    """Make the device query of the engine helper report `gb` on this rank.

    The engine passes device "cuda"; this machine has no GPU, so the probes run the
    CPU branch of the same helper, whose device query is psutil.virtual_memory()
    divided over the NUMA nodes. That query is what is replaced, not the helper."""
    from sglang.srt.utils import common

    nodes = len(common.get_cpu_ids_by_node())
    available = int(gb * GIB * nodes)
    common.psutil.virtual_memory = lambda: types.SimpleNamespace(available=available)
    return round(available / nodes, 3) / GIB


def _decisions(rank: int, *, dp_context: bool) -> dict:
    """Run the real 0.5.18 decision functions once and report what this rank decided.

    DSparkWorkerV2.init_cuda_graphs and DFlashWorkerV2.init_cuda_graphs run for real
    on a stand-in `self` that carries only the attributes they read; their `is_cuda`
    binding says True (the gate is CUDA-only, the probe runs the helper's CPU branch,
    see _inject_free_memory). The DSpark draft sampler build is replaced by a call of
    the real _resolve_folded_sampling (AUTO), made where the engine makes it: inside
    the real DSparkWorkerV2._draft_context(), which swaps the TP group under DP."""
    w, s, d = (importlib.import_module(m) for m in CONSUMERS)
    out: dict = {"dspark_folded": None}
    # need_gb = (8*V*4 + 8*4*V*2) / 2**30 = 0.36 GB for V = 4e6; AUTO folds when free - need >= 1.0 GB.
    lm_head = types.SimpleNamespace(org_vocab_size=4_000_000, weight=types.SimpleNamespace(dtype=types.SimpleNamespace(itemsize=2)))
    model = types.SimpleNamespace(lm_head=lm_head)

    def build_sampler():
        out["dspark_folded"] = s._resolve_folded_sampling(model=model, gamma=4, max_bs=8, device="cpu", tp_rank=rank)
        return None

    dspark = types.SimpleNamespace(
        _decode_graph_allowed=True, device="cpu", gpu_id=rank, _draft_dp_context_enabled=dp_context,
        draft_model_runner=types.SimpleNamespace(capture_tail_hooks=[]),
        _proposer=types.SimpleNamespace(attach_draft_sampler=lambda sampler: None),
        _maybe_build_draft_sampler=build_sampler,
        _draft_worker=types.SimpleNamespace(
            init_cuda_graphs=lambda capture_decode_cuda_graph: out.__setitem__("dspark_capture", capture_decode_cuda_graph)
        ),
    )
    dspark._draft_context = types.MethodType(w.DSparkWorkerV2._draft_context, dspark)
    w.DSparkWorkerV2.init_cuda_graphs(dspark)

    dflash = types.SimpleNamespace(
        device="cpu", gpu_id=rank, draft_model_runner=types.SimpleNamespace(capture_tail_hooks=[]),
        _maybe_build_draft_sampler=lambda: None,
        _draft_worker=types.SimpleNamespace(
            init_cuda_graphs=lambda capture_decode_cuda_graph: out.__setitem__("dflash_capture", capture_decode_cuda_graph)
        ),
    )
    d.DFlashWorkerV2.init_cuda_graphs(dflash)
    return out


def decision_case(rank: int, world_size: int, *, attn_tp_size: int, frees_gb: list[list[float]]) -> dict:
    """For each scenario (one free-memory figure per rank): the decisions without and
    with the adapter, the all_reduce calls made during each, and the probe values."""
    import torch.distributed as dist

    ps = _groups(rank, world_size, attn_tp_size)
    from sglang_dsv41_adapters import group_min_memory as gm
    from sglang_dsv41_adapters.framework import runtime
    from sglang.srt.runtime_context import get_context, get_exec, get_flags

    dp_attention = attn_tp_size < world_size
    get_context().override_server_args(tp_size=world_size, dp_size=world_size // attn_tp_size,
                                       enable_dp_attention=dp_attention).install()
    get_flags().dp.enabled = dp_attention  # what initialize_dp_attention sets
    # The dummy ServerArgs resolves no CUDA-graph config; DFlash's gate reads the decode backend.
    backend = importlib.import_module(DFLASH).Backend.FULL
    graph = types.SimpleNamespace(decode=types.SimpleNamespace(backend=backend))
    global _GRAPH_OVERRIDE  # a collected generator context would restore the config
    _GRAPH_OVERRIDE = get_exec().graph.override(cuda_graph_config=graph)
    _GRAPH_OVERRIDE.__enter__()
    from sglang.srt.utils import common

    w, s, d = (importlib.import_module(m) for m in CONSUMERS)
    w.is_cuda = d.is_cuda = lambda: True
    # The sampler passes torch.get_device_module().current_device() as gpu_id; this
    # CUDA build of torch answers torch.cuda, which needs a driver. The helper's CPU
    # branch ignores gpu_id, so any index serves.
    import torch

    torch.cuda.current_device = lambda: 0
    helper = common.get_available_gpu_memory
    original = {m.__name__: vars(m)[HELPER] for m in (w, s, d)}

    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(kwargs.get("op", args[0] if args else None) == dist.ReduceOp.MIN)
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    scenarios = []
    for frees in frees_gb:
        local = _inject_free_memory(frees[rank])
        row = {"local_gb": local}
        for mode in ("without", "with"):
            if mode == "with":
                outcome = _switch_on().outcomes[0]
                row["state"] = outcome.state
                row["replaced"] = _replaced(gm.NAME)
            gm.COLLECTIVES.clear()
            del calls[:]
            row[mode] = _decisions(rank, dp_context=dp_attention)
            row[mode]["all_reduce_calls"] = len(calls)
            row[mode]["all_reduce_min"] = all(calls)
            row[mode]["adapter_collectives"] = dict(gm.COLLECTIVES)
            # The value each consumer binding returns, called as the engine calls it.
            row[mode]["probe_gb"] = {
                "dspark_worker": w.get_available_gpu_memory("cpu", rank),
                "dflash_worker": d.get_available_gpu_memory("cpu", rank),
            }
            with w.DSparkWorkerV2._draft_context(types.SimpleNamespace(_draft_dp_context_enabled=dp_attention)):
                row[mode]["probe_gb"]["dspark_sampler"] = s.get_available_gpu_memory("cpu", 0)
            # The shared helper, called as every other importer calls it: this rank's own value.
            row[mode]["helper_gb"] = common.get_available_gpu_memory("cpu", rank)
            if mode == "with":
                row["helper_untouched"] = common.get_available_gpu_memory is helper
                runtime.revert()
                row["restored"] = (all(vars(m)[HELPER] is original[m.__name__] for m in (w, s, d))
                                   and _replaced(gm.NAME) == [])
        scenarios.append(row)
    dist.all_reduce = real_all_reduce
    ps.destroy_model_parallel()
    return {"rank": rank, "scenarios": scenarios}


# ---------------------------------------------------------------- drift (0.5.18 copies)

# 0.5.18 _resolve_folded_sampling up to its probe, which the drift below moves into a helper.
_RESOLVE_HEAD = (
    "def _resolve_folded_sampling(*, model, gamma, max_bs, device, tp_rank) -> bool:\n"
    '    """The sampling buffers are baked into the captured draft graph, so AUTO\n'
    '    must decide before capture from a free-memory probe."""\n'
    "    mode = envs.SGLANG_DSPARK_FOLDED_SAMPLING.get()\n"
    "    if mode == DsparkFoldedSampling.OFF:\n"
    "        return False\n"
    "    if mode == DsparkFoldedSampling.FORCE:\n"
    "        return True\n"
    "    vocab = int(model.lm_head.org_vocab_size)\n"
    "    noise_bytes = max_bs * vocab * 4\n"
    "    logits_bytes = max_bs * gamma * vocab * model.lm_head.weight.dtype.itemsize\n"
    "    need_gb = (noise_bytes + logits_bytes) / (1 << 30)\n"
)
_SAMPLER_PROBE = (
    "    available_gb = get_available_gpu_memory(\n"
    "        device, torch.get_device_module().current_device()\n"
    "    )\n"
)

# Each refactor of a 0.5.18 consumer module that moves the probe off the path the
# adapter covers; the refusal must name the symbol (and the module).
DRIFT_0_5_18 = {
    "dspark_probe_moved": Drift(
        WORKER,
        "    def init_cuda_graphs(self):\n        capture_decode_cuda_graph = self._decode_graph_allowed\n"
        "        if is_cuda() and capture_decode_cuda_graph:\n"
        "            available_mem = get_available_gpu_memory(self.device, self.gpu_id)\n",
        "    def _free_memory_gb(self):\n        return get_available_gpu_memory(self.device, self.gpu_id)\n\n"
        "    def init_cuda_graphs(self):\n        capture_decode_cuda_graph = self._decode_graph_allowed\n"
        "        if is_cuda() and capture_decode_cuda_graph:\n            available_mem = self._free_memory_gb()\n",
        "DSparkWorkerV2._free_memory_gb",
    ),
    "sampler_probe_moved": Drift(
        SAMPLER,
        _RESOLVE_HEAD + _SAMPLER_PROBE,
        "def _free_gb(device):\n    return get_available_gpu_memory(device, torch.get_device_module().current_device())\n\n\n"
        + _RESOLVE_HEAD + "    available_gb = _free_gb(device)\n",
        "_free_gb",
    ),
    "dflash_binding_signature": Drift(
        DFLASH,
        "from sglang.srt.utils import get_available_gpu_memory, is_cuda, is_hip, is_npu\n",
        "from sglang.srt.utils import is_cuda, is_hip, is_npu\n\n\n"
        "def get_available_gpu_memory(device, gpu_id, *, group=None):\n    return 0.0\n",
        "get_available_gpu_memory",
    ),
    "sampler_binding_not_helper": Drift(
        SAMPLER,
        "from sglang.srt.utils import get_available_gpu_memory\n",
        "from sglang.srt.utils import get_available_gpu_memory as _engine_probe\n\n\n"
        "def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):\n"
        "    return _engine_probe(device, gpu_id)\n",
        "get_available_gpu_memory",
    ),
    "dspark_call_shape": Drift(
        WORKER,
        "available_mem = get_available_gpu_memory(self.device, self.gpu_id)",
        "available_mem = get_available_gpu_memory(self.device, self.gpu_id, empty_cache=False)",
        "DSparkWorkerV2.init_cuda_graphs",
    ),
}


# ---------------------------------------------------------------- in-process checks (subprocess, 0.5.18)


def inproc_checks() -> dict:
    from sglang_dsv41_adapters import group_min_memory as gm
    from sglang_dsv41_adapters.framework import patching, runtime

    import sglang.srt.utils as utils_pkg
    from sglang.srt.model_executor import model_runner
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.utils import common

    mods = [importlib.import_module(m) for m in CONSUMERS]
    helper = common.get_available_gpu_memory
    others = {"utils.common": common, "utils": utils_pkg, "model_runner": model_runner, "eagle_worker_v2": eagle_worker_v2}

    def bindings():
        return [vars(m)[HELPER] for m in mods]

    def untouched():
        return all(b is helper for b in bindings()) and patching.applied() == []

    res: dict = {"others_bound_to_helper": {k: vars(m)[HELPER] is helper for k, m in others.items()}}

    # Deciding is pure: a plan for the three consumer bindings, nothing replaced yet.
    decision = runtime.decide({gm.FLAG: "1"}, names=(gm.NAME,))
    outcome = decision.outcomes[0]
    res["decide"] = [outcome.state, outcome.reason, outcome.engine]
    res["planned"] = sorted(f"{p.owner.__name__}.{p.name}" for p in decision.plans[gm.NAME].patches)
    res["nothing_patched_by_decide"] = untouched()

    # Applied: the three bindings replaced, each over the engine helper itself.
    runtime.apply(decision)
    first = bindings()
    res["replaced"] = _replaced(gm.NAME)
    res["originals_are_helper"] = all(patching.original(m, HELPER) is helper for m in mods)
    res["bindings_replaced"] = all(b is not helper for b in first)
    res["signature_kept"] = [str(inspect.signature(b)) for b in first] == [str(inspect.signature(helper))] * 3
    res["others_unchanged_while_applied"] = {k: vars(m)[HELPER] is helper for k, m in others.items()}

    # Decided again with the wrappers in place, and applied twice more: nothing changes.
    again = runtime.decide({gm.FLAG: "1"}, names=(gm.NAME,))
    res["decide_after_apply"] = [again.outcomes[0].state, again.outcomes[0].reason == outcome.reason]
    runtime.apply(again)
    runtime.apply(decision)
    res["apply_idempotent"] = (all(a is b for a, b in zip(bindings(), first))
                               and _replaced(gm.NAME) == res["replaced"]
                               and all(patching.original(m, HELPER) is helper for m in mods))

    runtime.revert()
    res["restored"] = untouched() and all(patching.original(m, HELPER) is None for m in mods)
    runtime.revert()
    res["revert_twice_harmless"] = untouched()

    # Off: nothing planned, nothing touched; and applying it undoes an earlier "on".
    off = runtime.decide({}, names=(gm.NAME,))
    res["off"] = [off.outcomes[0].state, gm.NAME in off.plans]
    runtime.apply(off)
    res["off_left_alone"] = untouched()
    runtime.apply(decision)
    runtime.apply(off)
    res["off_reverts_on"] = untouched()

    res["drift"] = {case: drift.outcome(gm, "1").as_dict() for case, drift in DRIFT_0_5_18.items()}
    return res


if __name__ == "__main__":
    print("RESULT:" + json.dumps(globals()[sys.argv[1]]()), flush=True)
