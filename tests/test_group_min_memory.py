"""Group-minimum memory probe (DSV41_GROUP_MIN_MEM) against the real engines.

The failure: before 0.5.19 each TP rank decides on its own free memory whether to
capture the DSpark / DFlash draft graph and whether DSpark folds sampling into it, so
ranks with different free memory take different decisions and then run different
collectives. The adapter makes each probe return the group minimum.

- 0.5.18 (pre-fix): real gloo groups in 2 and 4 rank processes, a different free
  memory per rank injected at the helper's device query; the real decision functions
  disagree without the adapter and agree (on the group minimum) with it. In-process
  checks and drift on doctored copies run in a 0.5.18 subprocess.
- 0.5.23 (the venv's engine): superseded by SpecTpSync.available_memory_gb where it is
  shown to reach the capture group for the deployment (a known topology whose batch group
  has more than one rank); applied by the pack (SpecTpSync.available_memory_gb made the
  group minimum) where it is not: DP attention with attention-TP 1, or the deployment
  unknown (a SpecTpSync over one rank keeps no site, so its probe stays per rank); refused
  when SGLANG_SPEC_TP_SYNC (the user's, or what DSV41_SPEC_TP_SYNC hands over) drops the
  memory sites, refused on doctored consumers.
  On real gloo ranks with 0.5.23's own SpecTpSync, GroupCoordinators and the workers'
  init_cuda_graphs: a one-rank attention-TP group inside a larger capture group, unequal
  free memory: the ranks' capture decisions differ unpatched and agree with the pack.
  Doctored copies of SpecTpSync itself: tests/test_spec_tp_sync_proof.py.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess

import pytest

from sglang_dsv41_adapters import group_min_memory as gm
from sglang_dsv41_adapters.framework import patching, runtime
from sglang_dsv41_adapters.spectpsync import engine_class, groups_proof
from sglang_dsv41_adapters.framework.flags import FlagError
from sglang_dsv41_adapters.framework.topology import REPRESENTATIVE
from tests import mem_cases
from harness.doctored import DoctoredEngine, Drift
from harness.engines import ROOT, engine_env, python
from harness.ranks import run_ranks
from harness.nccl import spawn_ranks
from harness import zygote

ON = {gm.FLAG: "1"}
ONLY = (gm.NAME,)
ENGINE_FLAG = engine_class.ENGINE_FLAG  # SGLANG_SPEC_TP_SYNC


TP4, DP4, DP2 = REPRESENTATIVE["tp"], REPRESENTATIVE["dp-attention-tp1"], REPRESENTATIVE["dp-attention-tp2"]


def decide(environ, engine=None, topology=TP4):
    """This adapter's outcome for `environ`, every other adapter left out (TP 4 by default:
    a deployment where the engine's own reduction is shown to reach the capture group)."""
    return runtime.decide(environ, engine, names=ONLY, topology=topology).outcomes[0]


@pytest.fixture(autouse=True)
def _reverted():
    yield
    runtime.revert()


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("raw,value", [("1", True), ("on", True), ("TRUE", True), ("0", False), ("Off", False), ("false", False)])
def test_flag_values_parse(raw, value):
    assert gm.parse({gm.FLAG: raw}) is value


def test_flag_unset_is_off():
    assert gm.parse({}) is False
    assert decide({}).state == runtime.OFF


@pytest.mark.parametrize("raw", ["yes please", "nah", "", " 1", "2", "enabled"])
def test_flag_bad_values_refused(raw):
    with pytest.raises(FlagError, match=gm.FLAG):
        gm.parse({gm.FLAG: raw})
    outcome = decide({gm.FLAG: raw})
    assert outcome.state == runtime.REFUSED and gm.FLAG in outcome.reason


# ---------------------------------------------------------------- 0.5.18: ranks


def _by_rank(results, scenario, mode, key):
    return [r["scenarios"][scenario][mode][key] for r in results]


