"""known_bad_config: a configuration known to corrupt output silently is refused at start.

The hazard (sgl-project/sglang#34959): DSpark's verify window (block size + 1) above 4 on a
tree whose DeepSeek-V4 compress write plan caps its pad at 4. Judged on every release
0.5.16 - 0.5.23 from its sources, and on doctored trees, labelled as their release so that
only the code can decide: 0.5.17 with the derived pad added (harness.write_pad.added), 0.5.18
and 0.5.23 with it taken out (removed), 0.5.17 with its wheel's plan kernel beside its Python
sources. A copy of the installed 0.5.23 without the pad is imported as a rank imports it:
doctor, doctor --engine, the wrapper and a rank's real ServerArgs (the block size read from
the draft checkpoint by the engine) agree wherever the window is known, and the rank refuses
through the engine's plugin loader where only it knows the window.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

import pytest

from harness import next_release, write_pad, zygote
from harness.engines import ROOT, engine_env, python, release_sources, release_wheel
from harness.ranks import run_ranks
from sglang_dsv41_adapters import known_bad_config
from sglang_dsv41_adapters.cli import EXIT_OK, EXIT_REFUSED
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from sglang_dsv41_adapters.framework import runtime, topology

pytestmark = pytest.mark.timeout(900)

SITE_PACKAGES = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent
RELEASES = ["0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
WITHOUT_PAD = {"0.5.16", "0.5.17"}
ON = {known_bad_config.FLAG: "1"}
DSPARK = ["--speculative-algorithm", "DSPARK"]
COMMANDS = {  # name: (extra server arguments, the verify window they set)
    "block 1": ([*DSPARK, "--speculative-dspark-block-size", "1"], 2),
    "block 2": ([*DSPARK, "--speculative-dspark-block-size", "2"], 3),
    "block 3": ([*DSPARK, "--speculative-dspark-block-size", "3"], 4),  # at the bound
    "block 4": ([*DSPARK, "--speculative-dspark-block-size", "4"], 5),
    "block 6": ([*DSPARK, "--speculative-dspark-block-size", "6"], 7),
    "num draft tokens 4": ([*DSPARK, "--speculative-num-draft-tokens", "4"], 4),
    "num draft tokens 5": ([*DSPARK, "--speculative-num-draft-tokens", "5"], 5),
    "block from the checkpoint": (DSPARK, None),
    "no speculative decoding": ([], 0),
    "EAGLE, 6 draft tokens": (["--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "6"], 0),
}
BOUND = 4


def command(extra: list[str]) -> list[str]:
    return ["python3", "-m", "sglang.launch_server", "--model-path", "/models/DeepSeek-V4-Flash", "--tp-size", "4", *extra]


@pytest.fixture(scope="module")
def deployments():
    """Each command as the wrapper and doctor read it: the installed engine's own parser."""
    found = {}
    for name, (extra, _) in COMMANDS.items():
        deployment, judged = topology.from_command(command(extra))
        assert deployment is not None, judged
        found[name] = deployment
    return found


def decide(engine, deployment):
    decision = runtime.decide(ON, engine, names=(known_bad_config.NAME,), topology=deployment)
    return decision.outcomes[0]


