"""Delivery is shown with the engine's own code: its plugin discovery decides, under the
environment the ranks will have, whether they run the pack; and run_scheduler_process
must still call the loader before it builds the Scheduler."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import shutil

import pytest

from adapter import delivery, folded_fence, runtime
from adapter.contract import InstalledEngine
from adapter.source_engine import SourceEngine
from tests.doctored import DoctoredEngine, doctored_module
from tests.engines import ENGINE_PATHS, ROOT, release_sources

OURS = "dsv41_adapters"
FENCE_ON = {folded_fence.FLAG: "1"}
SITE_PACKAGES = pathlib.Path(__import__("importlib").util.find_spec("sglang").origin).parent.parent


@pytest.fixture
def other_plugin(tmp_path, monkeypatch):
    """A second installed distribution with a general plugin whose module does not exist:
    were discovery to load it rather than list it, the import would fail."""
    dist = tmp_path / "other_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nother_plugin = no_such_module_anywhere:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "other_plugin"


@pytest.mark.parametrize("value,runs", [
    (None, [OURS]),            # unset: the engine runs every plugin
    ("", [OURS]),              # empty: the same
    (",", []),                 # a list of no names: the engine runs no plugin at all
    ("  ", []),                # blank: the same
    (OURS, [OURS]),
    (f" {OURS} ,x", [OURS]),
])
def test_the_engine_discovery_decides_for_each_sglang_plugins_value(value, runs):
    environ = {**FENCE_ON, **({} if value is None else {"SGLANG_PLUGINS": value})}
    problems = runtime.delivery_problems(environ)  # imports the engine, which sets variables of its own
    before = dict(os.environ)
    assert delivery.chosen_plugins(environ) == runs
    assert dict(os.environ) == before  # the environment was presented to the engine, then put back
    decision = runtime.decide(environ)
    if OURS in runs:
        assert problems == [] and not decision.refused
    else:
        assert problems == [f"SGLANG_PLUGINS={value!r} does not list the pack's plugin '{OURS}', so ranks would skip it "
                            f"(the engine's sglang.srt.plugins.load_plugins would run no plugin at all); list '{OURS}' "
                            "in SGLANG_PLUGINS or unset it"]
        assert decision.refused and problems[0] in decision.error().args[0]


def test_listing_another_plugin_only_skips_ours(other_plugin):
    environ = {**FENCE_ON, "SGLANG_PLUGINS": other_plugin}
    assert delivery.chosen_plugins(environ) == [other_plugin]
    assert sorted(delivery.chosen_plugins(FENCE_ON)) == sorted([OURS, other_plugin])
    problems = runtime.delivery_problems(environ)
    assert len(problems) == 1 and f"would run {other_plugin}" in problems[0]
    assert runtime.decide(environ).refused
    assert runtime.decide({**FENCE_ON, "SGLANG_PLUGINS": f"{other_plugin},{OURS}"}).refused is False


def rank_loads(value, results) -> None:
    """A spawned process running the engine's real loader, as a rank does."""
    if value is None:
        os.environ.pop("SGLANG_PLUGINS", None)
    else:
        os.environ["SGLANG_PLUGINS"] = value
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.managers.scheduler  # noqa: F401  (the pack's guard is set when this is imported)

    from adapter import patching

    results.put(sorted(s.adapter for s in patching.applied()))


@pytest.mark.parametrize("value", [",", None])
def test_what_discovery_says_is_what_a_real_rank_does(value):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=rank_loads, args=(value, results))
    child.start()
    child.join(timeout=180)
    assert child.exitcode == 0
    guarded = results.get(timeout=5) == ["pack-guard"]
    said = OURS in delivery.chosen_plugins({} if value is None else {"SGLANG_PLUGINS": value})
    assert guarded == said == (value is None)


def test_every_release_calls_the_loader_before_building_the_scheduler():
    assert delivery.loader_problems(InstalledEngine()) == []
    for tree in (SITE_PACKAGES, ENGINE_PATHS["0.5.18"][0], release_sources("0.5.16")):
        if (tree / "sglang").is_dir():
            assert delivery.loader_problems(SourceEngine(tree)) == [], tree


