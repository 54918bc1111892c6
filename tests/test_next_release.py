"""Ready for the next release: upstream's open fixes recognised by what they do, never refused,
and never switched off by what the pack hands over.

The trees are copies of the installed 0.5.23 with the fixes applied as their pull requests
describe them, in two shapes each (the PR's own and a refactor), labelled 0.5.24 or
0.0.0.dev0 (harness.next_release). Each is judged from its sources (doctor --engine, here)
and imported (a child interpreter with the tree first on its path, as a rank would), and
driven on gloo with the engine's own classes.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from harness import next_release, zygote
from harness.first_use import OnFirstUse
from harness.engines import ROOT, python
from harness.nccl import spawn_ranks
from harness.ranks import run_ranks
from sglang_dsv41_adapters import cli
from sglang_dsv41_adapters.engine.contract import Contract
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.topology import Topology
from sglang_dsv41_adapters.spectpsync import engine_class, selected_sites
from tests.agreement_cases import combos
from tests.next_release_cases import row as as_row
from tests.test_refactors import build_doctor, tree_env

pytestmark = pytest.mark.timeout(1200)

TREES = {  # name: (fixes, label)
    "39954": (["39954-pr"], "0.5.24"),
    "39954-refactor": (["39954-refactor"], "0.0.0.dev0"),
    "40246": (["40246-pr"], "0.5.24"),
    "40246-refactor": (["40246-refactor"], "0.0.0.dev0"),
    "31195": (["31195"], "0.5.24"),
    "all": (["39954-pr", "40246-pr", "31195"], "0.5.24"),
    "all-refactor": (["39954-refactor", "40246-refactor", "31195"], "0.0.0.dev0"),
}
NEW_SITE = {"40246": "18:dflash-draft-greedy", "40246-refactor": "21:dflash-proposal"}
LAYOUTS = {"tp4": (4, 1), "tp4-dp4-attn-tp1": (4, 4), "tp4-dp2-attn-tp2": (4, 2), "unknown": None}
ON = {"DSV41_SPEC_TP_SYNC": "all,pack-dflash-draft-greedy", "DSV41_GROUP_MIN_MEM": "1", "DSV41_TP_DIVERGENCE": "1"}
CASES = [({}, None), ({"DSV41_GROUP_MIN_MEM": "1"}, None), *[(ON, layout) for layout in LAYOUTS.values()],
         *[({"DSV41_GROUP_MIN_MEM": "1"}, layout) for layout in LAYOUTS.values()],
         ({"DSV41_SPEC_TP_SYNC": "all"}, (4, 1)), ({"DSV41_SPEC_TP_SYNC": "all,-dspark-plan"}, (4, 1)),
         ({"DSV41_SPEC_TP_SYNC": "rng"}, (4, 1)), ({"DSV41_SPEC_TP_SYNC": "pack-dflash-draft-greedy"}, (4, 1))]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("next")
    yield OnFirstUse(lambda name: next_release.tree(base / name, *TREES[name]))
    shutil.rmtree(base, ignore_errors=True)


def source_decisions(tree) -> list:
    engine = SourceEngine(tree)
    out = []
    for env, layout in CASES:
        topology = None if layout is None else Topology(layout[0], attn_dp_size=layout[1])
        out.append(as_row(runtime.decide(env, engine, topology=topology)))
    return out


@pytest.fixture(scope="module")
def judged(trees):
    """{tree: {"import": [...], "source": [...]}}, one entry per CASES item."""
    def judge(name):
        tree = trees[name]
        source = source_decisions(tree)  # first: what it proves here, the child finds in the run's proof cache
        imported = run_ranks(1, "tests.next_release_cases:decisions", env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"},
                             warm=False, kwargs={"cases": CASES}, timeout=600)[0]
        return {"import": imported, "source": source}
    return OnFirstUse(judge)


def case(judged, name, env, layout, side="import"):
    return judged[name][side][CASES.index((env, layout))]


@pytest.mark.parametrize("name", sorted(TREES))
def test_source_and_import_agree_on_every_tree(judged, name):
    sides = judged[name]
    for (env, layout), imported, source in zip(CASES, sides["import"], sides["source"]):
        assert imported["states"] == source["states"], (name, env, layout, imported["reasons"], source["reasons"])
        assert imported["env"] == source["env"] and imported["patches"] == source["patches"], (name, env, layout)


@pytest.mark.parametrize("name", sorted(TREES))
def test_no_fix_is_ever_refused(judged, name):
    for (env, layout), row in zip(CASES, judged[name]["import"]):
        report = row["states"].get("tp_divergence")
        if layout == (4, 4) and report == runtime.REFUSED:  # one rank per batch: nothing to compare, as on 0.5.23
            continue
        assert runtime.REFUSED not in row["states"].values(), (name, env, layout, row["reasons"])


@pytest.mark.parametrize("name", ["39954", "39954-refactor", "all", "all-refactor"])
def test_39954_supersedes_the_memory_probe_on_every_layout(judged, name):
    """The engine's probe reduces over the capture group whatever its own group: superseded
    on every layout, the deployment known or not (0.5.23 applies the pack's under DP
    attention with attention-TP 1 and where the deployment is unknown)."""
    for layout in LAYOUTS.values():
        row = case(judged, name, {"DSV41_GROUP_MIN_MEM": "1"}, layout)
        assert row["states"]["group_min_memory"] == runtime.SUPERSEDED, (layout, row["reasons"])
        assert "over the capture group it is given whatever its own group" in row["reasons"]["group_min_memory"]
        assert row["patches"]["group_min_memory"] == []


@pytest.mark.parametrize("name", ["40246", "40246-refactor", "31195"])
def test_without_39954_the_pack_still_serves_dp_attention(judged, name):
    row = case(judged, name, {"DSV41_GROUP_MIN_MEM": "1"}, (4, 4))
    assert row["states"]["group_min_memory"] == runtime.APPLIED
    assert row["patches"]["group_min_memory"] == ["SpecTpSync.available_memory_gb"]


@pytest.mark.parametrize("name", ["39954", "39954-refactor"])
def test_39954_on_gloo_the_ranks_agree_without_the_pack(trees, name):
    """DP 2 x attention-TP 1 (SpecTpSync over one rank, the MoE draft's capture group both):
    the tree's own worker probe gives both ranks the minimum and the same capture decision,
    and the pack, superseded, adds no collective."""
    frees = [0.6, 8.0]
    ranks = spawn_ranks(2, "tests.mem23_cases:capture_case", nccl=False, timeout=400, path=[str(trees[name])],
                        kwargs={"attn_tp": 1, "frees_gb": frees, "decide_with": [None, [2, 2]]})
    assert [r["groups"] for r in ranks] == [{"spec_tp_sync": 1, "draft_graph": 2}] * 2
    for label in ("unpatched", "None", "[2, 2]"):
        assert [r["runs"][label]["probe_gb"] for r in ranks] == [min(frees)] * 2, label
        assert [r["runs"][label]["dspark_capture"] for r in ranks] == [False, False], label
        assert [r["runs"][label]["dspark_all_reduce"] for r in ranks] == [["RedOpType.MIN"]] * 2, label
    for label in ("None", "[2, 2]"):
        assert [r["runs"][label]["state"] for r in ranks] == [runtime.SUPERSEDED] * 2
        assert [r["runs"][label]["pack_collectives"] for r in ranks] == [{}, {}]


@pytest.mark.parametrize("name", ["40246", "40246-refactor"])
@pytest.mark.parametrize("flag,handed", [("all", "all"), ("all,-dspark-plan", "all,-dspark-plan"), ("rng", "rng"),
                                         ("pack-dflash-draft-greedy", "none")])
def test_the_hand_over_keeps_the_engines_own_selection(judged, trees, name, flag, handed):
    """What the pack writes is the user's selection in the engine's grammar: a site it has never
    seen stays on wherever the engine's own preset keeps it."""
    for side in ("import", "source"):
        row = case(judged, name, {"DSV41_SPEC_TP_SYNC": flag}, (4, 1), side)
        assert row["env"]["rank0_broadcast"] == {"SGLANG_SPEC_TP_SYNC": handed}, (side, row["reasons"])
    engine = SourceEngine(trees[name])
    contract = Contract("rank0_broadcast", engine.module(engine_class.MODULE))
    number = int(NEW_SITE[name].split(":")[0])
    kept = number in selected_sites.selection(contract, handed)
    assert kept == (flag in ("all", "all,-dspark-plan")), handed
    if kept:
        reason = case(judged, name, {"DSV41_SPEC_TP_SYNC": flag}, (4, 1))["reasons"]["rank0_broadcast"]
        assert f"sites the pack does not know, kept on: {NEW_SITE[name]} (" in reason


@pytest.mark.parametrize("name,site", [("40246", "DFLASH_DRAFT_GREEDY"), ("40246-refactor", "DFLASH_PROPOSAL")])
def test_40246_on_gloo_the_new_site_broadcasts_under_the_hand_over(trees, name, site):
    ranks = spawn_ranks(2, "tests.next_release_cases:handed_site_case", nccl=False, timeout=300,
                        path=[str(trees[name])], kwargs={"flag": "all", "site": site})
    for r in ranks:
        assert (r["state"], r["handed"], r["enabled"], r["same_tensor"]) == (runtime.SUPERSEDED, "all", True, True)
        assert r["value"] == [100] * 4  # rank 0's value on every rank


def test_40246_site_31_leaves_the_engine_the_paths_it_broadcasts(judged):
    """The engine's site covers the eager plain head and the eager selector block in this
    tree; the pack keeps the paths it does not (the captured selector, Domino, LiLiCorr)."""
    row = case(judged, "40246", ON, (4, 1))
    assert row["states"]["rank0_broadcast"] == runtime.APPLIED
    patched = row["patches"]["rank0_broadcast"]
    assert "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head" not in patched
    assert {"_SelectorDraftSampler.__call__", "dflash_worker_v2.domino_greedy_rollout",
            "LiLiCorrDraftSampler.__call__"} <= set(patched)
    assert "the engine broadcasts these paths itself: plain head (18:dflash-draft-greedy)" \
        in row["reasons"]["rank0_broadcast"]
    # With the engine's sites handed over as "none", the site is the pack's on every path.
    alone = case(judged, "40246", {"DSV41_SPEC_TP_SYNC": "pack-dflash-draft-greedy"}, (4, 1))
    assert "DFlashWorkerV2._greedy_sample_from_vocab_parallel_head" in alone["patches"]["rank0_broadcast"]


@pytest.mark.parametrize("name", ["all", "all-refactor"])
def test_doctor_strict_passes_on_a_fixed_engine_with_no_flag(trees, name, tmp_path):
    """The Dockerfile's own doctor command with no flag required, on the tree imported as the image's
    Python imports its engine, and doctor --strict --engine on its sources."""
    built, record = build_doctor(trees[name], "", tmp_path)
    engine = zygote.run([python(), "entrypoint.py", "doctor", "--strict", "--engine", str(trees[name])], cwd=ROOT,
                        env=tree_env(ROOT), capture_output=True, text=True, timeout=300, once=True)
    for done in (built, engine):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.startswith("verdict: ok (exit 0)")
        assert TREES[name][1] in done.stdout  # the label it was judged under, said
    assert TREES[name][1] in record.read_text()


@pytest.fixture(scope="module")
def by_layout(trees, tmp_path_factory):
    model = str(tmp_path_factory.mktemp("model"))

    def table(name):
        tree = next_release.proven_here(trees[name], combos())
        return run_ranks(1, "tests.agreement_cases:layouts", env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}, warm=False,
                         kwargs={"model_dir": model, "source_tree": str(tree)}, timeout=900)[0]
    return OnFirstUse(table)


