"""Delivery is shown with the engine's own code: its plugin discovery decides, under the
environment the ranks will have, whether they run the pack; and run_scheduler_process
must still call the loader before it builds the Scheduler."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess

import pytest

from sglang_dsv41_adapters.framework import delivery, runtime
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.engine.installed import InstalledEngine
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from harness.doctored import DoctoredEngine, doctored_module
from harness.engines import ENGINE_PATHS, ROOT, engine_env, python, release_sources
from harness import zygote

OURS = "dsv41_adapters"
FENCE_ON = {folded_fence.FLAG: "1"}
SITE_PACKAGES = pathlib.Path(__import__("importlib").util.find_spec("sglang").origin).parent.parent


def chosen_names(environ) -> list[str]:
    """The plugins the engine's loader would run under `environ`, by name."""
    return [chosen.name for chosen in delivery.chosen_plugins(environ)]


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
    assert chosen_names(environ) == runs
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
    assert chosen_names(environ) == [other_plugin]
    assert sorted(chosen_names(FENCE_ON)) == sorted([OURS, other_plugin])
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

    from sglang_dsv41_adapters.framework import plugin

    results.put(plugin.guarded())


@pytest.mark.parametrize("value", [",", None])
def test_what_discovery_says_is_what_a_real_rank_does(value):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=rank_loads, args=(value, results))
    with zygote.warm_spawn(context):  # the engine imported, the pack not: as a rank before its loader runs
        child.start()
    child.join(timeout=180)
    assert child.exitcode == 0
    guarded = results.get(timeout=5)
    said = OURS in chosen_names({} if value is None else {"SGLANG_PLUGINS": value})
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
DECORATED = ("def run_scheduler_process(\n",  # a wrapper of its own (functools.wraps): its __code__ is the wrapper's
             "def _traced(function):\n    import functools\n\n    @functools.wraps(function)\n"
             "    def wrapper(*args, **kwargs):\n        return function(*args, **kwargs)\n    return wrapper\n\n\n"
             "@_traced\ndef run_scheduler_process(\n")


def built_at(path) -> int:
    """The line of `path` that builds the ranks' Scheduler (the first, where LATE adds one)."""
    lines = pathlib.Path(path).read_text().splitlines()
    return 1 + lines.index("        scheduler = Scheduler(server_args, port_args)")


