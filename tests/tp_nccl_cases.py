"""Rank code for tests/test_tp_nccl.py: broadcast sites over a real multi-process group
(harness.nccl), captured in CUDA graphs when the ranks have GPUs.

On the CPU the same cases run with every "replay" an eager call of the region (nothing
to capture): the counting and value logic is checked there, the capture on the GPU.
Every process gets NVLink multicast switched off (NO_MULTICAST): it can put the shared
GPUs out of service.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch

from harness.nccl import capture, device_of, make_group, no_host_sync, report, run
# Offers the kernel library to the broadcast and the report, as the registry's import does in a rank.
from sglang_dsv41_adapters.folded_fence import accept_snapshot  # noqa: E402,F401

BS = 64
def _replays(n, skewed, rank, skew, graph, region, nccl):
    """n replays, rank 1's skew set on the device before each (1 in the skewed ones)."""
    from sglang_dsv41_adapters.tp_divergence import divergence

    ones, zeros = torch.ones_like(skew), torch.zeros_like(skew)
    calls = divergence.calls()
    with no_host_sync(nccl):
        for i in range(n):
            skew.copy_(ones if rank == 1 and i in skewed else zeros)
            run(graph, region)
    if nccl:
        torch.cuda.synchronize()
        assert divergence.calls() == calls, "a replay ran Python: the graph did not count alone"


def _rows_off(history, expected) -> list[int]:
    """The replays after which this rank held something other than rank 0's values."""
    return [i for i, row in enumerate(history.cpu()) if not torch.equal(row, expected)]


# ---------------------------------------------------------------- 1. the engine's SpecTpSync


def sync_case(rank, world, nccl, n, skewed):
    """sglang 0.5.23's SpecTpSync, report on: rank 1's accept value skewed in `skewed` of n
    replays of a captured region holding two sites (accept graph 10, draft 17)."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    from sglang_dsv41_adapters.tp_divergence import divergence

    skewed = frozenset(skewed)
    os.environ.pop("SGLANG_SPEC_TP_SYNC", None)  # the engine's default: all
    group, kind = make_group(rank, world, nccl)
    device = device_of(group, nccl)
    report(True)
    tp_sync = SpecTpSync(group)
    source = torch.arange(BS, device=device)
    skew = torch.zeros((), dtype=torch.int64, device=device)
    accept, draft = torch.empty_like(source), torch.empty_like(source)
    history = torch.zeros(n, 2, BS, dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)

    def region():  # as DsparkVerifyEpilogue._accept and the folded draft sync inside their graphs
        accept.copy_(source + skew)
        tp_sync.sync(S.DSPARK_ACCEPT_GRAPH, accept)
        draft.copy_(source)
        tp_sync.sync(S.DSPARK_DRAFT, draft)
        history.index_copy_(0, step, torch.stack((accept, draft)).unsqueeze(0))
        step.add_(1)

    try:
        if not nccl:
            region()  # what the warm-up before capture does on the GPU: makes the counters
        graph = capture(group, region, nccl)
        divergence.reset()
        step.zero_()
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):  # eager calls report every 8, replays only at the flush
            _replays(n, skewed, rank, skew, graph, region, nccl)
            totals = divergence.totals()
            divergence.flush()
        lines = [line for line in printed.getvalue().splitlines() if " tp_divergence site=" in line]
        off = _rows_off(history, torch.stack((source, source)).cpu())
    finally:
        report(False)
        divergence.reset()
    return {"group": kind, "captured": graph is not None, "totals": totals, "lines": lines, "rows_off": off,
            "replays": int(step.item())}


# ---------------------------------------------------------------- 2. the pack's broadcast


def pack_case(rank, world, nccl, n, skewed):
    """The pack's broadcast (0.5.16 - 0.5.18) in a captured region: the accept triple packed
    into one collective (site 10) and a draft broadcast (17), rank 1's first field and
    draft skewed in `skewed` of n replays; off (no broadcast), on, and on with the
    divergence wrapper as tp_divergence's plan installs it there."""

    import wrapt

    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.tp_divergence import divergence
    from sglang_dsv41_adapters import tp_divergence as t
    from sglang_dsv41_adapters.spectpsync.sites import Site

    skewed = frozenset(skewed)
    group, kind = make_group(rank, world, nccl)
    b.bind_group(b.DSPARK, group)
    device = device_of(group, nccl)
    source = torch.arange(BS, device=device)
    expected = torch.stack((source, source + 1, source + 2, source)).cpu()
    compared = wrapt.FunctionWrapper(b.broadcast, t.before_0_5_19.compare_broadcast(1000))
    # name: (broadcast, the kernel library's paths on, captured): the library's one-launch block
    # and fused comparison against concatenation and torch ops, inside graphs and eagerly
    variants = {"off": (None, True, True), "on": (b.broadcast, True, True), "on_report": (compared, True, True),
                "on_report_torch": (compared, False, True), "on_report_eager": (compared, True, False),
                "on_report_torch_eager": (compared, False, False)}
    out = {"group": kind, "packing": [], "compare": []}
    try:
        for name, (broadcast, kernel, captured) in variants.items():
            b.use_kernel(kernel)
            divergence.use_kernel(kernel)
            skew = torch.zeros((), dtype=torch.int64, device=device)
            triple = [torch.empty(BS, dtype=torch.int64, device=device), torch.empty(BS, dtype=torch.int64, device=device),
                      torch.empty(BS, dtype=torch.int32, device=device)]
            draft = torch.empty_like(source)
            history = torch.zeros(n, 4, BS, dtype=torch.int64, device=device)
            step = torch.zeros(1, dtype=torch.int64, device=device)

            def region():  # as rank0_broadcast's wrappers on the accept and the folded draft inside graphs
                triple[0].copy_(source + skew)
                triple[1].copy_(source + 1)
                triple[2].copy_(source + 2)
                draft.copy_(source + skew)
                accepted = triple
                if broadcast is not None:  # the triple comes back as views of one received buffer
                    accepted = broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *triple)
                    broadcast(b.DSPARK, Site.DSPARK_DRAFT, draft)
                row = torch.stack((accepted[0], accepted[1], accepted[2].to(torch.int64), draft))
                history.index_copy_(0, step, row.unsqueeze(0))
                step.add_(1)

            if not (nccl and captured):
                region()
            graph = capture(group, region, nccl and captured)
            divergence.reset()
            step.zero_()
            _replays(n, skewed, rank, skew, graph, region, nccl and captured)
            out[name] = {"rows_off": _rows_off(history, expected), "replays": int(step.item()),
                         "totals": divergence.totals() if broadcast is compared else {}}
            if broadcast is compared and nccl:  # what served the CUDA values (the CPU never probes)
                out["packing"].append(b.packing_mode()[0])
                out["compare"].append(divergence.compare_mode()[0])
    finally:
        b.reset()
        b.use_kernel(True)
        divergence.use_kernel(True)
        divergence.reset()
    return out
