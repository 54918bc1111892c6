"""SUPERSEDED is a proof (the pack stands aside only where the engine is shown to do the job):
the engine's own SpecTpSync (sglang 0.5.19+) is judged from its source, the same way for the
installed engine and a release read from its sources.

- The real releases 0.5.19 - 0.5.23 (sources) and the installed 0.5.23: the proof holds, and
  each reason names what was shown and the server arguments it was judged for.
- Doctored copies of the real 0.5.23 modules, each doctoring applied twice: to the module the
  installed engine imports (tests/doctored.py: a copy, run) and to the same file in a copy of
  the release's sources read by adapter.engine.source_engine. Where the broadcast is not shown,
  rank0_broadcast and tp_divergence are refused; where the probe is not shown,
  group_min_memory is applied by the pack; the outcome is the same on both sides and the
  reason names what was not shown.
- The run-time probe of the installed class: against its own code under each value the
  ranks may read, with os.environ and the class left as they were.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import shutil
from dataclasses import dataclass, field

import pytest

from sglang_dsv41_adapters import group_min_memory as gm
from sglang_dsv41_adapters import rank0_broadcast as r0
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.spectpsync import engine_class, groups_proof, observation
from sglang_dsv41_adapters import tp_divergence as td
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework.topology import REPRESENTATIVE, Topology
from harness.doctored import DoctoredEngine, doctored_module, new_module_file
from harness import next_release
from harness.engines import release_sources

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent
SYNC = engine_class.MODULE
SPEC = "sglang.srt.speculative"
DSPARK_WORKER = f"{SPEC}.dspark_components.dspark_worker_v2"
PLANNER = f"{SPEC}.dspark_components.dspark_planner"
DFLASH_WORKER = f"{SPEC}.dflash_worker_v2"
PARALLEL_STATE = engine_class.PARALLEL_STATE
COMMON = engine_class.HELPER_HOME
TP4, DP4, DP2 = REPRESENTATIVE["tp"], REPRESENTATIVE["dp-attention-tp1"], REPRESENTATIVE["dp-attention-tp2"]
ON = {r0.NAME: {r0.FLAG: "all"}, gm.NAME: {gm.FLAG: "1"}, td.NAME: {td.FLAG: "1"}}
# What a copy of the sources needs besides the speculative package (the proof's own modules).
SOURCE_FILES = ["srt/environ.py", "srt/distributed/parallel_state.py", "srt/utils/__init__.py", "srt/utils/common.py",
                "srt/layers/dp_attention.py", "srt/arg_groups/speculative_hook.py",
                "srt/arg_groups/model_overrides/minimax_m3.py",
                # tp_divergence's watchdog dump: the watchdog, and the scheduler's that passes dump_info
                "srt/utils/watchdog.py", "srt/managers/scheduler_components/invariant_checker.py",
                # its site 30: the model runner's forward and the decode graph runner
                "srt/model_executor/model_runner.py", "srt/model_executor/runner/decode_cuda_graph_runner.py",
                # and the groups it reads from the runtime context (engine/parallel_groups.py)
                "srt/runtime_context.py", "srt/arg_groups/fields/parallel.py"]
MINIMAX = "sglang.srt.arg_groups.model_overrides.minimax_m3"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(engine_class.ENGINE_FLAG, raising=False)
    yield
    runtime.revert()


def outcome(adapter: str, engine=None, topology=TP4):
    return runtime.decide(ON[adapter], engine, names=(adapter,), topology=topology).outcomes[0]


# ---------------------------------------------------------------- the real releases

PROVEN = ["its own class, run over a group of two ranks with", "selects sites"]
BROADCAST = ["its sync(site, t) broadcasts t itself once from rank 0 and returns it at exactly those",
             "no other subclass or reassignment in the engine", "callers pass a tensor they hold or use what sync returns"]
PROBE = ["reduces sites 1,12 over the capture group it is given where its own group has more than one rank",
         "get_available_gpu_memory all_reduces MIN over the cpu_group it is given when distributed"]


def engines():
    yield "0.5.23-installed", None
    for release in ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"):
        yield release, SourceEngine(release_sources(release))


@pytest.mark.parametrize("name,engine", list(engines()), ids=lambda x: x if isinstance(x, str) else "")
def test_real_releases_are_proven(name, engine):
    rank0 = outcome(r0.NAME, engine)
    assert rank0.state == runtime.SUPERSEDED, rank0.reason
    for phrase in PROVEN + BROADCAST + ["for TP 4, no DP attention", "it over the group that runs one batch"]:
        assert phrase in rank0.reason, (phrase, rank0.reason)
    memory = outcome(gm.NAME, engine)
    assert memory.state == runtime.SUPERSEDED, memory.reason
    for phrase in PROBE + ["for TP 4, no DP attention", "shown from its source and by running it"]:
        assert phrase in memory.reason, (phrase, memory.reason)
    report = outcome(td.NAME, engine)
    assert report.state == runtime.APPLIED and all(p in report.reason for p in BROADCAST), report.reason
    if name == "0.5.19":  # its DFlash worker builds SpecTpSync over get_tp_group(); 0.5.19 refuses DFlash + DP attention
        assert "DFlashWorkerV2 builds it over the TP group (this release refuses DFlash with DP attention" in rank0.reason


@pytest.mark.parametrize("name,engine", list(engines()), ids=lambda x: x if isinstance(x, str) else "")
def test_real_releases_by_topology(name, engine):
    """DP attention with attention-TP 1 (and an unknown deployment): the engine's SpecTpSync keeps
    no site, so the pack makes the probe the group minimum, the report has nothing to compare and
    the hand-over names the flag that serves the memory sites."""
    for topology, state in ((DP2, runtime.SUPERSEDED), (DP4, runtime.APPLIED), (None, runtime.APPLIED),
                            (Topology(1), runtime.SUPERSEDED)):
        memory = outcome(gm.NAME, engine, topology)
        assert memory.state == state, (topology, memory.reason)
        assert groups_proof.judged_for(topology) in memory.reason
    applied = outcome(gm.NAME, engine, DP4)
    assert "sgl-project/sglang#39954" in applied.reason and "group of one rank there" in applied.reason
    assert "server arguments unknown" in outcome(gm.NAME, engine, None).reason
    report = outcome(td.NAME, engine, DP4)
    assert report.state == runtime.REFUSED and "one rank runs each batch for TP 4, DP attention 4 x attention-TP 1" \
        in report.reason
    assert outcome(td.NAME, engine, DP2).state == runtime.APPLIED
    rank0 = outcome(r0.NAME, engine, DP4)
    assert rank0.state == runtime.SUPERSEDED and "nothing to broadcast" in rank0.reason
    assert "sites 1:dspark-mem, 12:dflash-mem are not shown to be reduced there" in rank0.reason
    assert "DSV41_GROUP_MIN_MEM serves them, which is off" in rank0.reason


def test_memory_only_selection_needs_the_deployment():
    """`init` selects only the memory sites: superseded where the engine is shown to reduce them,
    refused where it is not, or not known to be (naming DSV41_GROUP_MIN_MEM)."""
    def init(topology):
        return runtime.decide({r0.FLAG: "init"}, names=(r0.NAME,), topology=topology).outcomes[0]

    assert init(TP4).state == init(DP2).state == runtime.SUPERSEDED
    for topology in (DP4, None):
        refused = init(topology)
        assert refused.state == runtime.REFUSED and "DSV41_GROUP_MIN_MEM=1" in refused.reason, refused.reason


# ---------------------------------------------------------------- doctored copies


@dataclass(frozen=True)
class Doctoring:
    """Edits of real 0.5.23 modules, and each adapter's expected (state, phrase of the reason).
    A module in READ_ONLY is not run on the installed side (running a copy would register its
    model override a second time): its doctored file is one the engine's sources hold."""

    edits: dict
    expect: dict = field(default_factory=dict)

    def installed(self, directory) -> DoctoredEngine:
        modules, added = {}, {}
        for name, edits in self.edits.items():
            if name in READ_ONLY:
                text = pathlib.Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")
                for old, new in edits:
                    assert text.count(old) == 1, (name, old)
                    text = text.replace(old, new)
                modules[name], added[name] = None, new_module_file(name, text, directory)
            else:
                modules[name] = doctored_module(name, *edits, directory=directory)
        return DoctoredEngine(modules, added)

    def source(self, directory) -> SourceEngine:
        """A whole copy of the release's sources (the child interpreter that runs its class
        imports it), with the same edits."""
        root = next_release.tree(pathlib.Path(directory) / "tree", (), version="0.5.23")
        for module, edits in self.edits.items():
            next_release.edit(root, module.removeprefix("sglang.").replace(".", "/") + ".py", *edits)
        return SourceEngine(root)


