"""rank0_broadcast (DSV41_SPEC_TP_SYNC): parser, 0.5.18 sites on real gloo groups,
bisection, collective counts, superseded hand-over on 0.5.23, refusal on drift."""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
import types

import pytest

from adapter import contract, runtime
from adapter import rank0_broadcast as r
from adapter.flags import FlagError
from tests.ranks import run_ranks

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
                     kwargs={"configs": configs, "doctored": [c[:3] for c in DOCTORED_18]})


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, "tests.broadcast_cases:main_case", release="0.5.18", timeout=280,
                     kwargs={"configs": [None, "all", "rng"], "gammas": [3, 7], "extras": False})


# --- parser -----------------------------------------------------------------------

GOOD = ["all", "off", "none", "init", "rng", "", ",", "ALL", " all , -dspark_plan ", "all,-dspark-plan,-dspark-draft",
        "7", "8,9,10", "dspark-target,dflash-target", "rng,-dspark-mem", "init,17", "-all", "all,-rng",
        "2", "3,dflash-mem", "dspark-graph-greedy", "dspark_draft_sample", "all,-5", "off,dspark-accept-graph",
        "DFLASH_SELECTOR", "16,-16,15"]
BAD = ["1O", "al", "yes", "true", "on", "0", "18", "-", "all,-", "dspark", "dspark-draft-greedyy", "all;off",
       "--7", "dspark-mem-", "17x", "dflash_accept", "+7", "all,bogus"]


@pytest.mark.parametrize("value", GOOD)
def test_grammar_matches_upstream(value):
    from sglang.srt.speculative.spec_tp_sync import parse_spec_tp_sync  # the real 0.5.23 parser

    assert {int(s) for s in r.parse_value(value)} == {int(s) for s in parse_spec_tp_sync(value)}


@pytest.mark.parametrize("value", BAD)
def test_bad_values_refused(value):
    from sglang.srt.speculative.spec_tp_sync import parse_spec_tp_sync

    with pytest.raises(FlagError) as err:
        r.parse({r.FLAG: value})
    assert r.FLAG in str(err.value) and "accepted" in str(err.value)
    with pytest.raises(ValueError):  # upstream refuses the same values
        parse_spec_tp_sync(value)
    # a refusal at start-up, whatever the TP size (parse never looks at the group)
    assert runtime.decide(r, {r.FLAG: value}).state == runtime.REFUSED


def test_presets_and_retired_handles():
    assert r.parse_value("rng") == {r.Site(n) for n in (1, 9, 11, 12, 13, 14, 16)}
    assert r.parse_value("init") == {r.Site.DSPARK_MEM, r.Site.DFLASH_MEM}
    for token in ("2", "3", "4", "5", "6", "dspark-graph-sample"):
        assert r.parse_value(token) == {r.Site.DSPARK_DRAFT}
    assert not r.parse({})
    assert runtime.decide(r, {}).state == runtime.OFF


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


def test_group_rule(two_ranks):
    assert two_ranks[0]["group_rule"] == {"dspark-dp0": "tp", "dflash-dp0": "tp",
                                          "dspark-dp1": "attn", "dflash-dp1": "attn"}


def test_bindings_on_0518(two_ranks):
    report = two_ranks[0]["install"]
    wrappers = {
        "dspark_draft.sample_draft_block": "_eager_draft",
        "dspark_draft_sampler.greedy_step_sampler": "_graph_greedy",
        "dspark_draft_sampler.SampleStepTokens": "_passthrough",
        "dspark_verify.accept_draft_tokens": "_eager_accept",
        "dspark_verify.accept_greedy_triton": "_graph_accept",
        "DSparkWorkerV2._forward_prefill": "_dspark_prefill",
        "DSparkWorkerV2.__init__": "wrapper",
        "DFlashWorkerV2.__init__": "wrapper",
        "DFlashWorkerV2._make_next_draft_input_prefill": "_dflash_prefill",
        "dflash_worker_v2.compute_dflash_sampling_correct_drafts_and_bonus": "_dflash_accept_sample",
        "dflash_worker_v2.compute_dflash_correct_drafts_and_bonus": "wrapper",
        "dflash_worker_v2._compute_dflash_accept_bonus_triton_unchecked": "wrapper",
    }
    for name, wrapper in wrappers.items():
        state = report["bindings"][name]
        assert state == {"wrapped": True, "double": False, "wrapper": wrapper}, name
    assert report["shared_untouched"] == [True, True]
    assert all(state == "applied" for state, _ in report["plans"].values())
    assert report["only_target"][r.DSPARK_WORKER] == "applied"
    assert report["only_target"][r.VERIFY] == "not needed"
    assert report["after_narrowing"] == {"sample_draft_block": False, "_forward_prefill": True}
    assert report["after_uninstall"] is False
    assert (report["decide"], report["decide_off"], report["decide_unset"]) == ("applied", "off", "off")


