"""tp_divergence (DSV41_TP_DIVERGENCE): counts per site on real gloo groups (the engine's
SpecTpSync of 0.5.23, the pack's broadcast with the real decision functions of 0.5.18),
the flags, the decision on each release, refusal on drift, and the Prometheus counters."""

from __future__ import annotations

import os
import re

import pytest

from sglang_dsv41_adapters.tp_divergence import divergence
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters import tp_divergence as t
from sglang_dsv41_adapters.framework.flags import FlagError
from sglang_dsv41_adapters.framework.topology import REPRESENTATIVE
from harness.doctored import Drift
from harness.engines import metric_samples, served_metrics
from harness.ranks import run_ranks
from harness import zygote
from tests.log_lines import untimed

N = 12
SKEWED = [1, 4, 5, 10]  # k = 4 of n = 12 steps
SYNC = "sglang.srt.speculative.spec_tp_sync"
# 0.5.23 sites driven by engine_case, and their calls per step (the accept triple: three syncs).
ENGINE_CALLS = {"17:dspark-draft": 3, "8:dspark-accept-greedy": 3, "11:dspark-target": 1, "15:dflash-accept-greedy": 1}
# elements one skewed step changes on rank 1, per skewed site
ENGINE_SKEWS = {"dspark-accept-greedy": 1, "dflash-accept-greedy": 2, "dspark-draft": 1}
TP4 = REPRESENTATIVE["tp"]
PACK_CALLS = {"17:dspark-draft": 3, "8:dspark-accept-greedy": 1, "15:dflash-accept-greedy": 1, "16:dflash-target": 1}


def engine_skews():
    return [[None, []]] + [[slug, SKEWED] for slug in ENGINE_SKEWS]


@pytest.fixture(scope="module")
def engine_two(tmp_path_factory):
    prom = tmp_path_factory.mktemp("prometheus")
    results = run_ranks(2, "tests.divergence_cases:engine_case", release="0.5.23",
                        kwargs={"n": N, "skews": engine_skews()}, env={"PROMETHEUS_MULTIPROC_DIR": str(prom)})
    return results, prom


@pytest.fixture(scope="module")
def engine_four():
    return run_ranks(4, "tests.divergence_cases:engine_case", release="0.5.23",
                     kwargs={"n": N, "skews": [[None, []], ["dspark-accept-greedy", SKEWED]]})


@pytest.fixture(scope="module")
def pack_two():
    return run_ranks(2, "tests.divergence_cases:pack_case", release="0.5.18", kwargs={"n": N, "skewed": SKEWED})


@pytest.fixture(scope="module")
def pack_four():
    return run_ranks(4, "tests.divergence_cases:pack_case", release="0.5.18", kwargs={"n": N, "skewed": SKEWED},
                     timeout=280)


def reported(lines) -> dict[str, list[int]]:
    """The report lines of one rank, summed per site."""
    out: dict[str, list[int]] = {}
    for line in lines:
        found = re.search(r"site=(\S+) calls=(\d+) diverged_calls=(\d+) diverged_elements=(\d+)", line)
        assert found and line.startswith(divergence.PREFIX), line
        out[found[1]] = [a + int(b) for a, b in zip(out.get(found[1], [0, 0, 0]), found.groups()[1:])]
    return out


def check_counts(ranks, run, calls, skewed_site=None, elements=0):
    """Exactly k diverged calls at the skewed site on rank 1, zero everywhere else."""
    for rank, result in enumerate(ranks):
        totals = result[run]["totals"]
        assert {site: row[0] for site, row in totals.items()} == {site: per * N for site, per in calls.items()}, rank
        for site, (_, diverged, differing) in totals.items():
            if rank == 1 and site == skewed_site:
                assert (diverged, differing) == (len(SKEWED), len(SKEWED) * elements), (rank, site, totals)
            else:
                assert (diverged, differing) == (0, 0), (rank, site, totals)
        # the lines: one per site that diverged since the last report, adding up to the counters
        want = {skewed_site: totals[skewed_site]} if rank == 1 and skewed_site else {}
        got = reported(result[run]["lines"])
        assert {s: row[1:] for s, row in got.items()} == {s: row[1:] for s, row in want.items()}, (rank, got)
        if want:
            assert len(result[run]["lines"]) > 1  # reported every 5 calls, not only at the end


