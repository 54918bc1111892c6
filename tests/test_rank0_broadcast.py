"""rank0_broadcast (DSV41_SPEC_TP_SYNC): parser, 0.5.18 sites on real gloo groups,
bisection, collective counts, superseded hand-over on 0.5.23, refusal on drift."""

from __future__ import annotations

import os
import types

import pytest

from sglang_dsv41_adapters import rank0_broadcast as r
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.spectpsync import engine_class, sites
from sglang_dsv41_adapters.framework.flags import FlagError
from harness.doctored import Drift
from harness.ranks import run_ranks

# Which value keys (tests/broadcast_cases.run_sites) each site protects.
SITE_KEYS = {
    "dspark-draft": {"draft_greedy", "draft_multinomial", "graph_greedy", "graph_sample"},
    "dspark-accept-greedy": {"accept_greedy"},
    "dspark-accept-graph": {"accept_graph"},
    "dspark-target": {"dspark_target"},
    "dflash-accept-greedy": {"dflash_greedy", "dflash_greedy_fallback"},
    "dflash-accept-sample": {"dflash_accept_sample"},
    "dflash-target": {"dflash_target"},
}
DECISIONS = set().union(*SITE_KEYS.values())

DOCTORED_18 = [
    ("sglang.srt.speculative.dspark_components.dspark_draft",
     "def sample_draft_block(", "def sample_draft_block_v2(", "sample_draft_block"),
    ("sglang.srt.speculative.dspark_components.dspark_verify",
     "def accept_draft_tokens(\n    *,\n", "def accept_draft_tokens(\n", "accept_draft_tokens"),
    ("sglang.srt.speculative.dspark_components.dspark_verify",
     "= accept_greedy_triton(", "= accept_greedy_triton_v2(", "accept_greedy_triton"),
    ("sglang.srt.speculative.dspark_components.dspark_draft_sampler",
     "def greedy_step_sampler(", "def greedy_step(", "greedy_step_sampler"),
    ("sglang.srt.speculative.dspark_components.dspark_worker_v2",
     "def _forward_prefill(\n        self, batch:", "def _forward_prefill(\n        self, fb:",
     "DSparkWorkerV2._forward_prefill"),
    ("sglang.srt.speculative.dflash_worker_v2",
     "def _make_next_draft_input_prefill(", "def _make_prefill_input(", "DFlashWorkerV2._make_next_draft_input_prefill"),
    ("sglang.srt.speculative.dflash_worker_v2",
     "    compute_dflash_sampling_correct_drafts_and_bonus,\n", "",
     "compute_dflash_sampling_correct_drafts_and_bonus"),
]


def _diverged(result, config):
    a, b = (rank["sites"][config]["values"] for rank in result[:2])
    others = [rank["sites"][config]["values"] for rank in result[1:]]
    return {k for k in DECISIONS if any(o[k] != result[0]["sites"][config]["values"][k] for o in others)}


@pytest.fixture(scope="module")
def two_ranks():
    configs = [None, "all"] + [f"all,-{slug}" for slug in SITE_KEYS]
    return run_ranks(2, "tests.broadcast_cases:main_case", release="0.5.18", timeout=280,
                     kwargs={"configs": configs, "doctored": DOCTORED_18})


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, "tests.broadcast_cases:main_case", release="0.5.18", timeout=280,
                     kwargs={"configs": [None, "all", "rng"], "gammas": [3, 7], "extras": False})


# --- parser -----------------------------------------------------------------------

GOOD = ["all", "off", "none", "init", "rng", "", ",", "ALL", " all , -dspark_plan ", "all,-dspark-plan,-dspark-draft",
        "7", "8,9,10", "dspark-target,dflash-target", "rng,-dspark-mem", "init,17", "-all", "all,-rng",
        "2", "3,dflash-mem", "dspark-graph-greedy", "dspark_draft_sample", "all,-5", "off,dspark-accept-graph",
        "DFLASH_SELECTOR", "16,-16,15"]
BAD = ["1O", "al", "yes", "true", "on", "18", "-", "all,-", "dspark", "dspark-draft-greedyy", "all;off",
       "--7", "dspark-mem-", "17x", "dflash_accept", "+7", "all,bogus"]


@pytest.mark.parametrize("value", GOOD)
def test_grammar_matches_upstream(value):
    from sglang.srt.speculative.spec_tp_sync import parse_spec_tp_sync  # the real 0.5.23 parser

    assert {int(s) for s in sites.parse_value(value)} == {int(s) for s in parse_spec_tp_sync(value)}