REFUSED, APPLIED, SUPERSEDED = runtime.REFUSED, runtime.APPLIED, runtime.SUPERSEDED
BROADCAST_LINE = "            self._tp_group.broadcast(values, src=0)\n"
PROBE_LINE = "        distributed = self.enabled(site) and group.world_size > 1\n"
KEPT_LINE = "        self._sites = sites if tp_group.world_size > 1 else frozenset()\n"


def sync_only(phrase):
    """A doctoring of the broadcast alone: its proof fails, the probe's holds."""
    return {r0.NAME: (REFUSED, phrase), td.NAME: (REFUSED, phrase), gm.NAME: (SUPERSEDED, "shown from its source")}


def both(phrase):
    """A doctoring the broadcast's and the probe's proofs share."""
    return {r0.NAME: (REFUSED, phrase), td.NAME: (REFUSED, phrase), gm.NAME: (APPLIED, phrase)}


def probe_only(phrase):
    """A doctoring of the probe alone: the pack applies the group minimum; the hand-over names
    DSV41_GROUP_MIN_MEM for the memory sites; the report is unaffected."""
    return {gm.NAME: (APPLIED, phrase), r0.NAME: (SUPERSEDED, phrase), td.NAME: (APPLIED, "compares")}


DOCTORINGS = {
    "sync_does_not_broadcast": Doctoring({SYNC: [(BROADCAST_LINE, "            pass\n")]},
                                         sync_only("broadcasts sites none where enabled() selects")),
    "sync_broadcasts_a_clone": Doctoring({SYNC: [(BROADCAST_LINE, "            self._tp_group.broadcast(values.clone(), src=0)\n")]},
                                         sync_only("did not broadcast the tensor it was given once from rank 0")),
    "sync_broadcasts_from_this_rank": Doctoring(
        {SYNC: [(BROADCAST_LINE, "            self._tp_group.broadcast(values, src=self._tp_group.rank_in_group)\n")]},
        sync_only("did not broadcast the tensor it was given once from rank 0")),
    "sync_returns_a_copy": Doctoring({SYNC: [("        return values\n", "        return values.clone()\n")]},
                                     sync_only("returned another tensor than the one it was given")),
    "sync_when_not_selected": Doctoring({SYNC: [("        if site in self._sites:\n            self._tp_group",
                                                 "        if site not in self._sites:\n            self._tp_group")]},
                                        sync_only("broadcasts sites none where enabled() selects")),
    "no_site_on_tp_above_1": Doctoring({SYNC: [(KEPT_LINE, KEPT_LINE.replace("> 1", "< 1"))]},
                                       both("it does not select by the variable")),
    "switch_renamed": Doctoring({SYNC: [("envs.SGLANG_SPEC_TP_SYNC.get()", "envs.SGLANG_SPEC_TP_SYNC_SITES.get()")]},
                                both("it raises AttributeError")),
    "sites_emptied_after_parsing": Doctoring({SYNC: [(KEPT_LINE, "        sites = frozenset()\n" + KEPT_LINE)]},
                                             both("it does not select by the variable")),
    "enabled_always_false": Doctoring({SYNC: [("        return site in self._sites\n", "        return False\n")]},
                                      both("it does not select by the variable")),
    "decorator_on_sync": Doctoring({SYNC: [("class SpecTpSync:\n", "def _traced(f):\n    return f\n\n\nclass SpecTpSync:\n"),
                                           ("    def sync(self,", "    @_traced\n    def sync(self,")]},
                                   # the run shows the job done: accepted, the wrapper named
                                   {r0.NAME: (SUPERSEDED, "SpecTpSync.sync: @_traced"),
                                    gm.NAME: (SUPERSEDED, "shown from its source"), td.NAME: (APPLIED, "compares")}),
    "subclass_overrides_sync": Doctoring(
        {DSPARK_WORKER: [("self._tp_sync = SpecTpSync(get_dp_tp_group())", "self._tp_sync = _LocalSync(get_dp_tp_group())"),
                         ("    def get_confidence_budget_prepare(self):",
                          "    def get_confidence_budget_prepare(self):\n        class _LocalSync(SpecTpSync):\n"
                          "            def sync(self, site, values):\n                return values\n\n")]},
        # a class made inside a method: what the workers build cannot be followed, for any adapter
        {r0.NAME: (REFUSED, "_LocalSync: cannot be followed to the class that runs"),
         td.NAME: (REFUSED, "_LocalSync: cannot be followed to the class that runs"),
         gm.NAME: (REFUSED, "_LocalSync: cannot be followed to the class that runs")}),
    "method_reassigned": Doctoring(
        {DFLASH_WORKER: [("class DFlashWorkerV2(", "def _quiet_sync():\n    SpecTpSync.sync = lambda self, site, values: values\n\n\n"
                                                    "class DFlashWorkerV2(")]},
        both("assigns SpecTpSync.sync")),
    "sites_reassigned": Doctoring(
        {DFLASH_WORKER: [("class DFlashWorkerV2(", "def _no_sites(worker):\n    worker._tp_sync._sites = frozenset()\n\n\n"
                                                    "class DFlashWorkerV2(")]},
        both("assigns worker._tp_sync._sites")),
    "caller_broadcasts_a_clone": Doctoring(
        {DSPARK_WORKER: [("self._tp_sync.sync(SpecTpSyncSite.DSPARK_TARGET, next_token_ids)",
                          "self._tp_sync.sync(SpecTpSyncSite.DSPARK_TARGET, next_token_ids.clone())")]},
        both("broadcasts next_token_ids.clone(), a temporary whose broadcast value nothing reads")),
    "caller_aliases_sync": Doctoring(
        {PLANNER: [("        self._tp_sync.sync(SpecTpSyncSite.DSPARK_PLAN, verify_lens)\n",
                    "        sync = self._tp_sync.sync\n        sync(SpecTpSyncSite.DSPARK_PLAN, verify_lens)\n")]},
        both("refers to self._tp_sync.sync without calling it")),
    "worker_builds_over_another_group": Doctoring(
        {DSPARK_WORKER: [("self._tp_sync = SpecTpSync(get_dp_tp_group())", "self._tp_sync = SpecTpSync(parallel.tp_group)")]},
        both("builds SpecTpSync(parallel.tp_group): not shown to be the group that runs one batch")),
    "group_broadcast_returns_a_copy": Doctoring(
        {PARALLEL_STATE: [("            )\n        return input_\n\n    def broadcast_object",
                           "            )\n        return input_.clone()\n\n    def broadcast_object")]},
        sync_only("GroupCoordinator.broadcast: no longer broadcasts its input (input_) in place and returns it")),
    "engine_overrides_the_switch": Doctoring(
        {MINIMAX: [('algorithm == "DSPARK" and not envs.SGLANG_SPEC_TP_SYNC.is_set()', 'algorithm == "DSPARK"')]},
        both("minimax_m3")),
    "engine_sets_off_where_unset": Doctoring(
        {MINIMAX: [('envs.SGLANG_SPEC_TP_SYNC.set("rng")', 'envs.SGLANG_SPEC_TP_SYNC.set("off")')]},
        {gm.NAME: (REFUSED, "SGLANG_SPEC_TP_SYNC='off' (set by the engine at minimax_m3.py:91) leaves out sites"),
         r0.NAME: (SUPERSEDED, "shown from its source"), td.NAME: (APPLIED, "the engine sets 'off' itself where it is unset")}),
    "probe_does_not_reduce": Doctoring({SYNC: [(PROBE_LINE, "        distributed = False\n")]},
                                       probe_only("does not reduce site(s) 1,12 over a capture group of two ranks")),
    "probe_never_distributed": Doctoring({SYNC: [("            distributed=distributed,\n", "            distributed=False,\n")]},
                                         probe_only("does not reduce site(s) 1,12 over a capture group of two ranks")),
    "probe_over_its_own_group": Doctoring(
        {SYNC: [("cpu_group=group.cpu_group if distributed else None",
                 "cpu_group=self._tp_group.cpu_group if distributed else None")]},
        probe_only("not once over the group it was given")),
    # The same behaviour in other words: recognised, not refused.
    "probe_on_its_own_group_size": Doctoring(
        {SYNC: [(PROBE_LINE, "        distributed = self.enabled(site) and self._tp_group.world_size > 1\n")]},
        {gm.NAME: (SUPERSEDED, "over the capture group it is given where its own group has more than one rank"),
         r0.NAME: (SUPERSEDED, "shown from its source"), td.NAME: (APPLIED, "compares")}),
    "sync_delegates_to_a_helper": Doctoring(
        {SYNC: [(BROADCAST_LINE, "            self._send(values)\n"),
                ("    def available_memory_gb(", "    def _send(self, values):\n        self._tp_group.broadcast(values, src=0)\n\n"
                                               "    def available_memory_gb(")]},
        {r0.NAME: (SUPERSEDED, "its sync(site, t) broadcasts t itself once from rank 0"),
         td.NAME: (APPLIED, "its sync(site, t) broadcasts t itself once from rank 0"),
         gm.NAME: (SUPERSEDED, "shown from its source and by running it")}),
    # A switch read once and kept: the ranks would run with whatever was read first.
    "switch_read_once": Doctoring(
        {SYNC: [("        sites = parse_spec_tp_sync(envs.SGLANG_SPEC_TP_SYNC.get())\n",
                 "        sites = _first_read()\n"),
                ("class SpecTpSync:\n", "@functools.lru_cache(maxsize=None)\ndef _first_read():\n"
                                        "    return parse_spec_tp_sync(envs.SGLANG_SPEC_TP_SYNC.get())\n\n\nclass SpecTpSync:\n"),
                ("import logging\n", "import functools\nimport logging\n")]},
        both("it does not select by the variable")),
    "helper_reduces_max": Doctoring(
        {COMMON: [("op=torch.distributed.ReduceOp.MIN, group=cpu_group", "op=torch.distributed.ReduceOp.MAX, group=cpu_group")]},
        {gm.NAME: (REFUSED, "get_available_gpu_memory: no longer all_reduces MIN over cpu_group"),
         r0.NAME: (SUPERSEDED, "no longer all_reduces MIN over cpu_group"), td.NAME: (APPLIED, "compares")}),
}