def expected(name: str) -> str:
    """The outcome on a tree without the derived pad."""
    window = COMMANDS[name][1]
    if window is None:
        return runtime.AT_LAUNCH
    return runtime.REFUSED if window > BOUND else runtime.APPLIED


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The doctored trees, each labelled as the release it was made from."""
    base = tmp_path_factory.mktemp("write_pad")
    with_kernel = write_pad.copy_tree(release_sources("0.5.17"), base / "0.5.17-kernel")
    write_pad.release_kernel(release_wheel("0.5.17"), with_kernel)
    yield {
        "0.5.17 + pad": write_pad.added(release_sources("0.5.17"), base / "added"),
        "0.5.17 + kernel": with_kernel,
        "0.5.17 + kernel + pad": write_pad.added(with_kernel, base / "added-kernel"),
        "0.5.17 + kernel + Python pad only": write_pad.added(with_kernel, base / "added-python", kernel=False),
        "0.5.18 - pad": write_pad.removed(release_sources("0.5.18"), base / "removed-18"),
        "0.5.23 - pad": write_pad.removed(release_sources("0.5.23"), base / "removed-23"),
        "0.5.23 pad renamed": write_pad.renamed(release_sources("0.5.23"), base / "renamed-23"),
        "0.5.23 pad moved": write_pad.moved(release_sources("0.5.23"), base / "moved-23"),
        "0.5.17 + pad, no kernel source": write_pad.added(
            write_pad.without_kernel(release_sources("0.5.17"), base / "no-kernel"), base / "no-kernel-pad"),
    }
    shutil.rmtree(base, ignore_errors=True)


# --- every release, from its sources ---------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_every_release_refuses_exactly_where_the_pad_is_missing_and_the_window_exceeds_the_bound(release, deployments):
    engine = SourceEngine(release_sources(release))
    for name, deployment in deployments.items():
        outcome = decide(engine, deployment)
        want = expected(name) if release in WITHOUT_PAD else runtime.SUPERSEDED
        assert outcome.state == want, (release, name, outcome.reason)
    check = runtime.engine_check(known_bad_config.SURFACE, engine)
    assert check[0] == (runtime.AT_LAUNCH if release in WITHOUT_PAD else runtime.SUPERSEDED), check


def test_the_refusal_says_why_where_and_what_is_safe(deployments):
    outcome = decide(SourceEngine(release_sources("0.5.17")), deployments["block 4"])
    reason = outcome.reason
    assert reason.startswith("known_bad_config refused on sglang 0.5.17: "
                             "sglang.srt.mem_cache.deepseek_v4_memory_pool:get_compress_state_write_pad: "
                             "DSpark verify window 5 exceeds 4 (--speculative-dspark-block-size 4 + 1): "), reason
    for said in ("sgl-project/sglang#34959", "sgl-project/sglang#33872", "sgl-project/sglang#34189",
                 "safe: --speculative-dspark-block-size 3 (verify window 4) or lower",
                 "switch DSV41_KNOWN_BAD_CONFIG off there"):
        assert said in reason, said
    # The process line keeps the verdict under 200 characters; doctor and the fatal line keep it whole.
    assert len(outcome.line()) < 200


def test_the_window_not_on_the_command_line_is_decided_at_launch(deployments):
    outcome = decide(SourceEngine(release_sources("0.5.16")), deployments["block from the checkpoint"])
    assert outcome.state == runtime.AT_LAUNCH
    assert "--speculative-dspark-block-size: not on the command line: the engine reads the block size from the " \
           "draft checkpoint" in outcome.reason and "refuses one above 4" in outcome.reason
    unknown = decide(SourceEngine(release_sources("0.5.16")), None)  # not the engine's server, or doctor alone
    assert unknown.state == runtime.AT_LAUNCH and "server arguments are not known here" in unknown.reason


# --- doctored trees: the code decides, not the label -------------------------------------------------

@pytest.mark.parametrize("tree,want", [
    ("0.5.17 + pad", "superseded"), ("0.5.17 + kernel + pad", "superseded"), ("0.5.17 + kernel", "judged"),
    ("0.5.18 - pad", "judged"), ("0.5.23 - pad", "judged"), ("0.5.17 + kernel + Python pad only", "judged"),
    ("0.5.23 pad renamed", "superseded"), ("0.5.23 pad moved", "superseded"),
    ("0.5.17 + pad, no kernel source", "decided at launch"),
])
def test_doctored_trees(trees, deployments, tree, want):
    engine = SourceEngine(trees[tree])
    assert engine.version == tree.split()[0]  # the release's own label: only the code changed
    for name, deployment in deployments.items():
        outcome = decide(engine, deployment)
        if want == "judged":
            assert outcome.state == expected(name), (tree, name, outcome.reason)
        elif want == "decided at launch":  # within upstream's old cap whatever the kernel; beyond it, unshown
            window_judged = expected(name)
            assert outcome.state == (runtime.AT_LAUNCH if window_judged == runtime.REFUSED else window_judged), \
                (tree, name, outcome.reason)
        else:
            assert outcome.state == want, (tree, name, outcome.reason)
    reason = decide(engine, deployments["block 6"]).reason
    if "kernel" in tree and "no kernel" not in tree:  # read from the kernel's own source where the tree ships it
        assert "c_plan.cuh: mtp_pad = " in reason
    if tree in ("0.5.17 + kernel", "0.5.17 + kernel + Python pad only"):  # the kernel's cap is the bound
        assert "mtp_pad = std::min(ring_size - compress_ratio, kMaxMTPDraftTokens) (capped at 4)" in reason
    if tree == "0.5.17 + kernel + Python pad only":
        assert "get_compress_state_write_pad(compress_ratio, ring_size) derives the pad from the ring" in reason
    if want == "superseded":  # found from the configurator's call, wherever it lives and whatever its name
        pad = {"0.5.23 pad renamed": "deepseek_v4_memory_pool.compress_ring_write_bound",
               "0.5.23 pad moved": "compress_ring.compress_ring_write_bound"}.get(tree, "get_compress_state_write_pad")
        assert f"{pad}(compress_ratio, ring_size) derives the pad from the ring" in reason, reason
    if want == "decided at launch":  # the Python mirror alone never shows it
        assert "the kernel's source is not in this tree" in reason and "each rank judges" in reason, reason
        assert "a verify window above 4 (its cap before sgl-project/sglang#34189) is safe only where it derives" \
               in reason, reason
        within = decide(engine, deployments["block 3"])
        assert within.state == runtime.APPLIED and "no release's write plan kept fewer than 4" in within.reason, \
            within.reason


def test_the_installed_kernel_is_read(deployments):
    outcome = decide(SourceEngine(SITE_PACKAGES), deployments["block 6"])
    assert outcome.state == runtime.SUPERSEDED
    assert "c_plan.cuh: mtp_pad = ring_size > window_size ? ring_size - window_size + 2 : 0 (derived from the ring)" \
           in outcome.reason


# --- imported as a rank imports it ---------------------------------------------------------------------

RANK_CASES = {name: COMMANDS[name][0][2:] for name in ("block 2", "block 3", "block 4", "block from the checkpoint")}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The deciders on a copy of the installed 0.5.23 without the pad (imported first on the
    path) and on the installed 0.5.23 itself."""
    base = tmp_path_factory.mktemp("imported")
    tree = next_release.proven_here(write_pad.removed(SITE_PACKAGES, base / "0.5.23-pad"))
    out = {}
    for name, root, env in (("without pad", tree, {"PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}),
                            ("0.5.23", SITE_PACKAGES, {})):
        model, draft = base / f"{name}-model", base / f"{name}-draft"
        model.mkdir(), draft.mkdir()
        out[name] = run_ranks(1, "tests.known_bad_config_cases:deciders", env={**env, **ON}, warm=False, timeout=600,
                              kwargs={"model_dir": str(model), "draft_dir": str(draft), "source_tree": str(root),
                                      "cases": RANK_CASES, "through_plugin": True})[0]
    yield out
    shutil.rmtree(base, ignore_errors=True)


def test_every_decider_agrees_where_the_window_is_known(imported):
    rows = imported["without pad"]
    for name in ("block 2", "block 3", "block 4"):
        row = rows[name]
        assert row["doctor"][0] == row["sources"][0] == row["wrapper"][0] == row["rank"][0] == expected(name), row
        assert row["doctor_failed"] == row["launch_refused"] == row["rank_refused"] == (expected(name) == "refused")
        # what the command says, the rank reads alike; the rank knows the window the engine resolved
        assert row["command"]["speculative_dspark_block_size"] == row["resolved"]["speculative_dspark_block_size"]
        assert row["resolved"]["speculative_num_draft_tokens"] == COMMANDS[name][1]


def test_the_rank_judges_the_window_the_engine_read_from_the_draft_checkpoint(imported):
    row = imported["without pad"]["block from the checkpoint"]
    assert row["doctor"][0] == row["sources"][0] == row["wrapper"][0] == runtime.AT_LAUNCH
    assert not row["doctor_failed"] and not row["launch_refused"]
    assert row["command"]["speculative_num_draft_tokens"] is None
    assert row["resolved"]["speculative_num_draft_tokens"] == 6  # dspark_block_size 5 in the draft's config, + 1
    assert row["rank"][0] == runtime.REFUSED and row["rank_refused"]
    assert "DSpark verify window 6 exceeds 4 (speculative_num_draft_tokens 6)" in row["rank"][1]
    # through the engine's plugin loader, as a spawned rank: the Scheduler is never built
    refused = imported["without pad"]["plugin"]["refused"]
    assert refused.startswith("the engine must not start: known_bad_config refused on sglang 0.5.23: ")
    assert "sgl-project/sglang#34959" in refused and "--speculative-dspark-block-size 3" in refused


def test_the_release_with_the_pad_lets_every_window_start(imported):
    for name, row in imported["0.5.23"].items():
        if name == "plugin":
            assert "constructor" in row, row  # the pack let the Scheduler's own constructor run
            continue
        assert {row[side][0] for side in ("doctor", "sources", "wrapper", "rank")} == {runtime.SUPERSEDED}, name


# --- doctor shows it for the command it is given ---------------------------------------------------------

def doctor(*args: str):
    return zygote.run([python(), "entrypoint.py", "doctor", *args], cwd=ROOT, env=engine_env("0.5.23", **ON),
                      capture_output=True, text=True, timeout=300)


def test_doctor_shows_the_hazard_for_the_command(trees):
    tree = str(trees["0.5.23 - pad"])
    done = doctor("--strict", "--verbose", "--engine", tree, "--", *command(COMMANDS["block 4"][0]))
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("known_bad_config "))
    assert row[:4] == ["known_bad_config", "DSV41_KNOWN_BAD_CONFIG", "'1'", "refused"], row
    text = " ".join(done.stdout.split())  # --verbose wraps its paragraphs
    assert "outcome: known_bad_config refused on sglang 0.5.23: " in text
    assert "safe: --speculative-dspark-block-size 3 (verify window 4) or lower" in text
    assert "\ndeployment: TP 4, no DP attention, DSPARK (the command's server arguments" in done.stdout
    # the short report: its one line per adapter gives the deciding reason
    done = doctor("--engine", tree, "--", *command(COMMANDS["block 4"][0]))
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("known_bad_config: refused - ")]
    # the safe setting whole first, then the reason, cut where it must be (oneline.fit)
    assert line.startswith("known_bad_config: refused - safe: --speculative-dspark-block-size 3 (verify window 4) or "
                           "lower"), line
    done = doctor("--strict", "--json", "--engine", tree, "--", *command(COMMANDS["block from the checkpoint"][0]))
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (mine,) = [a for a in report["adapters"] if a["adapter"] == "known_bad_config"]
    assert (mine["outcome"], mine["engine_check"]["outcome"]) == ("decided at launch", "decided at launch")
    assert report["deployment"]["server_args"] == {"speculative_algorithm": "DSPARK",
                                                   "speculative_dspark_block_size": None,
                                                   "speculative_num_draft_tokens": None}