@pytest.mark.parametrize("value", BAD)
def test_bad_values_refused(value):
    from sglang.srt.speculative.spec_tp_sync import parse_spec_tp_sync

    with pytest.raises(FlagError) as err:
        r.parse({r.FLAG: value})
    assert r.FLAG in str(err.value) and "accepted" in str(err.value)
    with pytest.raises(ValueError):  # upstream refuses the same values
        parse_spec_tp_sync(value)
    # a refusal at start-up, whatever the TP size (parse never looks at the group)
    assert decide({r.FLAG: value}).state == runtime.REFUSED


def decide(environ):
    return runtime.decide(environ, names=(r.NAME,)).outcomes[0]


def test_presets_and_retired_handles():
    assert sites.parse_value("rng") == {sites.Site(n) for n in (1, 9, 11, 12, 13, 14, 16)}
    assert sites.parse_value("init") == {sites.Site.DSPARK_MEM, sites.Site.DFLASH_MEM}
    for token in ("2", "3", "4", "5", "6", "dspark-graph-sample"):
        assert sites.parse_value(token) == {sites.Site.DSPARK_DRAFT}
    assert decide({}).state == runtime.OFF


@pytest.mark.parametrize("value", ["", " ", "0", "off", "OFF", "false", "none", "-all"])
def test_off_words_switch_the_adapter_off_and_hand_nothing_over(value, clean_env):
    """Off means the pack changes nothing, on 0.5.23 too: the engine keeps its own default."""
    assert r.parse({r.FLAG: value}) == frozenset()
    decision = runtime.decide({r.FLAG: value})
    assert decision.outcomes[1].state == runtime.OFF and not decision.refused
    runtime.apply(decision)
    assert engine_class.ENGINE_FLAG not in os.environ


# --- 0.5.18: every CPU site on real gloo groups --------------------------------------

def test_sites_two_ranks(two_ranks):
    assert _diverged(two_ranks, "None") == DECISIONS  # the skew reaches every site without the adapter
    assert _diverged(two_ranks, "all") == set()
    # rank 0's values are the ones everybody holds
    for key in DECISIONS:
        assert two_ranks[1]["sites"]["all"]["values"][key] == two_ranks[0]["sites"]["None"]["values"][key]
    assert two_ranks[0]["sites"]["None"]["counts"] == {}


def test_bisection(two_ranks):
    for slug, keys in SITE_KEYS.items():
        assert _diverged(two_ranks, f"all,-{slug}") == keys, slug


def test_sites_four_ranks(four_ranks):
    assert _diverged(four_ranks, "None") == DECISIONS
    assert _diverged(four_ranks, "all") == set()
    # rng = sites 1,9,11,12,13,14,16: of the CPU sites, the prefill ones and the DFlash sampled accept
    assert _diverged(four_ranks, "rng") == DECISIONS - SITE_KEYS["dspark-target"] - SITE_KEYS["dflash-target"] \
        - SITE_KEYS["dflash-accept-sample"]


def test_collective_counts(four_ranks):
    for gamma in (3, 7):
        counts = four_ranks[0]["counts"][str(gamma)]
        # 2 eager draft blocks + 2 folded draft calls, gamma steps each
        assert counts["dspark-draft"] == 4 * gamma
        assert counts["dspark-accept-greedy"] == 1  # the triple, packed: one collective
        assert counts["dspark-accept-graph"] == 1
        assert counts["dflash-accept-sample"] == 1  # accept_len + bonus, packed
        assert counts["dflash-accept-greedy"] == 2  # two calls, fallback not re-broadcast
        assert all(rank["counts"] == four_ranks[0]["counts"] for rank in four_ranks)


def test_several_tensors_one_collective(two_ranks):
    """Mixed dtypes and shapes in one collective: every rank gets rank 0's values with each
    tensor's own dtype and shape; standalone tensors come back as new tensors (this rank's
    originals untouched), a view of a larger buffer is written in place."""
    zero, one = (rank["packing"] for rank in two_ranks)
    assert one["values"] == zero["values"] == [[0, 1, 2, 3, 4], [0, 7, 14, 21, 28], [[True, False, False]],
                                               [2, 3, 4, 5], 3.5]
    assert one["dtypes"] == ["torch.int32", "torch.int64", "torch.bool", "torch.int64", "torch.float16"]
    assert one["shapes"] == [[5], [5], [1, 3], [4], []]
    assert one["same_object"] == [False, False, False, True, False]
    assert one["originals_kept"] == [True, True, True, False, True]
    assert one["buffer"] == [100, 101, 2, 3, 4, 5, 106, 107, 108, 109]
    assert one["counts"] == zero["counts"] == {"dspark-accept-graph": 1}


def test_group_rule(two_ranks):
    assert two_ranks[0]["group_rule"] == {"dspark-dp0": "tp", "dflash-dp0": "tp",
                                          "dspark-dp1": "attn", "dflash-dp1": "attn"}