@pytest.fixture(scope="module")
def two_ranks():
    # Scenario 0: both ranks capture, folded sampling AUTO differs (1.2 GB - 0.36 GB need < 1 GB headroom).
    # Scenario 1: the capture gate (< 1 GB) differs, for DSpark and DFlash.
    frees = [[1.2, 8.0], [0.6, 8.0]]
    return frees, run_ranks(2, "tests.mem_cases:decision_case", release="0.5.18",
                            kwargs={"attn_tp_size": 2, "frees_gb": frees}, timeout=240)


def test_two_ranks_disagree_without_adapter(two_ranks):
    _, res = two_ranks
    assert _by_rank(res, 0, "without", "dspark_capture") == [True, True]
    assert _by_rank(res, 0, "without", "dspark_folded") == [False, True]
    assert _by_rank(res, 1, "without", "dspark_capture") == [False, True]
    assert _by_rank(res, 1, "without", "dflash_capture") == [False, True]
    for s in (0, 1):
        assert _by_rank(res, s, "without", "all_reduce_calls") == [0, 0]


def test_two_ranks_agree_on_the_minimum_with_adapter(two_ranks):
    frees, res = two_ranks
    for s, expected in ((0, {"dspark_capture": True, "dspark_folded": False, "dflash_capture": True}),
                        (1, {"dspark_capture": False, "dspark_folded": None, "dflash_capture": False})):
        for key, value in expected.items():
            assert _by_rank(res, s, "with", key) == [value, value], (s, key)
        low = min(r["scenarios"][s]["local_gb"] for r in res)
        assert low == pytest.approx(min(frees[s]), rel=1e-6)
        for r in res:
            assert r["scenarios"][s]["state"] == runtime.APPLIED
            assert r["scenarios"][s]["replaced"] == mem_cases.REPLACED
            for probe, seen in r["scenarios"][s]["with"]["probe_gb"].items():
                assert seen == pytest.approx(low, rel=1e-6), (s, r["rank"], probe)
            # each rank still sees its own value without the adapter
            assert r["scenarios"][s]["without"]["probe_gb"]["dspark_worker"] == pytest.approx(
                r["scenarios"][s]["local_gb"], rel=1e-6)


def test_two_ranks_collectives_per_site(two_ranks):
    _, res = two_ranks
    for r in res:
        with_0, with_1 = r["scenarios"][0]["with"], r["scenarios"][1]["with"]
        # one all_reduce(MIN) per probe call; the folded-sampling probe only runs when capture is on
        assert with_0["adapter_collectives"] == {"dspark-capture": 1, "dspark-folded-sampling": 1, "dflash-capture": 1}
        assert with_0["all_reduce_calls"] == 3 and with_0["all_reduce_min"]
        assert with_1["adapter_collectives"] == {"dspark-capture": 1, "dflash-capture": 1}
        assert with_1["all_reduce_calls"] == 2 and with_1["all_reduce_min"]


def test_two_ranks_revert_restores_and_helper_untouched(two_ranks):
    _, res = two_ranks
    for r in res:
        for s in r["scenarios"]:
            assert s["restored"] and s["helper_untouched"]
            # the shared helper, as every other importer calls it, keeps this rank's own value
            assert s["with"]["helper_gb"] == pytest.approx(s["local_gb"], rel=1e-6)


@pytest.fixture(scope="module")
def four_ranks_dp():
    # TP4 with DP attention (dp 2, attn_tp 2) and a dense draft: the draft DP context is
    # on, so DSpark's group is each attn-TP pair ({0,1}, {2,3}); DFlash's is all four.
    frees = [1.2, 8.0, 8.0, 0.6]
    return frees, run_ranks(4, "tests.mem_cases:decision_case", release="0.5.18",
                            kwargs={"attn_tp_size": 2, "frees_gb": [frees]}, timeout=300)