@pytest.mark.parametrize("name", ["all", "all-refactor"])
def test_the_agreement_table_holds_on_the_next_release(by_layout, name):
    """doctor, doctor --engine, the wrapper (the command read with the engine's own parser) and
    a rank (the ServerArgs its Scheduler receives) agree on every flag combination and layout."""
    layouts = by_layout[name]
    assert sorted(layouts) == ["tp4", "tp4-dp-attention-tp1", "tp4-dp-attention-tp2", "tp4-dspark"]
    for layout, found in layouts.items():
        assert len(found["rows"]) == len(combos())
        for env, row in zip(combos(), found["rows"]):
            assert row["doctor"] == row["sources"] == row["wrapper"] == row["rank"], (name, layout, env)
            assert row["launch_refused"] == row["rank_refused"] == row["doctor_failed"], (name, layout, env)
    # the fix is seen: no layout applies the pack's memory probe
    memory = {layout: found["rows"][combos().index({"DSV41_GROUP_MIN_MEM": "1"})]["rank"]["group_min_memory"]
              for layout, found in layouts.items()}
    assert set(memory.values()) == {runtime.SUPERSEDED}, (name, memory)


# ---------------------------------------------------------------- grammar and presets the engine changes


CHANGED = {
    # the grammar no longer takes numbers: the pack hands over the engine's slugs
    "no-numbers": [("_BY_NUMBER = {str(int(site)): site for site in SpecTpSyncSite}", "_BY_NUMBER = {}")],
    # `all` leaves the memory sites out
    "all-without-memory": [("_ALL = frozenset(SpecTpSyncSite)\n",
                            "_ALL = frozenset(s for s in SpecTpSyncSite if not s.name.endswith('_MEM'))\n")],
}


