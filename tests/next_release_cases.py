"""Rank code for tests/test_next_release.py: what a rank of a next-release engine does with
the pack, the tree first on each rank's path (harness.next_release)."""

from __future__ import annotations


def decisions(rank, world_size, cases):
    """For each (environment, layout or None), the decision a rank takes on the engine it
    imports (`row`)."""
    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.framework.topology import Topology

    out = []
    for env, layout in cases:
        topology = None if layout is None else Topology(layout[0], attn_dp_size=layout[1])
        out.append(row(runtime.decide(env, topology=topology)))
    return out


def row(decision) -> dict:
    """What a decision says, as the tests compare it across deciders."""
    return {"states": {o.adapter: o.state for o in decision.outcomes},
            "reasons": {o.adapter: o.reason for o in decision.outcomes},
            "env": {name: dict(plan.env) for name, plan in decision.plans.items()},
            "patches": {name: [p.where for p in plan.patches] for name, plan in decision.plans.items()}}


def handed_site_case(rank, world, *, nccl: bool = False, flag: str, site: str):
    """The pack's decision for DSV41_SPEC_TP_SYNC=`flag` applied on this rank (what it hands
    to SGLANG_SPEC_TP_SYNC lands in os.environ), then the engine's own SpecTpSync built over
    the engine's own TP GroupCoordinator, as a worker builds it: does sync at the engine's
    `site` (one the pack has never seen) give every rank rank 0's value?"""
    import os

    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.framework.topology import Topology
    from tests.mem23_cases import _groups

    decision = runtime.decide({"DSV41_SPEC_TP_SYNC": flag}, names=("rank0_broadcast",), topology=Topology(world))
    runtime.apply(decision)
    tp, _ = _groups(rank, world, world, nccl)
    sync = SpecTpSync(tp)
    value = torch.full((4,), 100 + rank, dtype=torch.int64)
    returned = sync.sync(SpecTpSyncSite[site], value)
    out = {"state": decision.outcomes[0].state, "handed": os.environ.get("SGLANG_SPEC_TP_SYNC"),
           "enabled": sync.enabled(SpecTpSyncSite[site]), "value": returned.tolist(), "same_tensor": returned is value}
    runtime.revert()
    return out