def check_decisions(ranks, runs):
    """With the report on or off, every rank holds rank 0's values, the same values."""
    for run in runs:
        assert all(r[run]["values"] == ranks[0][run]["values"] for r in ranks), run
    off, on = runs
    assert ranks[0][off]["values"] == ranks[0][on]["values"]


# --- sglang 0.5.23: the engine's SpecTpSync ---------------------------------------------

@pytest.mark.parametrize("slug", [None, *ENGINE_SKEWS])
def test_engine_sites_two_ranks(engine_two, slug):
    ranks, _ = engine_two
    assert ranks[0][f"{slug}/True"]["state"] == runtime.APPLIED and ranks[0][f"{slug}/False"]["state"] == runtime.OFF
    site = next((s for s in ENGINE_CALLS if s.endswith(slug)), None) if slug else None
    check_counts(ranks, f"{slug}/True", ENGINE_CALLS, site, ENGINE_SKEWS.get(slug, 0))
    check_decisions(ranks, [f"{slug}/False", f"{slug}/True"])
    assert all(r[f"{slug}/False"]["lines"] == [] for r in ranks)  # off: nothing counted, nothing printed


def test_engine_sites_four_ranks(engine_four):
    check_counts(engine_four, "None/True", ENGINE_CALLS)
    check_counts(engine_four, "dspark-accept-greedy/True", ENGINE_CALLS, "8:dspark-accept-greedy", 1)
    for slug in ("None", "dspark-accept-greedy"):
        check_decisions(engine_four, [f"{slug}/False", f"{slug}/True"])


def test_prometheus_counters(engine_two):
    """What sglang's /metrics serves over the folder the ranks wrote to (sglang sets
    PROMETHEUS_MULTIPROC_DIR for its ranks): its own metrics route, asked over HTTP."""
    ranks, folder = engine_two
    name = divergence.METRIC_PREFIX
    samples = {(n, dict(labels)["tp_rank"], dict(labels)["site"]): value
               for (n, labels), value in metric_samples(served_metrics(folder), name).items()}
    # every run of rank 1 with the report on, added up: 4 skews x n steps
    assert samples[(name + "calls_total", "1", "8:dspark-accept-greedy")] == 4 * 3 * N
    assert samples[(name + "diverged_calls_total", "1", "8:dspark-accept-greedy")] == len(SKEWED)
    assert samples[(name + "diverged_elements_total", "1", "15:dflash-accept-greedy")] == 2 * len(SKEWED)
    assert samples[(name + "diverged_calls_total", "0", "8:dspark-accept-greedy")] == 0


def test_exit_report():
    ranks = run_ranks(2, "tests.divergence_cases:exit_case", release="0.5.23", kwargs={"k": 3}, with_stderr=True)
    lines = [[line for line in untimed(err) if " tp_divergence site=" in line] for _, err in ranks]
    assert lines[0] == []
    assert len(lines[1]) == 1 and lines[1][0].startswith(divergence.PREFIX)
    assert " rank=1 tp_divergence site=16:dflash-target calls=6 diverged_calls=3 diverged_elements=12" in lines[1][0]


# --- sglang 0.5.18: the pack's broadcast, real decision functions -----------------------

def test_pack_sites_two_ranks(pack_two):
    assert pack_two[0]["True"]["states"] == [runtime.APPLIED, runtime.APPLIED]
    elements = pack_two[1]["expected_elements"]
    assert elements >= 2  # the skew changes the accept length and the bonus of request 0
    check_counts(pack_two, "True", PACK_CALLS, "8:dspark-accept-greedy", elements)
    check_decisions(pack_two, ["False", "True"])


def test_pack_sites_four_ranks(pack_four):
    check_counts(pack_four, "True", PACK_CALLS, "8:dspark-accept-greedy", pack_four[1]["expected_elements"])
    check_decisions(pack_four, ["False", "True"])


# --- flags and decisions ------------------------------------------------------------------

@pytest.mark.parametrize("value", ["", "yes please", "2", " 1", "01x"])
def test_bad_switch_refused(value):
    with pytest.raises(FlagError):
        t.parse({t.FLAG: value})


