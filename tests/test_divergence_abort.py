"""DSV41_TP_DIVERGENCE=abort: a rank stops at the first divergence it sees, with one line
naming the site, the rank, the site's call and both values, and a non-zero status (real
gloo ranks, the engine's SpecTpSync and build_accept_outs of 0.5.23); the flag's grammar;
and the engine's watchdog dump with the report's state, through the watchdog's own stuck
tester and the scheduler's create_scheduler_watchdog."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from harness import zygote
from harness.engines import ROOT, engine_env, python
from harness.ranks import RESULT, _free_port, finish, run_ranks
from sglang_dsv41_adapters import tp_divergence as t
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.flags import FlagError
from sglang_dsv41_adapters.tp_divergence import divergence, watchdog_dump
from tests.divergence_cases import BS
from tests.log_lines import untimed

N, K = 8, 5
# rank 1's bonus of request 2 (100 + 2 + K at step K) is one more there than on rank 0
ABORT_LINE = re.compile(r"rank=1 tp_divergence abort: site=8:dspark-accept-greedy rank=1 step=(\d+) mine=(\d+) "
                        r"rank0=(\d+) element=(\d+) ")


def ranks_ending_as_they_may(target, kwargs, world_size=2, timeout=120, release="0.5.23"):
    """Each rank's (exit status, result or None, stderr); unlike run_ranks, a rank may fail."""
    port = _free_port()
    procs = [zygote.popen([python(), "-m", "harness._rank_main", target, json.dumps(kwargs)], cwd=ROOT,
                          env=engine_env(release) | dict(RANK=str(rank), WORLD_SIZE=str(world_size),
                                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world_size)]
    out = []
    for code, stdout, stderr in finish(procs, target, timeout):
        results = [json.loads(line[len(RESULT):]) for line in stdout.splitlines() if line.startswith(RESULT)]
        out.append((code, results[-1] if results else None, stderr))
    return out


def pack_lines(stderr):
    return [line for line in untimed(stderr) if line.startswith(divergence.PREFIX) and " tp_divergence " in line]


def test_abort_stops_rank_1_at_the_skewed_step():
    ranks = ranks_ending_as_they_may("tests.abort_cases:steps_case", {"n": N, "k": K, "mode": "abort"})
    (code0, result0, err0), (code1, result1, err1) = ranks
    # rank 1: one line, then the exception out of SpecTpSync.sync and the engine's caller, status non-zero
    assert code1 != 0 and result1 is None, err1[-3000:]
    lines = pack_lines(err1)
    assert len(lines) == 1, lines
    found = ABORT_LINE.search(lines[0])
    assert found, lines[0]
    # On the CPU the read lands at once: the stop is at the diverging call itself. build_accept_outs
    # syncs correct_len, bonus, cap_trim_lens at site 8 (dspark_verify.py:1143-1145 in 0.5.23): step K's
    # bonus is the site's call 3 (K - 1) + 2, and request 2's bonus is element 2 of that call's value.
    step, mine, rank0, element = map(int, found.groups())
    assert (step, element, mine, rank0) == (3 * (K - 1) + 2, 2, 102 + K + 1, 102 + K), lines[0]
    assert "Diverged: " + lines[0].split(" rank=1 ", 1)[1] in err1  # the exception carries the same line
    # rank 0 never diverges; its next broadcast fails once rank 1 is gone (in a server the
    # launcher kills the tree first, on the scheduler's SIGQUIT)
    assert pack_lines(err0) == [] and result0["done"] == K - 1 and "peer_gone" in result0, (result0, err0[-2000:])


def test_no_skew_runs_to_the_end():
    ranks = run_ranks(2, "tests.abort_cases:steps_case", kwargs={"n": N, "k": 0, "mode": "abort"}, with_stderr=True)
    for result, err in ranks:
        assert result["done"] == N and pack_lines(err) == []
        assert all(row[1] == 0 for row in result["totals"].values()) and result["totals"]["11:dspark-target"][0] == N


def test_abort_off_counts_only():
    ranks = run_ranks(2, "tests.abort_cases:steps_case", kwargs={"n": N, "k": K, "mode": "1"}, with_stderr=True)
    (r0, err0), (r1, err1) = ranks
    assert r0["done"] == r1["done"] == N and r0["state"] == r1["state"] == runtime.APPLIED
    assert r1["totals"]["8:dspark-accept-greedy"] == [3 * N, 1, 1] and r0["totals"]["8:dspark-accept-greedy"][1:] == [0, 0]
    assert not any(" abort" in line for line in pack_lines(err0) + pack_lines(err1))


# --- the flag -------------------------------------------------------------------------------

def test_abort_setting_and_its_reason(clean_env):
    assert t.parse({t.FLAG: "abort"}) == t.Setting(t.DEFAULT_EVERY, abort=True)
    assert t.parse({t.FLAG: "ABORT", t.EVERY_FLAG: "9"}) == t.Setting(9, abort=True)
    assert t.parse({t.FLAG: "1"}) == t.Setting(t.DEFAULT_EVERY, abort=False)
    decision = runtime.decide({t.FLAG: "abort"}, names=(t.NAME,))
    outcome = decision.outcomes[0]
    assert outcome.state == runtime.APPLIED
    assert "abort: stops the rank at the first divergence" in outcome.reason
    assert "rank-consensus checker (sglang.srt.utils.rank_consensus_checker, upstream PR #34406) is not used" in outcome.reason
    assert "WatchdogRaw.__init__" in outcome.reason
    on = runtime.decide({t.FLAG: "1"}, names=(t.NAME,)).outcomes[0]
    assert "abort:" not in on.reason and "rank-consensus" not in on.reason


def test_abort_on_0518_says_there_is_no_consensus_checker():
    from harness.engines import ENGINE_PATHS
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine

    engine = SourceEngine(ENGINE_PATHS["0.5.18"][0])
    outcome = runtime.decide({t.FLAG: "abort", "DSV41_SPEC_TP_SYNC": "all"}, engine,
                             names=("rank0_broadcast", t.NAME)).outcomes[1]
    assert outcome.state == runtime.APPLIED
    assert "abort: stops the rank" in outcome.reason and "this release has no rank-consensus checker" in outcome.reason


@pytest.mark.parametrize("value", ["abrot", " abort", "abort,1", "stop", ""])
def test_bad_value_refused_naming_abort(value):
    with pytest.raises(FlagError, match=r"abort \(report and stop the rank at the first divergence"):
        t.parse({t.FLAG: value})


def test_refused_where_the_scheduler_watchdog_drops_dump_info(clean_env):
    from harness.doctored import Drift

    module = watchdog_dump.SCHEDULER_WATCHDOG
    drift = Drift(module, "        dump_info=dump_info,\n", "", f"{module}:create_scheduler_watchdog")
    outcome = runtime.decide({t.FLAG: "1"}, drift.engine(), names=(t.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED and drift.symbol in outcome.reason


# --- the watchdog ---------------------------------------------------------------------------

def test_watchdog_dump_shows_the_report_state():
    ranks = run_ranks(2, "tests.abort_cases:watchdog_case", kwargs={"n": N, "k": K}, with_stderr=True)
    for rank, (_, err) in enumerate(ranks):
        stuck = [line for line in err.split("StuckTest debug info:\n")[1:]]
        sched = [line for line in err.split("Scheduler debug info:\n")[1:]]
        assert stuck and sched, err[-3000:]
        ours = [block.splitlines()[0] for block in stuck] + [block.splitlines()[1] for block in sched]
        # the scheduler's own part first (a registration in progress), then the report's state
        assert all(block.startswith("symmetric-memory registration in progress: comm=7 group=tp:0\n")
                   for block in sched), sched[0]
        total = 3 * N + N
        if rank == 1:
            want = (f"tp_divergence: rank=1 device=cpu as of call {total}: last diverged site=8:dspark-accept-greedy "
                    f"by its call {3 * N} (diverged_calls=1 diverged_elements=1); all sites: calls={total} "
                    "diverged_calls=1 diverged_elements=1")
        else:
            want = f"tp_divergence: rank=0 device=cpu as of call {total}: no diverged call ({total} site calls)"
        assert set(ours) == {want}, ours


class AddsOne:
    """Rank 1's group in a world of one: rank 0's value is one more than ours (the callers here
    pass arange), written over the tensor the broadcast receives into; counts broadcasts."""

    world_size, rank_in_group = 2, 1
    broadcasts = 0

    def broadcast(self, tensor, src=0):
        import torch

        self.broadcasts += 1
        return tensor.copy_(torch.arange(tensor.numel()).view(tensor.shape) + 1)


def test_a_stopped_rank_makes_no_further_broadcast(clean_env, capsys):
    """An engine `except Exception` around a site call (DFlash's Triton accept falls back to its
    eager path on any exception, dflash_worker_v2.py:2249 in 0.5.23) swallows the first Diverged:
    the next site call raises it again before its broadcast, with no second line."""
    import torch
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    runtime.apply(runtime.decide({t.FLAG: "abort"}, names=(t.NAME,)))
    divergence.forget()
    group = AddsOne()
    tp_sync = SpecTpSync(group)
    try:
        tp_sync.sync(S.DFLASH_TARGET, torch.arange(4))
    except Exception as swallowed:  # as the engine's fallback does
        assert isinstance(swallowed, divergence.Diverged)
    with pytest.raises(divergence.Diverged, match="site=16:dflash-target rank=launcher step=1 mine=0 rank0=1"):
        tp_sync.sync(S.DFLASH_ACCEPT_GREEDY, torch.arange(4))
    assert group.broadcasts == 1
    assert len([line for line in capsys.readouterr().err.splitlines() if " tp_divergence abort:" in line]) == 1
    divergence.forget()


def test_abort_at_the_pack_broadcast_on_0518():
    """The pack's packed accept triple (one collective; values flattened: accept lengths, bonus,
    the third field): rank 1 stops at step K, naming element BS + 2 (request 2's bonus)."""
    ranks = ranks_ending_as_they_may("tests.abort_cases:pack_case", {"n": N, "k": K}, release="0.5.18")
    (code0, result0, err0), (code1, result1, err1) = ranks
    assert code1 != 0 and result1 is None, err1[-3000:]
    (line,) = pack_lines(err1)
    assert f"site=8:dspark-accept-greedy rank=1 step={K} mine={102 + K + 1} rank0={102 + K} element={BS + 2} " in line
    # one collective per step: rank 0 completed step K, its next broadcast found rank 1 gone
    assert result0["states"] == ["applied", "applied"] and result0["done"] == K and "peer_gone" in result0
    assert pack_lines(err0) == []
