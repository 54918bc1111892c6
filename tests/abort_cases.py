"""Rank code for tests/test_divergence_abort.py (run through harness.ranks).

- steps_case (sglang 0.5.23): n decode steps through the engine's SpecTpSync over a real
  GroupCoordinator (gloo): the accept triple through the real `build_accept_outs` (site 8)
  and a target sync (site 11), with rank 1's bonus skewed at step k, under
  DSV41_TP_DIVERGENCE=`mode`. A rank whose broadcast fails because its peer stopped
  returns how far it got; Diverged is left to end the process, as in a scheduler.
- watchdog_case: the same steps with the report on, then the engine's watchdogs stuck on
  purpose: `Watchdog.create(..., test_stuck_time)` and the scheduler's own
  `create_scheduler_watchdog`; their dumps go to stderr through the engine's logger.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from tests.divergence_cases import BS, GAMMA, _configure, make_group


def _steps(rank, world_size, mode, every=1000):
    from sglang.srt.speculative.dspark_components.dspark_verify import build_accept_outs
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    decision = _configure({"DSV41_TP_DIVERGENCE": mode, "DSV41_TP_DIVERGENCE_EVERY": str(every)},
                          names=("tp_divergence",))
    tp_sync = SpecTpSync(make_group(rank, world_size))

    def step(i, skew):
        bonus = torch.arange(BS) + 100 + i
        bonus[2] += skew
        build_accept_outs(
            correct_len=torch.full((BS,), 2, dtype=torch.int64), bonus=bonus,
            cap_trim_lens=torch.zeros(BS, dtype=torch.int32), prefix_lens=torch.arange(BS) + 10,
            draft_tokens=torch.arange(BS * GAMMA).view(BS, GAMMA), gamma=GAMMA, verify_num_draft_tokens=GAMMA + 1,
            tp_sync=tp_sync, sync_site=S.DSPARK_ACCEPT_GREEDY)
        tp_sync.sync(S.DSPARK_TARGET, torch.arange(BS) + i)

    return decision.outcomes[0].state, step


def steps_case(rank, world_size, n, k, mode):
    from sglang_dsv41_adapters.tp_divergence import divergence

    state, step = _steps(rank, world_size, mode)
    done = 0
    try:
        for i in range(1, n + 1):
            step(i, int(rank == 1 and i == k))
            done = i
    except divergence.Diverged:
        raise  # ends this rank as an exception ends a scheduler process
    except RuntimeError as exc:  # the peer stopped: this rank's broadcast cannot complete
        return {"state": state, "done": done, "peer_gone": type(exc).__name__}
    return {"state": state, "done": done, "totals": divergence.totals()}


def watchdog_case(rank, world_size, n, k):
    from sglang.srt.distributed.device_communicators import pynccl_allocator
    from sglang.srt.managers.scheduler_components.invariant_checker import create_scheduler_watchdog
    from sglang.srt.utils.watchdog import Watchdog

    _, step = _steps(rank, world_size, "1", every=1)  # every call read: the last landed copy is current
    for i in range(1, n + 1):
        step(i, int(rank == 1 and i == k))
    # the watchdog's own stuck tester: its first feed sleeps past the timeout
    Watchdog.create("StuckTest", watchdog_timeout=0.2, soft=True, test_stuck_time=1.0).feed()
    # the scheduler's watchdog, its dump_info as the engine builds it; a registration in
    # progress stands in for the engine's own part of the dump
    pynccl_allocator._registering_context = SimpleNamespace(_comm_ptr=7, group_coordinator=SimpleNamespace(
        unique_name="tp:0"))
    scheduler = SimpleNamespace(forward_ct=0, is_initializing=True, cur_batch_for_debug=None)
    create_scheduler_watchdog(scheduler, watchdog_timeout=0.2, soft=True)
    time.sleep(1.0)
    scheduler.is_initializing = False  # inactive: no dump past this point
    time.sleep(0.3)
    return {"steps": n}


def pack_case(rank, world_size, n, k):
    """sglang 0.5.18: the pack's own broadcast (rank0_broadcast on), the accept triple packed
    into one collective, rank 1's bonus of request 2 skewed at step k, with abort."""
    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.spectpsync.sites import Site
    from tests.broadcast_cases import _bind

    _bind(rank, world_size)
    decision = _configure({"DSV41_SPEC_TP_SYNC": "all", "DSV41_TP_DIVERGENCE": "abort"},
                          names=("rank0_broadcast", "tp_divergence"))
    done = 0
    try:
        for i in range(1, n + 1):
            bonus = torch.arange(BS) + 100 + i
            bonus[2] += int(rank == 1 and i == k)
            b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GREEDY, torch.full((BS,), 2), bonus,
                        torch.zeros(BS, dtype=torch.int64))
            done = i
    except RuntimeError as exc:
        if "tp_divergence abort" in str(exc):
            raise
        return {"states": [o.state for o in decision.outcomes], "done": done, "peer_gone": type(exc).__name__}
    return {"states": [o.state for o in decision.outcomes], "done": done}
