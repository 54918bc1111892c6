"""tp_divergence's report site 30:pack-decode-graph-key (adapter.tp_divergence.graph_key): the
decode graph key a target forward replays, compared across real gloo ranks through the real
ModelRunner._forward_raw, can_run_graph, execute and load_batch of 0.5.23; the site's token;
refusal on drift of the symbols it reads."""

from __future__ import annotations

import re

import pytest

from harness.doctored import Drift
from harness.ranks import run_ranks
from sglang_dsv41_adapters import tp_divergence as t
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.flags import FlagError
from sglang_dsv41_adapters.spectpsync import sites
from sglang_dsv41_adapters.tp_divergence import divergence, graph_key

N = 180
SKEWED = {"tier": list(range(0, N, 3))[:60], "eager": list(range(1, N, 3))[:60]}  # 120 skewed steps in all
SITE = "30:pack-decode-graph-key"
WANT_KEY = {"tier": 8, "eager": graph_key.EAGER}  # rank 1's key at a skewed step; 4 otherwise


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, "tests.graph_key_cases:graph_key_case", release="0.5.23",
                     kwargs={"n": N, "skews": [[None, []], *([k, v] for k, v in SKEWED.items())]})


@pytest.mark.parametrize("kind", [None, "tier", "eager"])
def test_counted_on_two_ranks(ranks, kind):
    skewed = SKEWED.get(kind, [])
    for rank, result in enumerate(ranks):
        off, on = result[f"{kind}/False"], result[f"{kind}/True"]
        # the engine's own choice: rank 1 replays another key, or runs eager, at the skewed steps
        want = [WANT_KEY[kind] if rank == 1 and i in skewed else 4 for i in range(N)]
        assert off["keys"] == on["keys"] == want, rank
        # off: nothing patched, nothing printed
        assert (off["state"], off["patched"], off["lines"]) == (runtime.OFF, False, []), rank
        assert (on["state"], on["patched"]) == (runtime.APPLIED, True)
        diverged = len(skewed) if rank == 1 else 0
        assert on["totals"][SITE] == [N, diverged, diverged], rank
        printed = [re.search(r"site=(\S+) calls=(\d+) diverged_calls=(\d+)", line).groups() for line in on["lines"]]
        assert all(line.startswith(divergence.PREFIX) for line in on["lines"])
        assert sum(int(d) for s, _, d in printed if s == SITE) == diverged, (rank, on["lines"])
    if skewed:
        assert len(skewed) == 60 and len(ranks[1][f"{kind}/True"]["lines"]) > 1  # reported every 50 calls


def test_token_is_reserved_not_selectable():
    assert sites.Site.PACK_DECODE_GRAPH_KEY.label == SITE
    assert sites.Site.PACK_DECODE_GRAPH_KEY in sites.REPORT_ONLY and not sites.REPORT_ONLY & (sites.ALL | sites.PACK)
    for token in ("pack-decode-graph-key", "30", "all,-30"):
        with pytest.raises(FlagError, match="DSV41_TP_DIVERGENCE"):
            sites.parse_value(token)
    assert sites.parse_value("all") == sites.ALL


def test_applied_with_the_report_and_untouched_without(clean_env):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    before = vars(ModelRunner)["_forward_raw"], vars(DecodeCudaGraphRunner)["execute"]
    decision = runtime.decide({}, names=(t.NAME,))
    runtime.apply(decision)
    assert (vars(ModelRunner)["_forward_raw"], vars(DecodeCudaGraphRunner)["execute"]) == before
    decision = runtime.decide({t.FLAG: "1"}, names=("rank0_broadcast", t.NAME))
    assert f"compares {SITE} (the decode graph key" in decision.outcomes[1].reason
    runtime.apply(decision)
    assert vars(ModelRunner)["_forward_raw"].__wrapped__ is before[0]
    assert vars(DecodeCudaGraphRunner)["execute"].__wrapped__ is before[1]
    runtime.revert()
    assert (vars(ModelRunner)["_forward_raw"], vars(DecodeCudaGraphRunner)["execute"]) == before


@pytest.mark.parametrize("module,old,new,symbol", [
    (graph_key.MODEL_RUNNER, "                and self.decode_cuda_graph_runner.can_run_graph(forward_batch)",
     "                and self.decode_cuda_graph_runner.can_replay(forward_batch)", graph_key.FORWARD),
    (graph_key.MODEL_RUNNER, "    def _forward_raw(", "    def _forward_once(", graph_key.FORWARD),
    (graph_key.GRAPH_RUNNER, "output = self.backend.replay(self._replay_graph_key, forward_batch)",
     "output = self.backend.replay(self._graph_key_now, forward_batch)", graph_key.EXECUTE),
])
def test_refused_on_drift(clean_env, tmp_path, module, old, new, symbol):
    drift = Drift(module, old, new, f"{module}:{symbol}")
    outcome = runtime.decide({t.FLAG: "1"}, drift.engine(tmp_path), names=(t.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED
    assert drift.symbol in outcome.reason and "sglang 0.5.23" in outcome.reason and t.NAME in outcome.reason


@pytest.mark.parametrize("tp, attention, picked", [(4, 4, "tp"), (4, 2, "attention"), (2, 2, "tp")])
def test_compared_over_the_ranks_that_run_one_batch(tp, attention, picked):
    """The engine's own runtime context: under DP attention its attention-TP group is narrower
    than the TP group, and it is the one compared (0.5.23 leaves server_args.enable_dp_attention
    false under --enable-dp-attention, so the topology is read, not the flag)."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_parallel
    from sglang_dsv41_adapters.tp_divergence import graph_key

    groups = {"tp": SimpleNamespace(world_size=tp), "attention": SimpleNamespace(world_size=attention)}
    with get_parallel().override(tp_group=groups["tp"], attn_tp_group=groups["attention"]):
        assert graph_key.batch_group() is groups[picked]

