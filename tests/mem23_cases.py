"""Rank code for the memory probe where SpecTpSync keeps no site (tests/test_group_min_memory.py
on gloo, tests/test_tp_nccl.py on NCCL): sglang 0.5.23's own SpecTpSync and the workers'
init_cuda_graphs probe path, with attention-TP groups of one rank inside a larger capture
group and unequal free memory.

Each rank builds the engine's own GroupCoordinators (the TP group and the attention-TP
groups), states the layout to the engine's ParallelContext, and then builds the worker's
SpecTpSync and draft graph group the way `DSparkWorkerV2.__init__` does (the two lines are
checked against its source): `SpecTpSync(get_dp_tp_group())` and
`draft_parallel_layout.tp_group or parallel.tp_group`, the layout resolved by the engine for
a MoE draft (which 0.5.23 allows under DP attention only with attention-TP 1). The real
`DSparkWorkerV2.init_cuda_graphs` and `DFlashWorkerV2.init_cuda_graphs` then run on a
stand-in `self` carrying only what they read; each reports whether it would capture the
draft graph. Free memory is injected per rank at the device query under the engine helper:
on the CPU the helper's CPU branch (`get_free_cpu_memory`), on a GPU by holding memory on
the device so that `torch.cuda.mem_get_info` reports the figure.

DSV41_GROUP_MIN_MEM is switched on the way a rank does it: `runtime.decide` with the
deployment's topology (as the plugin builds it from server_args), then `runtime.apply`.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types

GIB = 1 << 30
DSPARK = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
DFLASH = "sglang.srt.speculative.dflash_worker_v2"
# DSparkWorkerV2.__init__ (0.5.23) builds its SpecTpSync and draft graph group so:
INIT_LINES = ("self._tp_sync = SpecTpSync(get_dp_tp_group())",
              "self._draft_graph_group = (\n            self.draft_parallel_layout.tp_group or parallel.tp_group\n        )")


def _groups(rank: int, world: int, attn_tp: int, nccl: bool):
    """sglang's GroupCoordinator for the TP group and the attention-TP groups (gloo CPU
    groups; the device groups NCCL on GPUs), every side channel off."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    def build(blocks, name):
        wanted = dict(group_ranks=blocks, local_rank=rank, torch_distributed_backend="nccl" if nccl else "gloo",
                      group_name=name)
        for param in inspect.signature(GroupCoordinator.__init__).parameters:
            if param.startswith("use_"):
                wanted[param] = False
        return GroupCoordinator(**wanted)

    tp = build([list(range(world))], "tp")
    attn = tp if attn_tp == world else build([list(range(i, i + attn_tp)) for i in range(0, world, attn_tp)], "attn_tp")
    return tp, attn


def _layout(rank: int, world: int, attn_tp: int, tp, attn) -> dict:
    """The parallel fields the engine publishes for this layout (no attention CP)."""
    return dict(tp_size=world, tp_rank=rank, attn_tp_size=attn_tp, attn_tp_rank=rank % attn_tp,
                attn_dp_size=world // attn_tp, attn_dp_rank=rank // attn_tp, attn_cp_size=1, attn_cp_rank=0,
                attn_dp_enabled=attn_tp < world, enable_dp_attention=attn_tp < world, tp_group=tp,
                attn_tp_group=attn)


@contextlib.contextmanager
def _free_memory(gb: float, nccl: bool):
    """This rank's device query reports `gb` free while inside."""
    if nccl:
        import torch

        free, _ = torch.cuda.mem_get_info()
        held = torch.empty(max(int(free - gb * GIB), 0), dtype=torch.uint8, device="cuda")
        try:
            yield
        finally:
            del held
            torch.cuda.empty_cache()
        return
    from sglang.srt.utils import common

    nodes = len(common.get_cpu_ids_by_node())
    saved = common.get_free_cpu_memory
    common.get_free_cpu_memory = lambda: gb * GIB * nodes
    try:
        yield
    finally:
        common.get_free_cpu_memory = saved


def _dspark_capture(worker, spec_sync, graph_group, rank: int, nccl: bool) -> bool:
    """The capture decision of the real DSparkWorkerV2.init_cuda_graphs."""
    from sglang.srt.speculative.draft_parallel import legacy_draft_parallel_spec, resolve_draft_parallel_layout
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seen = {}
    layout = resolve_draft_parallel_layout(legacy_draft_parallel_spec(SpeculativeAlgorithm.DSPARK, dspark_is_moe=True))
    me = types.SimpleNamespace(
        _hosts_draft=True, _decode_graph_allowed=True, _tp_sync=spec_sync, _draft_graph_group=graph_group,
        device="cuda" if nccl else "cpu", gpu_id=rank if nccl else 0, draft_parallel_layout=layout,
        _maybe_build_draft_sampler=lambda: None, draft_model_runner=types.SimpleNamespace(capture_tail_hooks=[]),
        _proposer=types.SimpleNamespace(attach_draft_sampler=lambda sampler: None), _deferred_commit=lambda: None,
        _draft_worker=types.SimpleNamespace(
            init_cuda_graphs=lambda capture_decode_cuda_graph: seen.setdefault("capture", capture_decode_cuda_graph)),
    )
    me._draft_context = types.MethodType(worker.DSparkWorkerV2._draft_context, me)
    worker.DSparkWorkerV2.init_cuda_graphs(me)
    return seen["capture"]


