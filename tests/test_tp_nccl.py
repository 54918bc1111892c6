"""Issue 16: broadcast sites over a real multi-process group, inside captured CUDA graphs
over NCCL (world = every visible GPU, at least 2), the ranks spawned with
torch.multiprocessing (tests/tp_nccl_cases.py).

1. sglang 0.5.23's own SpecTpSync with DSV41_TP_DIVERGENCE on, over the engine's own
   GroupCoordinator (pynccl inside graph capture, as its TP group): a skew on rank 1 in k
   of n replays is counted exactly k times at that site on rank 1, zero elsewhere; the
   replays run under torch.cuda.set_sync_debug_mode("error") and run no Python.
2. The pack's rank-0 broadcast (what 0.5.16 - 0.5.18 use; their own modules are not on the
   GPU machine, so the pack's broadcast() is driven directly over the same group): after
   every replay every rank holds rank 0's values; with the broadcast off rank 1 diverges
   in exactly the skewed replays (the test fails if the skew does not show).

The GPU tests are skipped without 2 CUDA GPUs. The same rank code runs here on gloo with
2 and 4 CPU processes (each replay an eager call: nothing is captured), so its counting
and value checks are exercised without a GPU. On the GPU machine:
`python3 -m pytest tests/test_tp_nccl.py -q -rA` (bench/gpu/tp_nccl.sh).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.tp_nccl_cases import BS, spawn_ranks

N = 24
SKEWED = [2, 5, 11, 17, 23]  # k = 5 of n = 24 replays
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs at least 2 CUDA GPUs for NCCL (found {GPUS})")
NCCL_TIMEOUT = 70  # seconds per spawn on the GPUs (bench/gpu/tp_nccl.sh bounds the whole run)


def check_sync(ranks):
    k = len(SKEWED)
    for rank, result in enumerate(ranks):
        assert result["replays"] == N, (rank, result)
        accept = [N, k, k * BS] if rank == 1 else [N, 0, 0]
        assert result["totals"] == {"10:dspark-accept-graph": accept, "17:dspark-draft": [N, 0, 0]}, (rank, result)
        assert result["rows_off"] == [], (rank, result["rows_off"])  # every replay: rank 0's values
        # the report lines: rank 1's add up to its counters; replays print only at the flush
        got = [re.search(r"rank=(\d+) site=(\S+) calls=\d+ diverged_calls=(\d+) diverged_elements=(\d+)", line).groups()
               for line in result["lines"]]
        if rank == 1:
            assert {g[:2] for g in got} == {("1", "10:dspark-accept-graph")}, got
            assert [sum(int(g[2]) for g in got), sum(int(g[3]) for g in got)] == [k, k * BS], got
            assert len(got) == 1 or not result["captured"], got
        else:
            assert got == []


def check_pack(ranks):
    k = len(SKEWED)
    for rank, result in enumerate(ranks):
        for variant in ("off", "on", "on_report"):
            assert result[variant]["replays"] == N, (rank, variant)
        # off: the skew shows on rank 1, in exactly the skewed replays; on: it never does
        assert result["off"]["rows_off"] == (SKEWED if rank == 1 else []), (rank, result["off"])
        assert result["on"]["rows_off"] == [] and result["on_report"]["rows_off"] == [], (rank, result)
        diverged = [N, k, k * BS] if rank == 1 else [N, 0, 0]
        assert result["on_report"]["totals"] == {"10:dspark-accept-graph": diverged, "17:dspark-draft": diverged}, rank


def report_group(ranks):
    kinds = {r["group"] for r in ranks}
    assert len(kinds) == 1, kinds
    print(f"TP group used: {kinds.pop()}")


# --- GPUs, NCCL, captured graphs -----------------------------------------------------------

@pytest.fixture(scope="module")
def nccl_sync():
    return spawn_ranks(GPUS, "tests.tp_nccl_cases:sync_case", nccl=True, kwargs={"n": N, "skewed": SKEWED},
                       timeout=NCCL_TIMEOUT)


@needs_gpus
def test_nccl_spec_tp_sync_counts_in_graphs(nccl_sync):
    report_group(nccl_sync)
    check_sync(nccl_sync)


@needs_gpus
def test_nccl_uses_the_engines_group_coordinator(nccl_sync):
    """Says whether the engine's coordinator was used or the torch.distributed fallback (and why)."""
    assert nccl_sync[0]["group"].startswith("sglang GroupCoordinator"), nccl_sync[0]["group"]


@needs_gpus
def test_nccl_pack_broadcast_in_graphs():
    ranks = spawn_ranks(GPUS, "tests.tp_nccl_cases:pack_case", nccl=True, kwargs={"n": N, "skewed": SKEWED},
                       timeout=NCCL_TIMEOUT)
    report_group(ranks)
    check_pack(ranks)


# --- the same rank code on gloo, CPU processes (eager) -------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_gloo_spec_tp_sync_counts(world):
    ranks = spawn_ranks(world, "tests.tp_nccl_cases:sync_case", nccl=False, kwargs={"n": N, "skewed": SKEWED},
                        timeout=240)
    assert ranks[0]["group"] == "sglang GroupCoordinator (gloo)"
    check_sync(ranks)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_pack_broadcast(world):
    ranks = spawn_ranks(world, "tests.tp_nccl_cases:pack_case", nccl=False, kwargs={"n": N, "skewed": SKEWED},
                        timeout=240)
    check_pack(ranks)