def judged(name, folder):
    """One doctoring's outcomes on both sides, {adapter: (installed, source)}: one tree's work, so that
    each test's timeout bounds its own."""
    doctoring = DOCTORINGS[name]
    installed, source = doctoring.installed(folder), doctoring.source(folder)
    return {adapter: (outcome(adapter, installed), outcome(adapter, source)) for adapter in doctoring.expect}


READ_ONLY = (MINIMAX,)


def test_more_doctorings_than_the_issue_names():
    assert len(DOCTORINGS) >= 22


@pytest.mark.parametrize("name", sorted(DOCTORINGS))
def test_doctored(name, tmp_path):
    for adapter, (installed, source) in judged(name, tmp_path).items():
        state, phrase = DOCTORINGS[name].expect[adapter]
        assert (installed.state, source.state) == (state, state), (adapter, installed.reason, source.reason)
        assert phrase in installed.reason and phrase in source.reason, (adapter, phrase, installed.reason, source.reason)


def test_doctored_probe_applies_the_pack(tmp_path):
    """Where the engine's probe is not shown, the pack's own group minimum takes its place:
    SpecTpSync.available_memory_gb is wrapped, nothing else."""
    installed = outcome(gm.NAME, DOCTORINGS["probe_does_not_reduce"].installed(tmp_path))
    assert installed.state == APPLIED
    assert "SpecTpSync.available_memory_gb made the minimum over the group its caller passes" in installed.reason