@pytest.mark.parametrize("value", ["0", "-5", "", " 10", "1e3", "ten", "٣"])
def test_bad_every_refused_even_with_the_report_off(value):
    for environ in ({t.EVERY_FLAG: value}, {t.EVERY_FLAG: value, t.FLAG: "1"}):
        with pytest.raises(FlagError, match=t.EVERY_FLAG):
            t.parse(environ)


def test_settings():
    assert t.parse({}) is None and t.parse({t.FLAG: "off", t.EVERY_FLAG: "7"}) is None
    assert t.parse({t.FLAG: "on"}) == t.Setting(t.DEFAULT_EVERY)
    assert t.parse({t.FLAG: "TRUE", t.EVERY_FLAG: "250"}) == t.Setting(250)
    assert runtime.unknown_flags({t.FLAG: "1", t.EVERY_FLAG: "5"}) == []


def decide(environ, engine=None):
    decision = runtime.decide(environ, engine, names=("rank0_broadcast", t.NAME))
    return decision, decision.outcomes[1]


def test_off_means_untouched(clean_env):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    before = vars(SpecTpSync)["sync"]
    decision, outcome = decide({})
    runtime.apply(decision)
    assert outcome.state == runtime.OFF and decision.plans == {}
    assert vars(SpecTpSync)["sync"] is before


def test_on_0523_wraps_spec_tp_sync_and_names_the_sites(clean_env):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    original = vars(SpecTpSync)["sync"]
    decision, outcome = decide({t.FLAG: "1"})
    assert outcome.state == runtime.APPLIED
    assert "SGLANG_SPEC_TP_SYNC unset (the class's own default; the engine sets 'rng' itself where it is unset " \
        "(minimax_m3.py:" in outcome.reason
    assert "not compared: 1:dspark-mem, 12:dflash-mem" in outcome.reason and "off:" not in outcome.reason
    runtime.apply(decision)
    assert vars(SpecTpSync)["sync"].__wrapped__ is original
    runtime.apply(decision)  # again: still wrapped once
    assert vars(SpecTpSync)["sync"].__wrapped__ is original
    # the selector handed over by rank0_broadcast is what the ranks run with
    _, outcome = decide({t.FLAG: "1", "DSV41_SPEC_TP_SYNC": "dspark-target,8"})
    assert outcome.reason.startswith("compares 8:dspark-accept-greedy, 11:dspark-target at ")
    assert "off: 7:dspark-plan, 9:dspark-accept-sample" in outcome.reason
    runtime.revert()
    assert vars(SpecTpSync)["sync"] is original


@pytest.mark.parametrize("environ", [{"SGLANG_SPEC_TP_SYNC": "init"}, {"SGLANG_SPEC_TP_SYNC": "off"},
                                     {"DSV41_SPEC_TP_SYNC": "init"}])
def test_no_site_to_compare_is_refused(clean_env, environ):
    # TP 4: where the hand-over of `init` is superseded (rank0_broadcast refuses it where the
    # engine's memory probe is not shown to reach the capture group, e.g. deployment unknown)
    decision = runtime.decide({t.FLAG: "1", **environ}, names=("rank0_broadcast", t.NAME), topology=TP4)
    outcome = decision.outcomes[1]
    assert outcome.state == runtime.REFUSED
    assert "nothing to compare" in outcome.reason and t.FLAG in outcome.reason


def test_engine_check_on_the_release_sources():
    """doctor --engine and the compatibility matrix: judged with the pack's broadcast on."""
    from sglang_dsv41_adapters.engine.source_engine import SourceEngine
    from harness.engines import ENGINE_PATHS

    state, reason = runtime.engine_check(t.SURFACE, SourceEngine(ENGINE_PATHS["0.5.18"][0]))
    assert state == runtime.APPLIED and "at the pack's broadcast (sglang_dsv41_adapters.spectpsync.broadcast.broadcast)" in reason
    assert "7:dspark-plan: broadcast by the engine itself before 0.5.19" in reason
    # the deployment's own decision on that release: without the broadcast, nothing to compare
    _, outcome = decide({t.FLAG: "1"}, SourceEngine(ENGINE_PATHS["0.5.18"][0]))
    assert outcome.state == runtime.REFUSED and "DSV41_SPEC_TP_SYNC is off" in outcome.reason
    _, outcome = decide({t.FLAG: "1", "DSV41_SPEC_TP_SYNC": "all,-dspark-draft"}, SourceEngine(ENGINE_PATHS["0.5.18"][0]))
    assert outcome.state == runtime.APPLIED and "off in DSV41_SPEC_TP_SYNC: 17:dspark-draft" in outcome.reason