# --- the flag ----------------------------------------------------------------------------------------------

def test_off_unless_set_and_strict_values():
    engine = SourceEngine(release_sources("0.5.17"))
    unset = runtime.decide({}, engine, names=(known_bad_config.NAME,)).outcomes[0]
    assert (unset.state, unset.reason) == (runtime.OFF, "DSV41_KNOWN_BAD_CONFIG is off")
    off = runtime.decide({known_bad_config.FLAG: "0"}, engine, names=(known_bad_config.NAME,))
    assert off.outcomes[0].state == runtime.OFF and not off.refused
    bad = runtime.decide({known_bad_config.FLAG: "yes please"}, engine, names=(known_bad_config.NAME,))
    assert bad.refused and bad.flag_errors and "DSV41_KNOWN_BAD_CONFIG='yes please' is not understood" in bad.reasons[0]


def test_a_rank_never_starts_unjudged():
    """What doctor leaves to the launch, a rank must decide: where what reached its Scheduler
    still does not say the window, the rank refuses instead of starting unjudged."""
    engine = SourceEngine(release_sources("0.5.17"))
    decision = runtime.decide(ON, engine, names=(known_bad_config.NAME,), topology=None)
    assert decision.outcomes[0].state == runtime.AT_LAUNCH and not decision.refused
    in_rank = runtime.judged_here(decision)
    (outcome,) = in_rank.outcomes
    assert outcome.state == runtime.REFUSED and in_rank.refused
    assert outcome.reason.startswith(decision.outcomes[0].reason) and "a rank does not start unjudged" in outcome.reason
    assert "a rank does not start unjudged" in str(in_rank.error())