CHANGED_CASES = [({"DSV41_SPEC_TP_SYNC": "7,8"}, (4, 1)), ({"DSV41_SPEC_TP_SYNC": "all"}, (4, 1)),
                 ({"DSV41_GROUP_MIN_MEM": "1"}, (4, 1))]


@pytest.fixture(params=sorted(CHANGED))
def changed(request, tmp_path):
    """(the name, its verdicts imported, from source) for one changed grammar or preset."""
    name = request.param
    tree = next_release.tree(tmp_path / name, (), "0.5.24")
    next_release.edit(tree, next_release.SYNC, *CHANGED[name])
    imported = run_ranks(1, "tests.next_release_cases:decisions", env={"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"},
                         warm=False, kwargs={"cases": CHANGED_CASES}, timeout=600)[0]
    engine = SourceEngine(tree)
    return name, imported, [as_row(runtime.decide(env, engine, topology=Topology(*layout)))
                            for env, layout in CHANGED_CASES]


def test_a_changed_grammar_gets_one_verdict_from_source_and_import(changed):
    name, imported, source = changed
    for found, expected in zip(imported, source):
        assert found["states"] == expected["states"], (name, found["reasons"], expected["reasons"])
        assert found["env"] == expected["env"], name
    if name == "no-numbers":
        assert imported[0]["env"]["rank0_broadcast"] == {"SGLANG_SPEC_TP_SYNC": "dspark-plan,dspark-accept-greedy"}
        assert imported[0]["states"]["rank0_broadcast"] == runtime.SUPERSEDED
    else:  # the pack's `all` keeps the memory sites on; the engine's own default leaves them out
        assert imported[1]["env"]["rank0_broadcast"] == {"SGLANG_SPEC_TP_SYNC": "all,dspark-mem,dflash-mem"}
        assert imported[2]["states"]["group_min_memory"] == runtime.REFUSED
        assert "leaves out sites 1:dspark-mem, 12:dflash-mem" in imported[2]["reasons"]["group_min_memory"]