def test_refused_on_doctored_0518(two_ranks):
    for (module, _, _, symbol), result in zip(DOCTORED_18, two_ranks[0]["doctored"]):
        assert "refused" in result, (module, symbol, result)
        assert symbol in result["symbol"] and module in result["symbol"], result


# --- 0.5.19+: superseded, hand-over to SGLANG_SPEC_TP_SYNC ----------------------------

@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(r.ENGINE_FLAG, raising=False)
    yield
    r._state.clear()
    os.environ.pop(r.ENGINE_FLAG, None)


def _engine_sites(value):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    os.environ[r.ENGINE_FLAG] = value
    return {int(s) for s in SpecTpSync(types.SimpleNamespace(world_size=2, rank_in_group=1))._sites}


def test_superseded_hands_over(clean_env):
    outcome = runtime.decide(r, {r.FLAG: "all,-dspark-plan,-3"})
    assert outcome.state == runtime.SUPERSEDED
    assert "sglang.srt.speculative.spec_tp_sync.SpecTpSync" in outcome.reason
    value = os.environ[r.ENGINE_FLAG]
    assert _engine_sites(value) == {int(s) for s in r.parse_value("all,-dspark-plan,-3")}
    # "off" is handed over too (the engine's default is all)
    r._state.clear()
    os.environ.pop(r.ENGINE_FLAG)
    assert runtime.decide(r, {r.FLAG: "off"}).state == runtime.SUPERSEDED
    assert os.environ[r.ENGINE_FLAG] == "off" and _engine_sites("off") == set()


def test_superseded_agree_and_disagree(clean_env):
    same = {r.FLAG: "dspark-draft,8", r.ENGINE_FLAG: "17,dspark_accept_greedy"}
    assert runtime.decide(r, same).state == runtime.SUPERSEDED
    for theirs in ("all", "rng", "8"):
        outcome = runtime.decide(r, {r.FLAG: "dspark-draft,8", r.ENGINE_FLAG: theirs})
        assert outcome.state == runtime.REFUSED and r.ENGINE_FLAG in outcome.reason, theirs
    outcome = runtime.decide(r, {r.FLAG: "all", r.ENGINE_FLAG: "bogus"})
    assert outcome.state == runtime.REFUSED and "bogus" in outcome.reason


def test_other_modules_not_needed_on_0523(clean_env):
    r.parse({r.FLAG: "all"})
    for name in (r.DRAFT, r.VERIFY, r.DSPARK_WORKER, r.DFLASH_WORKER):
        plan = r.check(importlib.import_module(name))
        assert plan.state == "not needed" and "SpecTpSync" in plan.detail


@pytest.mark.parametrize("old,new,symbol", [
    ("def parse_spec_tp_sync(", "def parse_tp_sync(", "parse_spec_tp_sync"),
    ("class SpecTpSync:", "class SpecTpSyncV2:", "SpecTpSync"),
    ("def parse_spec_tp_sync(spec: str)", "def parse_spec_tp_sync(*, spec: str)", "parse_spec_tp_sync"),
])
def test_refused_on_doctored_0523(clean_env, old, new, symbol):
    spec = importlib.util.find_spec(r.SPEC_TP_SYNC)
    text = open(spec.origin, encoding="utf-8").read()
    assert old in text
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(text.replace(old, new, 1))
    try:
        doctored = importlib.util.spec_from_file_location(r.SPEC_TP_SYNC, fh.name)
        module = importlib.util.module_from_spec(doctored)
        doctored.loader.exec_module(module)
        r.parse({r.FLAG: "all"})
        with pytest.raises(contract.Refused) as err:
            r.check(module)
        assert err.value.symbol == f"{r.SPEC_TP_SYNC}:{symbol}"
    finally:
        os.unlink(fh.name)