# ---------------------------------------------------------------- the run-time probe


def test_the_probe_leaves_the_process_as_it_was(monkeypatch):
    """Judging the installed class runs it against its own code: os.environ and the class's
    attributes are the same afterwards, and nothing is printed."""
    sync = importlib.import_module(SYNC)
    monkeypatch.setenv(engine_class.ENGINE_FLAG, "all,-dspark-plan")
    before, attrs = dict(os.environ), dict(vars(sync.SpecTpSync))
    observation.reset()
    reason = runtime.decide({td.FLAG: "1", engine_class.ENGINE_FLAG: "all,-dspark-plan"}, names=(td.NAME,),
                            topology=TP4).outcomes[0].reason
    assert "off: 7:dspark-plan" in reason
    assert dict(os.environ) == before and dict(vars(sync.SpecTpSync)) == attrs


def test_the_probe_sees_what_the_source_cannot(monkeypatch):
    """A method replaced at run time (the source unchanged) is refused on the installed engine."""
    sync = importlib.import_module(SYNC)
    monkeypatch.setattr(sync.SpecTpSync, "sync", lambda self, site, values: values)
    refused = outcome(r0.NAME)
    assert refused.state == runtime.REFUSED and "SpecTpSync.sync: is <function" in refused.reason
    assert "not the function its source defines" in refused.reason


