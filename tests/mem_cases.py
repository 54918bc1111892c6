"""Rank and subprocess code for tests/test_group_min_memory.py (runs on sglang 0.5.18).

Rank functions run under tests.ranks.run_ranks: a fresh interpreter per rank with the
default gloo process group already initialised.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
import types

from tests.doctored import doctored_module

GIB = 1 << 30

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
SAMPLER = "sglang.srt.speculative.dspark_components.dspark_draft_sampler"
DFLASH = "sglang.srt.speculative.dflash_worker_v2"


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
    w, s, d = (importlib.import_module(m) for m in (WORKER, SAMPLER, DFLASH))
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
    from adapter import group_min_memory as gm
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

    w, s, d = (importlib.import_module(m) for m in (WORKER, SAMPLER, DFLASH))
    w.is_cuda = d.is_cuda = lambda: True
    # The sampler passes torch.get_device_module().current_device() as gpu_id; this
    # CUDA build of torch answers torch.cuda, which needs a driver. The helper's CPU
    # branch ignores gpu_id, so any index serves.
    import torch

    torch.cuda.current_device = lambda: 0
    original = {m.__name__: vars(m)["get_available_gpu_memory"] for m in (w, s, d)}

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
                plans = [gm.install(m) for m in (w, s, d)]
                row["plans"] = [p.state for p in plans]
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
            if mode == "with":
                for m in (w, s, d):
                    gm.uninstall(m)
                row["restored"] = all(vars(m)["get_available_gpu_memory"] is original[m.__name__] for m in (w, s, d))
                row["helper_untouched"] = common.get_available_gpu_memory is original[WORKER]
        scenarios.append(row)
    dist.all_reduce = real_all_reduce
    ps.destroy_model_parallel()
    return {"rank": rank, "scenarios": scenarios}


# ---------------------------------------------------------------- in-process checks (subprocess, 0.5.18)

# (module, old text, new text, symbol the refusal must name)
DOCTORED = {
    "dspark_probe_moved": (
        WORKER,
        "    def init_cuda_graphs(self):\n        capture_decode_cuda_graph = self._decode_graph_allowed\n"
        "        if is_cuda() and capture_decode_cuda_graph:\n"
        "            available_mem = get_available_gpu_memory(self.device, self.gpu_id)\n",
        "    def _free_memory_gb(self):\n        return get_available_gpu_memory(self.device, self.gpu_id)\n\n"
        "    def init_cuda_graphs(self):\n        capture_decode_cuda_graph = self._decode_graph_allowed\n"
        "        if is_cuda() and capture_decode_cuda_graph:\n            available_mem = self._free_memory_gb()\n",
        "DSparkWorkerV2._free_memory_gb",
    ),
    "sampler_probe_moved": (
        SAMPLER,
        "    available_gb = get_available_gpu_memory(\n        device, torch.get_device_module().current_device()\n    )\n",
        "    available_gb = _free_gb(device)\n",
        "_free_gb",
    ),
    "dflash_binding_signature": (
        DFLASH,
        "from sglang.srt.utils import get_available_gpu_memory, is_cuda, is_hip, is_npu\n",
        "from sglang.srt.utils import is_cuda, is_hip, is_npu\n\n\n"
        "def get_available_gpu_memory(device, gpu_id, *, group=None):\n    return 0.0\n",
        "get_available_gpu_memory",
    ),
    "sampler_binding_not_helper": (
        SAMPLER,
        "from sglang.srt.utils import get_available_gpu_memory\n",
        "from sglang.srt.utils import get_available_gpu_memory as _engine_probe\n\n\n"
        "def get_available_gpu_memory(device, gpu_id, distributed=False, empty_cache=True, cpu_group=None):\n"
        "    return _engine_probe(device, gpu_id)\n",
        "get_available_gpu_memory",
    ),
    "dspark_call_shape": (
        WORKER,
        "available_mem = get_available_gpu_memory(self.device, self.gpu_id)",
        "available_mem = get_available_gpu_memory(self.device, self.gpu_id, empty_cache=False)",
        "DSparkWorkerV2.init_cuda_graphs",
    ),
}
SAMPLER_HELPER = "\n\ndef _free_gb(device):\n    return get_available_gpu_memory(device, torch.get_device_module().current_device())\n"


def load_doctored(module_name: str, old: str, new: str, tail: str = ""):
    doctored = doctored_module(module_name, (old, new), tail=tail)
    assert sys.modules[module_name] is not doctored
    return doctored


def inproc_checks() -> dict:
    from adapter import group_min_memory as gm
    from adapter import patching, runtime
    from adapter.contract import Refused

    import sglang.srt.utils as utils_pkg
    from sglang.srt.model_executor import model_runner
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.utils import common

    mods = [importlib.import_module(m) for m in (WORKER, SAMPLER, DFLASH)]
    helper = common.get_available_gpu_memory
    others = {"utils.common": common, "utils": utils_pkg, "model_runner": model_runner, "eagle_worker_v2": eagle_worker_v2}
    res: dict = {"others_bound_to_helper": {k: vars(m)["get_available_gpu_memory"] is helper for k, m in others.items()}}
    res["check_states"] = {m.__name__: gm.check(m).state for m in mods}
    res["decide_no_patch"] = runtime.decide(gm, {gm.FLAG: "1"}, patch=False).state
    res["nothing_patched_by_check"] = all(vars(m)["get_available_gpu_memory"] is helper for m in mods)
    outcome = runtime.decide(gm, {gm.FLAG: "1"})
    res["decide"] = [outcome.state, outcome.reason]
    runtime.decide(gm, {gm.FLAG: "1"})  # second install
    for m in mods:
        gm.install(m)  # third
    bindings = [vars(m)["get_available_gpu_memory"] for m in mods]
    res["wrapped_by"] = [patching.wrapped_by(m, "get_available_gpu_memory") for m in mods]
    res["wrapped_once"] = all(b.__wrapped__ is helper for b in bindings)
    res["signature_kept"] = [str(inspect.signature(b)) for b in bindings] == [str(inspect.signature(helper))] * 3
    res["others_unchanged_while_installed"] = {k: vars(m)["get_available_gpu_memory"] is helper for k, m in others.items()}
    res["check_after_install"] = [gm.check(m).state for m in mods]
    for m in mods:
        gm.uninstall(m)
    res["restored"] = all(vars(m)["get_available_gpu_memory"] is helper for m in mods)
    res["uninstall_twice_harmless"] = [patching.remove(m, "get_available_gpu_memory", gm.NAME) for m in mods]
    res["off"] = runtime.decide(gm, {}).state
    res["off_left_alone"] = all(vars(m)["get_available_gpu_memory"] is helper for m in mods)

    drift = {}
    for case, (module_name, old, new, symbol) in DOCTORED.items():
        tail = SAMPLER_HELPER if case == "sampler_probe_moved" else ""
        doctored = load_doctored(module_name, old, new, tail)
        try:
            plan = gm.check(doctored)
        except Refused as exc:
            drift[case] = {"refused": True, "symbol": exc.symbol, "message": str(exc), "expected": symbol}
        else:
            drift[case] = {"refused": False, "state": plan.state, "expected": symbol}
    res["drift"] = drift
    return res


if __name__ == "__main__":
    print("RESULT:" + json.dumps(globals()[sys.argv[1]]()), flush=True)
