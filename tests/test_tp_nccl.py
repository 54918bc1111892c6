"""Broadcast sites over a real multi-process group, inside captured CUDA graphs
over NCCL (world = every visible GPU, at least 2), the ranks spawned with
torch.multiprocessing (tests/tp_nccl_cases.py).

1. sglang 0.5.23's own SpecTpSync with DSV41_TP_DIVERGENCE on, over the engine's own
   GroupCoordinator (pynccl inside graph capture, as its TP group): a skew on rank 1 in k
   of n replays is counted exactly k times at that site on rank 1, zero elsewhere; the
   replays run under torch.cuda.set_sync_debug_mode("error") and run no Python.
2. The pack's rank-0 broadcast (what 0.5.16 - 0.5.18 use) driven directly over the same
   group: after every replay every rank holds rank 0's values; with the broadcast off rank 1
   diverges in exactly the skewed replays (the test fails if the skew does not show).
3. sglang 0.5.18 itself (tests/tp18_cases.py, the ranks spawned with 0.5.18 first on
   sys.path): its GroupCoordinator and graph_capture(), its DsparkDraftSampler.__call__
   (greedy and folded sampling) and DsparkVerifyEpilogue._accept captured in one graph,
   DSV41_SPEC_TP_SYNC=all applied through the runtime or unset: on, no rank ever differs
   from rank 0; off, rank 1's drafts and accept differ in exactly the skewed replays.

4. The memory probe where SpecTpSync keeps no site: sglang 0.5.23's own SpecTpSync and
   DSparkWorkerV2/DFlashWorkerV2.init_cuda_graphs on DP 2 x attention-TP 1
   (tests/mem23_cases.py; two of the GPUs): the engine's GroupCoordinators with NCCL device
   groups, the helper's CUDA branch, rank 0's GPU held down to 0.6 GB free: unpatched the
   ranks decide differently whether to capture the DSpark draft graph (the test fails if they
   do not); with DSV41_GROUP_MIN_MEM=1 decided for that topology they agree.

5. The pack's own site 31:pack-dflash-draft-greedy (tests/dflash_draft_cases.py) on
   sglang 0.5.23's own DFlash draft code: `_DominoDraftSampler.__call__` and
   `_SelectorDraftSampler.__call__` captured in CUDA graphs as the engine's draft graph runs them
   (the broadcast recorded inside), the eager plain head without shard_indices, rank 1 skewed in
   k of n steps: off, rank 1's blocks differ in exactly those steps (the test fails if they do
   not); on, every rank holds rank 0's block; the divergence report counts k at row 31.

The GPU tests are skipped without 2 CUDA GPUs. The same rank code runs here on gloo with
2 and 4 CPU processes (each replay an eager call: nothing is captured), so its counting
and value checks are exercised without a GPU (3 on 2 ranks: eagerly, with the Triton-only
launches under _accept swapped for the engine's torch reference paths; only the GPU covers
capture, Triton, NCCL and replays). On the GPU machine:
`python3 -m pytest tests/test_tp_nccl.py -q -rA` (bench/gpu/tp_nccl.sh).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests import dflash_draft_cases, tp18_cases
from harness.engines import ENGINE_PATHS
from harness.nccl import spawn_ranks
from tests.tp_nccl_cases import BS

N = 24
SKEWED = [2, 5, 11, 17, 23]  # k = 5 of n = 24 replays
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs at least 2 CUDA GPUs for NCCL (found {GPUS})")
NCCL_TIMEOUT = 70  # seconds per spawn on the GPUs (bench/gpu/tp_nccl.sh bounds the whole run)
NCCL18_TIMEOUT = 120  # 0.5.18's import and its Triton kernels' first compile in every rank


def release18_path() -> list[str] | None:
    """Where the ranks import sglang 0.5.18 from: ENGINE18_PATH (bench/gpu/setup.sh on the GPU
    machine), else tests/engines.py's folders when scripts/setup.sh filled them."""
    if os.environ.get("ENGINE18_PATH"):
        return os.environ["ENGINE18_PATH"].split(os.pathsep)
    paths = ENGINE_PATHS["0.5.18"]
    return [str(p) for p in paths] if all(p.is_dir() for p in paths) else None


RELEASE18 = release18_path()
needs_release18 = pytest.mark.skipif(RELEASE18 is None, reason="sglang 0.5.18 is not here: set ENGINE18_PATH "
                                     "(bench/gpu/setup.sh) or fill .engines (scripts/setup.sh)")


