"""The pack's own site 31:pack-dflash-draft-greedy: DFlash's greedy draft
proposal broadcast from rank 0 where it is rank-local (adapter/rank0_broadcast/dflash_draft.py).

- grammar: its own token (slug or number), never a preset, never one of the engine's;
- the engine's own draft code on 2 gloo ranks (tests/dflash_draft_cases.py) with rank 1
  skewed in some steps: off, rank 1's block differs in exactly the skewed steps on the
  rank-local paths (Domino, selector, plain head without shard_indices); on, every rank holds
  rank 0's block; the vocab-parallel plain head agrees either way and is not broadcast; the
  divergence report counts the site at row 31;
- every release 0.5.16 - 0.5.23 from its sources: the paths present there are patched, on
  0.5.19+ beside the engine's SpecTpSync hand-over; a doctored release refused, symbol named.
"""

from __future__ import annotations

import pathlib

import pytest

from harness.doctored import Drift
from harness.engines import ROOT
from harness.nccl import spawn_ranks
from sglang_dsv41_adapters import load, rank0_broadcast as r
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.flags import FlagError
from sglang_dsv41_adapters.rank0_broadcast import dflash_draft as d
from sglang_dsv41_adapters.spectpsync import engine_class, sites
from sglang_dsv41_adapters.tp_divergence import divergence