def test_the_pack_own_wrappers_are_looked_through():
    """tp_divergence wraps SpecTpSync.sync and group_min_memory available_memory_gb: deciding
    again with them in place proves the engine's functions underneath."""
    from sglang_dsv41_adapters.framework import patching

    environ = {td.FLAG: "1", gm.FLAG: "1"}
    runtime.apply(runtime.decide(environ, names=(td.NAME, gm.NAME)))  # deployment unknown: both applied
    # __init__: the watchdog's dump; _forward_raw and execute: site 30, the decode graph key
    assert sorted(s.name for s in patching.applied()) == ["__init__", "_forward_raw", "available_memory_gb", "execute",
                                                          "sync"]
    again = runtime.decide(environ, names=(td.NAME, gm.NAME), topology=TP4)
    assert [o.state for o in again.outcomes] == [runtime.APPLIED, runtime.SUPERSEDED], [o.reason for o in again.outcomes]


def test_a_probe_remembered_holds_the_class_and_methods_it_ran():
    """The class is run once per class, functions and value: remembered by the objects
    themselves (held), not their ids, which another class could take once this one died."""
    sync = importlib.import_module(SYNC)
    observation.reset()
    runtime.decide({td.FLAG: "1"}, names=(td.NAME,), topology=TP4)
    assert observation._OBSERVED
    for (module, cls, functions), _ in observation._OBSERVED:
        held = {name: value for owner, name, value in functions if owner is cls}  # each class of the MRO, its functions
        assert module is sync and cls is sync.SpecTpSync and held["__init__"] is vars(sync.SpecTpSync)["__init__"]