def check_sync(ranks):
    k = len(SKEWED)
    for rank, result in enumerate(ranks):
        assert result["replays"] == N, (rank, result)
        accept = [N, k, k * BS] if rank == 1 else [N, 0, 0]
        assert result["totals"] == {"10:dspark-accept-graph": accept, "17:dspark-draft": [N, 0, 0]}, (rank, result)
        assert result["rows_off"] == [], (rank, result["rows_off"])  # every replay: rank 0's values
        # the report lines: rank 1's add up to its counters; replays print only at the flush
        got = [re.search(r"rank=(\d+) tp_divergence site=(\S+) calls=\d+ diverged_calls=(\d+) diverged_elements=(\d+)",
                         line).groups()
               for line in result["lines"]]
        if rank == 1:
            assert {g[:2] for g in got} == {("1", "10:dspark-accept-graph")}, got
            assert [sum(int(g[2]) for g in got), sum(int(g[3]) for g in got)] == [k, k * BS], got
            assert len(got) == 1 or not result["captured"], got
        else:
            assert got == []


REPORTED = ("on_report", "on_report_torch", "on_report_eager", "on_report_torch_eager")


def check_pack(ranks, kernel=False):
    """`kernel`: the library must have served the CUDA variants that use it (one launch each)."""
    k = len(SKEWED)
    for rank, result in enumerate(ranks):
        for variant in ("off", "on", *REPORTED):
            assert result[variant]["replays"] == N, (rank, variant)
        # off: the skew shows on rank 1, in exactly the skewed replays; on: it never does
        assert result["off"]["rows_off"] == (SKEWED if rank == 1 else []), (rank, result["off"])
        assert [result[v]["rows_off"] for v in ("on", *REPORTED)] == [[]] * 5, (rank, result)
        # the library's fused comparison counts what torch ops count, in graphs and eagerly
        diverged = [N, k, k * BS] if rank == 1 else [N, 0, 0]
        for variant in REPORTED:
            assert result[variant]["totals"] == {"10:dspark-accept-graph": diverged, "17:dspark-draft": diverged}, \
                (rank, variant)
        if kernel:  # in REPORTED's order: library, torch, library, torch
            assert result["packing"] == ["one-launch block", "concatenation"] * 2, result["packing"]
            assert result["compare"] == ["fused kernel", "torch ops"] * 2, result["compare"]


def check_release18(ranks):
    fields = ("draft_greedy", "draft_folded", "accept")
    calls = {"dspark-draft": 2 * tp18_cases.GAMMA, "dspark-accept-graph": 1}  # per region call, adapter on
    for rank, result in enumerate(ranks):
        assert result["sglang"] == "0.5.18", (result["sglang"], result["sglang_file"])
        assert result["group"].startswith("sglang GroupCoordinator"), result["group"]
        on, off = result["variants"]["on"], result["variants"]["off"]
        for name, variant in (("on", on), ("off", off)):
            assert variant["replays"] == N, (rank, name, variant)
            # replays run no Python when captured; on the CPU each is an eager call
            assert variant["python_calls_in_replays"] == (0 if variant["captured"] else N), (rank, name, variant)
        assert set(on["wrapped"].values()) == {True} and set(off["wrapped"].values()) == {False}, (rank, on, off)
        assert on["state"] == "applied" and off["state"] == "off", (rank, on["state"], off["state"])
        assert on["collectives_at_capture"] == {s: c * on["calls_before_replays"] for s, c in calls.items()}, (rank, on)
        assert off["collectives_at_capture"] == {}, (rank, off)
        # on: every replay, every field holds rank 0's values; off: rank 1's skew shows in
        # exactly the skewed replays, in the drafts of both samplers and in the accept
        assert on["rows_off"] == {f: [] for f in fields}, (rank, on["rows_off"])
        assert off["rows_off"] == {f: (SKEWED if rank == 1 else []) for f in fields}, (rank, off["rows_off"])
    assert ranks[0]["variants"]["off"]["distinct_rows"] > 1  # the sampled rows redraw from replay to replay


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
    """With a kernel file named or there (bench/gpu/tp_nccl.sh builds it) the library's paths must serve."""
    from sglang_dsv41_adapters.folded_fence import accept_snapshot

    ranks = spawn_ranks(GPUS, "tests.tp_nccl_cases:pack_case", nccl=True, kwargs={"n": N, "skewed": SKEWED},
                       timeout=NCCL_TIMEOUT)
    report_group(ranks)
    # named by the environment (bench/gpu/tp_nccl.sh), or there at the default path: it must serve
    kernel = bool(os.environ.get(accept_snapshot.PATH_ENV)) or os.path.isfile(accept_snapshot.kernel_path())
    print(f"kernel file {accept_snapshot.kernel_path()}: {'there' if kernel else 'missing'}; "
          f"packing {ranks[0]['packing']}, compare {ranks[0]['compare']}")
    check_pack(ranks, kernel=kernel)