SITE = sites.Site.PACK_DFLASH_DRAFT_GREEDY
N, SKEWED = 8, [1, 4, 6]
LOCAL = ("domino", "selector", "plain_local")
RELEASES = ("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
# Release -> the wrappers the site puts on it (the DFlash group recorder aside).
WHERE = {
    "0.5.16": ["DFlashWorkerV2._greedy_sample_from_vocab_parallel_head"],
    "0.5.19": ["DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", "_SelectorDraftSampler.__call__",
               "DFlashWorkerV2._propose_selector_block"],
    "0.5.20": ["DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", "_SelectorDraftSampler.__call__",
               "DFlashWorkerV2._propose_selector_block", "dflash_worker_v2.domino_greedy_rollout"],
    "0.5.21": ["DFlashWorkerV2._greedy_sample_from_vocab_parallel_head", "_SelectorDraftSampler.__call__",
               "DFlashWorkerV2._propose_selector_block", "dflash_worker_v2.domino_greedy_rollout",
               "LiLiCorrDraftSampler.__call__", "dflash_worker_v2.propose_lilicorr_block"],
}
for _release, _from in (("0.5.17", "0.5.16"), ("0.5.18", "0.5.16"), ("0.5.22", "0.5.21"), ("0.5.23", "0.5.21")):
    WHERE[_release] = WHERE[_from]


# --- grammar -------------------------------------------------------------------------

def test_own_token_selects_it_and_no_preset_does():
    for token in ("pack-dflash-draft-greedy", "PACK_DFLASH_DRAFT_GREEDY", "31", " 31 "):
        assert sites.parse_value(token) == {SITE}
    assert sites.parse_value("all,31") == sites.ALL | {SITE}
    assert sites.parse_value("all,31,-31") == sites.ALL
    assert sites.parse_value("31,-all") == {SITE}  # -all takes upstream's sites away, not the pack's
    for preset in sites.PRESETS.values():
        assert SITE not in preset
    with pytest.raises(FlagError):
        sites.parse_value("dflash-draft-greedy")  # upstream's likely slug (PR #40246) is not the pack's
    assert sites.parse_numbers("none") == frozenset()


def test_never_one_of_the_engines_numbers_or_slugs():
    """Checked on every release's SpecTpSyncSite, and a number the divergence report can hold."""
    assert int(SITE) < divergence.ROWS and SITE.slug.startswith(sites.PACK_PREFIX)
    for release in RELEASES[3:]:
        text = (ROOT / ".engines" / "src" / release / "sglang/srt/speculative/spec_tp_sync.py").read_text()
        body = text[text.index("class SpecTpSyncSite"):text.index("\n\n\n", text.index("class SpecTpSyncSite"))]
        assert f"= {int(SITE)}\n" not in body and "PACK_" not in body, release


def test_a_collision_stops_only_a_selection_that_names_the_token(monkeypatch):
    """An engine site at the pack's number 31: `all` and the pack's slug mean what they meant;
    only a selection naming `31` is ambiguous, and is refused with both ways to say it."""
    from sglang.srt.speculative import spec_tp_sync

    drift = Drift(engine_class.MODULE, "    DSPARK_DRAFT = 17\n", "    DSPARK_DRAFT = 17\n    DFLASH_DRAFT = 31\n",
                  "SpecTpSyncSite.DFLASH_DRAFT")
    assert "DSPARK_DRAFT = 17" in pathlib.Path(spec_tp_sync.__file__).read_text()
    decide = lambda value: runtime.decide({r.FLAG: value}, drift.engine(), names=(r.NAME,)).outcomes[0]  # noqa: E731
    for value in ("all", "all,pack-dflash-draft-greedy", "all,-pack-dflash-draft-greedy"):
        assert decide(value).state != runtime.REFUSED, (value, decide(value).reason)
    for value in ("all,31", "all,-31"):
        outcome = decide(value)
        assert outcome.state == runtime.REFUSED and "SpecTpSyncSite.DFLASH_DRAFT" in outcome.reason, outcome.reason
        assert "31:pack-dflash-draft-greedy" in outcome.reason and "slug (pack-dflash-draft-greedy)" in outcome.reason


# --- the engine's draft code on two gloo ranks -----------------------------------------

@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(2, "tests.dflash_draft_cases:draft_case", nccl=False, kwargs={"n": N, "skewed": SKEWED},
                       timeout=280)


def test_rank_local_paths_diverge_off_and_agree_on(ranks):
    for name in LOCAL:
        zero, one = (rank["paths"][name] for rank in ranks)
        assert one["off"]["steps_off"] == SKEWED, name  # the skew shows, in exactly the skewed steps
        assert one["off"]["skew_moved"] == SKEWED and zero["off"]["skew_moved"] == [], name
        for variant in ("on", "on_report"):
            assert zero[variant]["steps_off"] == one[variant]["steps_off"] == [], (name, variant)
            assert zero[variant]["collectives"] == one[variant]["collectives"] == N, (name, variant)
        assert zero["off"]["collectives"] == 0 and zero["off"]["distinct_blocks"] > 1, name
        assert one["on"]["states"] == {"rank0_broadcast": "applied", "tp_divergence": "off"}


def test_vocab_parallel_head_is_tp_safe_and_not_broadcast(ranks):
    """ENGINE_NOTES 2.2's claim, for the one path it holds for: rank 1's skewed shard moves the
    answer on every rank alike, with the site off and on, and the site broadcasts nothing there."""
    for rank in ranks:
        sharded = rank["paths"]["plain_sharded"]
        for variant in ("off", "on", "on_report"):
            assert sharded[variant]["steps_off"] == [] and sharded[variant]["collectives"] == 0, variant
            assert sharded[variant]["skew_moved"] == SKEWED, variant


def test_divergence_report_counts_the_site(ranks):
    key = f"{int(SITE)}:{SITE.slug}"
    for name in LOCAL:
        zero, one = (rank["paths"][name]["on_report"]["totals"] for rank in ranks)
        assert zero == {key: [N, 0, 0]}, name
        assert set(one) == {key} and one[key][:2] == [N, len(SKEWED)] and one[key][2] >= len(SKEWED), (name, one)
    assert ranks[1]["paths"]["plain_sharded"]["on_report"]["totals"] == {}
    assert ranks[0]["paths"]["domino"]["on_report"]["states"] == {"rank0_broadcast": "applied",
                                                                  "tp_divergence": "applied"}


def test_release_0518_plain_head():
    """0.5.18 (no SpecTpSync): the site rides the pack's before-0.5.19 plan."""
    from harness.engines import ENGINE_PATHS

    ranks = spawn_ranks(2, "tests.dflash_draft_cases:draft_case", nccl=False, timeout=240,
                        kwargs={"n": N, "skewed": SKEWED, "paths": ["plain_local", "plain_sharded"],
                                "variants": ["off", "on"]}, path=[str(p) for p in ENGINE_PATHS["0.5.18"]])
    assert ranks[0]["sglang"] == "0.5.18"
    local = [rank["paths"]["plain_local"] for rank in ranks]
    assert local[1]["off"]["steps_off"] == SKEWED and local[1]["on"]["steps_off"] == [] == local[0]["on"]["steps_off"]
    assert [rank["paths"]["plain_sharded"]["on"]["collectives"] for rank in ranks] == [0, 0]


# --- every release, from its sources ---------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_every_release_patches_the_paths_it_has(release):
    adapter = load(r.NAME)
    state, reason = runtime.engine_check(adapter, SourceEngine(ROOT / ".engines" / "src" / release))[:2]
    if release == "0.5.16":  # the DSpark draft refusal of `all` on 0.5.16, unchanged
        assert state == runtime.REFUSED and "dspark_draft_sampler" in reason
        return
    assert state == runtime.APPLIED, reason
    own = reason[reason.index(SITE.label):]
    assert own.split(" at ", 1)[1].split(": ")[0].split(", ") == (
        (["DFlashWorkerV2.__init__"] if release >= "0.5.19" else []) + WHERE[release]), own
    if release >= "0.5.19":
        assert "handed to SGLANG_SPEC_TP_SYNC" in reason


def test_only_the_pack_site_on_0523_hands_none(monkeypatch):
    monkeypatch.delenv(engine_class.ENGINE_FLAG, raising=False)
    decision = runtime.decide({r.FLAG: "pack-dflash-draft-greedy"}, names=(r.NAME,))
    assert decision.outcomes[0].state == runtime.APPLIED
    assert decision.plans[r.NAME].env == {engine_class.ENGINE_FLAG: "none"}
    assert [p.where for p in decision.plans[r.NAME].patches] == ["DFlashWorkerV2.__init__"] + WHERE["0.5.23"]


DOCTORED = [  # (module, old, new, symbol named in the refusal)
    (d.WORKER, "            draft_next = domino_greedy_rollout(", "            draft_next = domino_rollout_v2(",
     "DFlashWorkerV2.forward_batch_generation"),
    (d.WORKER, "        self.tp_group.all_gather_into_tensor(gathered_max, local_max)\n"
               "        self.tp_group.all_gather_into_tensor(gathered_ids, local_arg)\n",
     "        gathered_max.copy_(local_max.repeat(self.tp_size))\n"
     "        gathered_ids.copy_(local_arg.repeat(self.tp_size))\n", "_DflashDraftSampler.__call__"),
    (d.WORKER, "    def _propose_selector_block(\n        self,\n        *,", "    def _propose_selector_block(\n        self,",
     "DFlashWorkerV2._propose_selector_block"),
    (d.WORKER, '        if not hasattr(lm_head, "shard_indices"):\n            for start',
     '        if getattr(lm_head, "shard_indices", None) is None:\n            for start',
     "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head"),
    (d.WORKER, "            return _SelectorDraftSampler(", "            return _SelectorDraftSamplerV2(",
     "DFlashWorkerV2._maybe_build_draft_sampler"),
    (d.LILICORR, "        self.out[:rows].copy_(", "        self.block[:rows].copy_(", "LiLiCorrDraftSampler.__call__"),
]


@pytest.mark.parametrize("module,old,new,symbol", DOCTORED, ids=[c[3] for c in DOCTORED])
def test_refused_on_doctored_0523(module, old, new, symbol, monkeypatch):
    monkeypatch.delenv(engine_class.ENGINE_FLAG, raising=False)
    drift = Drift(module, old, new, f"{module}:{symbol}")
    outcome = runtime.decide({r.FLAG: "pack-dflash-draft-greedy"}, drift.engine(), names=(r.NAME,)).outcomes[0]
    assert outcome.state == runtime.REFUSED, outcome.reason
    assert drift.symbol in outcome.reason, outcome.reason
    # the engine's own sites alone are unaffected by the drift of a DFlash draft path
    assert runtime.decide({r.FLAG: "all"}, drift.engine(), names=(r.NAME,)).outcomes[0].state == runtime.SUPERSEDED


def test_group_on_0523_is_the_one_the_engines_spec_tp_sync_was_built_over(monkeypatch):
    """The recorder put on DFlashWorkerV2.__init__ (0.5.19+) binds, once __init__ has run, the
    group of the worker's own SpecTpSync (the real class), over which the engine's DFlash sites go."""
    import types

    from sglang.srt.speculative.spec_tp_sync import SpecTpSync
    from sglang_dsv41_adapters.spectpsync import broadcast as pack

    monkeypatch.delenv(engine_class.ENGINE_FLAG, raising=False)
    decision = runtime.decide({r.FLAG: "pack-dflash-draft-greedy"}, names=(r.NAME,))
    (recorder,) = [p.wrapper for p in decision.plans[r.NAME].patches if p.where == "DFlashWorkerV2.__init__"]
    group, worker = types.SimpleNamespace(world_size=2, rank_in_group=1), types.SimpleNamespace()

    def init():
        with pytest.raises(RuntimeError):  # nothing bound while __init__ runs
            pack.group_of(pack.DFLASH)
        worker._tp_sync = SpecTpSync(group)

    pack.reset()
    try:
        recorder(init, worker, (), {})
        assert pack.group_of(pack.DFLASH) is group
    finally:
        pack.reset()