def test_bindings_on_0518(two_ranks):
    report = two_ranks[0]["install"]
    # Every consumer binding replaced, once; the shared helpers the rank-0-only
    # observability call uses are not.
    assert all(report["bindings"].values()), report["bindings"]
    assert report["shared_untouched"] == [True, True]
    assert report["outcome"][0] == "applied"
    assert "sites 1:dspark-mem, 12:dflash-mem are served by DSV41_GROUP_MIN_MEM" in report["outcome"][1]
    # Narrowing the selection to one site reverts every other binding.
    assert report["only_target"] == ["DSparkWorkerV2.__init__", "DSparkWorkerV2._forward_prefill"]
    assert {k for k, v in report["after_narrowing"].items() if v} == {"DSparkWorkerV2._forward_prefill",
                                                                      "DSparkWorkerV2.__init__"}
    assert not any(report["after_revert"].values())
    assert report["decide"] == {"all": "applied", "off": "off", "0": "off", "": "off", "init": "refused"}
    assert report["decide_unset"] == "off"


def test_refused_on_doctored_0518(two_ranks):
    for (module, _, _, symbol), result in zip(DOCTORED_18, two_ranks[0]["doctored"]):
        assert result["state"] == "refused", (module, symbol, result)
        assert symbol in result["reason"] and module in result["reason"], result


# --- 0.5.19+: superseded, hand-over to SGLANG_SPEC_TP_SYNC ----------------------------

@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(engine_class.ENGINE_FLAG, raising=False)
    yield
    runtime.revert()
    assert engine_class.ENGINE_FLAG not in os.environ


def _engine_sites(value):
    """The sites the real 0.5.23 SpecTpSync runs with, given SGLANG_SPEC_TP_SYNC."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    os.environ[engine_class.ENGINE_FLAG] = value
    try:
        return {int(s) for s in SpecTpSync(types.SimpleNamespace(world_size=2, rank_in_group=1))._sites}
    finally:
        del os.environ[engine_class.ENGINE_FLAG]


def test_superseded_hands_over(clean_env):
    decision = runtime.decide({r.FLAG: "all,-dspark-plan,-3"}, names=(r.NAME,))
    outcome = decision.outcomes[0]
    assert outcome.state == runtime.SUPERSEDED
    assert "sglang.srt.speculative.spec_tp_sync.SpecTpSync" in outcome.reason
    assert engine_class.ENGINE_FLAG not in os.environ  # deciding writes nothing
    runtime.apply(decision)
    value = os.environ[engine_class.ENGINE_FLAG]
    del os.environ[engine_class.ENGINE_FLAG]
    assert _engine_sites(value) == {int(s) for s in sites.parse_value("all,-dspark-plan,-3")}


def test_superseded_agree_and_disagree(clean_env):
    same = {r.FLAG: "dspark-draft,8", engine_class.ENGINE_FLAG: "17,dspark_accept_greedy"}
    decision = runtime.decide(same, names=(r.NAME,))
    assert decision.outcomes[0].state == runtime.SUPERSEDED and decision.plans[r.NAME].env == {}
    for theirs in ("all", "rng", "8"):
        outcome = decide({r.FLAG: "dspark-draft,8", engine_class.ENGINE_FLAG: theirs})
        assert outcome.state == runtime.REFUSED and engine_class.ENGINE_FLAG in outcome.reason, theirs
    outcome = decide({r.FLAG: "all", engine_class.ENGINE_FLAG: "bogus"})
    assert outcome.state == runtime.REFUSED and "bogus" in outcome.reason


def test_nothing_is_patched_on_0523(clean_env):
    decision = runtime.decide({r.FLAG: "all"}, names=(r.NAME,))
    assert decision.plans[r.NAME].patches == []
    assert list(decision.plans[r.NAME].env) == [engine_class.ENGINE_FLAG]


@pytest.mark.parametrize("old,new,symbol", [
    ("def parse_spec_tp_sync(", "def parse_tp_sync(", "parse_spec_tp_sync"),
    ("class SpecTpSync:", "class SpecTpSyncV2:", "SpecTpSync"),
    ("def parse_spec_tp_sync(spec: str)", "def parse_spec_tp_sync(*, spec: str)", "parse_spec_tp_sync"),
])
def test_refused_on_doctored_0523(clean_env, old, new, symbol):
    # parse_spec_tp_sync is relied on only to compare a value the user set themselves.
    drift = Drift(engine_class.MODULE, old, new, f"{engine_class.MODULE}:{symbol}")
    outcome = runtime.decide({r.FLAG: "all", engine_class.ENGINE_FLAG: "all"}, drift.engine(), names=(r.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED
    assert drift.symbol in outcome.reason