@needs_gpus
@needs_release18
def test_nccl_release18_draft_and_accept_in_graphs():
    ranks = spawn_ranks(GPUS, "tests.tp18_cases:release18_case", nccl=True, kwargs={"n": N, "skewed": SKEWED},
                        timeout=NCCL18_TIMEOUT, path=RELEASE18)
    report_group(ranks)
    print(f"sglang {ranks[0]['sglang']} from {ranks[0]['sglang_file']} (runtime judged {ranks[0]['engine_version']})")
    assert all(r["variants"][v]["captured"] for r in ranks for v in ("on", "off"))
    check_release18(ranks)


@needs_gpus
def test_nccl_group_min_memory_dp_attention():
    """DP 2 x attention-TP 1 on two GPUs: the capture decision differs unpatched, agrees with the pack."""
    ranks = spawn_ranks(2, "tests.mem23_cases:capture_case", nccl=True, timeout=NCCL18_TIMEOUT,
                        kwargs={"attn_tp": 1, "frees_gb": [0.6, 8.0], "decide_with": [None, [2, 2]]})
    print({r["runs"]["unpatched"]["probe_gb"]: r["runs"]["[2, 2]"]["probe_gb"] for r in ranks})
    assert [r["groups"] for r in ranks] == [{"spec_tp_sync": 1, "draft_graph": 2}] * 2
    assert [r["runs"]["unpatched"]["dspark_capture"] for r in ranks] == [False, True]
    assert [r["runs"]["unpatched"]["dspark_all_reduce"] for r in ranks] == [[], []]
    for label in ("None", "[2, 2]"):
        runs = [r["runs"][label] for r in ranks]
        assert [run["state"] for run in runs] == ["applied", "applied"], ranks[0]["reasons"]
        assert [run["dspark_capture"] for run in runs] == [False, False]
        assert runs[0]["probe_gb"] == runs[1]["probe_gb"] < 1.0
        assert [run["dspark_all_reduce"] for run in runs] == [["RedOpType.MIN"]] * 2
        assert [run["dflash_capture"] for run in runs] == [False, False]  # eager draft under DP attention


def check_dflash_draft(ranks, captured):
    k, key = len(SKEWED), "31:pack-dflash-draft-greedy"
    for rank, result in enumerate(ranks):
        for name, path in result["paths"].items():
            assert all(v["captured"] == (captured and name in dflash_draft_cases.CAPTURED) for v in path.values()), name
            assert path["off"]["steps_off"] == (SKEWED if rank == 1 else []), (rank, name, path["off"])
            assert path["on"]["steps_off"] == [] == path["on_report"]["steps_off"], (rank, name)
            # one broadcast per step, Python-counted: a captured sampler records it once, at capture
            per_step = 0 if path["on"]["captured"] else 1
            assert path["on"]["collectives"] == N * per_step, (rank, name, path["on"])
            assert path["on"]["collectives_at_capture"] >= 1 and path["off"]["collectives_at_capture"] == 0
            diverged = [N, k] if rank == 1 else [N, 0]
            assert path["on_report"]["totals"][key][:2] == diverged, (rank, name, path["on_report"]["totals"])


@needs_gpus
def test_nccl_dflash_draft_in_graphs():
    ranks = spawn_ranks(2, "tests.dflash_draft_cases:draft_case", nccl=True, timeout=NCCL18_TIMEOUT,
                        kwargs={"n": N, "skewed": SKEWED, "paths": ["domino", "selector", "plain_local"]})
    report_group(ranks)
    check_dflash_draft(ranks, captured=True)


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


def test_gloo_release18_draft_and_accept():
    """Not skipped: like tests/test_rank0_broadcast.py, CI has 0.5.18 in .engines."""
    path = RELEASE18 or [str(p) for p in ENGINE_PATHS["0.5.18"]]
    ranks = spawn_ranks(2, "tests.tp18_cases:release18_case", nccl=False, kwargs={"n": N, "skewed": SKEWED},
                        timeout=240, path=path)
    assert not any(r["variants"][v]["captured"] for r in ranks for v in ("on", "off"))
    check_release18(ranks)


def test_gloo_dflash_draft():
    ranks = spawn_ranks(2, "tests.dflash_draft_cases:draft_case", nccl=False, timeout=240,
                        kwargs={"n": N, "skewed": SKEWED, "paths": ["domino", "selector", "plain_local"]})
    check_dflash_draft(ranks, captured=False)