def test_doctor_engine_says_decided_at_launch_where_the_class_cannot_run(tmp_path):
    """Sources that cannot be imported here (a partial tree): the verdicts that rest on running
    the engine's class are left to the ranks, with their own outcome, in the table and the JSON."""
    site = next_release.SITE_PACKAGES / "sglang"
    root = tmp_path / "partial"
    shutil.copytree(site / "srt" / "speculative", root / "sglang" / "srt" / "speculative",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("srt/environ.py", "srt/distributed/parallel_state.py", "srt/utils/__init__.py", "srt/utils/common.py",
                 "srt/layers/dp_attention.py"):
        (root / "sglang" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / name, root / "sglang" / name)
    (root / "sglang" / "_version.py").write_text("__version__ = version = '0.5.24'\n")
    # a class of its own (the same code observed elsewhere would be known already)
    sync = root / "sglang" / next_release.SYNC
    sync.write_text(sync.read_text(encoding="utf-8") + "\n# a preview build\n", encoding="utf-8")
    found = cli.report({"DSV41_SPEC_TP_SYNC": "all"}, SourceEngine(root))
    row = next(r for r in found["adapters"] if r["adapter"] == "rank0_broadcast")
    assert row["state"] == runtime.AT_LAUNCH, row["reason"]
    assert "each rank runs it at launch" in row["reason"] and "cannot be imported here" in row["reason"]
    assert json.dumps(cli.as_json(found, str(root), 0))  # the schema's own test validates the shape
    assert cli.as_json(found, str(root), 0)["adapters"][1]["outcome"] == "decided at launch"