def test_four_ranks_dp_attention(four_ranks_dp):
    frees, res = four_ranks_dp
    assert _by_rank(res, 0, "without", "dspark_capture") == [True, True, True, False]
    assert _by_rank(res, 0, "without", "dspark_folded") == [False, True, True, None]
    assert _by_rank(res, 0, "without", "dflash_capture") == [True, True, True, False]

    assert _by_rank(res, 0, "with", "dspark_capture") == [True, True, False, False]
    assert _by_rank(res, 0, "with", "dspark_folded") == [False, False, None, None]
    assert _by_rank(res, 0, "with", "dflash_capture") == [False] * 4
    for r in res:
        pair = frees[0:2] if r["rank"] < 2 else frees[2:4]
        seen = r["scenarios"][0]["with"]["probe_gb"]
        # DSpark: the attn-TP pair's minimum, outside and inside the (real, swapping) draft context
        assert seen["dspark_worker"] == pytest.approx(min(pair), rel=1e-6)
        assert seen["dspark_sampler"] == pytest.approx(min(pair), rel=1e-6)
        # DFlash: the whole TP group's minimum
        assert seen["dflash_worker"] == pytest.approx(min(frees), rel=1e-6)
        expected = {"dspark-capture": 1, "dflash-capture": 1}
        if r["rank"] < 2:
            expected["dspark-folded-sampling"] = 1
        assert r["scenarios"][0]["with"]["adapter_collectives"] == expected
        assert r["scenarios"][0]["with"]["all_reduce_calls"] == len(expected)
        assert r["scenarios"][0]["state"] == runtime.APPLIED
        assert r["scenarios"][0]["replaced"] == mem_cases.REPLACED
        assert r["scenarios"][0]["restored"] and r["scenarios"][0]["helper_untouched"]


# ---------------------------------------------------------------- 0.5.18: in-process (subprocess)