@pytest.mark.parametrize("drift,problem", [
    ((DROPPED,), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
    ((CONDITIONAL,), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
    ((DROPPED, LATE), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
    ((DROPPED, DECORATED), "no longer calls load_plugins() as a statement of its own before Scheduler(...)"),
])
def test_a_scheduler_process_that_no_longer_loads_plugins_first_is_refused(tmp_path, drift, problem):
    scheduler = doctored_module(delivery.SCHEDULER, *drift, directory=tmp_path)
    engine = DoctoredEngine({delivery.SCHEDULER: scheduler})
    decision = runtime.decide(FENCE_ON, engine)
    assert decision.refused
    reason = next(r for r in decision.reasons if "run_scheduler_process" in r)
    assert reason.startswith("delivery refused on sglang 0.5.23: sglang.srt.managers.scheduler:run_scheduler_process: ")
    assert problem in reason and f"({scheduler.__file__}:{built_at(scheduler.__file__)}); " in reason, reason
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
    real = path.read_text()
    for drift in ((DROPPED,), (DROPPED, DECORATED)):
        text = real
        for old, new in drift:
            text = text.replace(old, new)
        path.write_text(text)
        problems = delivery.loader_problems(SourceEngine(tree))
        assert len(problems) == 1
        assert "run_scheduler_process: no longer calls load_plugins() as a statement of its own" in problems[0]
        assert f"({path}:{built_at(path)}); " in problems[0], problems[0]  # the line in that file, not in the reader's


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


# --- another distribution under the pack's entry-point name -------------------------------------

RIVAL = "rival_plugin:register"


@pytest.fixture
def rival(tmp_path):
    """A real second distribution registering the pack's name, as importlib.metadata finds
    one in a folder on sys.path; its module records that the engine ran it."""
    dist = tmp_path / "rival_pack-2.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rival-pack\nVersion: 2.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{OURS} = {RIVAL}\n")
    (tmp_path / "rival_plugin.py").write_text("RAN = False\n\ndef register():\n    global RAN\n    RAN = True\n")
    return tmp_path


# In a child: the rival's folder first or last on sys.path, what the pack says, then what
# the engine's real loader does (ours registers the scheduler guard, the rival sets RAN).
SAYS_THEN_LOADS = """
import json, sys
folder, first = sys.argv[1], sys.argv[2] == "first"
sys.path.insert(0, folder) if first else sys.path.append(folder)
from sglang_dsv41_adapters.framework import delivery, runtime
said = delivery.pack_entry_point({})
problems = runtime.delivery_problems({})
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.managers.scheduler
import rival_plugin
from sglang_dsv41_adapters.framework import plugin
ours = plugin.guarded()
print(json.dumps({"said": said and said.value, "problems": problems, "ours_ran": ours, "rival_ran": rival_plugin.RAN}))
"""


@pytest.mark.parametrize("order", ["first", "last"])
def test_another_distribution_under_the_packs_name_is_refused_in_either_order(rival, order):
    done = zygote.run([python(), "-c", SAYS_THEN_LOADS, str(rival), order], cwd=ROOT, env=engine_env("0.5.23"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # The engine keeps the last entry point of a name it loads: the rival when it comes later on sys.path.
    ours_runs = order == "first"
    assert (found["ours_ran"], found["rival_ran"]) == (ours_runs, not ours_runs)
    assert found["said"] == (delivery.TARGET if ours_runs else RIVAL)  # the pack says what the engine does
    (problem,) = found["problems"]  # and refuses either way: which one runs is the order of sys.path
    assert f"entry point '{OURS}' in group sglang.srt.plugins is registered by 2 distributions" in problem
    assert f"{OURS} = {RIVAL} from rival-pack 2.0 ({rival})" in problem
    assert f"{OURS} = {delivery.TARGET} from sglang-dsv41-adapters " in problem
    if ours_runs:
        assert "ranks run the pack's only because its distribution is found last on sys.path" in problem
    else:
        assert f"ranks would run {RIVAL} from rival-pack 2.0 ({rival}) instead of the pack's {delivery.TARGET}" in problem


def test_a_shadowed_plugin_stops_doctor_strict_and_the_launch(rival):
    env = engine_env("0.5.23", **FENCE_ON)
    env["PYTHONPATH"] = f"{rival}{os.pathsep}{env['PYTHONPATH']}"
    doctor = zygote.run([python(), "entrypoint.py", "doctor", "--strict", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 69, doctor.stderr[-3000:]
    report = json.loads(doctor.stdout)
    (problem,) = report["ranks"]["problems"]
    assert "registered by 2 distributions" in problem and problem in report["problems"]
    # Which of the two the engine keeps depends on where each is found on sys.path (the checkout's
    # own egg-info, when set up editable, comes before the rival): the order test above pins both.
    assert report["ranks"]["entry_point"]["value"] in (delivery.TARGET, RIVAL)
    launch = zygote.run([python(), "entrypoint.py", "python", "-c", "print('ran')"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert launch.returncode == 69 and "ran" not in launch.stdout
    assert "the engine must not start: " in launch.stderr and "rival-pack 2.0" in launch.stderr


def test_a_shadowed_plugin_fails_the_image_build_with_every_flag_off(rival):
    """docker build runs doctor --strict with every flag unset: an installation whose ranks
    cannot be shown to run the pack fails there, not at the first rollout that sets a flag."""
    env = engine_env("0.5.23")
    env["PYTHONPATH"] = f"{rival}{os.pathsep}{env['PYTHONPATH']}"
    doctor = zygote.run([python(), "entrypoint.py", "doctor", "--strict"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 69, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    assert "registered by 2 distributions" in doctor.stdout and "verdict: refused" in doctor.stdout
    alone = zygote.run([python(), "entrypoint.py", "doctor", "--strict"], cwd=ROOT, env=engine_env("0.5.23"),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stdout[-3000:]
