"""Group-minimum memory probe (adapter.group_min_memory) against the real engines.

- 0.5.18 (pre-fix): real gloo groups in 2 and 4 rank processes, a different free
  memory per rank injected at the helper's device query; the real decision functions
  disagree without the adapter and agree (on the group minimum) with it. In-process
  checks and drift on doctored copies run in a 0.5.18 subprocess.
- 0.5.23 (the venv's engine): superseded by SpecTpSync.available_memory_gb, refused
  when SGLANG_SPEC_TP_SYNC drops the MEM sites, refused on doctored upstream code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import pathlib
import subprocess

import pytest

from adapter import group_min_memory as gm
from adapter import runtime
from adapter.contract import Refused
from adapter.flags import FlagError
from tests import mem_cases
from tests.engines import ROOT, engine_env, python
from tests.ranks import run_ranks

ON = {gm.FLAG: "1"}


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("raw,value", [("1", True), ("on", True), ("TRUE", True), ("0", False), ("Off", False), ("false", False)])
def test_flag_values_parse(raw, value):
    assert gm.parse({gm.FLAG: raw}) is value


def test_flag_unset_is_off():
    assert gm.parse({}) is False
    assert runtime.decide(gm, {}, patch=False).state == runtime.OFF


@pytest.mark.parametrize("raw", ["yes", "no", "", " 1", "2", "enabled"])
def test_flag_bad_values_refused(raw):
    with pytest.raises(FlagError, match=gm.FLAG):
        gm.parse({gm.FLAG: raw})
    outcome = runtime.decide(gm, {gm.FLAG: raw}, patch=False)
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
            assert r["scenarios"][s]["plans"] == ["applied"] * 3
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


def test_two_ranks_uninstall_restores_and_helper_untouched(two_ranks):
    _, res = two_ranks
    for r in res:
        for s in r["scenarios"]:
            assert s["restored"] and s["helper_untouched"]


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
        assert r["scenarios"][0]["restored"] and r["scenarios"][0]["helper_untouched"]


# ---------------------------------------------------------------- 0.5.18: in-process (subprocess)


@pytest.fixture(scope="module")
def on_0_5_18():
    proc = subprocess.run([python(), "-m", "tests.mem_cases", "inproc_checks"], cwd=ROOT, env=engine_env("0.5.18"),
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT:"):])


def test_0_5_18_applied_on_the_three_consumers(on_0_5_18):
    assert set(on_0_5_18["check_states"].values()) == {"applied"}
    assert on_0_5_18["decide_no_patch"] == "applied" and on_0_5_18["nothing_patched_by_check"]
    state, reason = on_0_5_18["decide"]
    assert state == "applied"
    for site in ("DSparkWorkerV2.init_cuda_graphs", "_resolve_folded_sampling", "DFlashWorkerV2.init_cuda_graphs"):
        assert site in reason


def test_0_5_18_install_idempotent_and_reversible(on_0_5_18):
    assert on_0_5_18["wrapped_by"] == [gm.NAME] * 3
    assert on_0_5_18["wrapped_once"] and on_0_5_18["signature_kept"]
    assert on_0_5_18["check_after_install"] == ["applied"] * 3
    assert on_0_5_18["restored"]
    assert on_0_5_18["uninstall_twice_harmless"] == [False] * 3
    assert on_0_5_18["off"] == "off" and on_0_5_18["off_left_alone"]


def test_0_5_18_other_callers_unchanged(on_0_5_18):
    assert all(on_0_5_18["others_bound_to_helper"].values())
    assert all(on_0_5_18["others_unchanged_while_installed"].values())
    assert set(on_0_5_18["others_unchanged_while_installed"]) == {"utils.common", "utils", "model_runner", "eagle_worker_v2"}


@pytest.mark.parametrize("case", sorted(mem_cases.DOCTORED))
def test_0_5_18_drift_refused(on_0_5_18, case):
    found = on_0_5_18["drift"][case]
    assert found["refused"], found
    assert found["symbol"].endswith(":" + found["expected"]), found
    assert found["expected"] in found["message"] and "0.5.18" in found["message"]


# ---------------------------------------------------------------- 0.5.23: superseded / refused


@pytest.fixture(scope="module")
def engine_23():
    import sglang.srt.utils.common as common

    modules = {name: importlib.import_module(name) for name, _ in gm.TARGETS}
    return common, modules


def test_0_5_23_superseded(engine_23, monkeypatch):
    common, modules = engine_23
    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)
    helper = common.get_available_gpu_memory
    outcome = runtime.decide(gm, ON)
    assert outcome.state == runtime.SUPERSEDED, outcome.reason
    assert "spec_tp_sync:SpecTpSync.available_memory_gb" in outcome.reason
    assert "1:dspark-mem and 12:dflash-mem" in outcome.reason
    plans = {name: gm.check(m) for name, m in modules.items()}
    assert plans[gm.DSPARK_WORKER].state == plans[gm.DFLASH_WORKER].state == "superseded"
    assert "DSPARK_MEM" in plans[gm.DSPARK_WORKER].detail and "DFLASH_MEM" in plans[gm.DFLASH_WORKER].detail
    assert plans[gm.DSPARK_SAMPLER].state == "not needed"  # folded sampling AUTO gone since 0.5.22
    assert all(not p.patches for p in plans.values())
    assert common.get_available_gpu_memory is helper
    assert all(gm.HELPER not in vars(m) for name, m in modules.items() if name != gm.SPEC_TP_SYNC)


@pytest.mark.parametrize("spec", ["init", "rng", "all,-dflash-selector", "1,12"])
def test_0_5_23_superseded_when_mem_sites_kept(engine_23, monkeypatch, spec):
    monkeypatch.setenv("SGLANG_SPEC_TP_SYNC", spec)
    outcome = runtime.decide(gm, ON)
    assert outcome.state == runtime.SUPERSEDED, outcome.reason
    assert repr(spec) in outcome.reason


@pytest.mark.parametrize("spec,missing", [
    ("all,-dspark-mem", ["1:dspark-mem"]),
    ("all,-12", ["12:dflash-mem"]),
    ("off", ["1:dspark-mem", "12:dflash-mem"]),
    ("rng,-init", ["1:dspark-mem", "12:dflash-mem"]),
])
def test_0_5_23_refused_when_mem_sites_excluded(engine_23, monkeypatch, spec, missing):
    monkeypatch.setenv("SGLANG_SPEC_TP_SYNC", spec)
    outcome = runtime.decide(gm, ON)
    assert outcome.state == runtime.REFUSED
    assert "SGLANG_SPEC_TP_SYNC" in outcome.reason and gm.FLAG in outcome.reason
    for site in missing:
        assert site in outcome.reason
    # and the flag switched off leaves the user's choice alone
    assert runtime.decide(gm, {gm.FLAG: "0"}).state == runtime.OFF


def test_0_5_23_refused_on_a_spec_the_engine_rejects(engine_23, monkeypatch):
    monkeypatch.setenv("SGLANG_SPEC_TP_SYNC", "all,-dspark-memory")
    outcome = runtime.decide(gm, ON)
    assert outcome.state == runtime.REFUSED and "unknown token" in outcome.reason


def _doctored_23(module_name, old, new):
    real = importlib.import_module(module_name)
    source = pathlib.Path(inspect.getsourcefile(real)).read_text()
    assert source.count(old) == 1
    return mem_cases.load_doctored(module_name, old, new)


@pytest.mark.parametrize("module_name,old,new,symbol", [
    (gm.SPEC_TP_SYNC, "def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, *, group):",
     "def available_memory_gb(self, site: SpecTpSyncSite, device, gpu_id, group):", "SpecTpSync.available_memory_gb"),
    (gm.SPEC_TP_SYNC, "            cpu_group=group.cpu_group if distributed else None,\n", "",
     "SpecTpSync.available_memory_gb"),
    (gm.DSPARK_WORKER, "            SpecTpSyncSite.DSPARK_MEM,\n", "            SpecTpSyncSite.DSPARK_PLAN,\n",
     "DSparkWorkerV2.init_cuda_graphs"),
])
def test_0_5_23_drift_refused(engine_23, monkeypatch, module_name, old, new, symbol):
    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)
    real = importlib.import_module(module_name)
    assert gm.check(real).state == "superseded"
    doctored = _doctored_23(module_name, old, new)
    with pytest.raises(Refused) as info:
        gm.check(doctored)
    assert info.value.symbol == f"{module_name}:{symbol}" and "0.5.23" in str(info.value)


def test_not_a_target_module_refused(engine_23):
    _, modules = engine_23
    with pytest.raises(Refused, match="not a module this adapter patches"):
        gm.check(importlib.import_module("sglang.srt.utils.common"))