def test_a_trees_class_is_run_once_for_every_process_that_judges_the_same_sources(monkeypatch, tmp_path):
    """A release read from its sources: its class runs in a child interpreter once, and what it
    did is kept in the proof cache under the content of the files that decide it. Another
    process (this one, having forgotten all it held) starts no interpreter for it; with the
    cache empty, or where the class cannot run (never kept), it starts one again."""
    from sglang_dsv41_adapters.engine import proofs
    from sglang_dsv41_adapters.spectpsync import behaviour

    started = []

    def counted(args, **kwargs):
        started.append(kwargs["cwd"])
        return popen(args, **kwargs)

    def another_process(cache):
        monkeypatch.setenv(proofs.ENV, str(cache))
        proofs.forget()
        behaviour.close_children()

    popen = behaviour.popen
    monkeypatch.setattr(behaviour, "popen", counted)
    tree, values, target = str(release_sources("0.5.22")), [None, "all", "off"], (SYNC, "SpecTpSync")
    another_process(tmp_path / "cache")
    first = observation._tree_observed(tree, values, target)
    assert len(started) == 1 and set(first) == set(values)
    another_process(tmp_path / "cache")
    assert observation._tree_observed(tree, values, target) == first and len(started) == 1
    another_process(tmp_path / "empty")
    assert observation._tree_observed(tree, values, target) == first and len(started) == 2

    partial = tmp_path / "partial" / "sglang" / "srt" / "speculative"  # the class's module alone: it cannot import
    partial.mkdir(parents=True)
    shutil.copyfile(pathlib.Path(tree, *SYNC.split(".")).with_suffix(".py"), partial / "spec_tp_sync.py")
    for _ in range(2):
        another_process(tmp_path / "cache")
        with pytest.raises(behaviour.Unobservable):
            observation._tree_observed(str(tmp_path / "partial"), values, target)
    assert len(started) == 4


def test_a_tree_named_by_a_relative_path_is_run_as_by_its_full_path(monkeypatch):
    """`doctor --engine .engines/src/0.5.22`: the child runs in the tree's folder, where a relative
    name points elsewhere; the class runs all the same (its verdicts are not left to the ranks)."""
    from sglang_dsv41_adapters.spectpsync import behaviour

    tree = release_sources("0.5.22")
    monkeypatch.chdir(tree.parent)
    found = []
    for name in (tree.name, str(tree)):
        behaviour.close_children()
        found.append(behaviour.observe_tree(name, ["all"]))
    assert found[0] == found[1] and found[0]["sites"]