def _dflash_capture(worker, spec_sync, rank: int, nccl: bool) -> bool:
    """The capture decision of the real DFlashWorkerV2.init_cuda_graphs (whose probe group
    is get_parallel().tp_group)."""
    from sglang.srt.configs.draft_parallel import DraftParallelLayout

    seen = {}
    me = types.SimpleNamespace(
        _tp_sync=spec_sync, device="cuda" if nccl else "cpu", gpu_id=rank if nccl else 0, _target_tp_rank=rank,
        draft_parallel_layout=DraftParallelLayout(tp_group=None, attn_tp_size=1), selector=None,
        _maybe_build_draft_sampler=lambda: None, draft_model_runner=types.SimpleNamespace(capture_tail_hooks=[]),
        _draft_worker=types.SimpleNamespace(
            init_cuda_graphs=lambda capture_decode_cuda_graph: seen.setdefault("capture", capture_decode_cuda_graph)),
    )
    worker.DFlashWorkerV2.init_cuda_graphs(me)
    return seen["capture"]


def capture_case(rank: int, world: int, *, nccl: bool = False, attn_tp: int, frees_gb: list[float],
                 decide_with: list) -> dict:
    """For each topology in `decide_with` (None: unknown; else [tp_size, attn_dp_size]), and
    unpatched first: both workers' capture decisions, this rank's probe values and the
    group all_reduces made, with DSV41_GROUP_MIN_MEM decided and applied for it."""
    import torch.distributed as dist

    from sglang_dsv41_adapters import group_min_memory as gm
    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.framework.topology import Topology
    from sglang.srt.layers.dp_attention import get_dp_tp_group
    from sglang.srt.runtime_context import get_context, get_exec, get_parallel
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync
    from harness.doctored import DoctoredEngine

    dspark, dflash = importlib.import_module(DSPARK), importlib.import_module(DFLASH)
    init = inspect.getsource(dspark.DSparkWorkerV2.__init__)
    out = {"init_lines": [line in init for line in INIT_LINES], "runs": {}}
    # Not on the probe path: the pp context (a one-rank pp group) and, on the CPU, the CUDA gate.
    dspark.draft_pp_context = dflash.draft_pp_context = contextlib.nullcontext
    if not nccl:
        dspark.is_cuda_alike = dflash.is_cuda = lambda: True
    backend = dflash.Backend.FULL
    graph_config = types.SimpleNamespace(decode=types.SimpleNamespace(backend=backend))

    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(str(kwargs.get("op")))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    tp, attn = _groups(rank, world, attn_tp, nccl)
    # A dummy published config with this layout's widths; the ranks and groups are stated below.
    dp = {"dp_size": world // attn_tp, "enable_dp_attention": True} if attn_tp < world else {}
    get_context().override_server_args(tp_size=world, **dp).install()
    with get_parallel().override(**_layout(rank, world, attn_tp, tp, attn)), \
            get_exec().graph.override(cuda_graph_config=graph_config), _free_memory(frees_gb[rank], nccl):
        spec_sync = SpecTpSync(get_dp_tp_group())  # as DSparkWorkerV2.__init__ and DFlashWorkerV2.__init__
        graph_group = _dspark_capture_group()
        out["groups"] = {"spec_tp_sync": spec_sync._tp_group.world_size, "draft_graph": graph_group.world_size}
        for topology in [False, *decide_with]:
            if topology is False:
                label, state = "unpatched", None
            else:
                deployment = None if topology is None else Topology(topology[0], attn_dp_size=topology[1])
                decision = runtime.decide({gm.FLAG: "1"}, DoctoredEngine({}), names=(gm.NAME,), topology=deployment)
                runtime.apply(decision)
                label, state = str(topology), decision.outcomes[0].state
                out.setdefault("reasons", {})[label] = decision.outcomes[0].reason
            # What the DSpark probe returns on this rank, called as init_cuda_graphs calls it.
            probe = spec_sync.available_memory_gb(spec_sync_site("DSPARK_MEM"), "cuda" if nccl else "cpu",
                                                  rank if nccl else 0, group=graph_group)
            del calls[:]
            gm.COLLECTIVES.clear()
            run = {"state": state, "probe_gb": round(probe, 3),
                   "dspark_capture": _dspark_capture(dspark, spec_sync, graph_group, rank, nccl)}
            run["dspark_all_reduce"], calls[:] = list(calls), []
            run["dflash_capture"] = _dflash_capture(dflash, spec_sync, rank, nccl)
            run["dflash_all_reduce"] = list(calls)
            run["pack_collectives"] = dict(gm.COLLECTIVES)
            out["runs"][label] = run
            runtime.revert()
    dist.all_reduce = real_all_reduce
    return out


def _dspark_capture_group():
    """DSparkWorkerV2.__init__'s `draft_parallel_layout.tp_group or parallel.tp_group`, the
    layout resolved for a MoE draft."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.draft_parallel import legacy_draft_parallel_spec, resolve_draft_parallel_layout
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    layout = resolve_draft_parallel_layout(legacy_draft_parallel_spec(SpeculativeAlgorithm.DSPARK, dspark_is_moe=True))
    return layout.tp_group or get_parallel().tp_group


def spec_sync_site(name: str):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

    return SpecTpSyncSite[name]