def test_a_renamed_parameter_of_sync_is_recognised(clean_env):
    """sync(site, tensor) does what sync(site, values) did (every engine caller passes both
    positionally, shown from its source): the same broadcast, recognised by running it."""
    drift = Drift(SYNC, "    def sync(self, site: SpecTpSyncSite, values: torch.Tensor)",
                  "    def sync(self, site: SpecTpSyncSite, tensor: torch.Tensor) -> torch.Tensor:\n"
                  "        values = tensor\n        return self._sync(site, values)\n\n"
                  "    def _sync(self, site: SpecTpSyncSite, values: torch.Tensor)", f"{SYNC}:SpecTpSync.sync")
    outcome = runtime.decide({t.FLAG: "1"}, drift.engine(), names=(t.NAME,)).outcomes[0]
    assert outcome.state == runtime.APPLIED, outcome.reason
    assert "its sync(site, t) broadcasts t itself once from rank 0" in outcome.reason


@pytest.mark.parametrize("old,new,symbol", [
    ("            self._tp_group.broadcast(values, src=0)\n        return values",
     "            return self._tp_group.broadcast(values.clone(), src=0)\n        return values", "SpecTpSync.sync"),
    ("    def enabled(self, site: SpecTpSyncSite)", "    def is_enabled(self, site: SpecTpSyncSite)", "SpecTpSync.enabled"),
    ("class SpecTpSync:", "class SpecTpSyncV2:", "SpecTpSync"),
])
def test_refused_on_doctored_0523(clean_env, old, new, symbol):
    drift = Drift(SYNC, old, new, f"{SYNC}:{symbol}")
    outcome = runtime.decide({t.FLAG: "1"}, drift.engine(), names=(t.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED
    assert drift.symbol in outcome.reason and "sglang 0.5.23" in outcome.reason


def test_doctor_reports_the_sites(clean_env):
    import subprocess

    from harness.engines import ROOT, engine_env, python

    done = zygote.run([python(), "entrypoint.py", "doctor", "--json", "--strict"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=engine_env("0.5.23", DSV41_TP_DIVERGENCE="1",
                                                                 DSV41_SPEC_TP_SYNC="all,-dspark-draft"))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    row = next(a for a in json.loads(done.stdout)["adapters"] if a["adapter"] == t.NAME)
    assert (row["outcome"], row["engine_check"]["outcome"]) == ("applied", "applied")
    assert row["setting"] == {"every": 1000, "abort": False}
    assert "off: 17:dspark-draft" in row["reason"] and "handed over from DSV41_SPEC_TP_SYNC" in row["reason"]
    # doctor names what was proven of the engine's SpecTpSync, and for which deployment
    assert "shown from its source: its own class, run over a group of two ranks" in row["reason"]
    assert "for every deployment (server arguments unknown)" in row["reason"]
    rank0 = next(a for a in json.loads(done.stdout)["adapters"] if a["adapter"] == "rank0_broadcast")
    assert rank0["outcome"] == "superseded" and "its sync(site, t) broadcasts t itself" in rank0["reason"]
    assert os.environ.get("SGLANG_SPEC_TP_SYNC") is None


def test_a_labelled_site_is_held_so_that_its_id_stays_its_own():
    """label() keeps (number, slug) by the member's id (report_sync's C form reads it so too):
    the member is held, so no later object can take that id and be counted as this site."""
    import gc
    import weakref

    class Member:  # a site as label() reads one; unlike an IntEnum member it can be weakly referenced
        slug = "held-site"

        def __int__(self):
            return 77

    site = Member()
    gone = weakref.ref(site)
    assert divergence.label(site) == (77, "held-site")
    del site
    gc.collect()
    assert gone() is not None and divergence.label(gone()) == (77, "held-site")