DROPPED = ("    load_plugins()\n", "    pass\n")
LATE = ("        scheduler = Scheduler(server_args, port_args)\n",
        "        scheduler = Scheduler(server_args, port_args)\n        load_plugins()\n")
CONDITIONAL = ("    load_plugins()\n", "    if os.environ.get('LOAD'):\n        load_plugins()\n")


@pytest.mark.parametrize("drift,problem", [
    ((DROPPED,), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
    ((CONDITIONAL,), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
    ((DROPPED, LATE), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
])
def test_a_scheduler_process_that_no_longer_loads_plugins_first_is_refused(tmp_path, drift, problem):
    scheduler = doctored_module(delivery.SCHEDULER, *drift, directory=tmp_path)
    engine = DoctoredEngine({delivery.SCHEDULER: scheduler})
    decision = runtime.decide(FENCE_ON, engine)
    assert decision.refused
    reason = next(r for r in decision.reasons if "run_scheduler_process" in r)
    assert reason.startswith("delivery refused on sglang 0.5.23: sglang.srt.managers.scheduler:run_scheduler_process: ")
    assert problem in reason and f"{scheduler.__file__}:" in reason
    # With every adapter off nothing is lost: the launch goes on.
    assert not runtime.decide({}, engine).refused


def test_the_same_drift_read_from_source_is_refused_alike(tmp_path):
    """doctor --engine: the contract is read from the sources the same way."""
    tree = tmp_path / "engine"
    for name in (delivery.SCHEDULER, delivery.PLUGINS):
        real = SITE_PACKAGES.joinpath(*name.split("."))
        real = real.with_suffix(".py") if real.with_suffix(".py").is_file() else real / "__init__.py"
        target = tree / real.relative_to(SITE_PACKAGES)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real, target)
    (tree / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    assert delivery.loader_problems(SourceEngine(tree)) == []
    path = tree / "sglang" / "srt" / "managers" / "scheduler.py"
    path.write_text(path.read_text().replace(*DROPPED))
    problems = delivery.loader_problems(SourceEngine(tree))
    assert len(problems) == 1
    assert "run_scheduler_process: no longer calls load_plugins() as a statement of its own" in problems[0]
    assert f"{path}:" in problems[0]


@pytest.mark.parametrize("value", [",", "  ", OURS, None])
def test_doctor_engine_judges_discovery_as_the_installed_engine_does(value):
    """The release's loader is byte for byte the installed one: its discovery is run with
    that code, so doctor --engine and the launcher agree."""
    environ = {**FENCE_ON, **({} if value is None else {"SGLANG_PLUGINS": value})}
    sources = SourceEngine(SITE_PACKAGES)
    assert delivery.discovery_module(sources) is delivery.discovery_module(InstalledEngine())
    assert runtime.delivery_problems(environ, sources) == runtime.delivery_problems(environ)
    assert runtime.decide(environ, sources).refused == runtime.decide(environ).refused == (value in (",", "  "))


def test_a_release_whose_loader_differs_is_not_judged_by_the_installed_code(tmp_path):
    tree = tmp_path / "engine"
    for name in (delivery.SCHEDULER + ".py", delivery.PLUGINS + ".__init__.py"):
        relative = pathlib.Path(*name.split(".")[:-1]).with_suffix(".py")
        target = tree / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE_PACKAGES / relative, target)
    (tree / "sglang" / "version.py").write_text('__version__ = "0.5.23"\n')
    plugins = tree / "sglang" / "srt" / "plugins" / "__init__.py"
    assert delivery.discovery_module(SourceEngine(tree)) is not None
    plugins.write_text(plugins.read_text() + "\n# changed\n")
    assert delivery.discovery_module(SourceEngine(tree)) is None
    assert runtime.delivery_problems({**FENCE_ON, "SGLANG_PLUGINS": ","}, SourceEngine(tree)) == []