@pytest.fixture(scope="module")
def on_0_5_18():
    proc = zygote.run([python(), "-m", "tests.mem_cases", "inproc_checks"], cwd=ROOT, env=engine_env("0.5.18"),
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT:"):])


def test_0_5_18_applied_on_the_three_consumers(on_0_5_18):
    state, reason, engine = on_0_5_18["decide"]
    assert state == runtime.APPLIED and engine == "0.5.18"
    for site in ("DSparkWorkerV2.init_cuda_graphs", "_resolve_folded_sampling", "DFlashWorkerV2.init_cuda_graphs"):
        assert site in reason
    # the plan names each consumer module's own binding of the helper; deciding patches nothing
    assert on_0_5_18["planned"] == mem_cases.REPLACED
    assert on_0_5_18["nothing_patched_by_decide"]


def test_0_5_18_apply_idempotent_and_reversible(on_0_5_18):
    assert on_0_5_18["replaced"] == mem_cases.REPLACED
    assert on_0_5_18["originals_are_helper"] and on_0_5_18["bindings_replaced"]
    assert on_0_5_18["signature_kept"]
    assert on_0_5_18["decide_after_apply"] == [runtime.APPLIED, True]
    assert on_0_5_18["apply_idempotent"]
    assert on_0_5_18["restored"] and on_0_5_18["revert_twice_harmless"]
    assert on_0_5_18["off"] == [runtime.OFF, False]
    assert on_0_5_18["off_left_alone"] and on_0_5_18["off_reverts_on"]


def test_0_5_18_other_callers_unchanged(on_0_5_18):
    assert all(on_0_5_18["others_bound_to_helper"].values())
    assert all(on_0_5_18["others_unchanged_while_applied"].values())
    assert set(on_0_5_18["others_unchanged_while_applied"]) == {"utils.common", "utils", "model_runner", "eagle_worker_v2"}


@pytest.mark.parametrize("case", sorted(mem_cases.DRIFT_0_5_18))
def test_0_5_18_drift_refused(on_0_5_18, case):
    drift, outcome = mem_cases.DRIFT_0_5_18[case], on_0_5_18["drift"][case]
    assert outcome["state"] == runtime.REFUSED, outcome
    assert f"{drift.module}:{drift.symbol}:" in outcome["reason"], outcome
    assert outcome["engine"] == "0.5.18" and "0.5.18" in outcome["reason"]


# ---------------------------------------------------------------- 0.5.23: superseded / refused

CONSUMERS = [name for name, _ in gm.TARGETS if name != engine_class.MODULE]


@pytest.fixture
def no_engine_switch(monkeypatch):
    """SGLANG_SPEC_TP_SYNC unset in this process, as the engine's ranks would inherit it."""
    monkeypatch.delenv(ENGINE_FLAG, raising=False)


def test_0_5_23_superseded(no_engine_switch):
    import sglang.srt.utils.common as common

    helper = common.get_available_gpu_memory
    decision = runtime.decide(ON, names=ONLY, topology=TP4)
    outcome = decision.outcomes[0]
    assert outcome.state == runtime.SUPERSEDED, outcome.reason
    assert "for TP 4, no DP attention, shown from its source and by running it" in outcome.reason
    assert "reduces sites 1,12 over the capture group it is given where its own group has more than one rank" \
        in outcome.reason
    assert "1:dspark-mem" in outcome.reason and "12:dflash-mem" in outcome.reason
    # both capture gates probe through the engine's own reduction; folded sampling AUTO is gone since 0.5.22
    assert "DSparkWorkerV2.init_cuda_graphs probes through" in outcome.reason and "(DSPARK_MEM)" in outcome.reason
    assert "DFlashWorkerV2.init_cuda_graphs probes through" in outcome.reason and "(DFLASH_MEM)" in outcome.reason
    assert "_resolve_folded_sampling" not in outcome.reason
    plan = decision.plans[gm.NAME]
    assert plan.patches == [] and plan.env == {}
    runtime.apply(decision)
    assert patching.applied() == [] and ENGINE_FLAG not in os.environ
    assert common.get_available_gpu_memory is helper
    assert all(gm.HELPER not in vars(importlib.import_module(name)) for name in CONSUMERS)


@pytest.mark.parametrize("topology,state", [(TP4, runtime.SUPERSEDED), (DP2, runtime.SUPERSEDED),
                                            (DP4, runtime.APPLIED), (None, runtime.APPLIED)],
                         ids=["tp4", "dp2xattn-tp2", "dp4xattn-tp1", "unknown"])
def test_0_5_23_by_topology(no_engine_switch, topology, state):
    """Superseded only where the deployment is known and the engine's SpecTpSync keeps its
    sites; else the pack wraps SpecTpSync.available_memory_gb (a class attribute), nothing else."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    original = vars(SpecTpSync)["available_memory_gb"]
    decision = runtime.decide(ON, names=ONLY, topology=topology)
    outcome = decision.outcomes[0]
    assert outcome.state == state, outcome.reason
    assert groups_proof.judged_for(topology) in outcome.reason
    runtime.apply(decision)
    if state == runtime.APPLIED:
        assert [(s.owner, s.name) for s in patching.applied()] == [(SpecTpSync, "available_memory_gb")]
        assert vars(SpecTpSync)["available_memory_gb"].__wrapped__ is original
        assert "upstream's unreleased fix, sgl-project/sglang#39954" in outcome.reason
    else:
        assert patching.applied() == []
    runtime.revert()
    assert vars(SpecTpSync)["available_memory_gb"] is original and ENGINE_FLAG not in os.environ


@pytest.mark.parametrize("spec", ["init", "rng", "all,-dflash-selector", "1,12"])
def test_0_5_23_superseded_when_mem_sites_kept(spec):
    outcome = decide({**ON, ENGINE_FLAG: spec})
    assert outcome.state == runtime.SUPERSEDED, outcome.reason
    assert repr(spec) in outcome.reason


@pytest.mark.parametrize("spec,missing", [
    ("all,-dspark-mem", ["1:dspark-mem"]),
    ("all,-12", ["12:dflash-mem"]),
    ("off", ["1:dspark-mem", "12:dflash-mem"]),
    ("rng,-init", ["1:dspark-mem", "12:dflash-mem"]),
])
def test_0_5_23_refused_when_mem_sites_excluded(monkeypatch, spec, missing):
    outcome = decide({**ON, ENGINE_FLAG: spec})
    assert outcome.state == runtime.REFUSED
    assert ENGINE_FLAG in outcome.reason and gm.FLAG in outcome.reason
    for site in missing:
        assert site in outcome.reason
    # and the flag switched off leaves the user's choice alone
    monkeypatch.setenv(ENGINE_FLAG, spec)
    off = runtime.decide({gm.FLAG: "0", ENGINE_FLAG: spec}, names=ONLY)
    assert off.outcomes[0].state == runtime.OFF
    runtime.apply(off)
    assert os.environ[ENGINE_FLAG] == spec


def test_0_5_23_refused_on_a_spec_the_engine_rejects():
    outcome = decide({**ON, ENGINE_FLAG: "all,-dspark-memory"})
    assert outcome.state == runtime.REFUSED and "unknown token" in outcome.reason


# The pack's own site selector reaches the engine's switch through rank0_broadcast's hand-over.

HANDS_OVER_WITHOUT_DSPARK_MEM = {gm.FLAG: "1", "DSV41_SPEC_TP_SYNC": "all,-dspark-mem"}


@pytest.mark.parametrize("names", [
    ("folded_fence", "rank0_broadcast", "group_min_memory"),
    ("group_min_memory", "rank0_broadcast", "folded_fence"),
])
def test_0_5_23_refused_when_the_pack_hands_over_no_dspark_mem(no_engine_switch, names):
    decision = runtime.decide(HANDS_OVER_WITHOUT_DSPARK_MEM, names=names)
    outcomes = {o.adapter: o for o in decision.outcomes}
    memory = outcomes[gm.NAME]
    assert memory.state == runtime.REFUSED
    assert "1:dspark-mem" in memory.reason and "DSV41_SPEC_TP_SYNC" in memory.reason
    assert "12:dflash-mem" not in memory.reason  # the hand-over keeps DFlash's site
    # a refused decision changes nothing: no patch, nothing handed to the engine
    with pytest.raises(runtime.AdapterRefused, match="1:dspark-mem"):
        runtime.apply(decision)
    assert patching.applied() == [] and ENGINE_FLAG not in os.environ


def test_0_5_23_hand_over_outcomes_do_not_depend_on_adapter_order(no_engine_switch):
    forward = runtime.decide(HANDS_OVER_WITHOUT_DSPARK_MEM, names=("folded_fence", "rank0_broadcast", "group_min_memory"))
    backward = runtime.decide(HANDS_OVER_WITHOUT_DSPARK_MEM, names=("group_min_memory", "rank0_broadcast", "folded_fence"))
    assert sorted(forward.outcomes, key=lambda o: o.adapter) == sorted(backward.outcomes, key=lambda o: o.adapter)


def test_0_5_23_selector_off_hands_nothing_over(no_engine_switch):
    decision = runtime.decide({"DSV41_SPEC_TP_SYNC": "off"})
    states = {o.adapter: o.state for o in decision.outcomes}
    assert states["rank0_broadcast"] == states[gm.NAME] == runtime.OFF
    runtime.apply(decision)
    assert ENGINE_FLAG not in os.environ
    # and switching the selector off takes back what an earlier "all" handed over
    runtime.apply(runtime.decide({"DSV41_SPEC_TP_SYNC": "all"}))
    assert ENGINE_FLAG in os.environ
    runtime.apply(decision)
    assert ENGINE_FLAG not in os.environ


def test_0_5_23_selector_off_keeps_the_users_engine_switch(monkeypatch):
    monkeypatch.setenv(ENGINE_FLAG, "init")
    runtime.apply(runtime.decide({"DSV41_SPEC_TP_SYNC": "off", ENGINE_FLAG: "init"}))
    assert os.environ[ENGINE_FLAG] == "init"


DRIFT_0_5_23 = [
    Drift(engine_class.MODULE, "def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, *, group):",
          "def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, group):", gm.UPSTREAM_PROBE),
    Drift(gm.DSPARK_WORKER, "            SpecTpSyncSite.DSPARK_MEM,\n", "            SpecTpSyncSite.DSPARK_PLAN,\n",
          "DSparkWorkerV2.init_cuda_graphs"),
    Drift(gm.DFLASH_WORKER, "                    group=get_parallel().tp_group,\n", "",
          "DFlashWorkerV2.init_cuda_graphs"),
]


@pytest.mark.parametrize("drift", DRIFT_0_5_23, ids=lambda d: f"{d.module.rpartition('.')[2]}:{d.symbol}")
def test_0_5_23_drift_refused(drift):
    assert decide(ON).state == runtime.SUPERSEDED  # the real engine
    outcome = runtime.decide(ON, drift.engine(), names=ONLY, topology=TP4).outcomes[0]
    assert outcome.state == runtime.REFUSED
    assert f"{drift.module}:{drift.symbol}:" in outcome.reason and "0.5.23" in outcome.reason


def test_0_5_23_probe_not_shown_is_applied_by_the_pack():
    """The engine's probe no longer reduces over the group it is given: the pack's own group
    minimum takes its place, naming what was not shown."""
    drift = Drift(engine_class.MODULE, "            cpu_group=group.cpu_group if distributed else None,\n", "",
                  gm.UPSTREAM_PROBE)
    outcome = runtime.decide(ON, drift.engine(), names=ONLY, topology=TP4).outcomes[0]
    assert outcome.state == runtime.APPLIED, outcome.reason
    assert f"({engine_class.MODULE}:SpecTpSync.available_memory_gb: run against its own code" in outcome.reason
    assert "not once over the group it was given" in outcome.reason


# ---------------------------------------------------------------- 0.5.23: ranks (SpecTpSync over one rank)

FREES = [0.6, 8.0]  # rank 0 below the 1 GB capture gate, rank 1 well above


@pytest.fixture(scope="module")
def dp_attention_ranks():
    """DP 2 x attention-TP 1: SpecTpSync over a one-rank group, the MoE draft's capture group
    the whole TP group (2 ranks)."""
    return spawn_ranks(2, "tests.mem23_cases:capture_case", nccl=False, timeout=300,
                       kwargs={"attn_tp": 1, "frees_gb": FREES, "decide_with": [None, [2, 2]]})


def runs(ranks, label, key):
    return [r["runs"][label][key] for r in ranks]


def test_0_5_23_dp_attention_ranks_disagree_unpatched(dp_attention_ranks):
    ranks = dp_attention_ranks
    for r in ranks:
        assert r["init_lines"] == [True, True]  # the worker builds both groups as the case does
        assert r["groups"] == {"spec_tp_sync": 1, "draft_graph": 2}
    # the engine's probe stays per rank: each sees its own free memory, and they decide differently
    assert runs(ranks, "unpatched", "probe_gb") == FREES
    assert runs(ranks, "unpatched", "dspark_capture") == [False, True]
    assert runs(ranks, "unpatched", "dspark_all_reduce") == [[], []]


def test_0_5_23_dp_attention_ranks_agree_with_the_pack(dp_attention_ranks):
    ranks = dp_attention_ranks
    for label in ("None", "[2, 2]"):  # the deployment unknown, or DP 2 x attention-TP 1
        assert runs(ranks, label, "state") == [runtime.APPLIED] * 2
        assert runs(ranks, label, "probe_gb") == [min(FREES)] * 2
        assert runs(ranks, label, "dspark_capture") == [False, False]
        # one all_reduce(MIN) per probe, over the group the worker passes
        assert runs(ranks, label, "dspark_all_reduce") == [["RedOpType.MIN"]] * 2
        assert runs(ranks, label, "pack_collectives") == [{"spec-tp-sync-DSPARK_MEM": 1}] * 2
    assert "for TP 2, DP attention 2 x attention-TP 1" in ranks[0]["reasons"]["[2, 2]"]
    # DFlash keeps its draft eager under DP attention before it would probe (0.5.20 - 0.5.23)
    for label in ("unpatched", "None", "[2, 2]"):
        assert runs(ranks, label, "dflash_capture") == [False, False]
        assert runs(ranks, label, "dflash_all_reduce") == [[], []]


def test_0_5_23_without_dp_attention_the_engine_reduces():
    """TP 2, no DP attention: the engine's own SpecTpSync reduces (superseded); unknown
    deployment: the pack's probe takes its place with the same one collective."""
    ranks = spawn_ranks(2, "tests.mem23_cases:capture_case", nccl=False, timeout=300,
                        kwargs={"attn_tp": 2, "frees_gb": FREES, "decide_with": [None, [2, 1]]})
    assert [r["groups"] for r in ranks] == [{"spec_tp_sync": 2, "draft_graph": 2}] * 2
    assert runs(ranks, "[2, 1]", "state") == [runtime.SUPERSEDED] * 2
    for label in ("unpatched", "None", "[2, 1]"):
        assert runs(ranks, label, "probe_gb") == [min(FREES)] * 2
        for worker in ("dspark", "dflash"):
            assert runs(ranks, label, f"{worker}_capture") == [False, False]
            assert runs(ranks, label, f"{worker}_all_reduce") == [["RedOpType.MIN"]] * 2
    assert runs(ranks, "[2, 1]", "pack_collectives") == [{}, {}]


def test_0_5_23_four_ranks_dp_attention():
    """DP 4 x attention-TP 1: one rank short of memory among four."""
    frees = [8.0, 8.0, 0.6, 8.0]
    ranks = spawn_ranks(4, "tests.mem23_cases:capture_case", nccl=False, timeout=400,
                        kwargs={"attn_tp": 1, "frees_gb": frees, "decide_with": [[4, 4]]})
    assert runs(ranks, "unpatched", "dspark_capture") == [True, True, False, True]
    assert runs(ranks, "[4, 4]", "dspark_capture") == [False] * 4
    assert runs(ranks, "[4, 4]", "probe_gb") == [0.6] * 4


def test_0_5_23_missing_consumer_module_refused():
    outcome = decide(ON, DoctoredEngine({gm.DFLASH_WORKER: None}))
    assert outcome.state == runtime.REFUSED
    assert gm.DFLASH_WORKER in outcome.reason and "missing" in outcome.reason


def test_one_engine_object_keeps_each_layouts_verdict_apart():
    """An engine object judges its code once per adapter and layout (doctor's column on every report
    made with it): the verdict for one layout is never the answer for another, in either order."""
    from sglang_dsv41_adapters.engine.installed import InstalledEngine
    from sglang_dsv41_adapters.framework.topology import Topology

    tp, dp_attention = Topology(4, 1), Topology(4, attn_dp_size=4)
    alone = {layout: runtime.engine_check(gm.SURFACE, InstalledEngine(), layout) for layout in (tp, dp_attention)}
    assert alone[tp][0] == runtime.SUPERSEDED and alone[dp_attention][0] == runtime.APPLIED, alone
    for first, then in ((tp, dp_attention), (dp_attention, tp)):
        engine = InstalledEngine()
        assert [runtime.engine_check(gm.SURFACE, engine, layout) for layout in (first, then, first)] == \
            [alone[first], alone[then], alone[first]]
