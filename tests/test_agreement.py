"""One decision everywhere: doctor, doctor --engine, the launcher and every rank agree.

The table: every DSV41_SPEC_TP_SYNC value in agreement_cases.SELECTOR (unset, 1, all, init,
rng, off, all,-dspark-mem, 17, dspark-plan,dflash-target) with DSV41_GROUP_MIN_MEM unset,
0 or 1, and with DSV41_TP_DIVERGENCE=1, and DSV41_KNOWN_BAD_CONFIG on alone, beside every
other flag and off (39 combinations), on 0.5.23 and 0.5.18 installed and read from their
sources, and on 0.5.16 from its sources. For every combination:
- doctor --strict fails exactly when the launch refuses (installed releases);
- doctor --engine on the release's sources gives each adapter the outcome the installed
  release gives it;
- every rotation of ADAPTERS and of its reverse gives the same outcomes;
- what the launch applies comes only from adapters that are on, and only rank0_broadcast
  hands anything to the engine (0.5.19+), never when it is off.

And with the deployment (agreement_cases.LAYOUTS: TP only, DP attention with attention-TP 1
and 2, 0.5.23's --attn-dp-size spelling, and DSpark with its block size left to the draft
checkpoint), for every combination on 0.5.23 and 0.5.18:
doctor -- COMMAND, doctor --engine SOURCES -- COMMAND, the wrapper (the command read with
the engine's own parser) and a rank (the ServerArgs its Scheduler receives) give every
adapter the same outcome, and doctor --strict fails exactly when the launch refuses.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests.agreement_cases import combos
from harness.engines import ENGINE_PATHS, ROOT
from harness.first_use import OnFirstUse
from harness.ranks import run_ranks

sys.path.insert(0, str(ROOT / "tools"))
import compat_matrix  # noqa: E402  (fetches a release's sources once into .engines/src)

pytestmark = pytest.mark.timeout(1200)  # the table takes about 3 minutes on two cores

SITE_PACKAGES = str(pathlib.Path(__import__("importlib").util.find_spec("sglang").origin).parent.parent)
OFF = ("off", None)


@pytest.fixture(scope="module")
def table():
    old = str(compat_matrix.source_tree("0.5.16"))
    t23 = run_ranks(1, "tests.agreement_cases:table", release="0.5.23", timeout=600,
                    kwargs={"source_trees": [["0.5.23", SITE_PACKAGES], ["0.5.16", old]]})[0]
    t18 = run_ranks(1, "tests.agreement_cases:table", release="0.5.18", timeout=600,
                    kwargs={"source_trees": [["0.5.18", str(ENGINE_PATHS["0.5.18"][0])]]})[0]
    return {**t23, **t18}


@pytest.fixture(scope="module")
def by_layout(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("model"))
    trees = {"0.5.23": SITE_PACKAGES, "0.5.18": str(ENGINE_PATHS["0.5.18"][0])}
    return OnFirstUse(lambda release: run_ranks(1, "tests.agreement_cases:layouts", release=release, timeout=900,
                                                kwargs={"model_dir": model, "source_tree": trees[release]})[0])


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
def test_every_decider_agrees_on_each_layout(by_layout, release):
    layouts = by_layout[release]
    assert sorted(layouts) == sorted(["tp4", "tp4-dp-attention-tp1", "tp4-dp-attention-tp2", "tp4-dspark"]
                                     + (["tp4-attn-dp4"] if release == "0.5.23" else []))
    for name, layout in layouts.items():
        # The wrapper's reading of the command is the rank's reading of its ServerArgs; of the
        # arguments the adapters read, what the command sets the rank reads alike (the rank
        # also knows what the engine resolved).
        command, rank = dict(layout["command"]), dict(layout["rank"])
        said, resolved = command.pop("server_args"), rank.pop("server_args")
        assert command == rank, name
        assert {k: v for k, v in said.items() if v is not None} == {k: resolved[k] for k, v in said.items()
                                                                     if v is not None}, name
        assert len(layout["rows"]) == len(combos())
        for env, row in zip(combos(), layout["rows"]):
            assert row["doctor"] == row["sources"] == row["wrapper"] == row["rank"], (name, env, row["reasons"])
            assert row["launch_refused"] == row["rank_refused"] == row["doctor_failed"], (name, env, row["reasons"])


def test_the_layout_changes_the_verdicts_it_should(by_layout):
    """The dimension is not idle: on 0.5.23 the engine's probe reaches the capture group only
    where a batch runs on several ranks, and the report has something to compare only there."""
    def state(release, layout, adapter, **env):
        return by_layout[release][layout]["rows"][combos().index(env)]["rank"][adapter]

    memory = {layout: state("0.5.23", layout, "group_min_memory", DSV41_GROUP_MIN_MEM="1")
              for layout in by_layout["0.5.23"]}
    assert memory == {"tp4": "superseded", "tp4-dp-attention-tp1": "applied", "tp4-dp-attention-tp2": "superseded",
                      "tp4-attn-dp4": "applied", "tp4-dspark": "superseded"}
    for release in ("0.5.23", "0.5.18"):
        report = {layout: state(release, layout, "tp_divergence", DSV41_SPEC_TP_SYNC="all", DSV41_TP_DIVERGENCE="1")
                  for layout in by_layout[release]}
        assert report["tp4"] == "applied" and report["tp4-dp-attention-tp1"] == "refused", (release, report)


def test_the_layouts_are_read_as_written(by_layout):
    attn = {name: (layout["rank"]["tp_size"], layout["rank"]["attn_dp_size"]) for name, layout in by_layout["0.5.23"].items()}
    assert attn == {"tp4": (4, 1), "tp4-dp-attention-tp1": (4, 4), "tp4-dp-attention-tp2": (4, 2), "tp4-attn-dp4": (4, 4),
                    "tp4-dspark": (4, 1)}


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
def test_the_rank_knows_the_dspark_window_the_command_leaves_to_the_engine(by_layout, release):
    """The block size is not on the command: the engine reads it from the draft checkpoint
    (dspark_block_size 5) into the rank's ServerArgs. Both releases derive the write pad, so
    the known-bad guard is superseded for the command and for the rank alike."""
    layout = by_layout[release]["tp4-dspark"]
    assert layout["command"]["server_args"]["speculative_num_draft_tokens"] is None
    assert layout["rank"]["server_args"]["speculative_num_draft_tokens"] == 6
    for env in combos():
        row = layout["rows"][combos().index(env)]
        if env.get("DSV41_KNOWN_BAD_CONFIG") == "1":
            assert row["rank"]["known_bad_config"] == row["wrapper"]["known_bad_config"] == "superseded", env


def test_the_table_covers_every_combination_on_three_releases(table):
    assert len(combos()) == 39
    assert {release: sorted(sides) for release, sides in table.items()} == {
        "0.5.23": ["installed", "sources"], "0.5.18": ["installed", "sources"], "0.5.16": ["sources"]}
    assert all(len(rows) == 39 for sides in table.values() for rows in sides.values())


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
def test_doctor_strict_fails_exactly_when_the_launch_refuses(table, release):
    for env, row in zip(combos(), table[release]["installed"]):
        assert row["doctor_failed"] == row["launch_refused"], (env, row["reasons"])


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
def test_doctor_engine_on_the_sources_agrees_with_the_installed_release(table, release):
    for env, installed, sources in zip(combos(), table[release]["installed"], table[release]["sources"]):
        assert sources["states"] == installed["states"], env
        assert sources["launch_refused"] == installed["launch_refused"], env


@pytest.mark.parametrize("release,side", [("0.5.23", "installed"), ("0.5.23", "sources"), ("0.5.18", "installed"),
                                          ("0.5.18", "sources"), ("0.5.16", "sources")])
def test_the_order_of_adapters_never_matters(table, release, side):
    for env, row in zip(combos(), table[release][side]):
        assert all(states == row["states"] for states in row["orders"]), env


@pytest.mark.parametrize("release", ["0.5.23", "0.5.18"])
def test_off_means_untouched(table, release):
    for env, row in zip(combos(), table[release]["installed"]):
        if row["launch_refused"]:
            continue
        on = {adapter for adapter, state in row["states"].items() if state != "off"}
        assert set(row["patched_by"]) <= on, env
        if env.get("DSV41_SPEC_TP_SYNC") in OFF or release == "0.5.18":
            assert row["handed"] == {}, env
        else:
            assert row["handed"] == {"SGLANG_SPEC_TP_SYNC": "rank0_broadcast"}, env


def row(table, release, side, **env):
    return table[release][side][combos().index({k: v for k, v in env.items() if v is not None})]


def test_the_cases_of_the_issue(table):
    # An adapter that is off never fails the build over another flag.
    for side in ("installed", "sources"):
        off23 = row(table, "0.5.23", side, DSV41_SPEC_TP_SYNC="off")
        assert not off23["doctor_failed"] and not off23["launch_refused"]
        assert row(table, "0.5.18", side, DSV41_SPEC_TP_SYNC="off")["states"]["rank0_broadcast"] == "off"
    # Dropping a memory site while the memory probe is on: refused by every decider.
    for side in ("installed", "sources"):
        dropped = row(table, "0.5.23", side, DSV41_SPEC_TP_SYNC="all,-dspark-mem", DSV41_GROUP_MIN_MEM="1")
        assert dropped["states"]["group_min_memory"] == "refused" and dropped["doctor_failed"]
        assert "1:dspark-mem" in dropped["reasons"]["group_min_memory"]
    # Sites another flag serves are named with the flag.
    applied = row(table, "0.5.18", "installed", DSV41_SPEC_TP_SYNC="all")
    assert applied["states"]["rank0_broadcast"] == "applied"
    assert "1:dspark-mem, 12:dflash-mem are served by DSV41_GROUP_MIN_MEM" in applied["reasons"]["rank0_broadcast"]
    init = row(table, "0.5.18", "installed", DSV41_SPEC_TP_SYNC="init", DSV41_GROUP_MIN_MEM="1")
    assert init["states"] == {"folded_fence": "off", "rank0_broadcast": "refused", "group_min_memory": "applied",
                              "tp_divergence": "off", "known_bad_config": "off"}
    assert "1:dspark-mem by DSV41_GROUP_MIN_MEM" in init["reasons"]["rank0_broadcast"]
    # The divergence report compares what is broadcast: on 0.5.18 the pack's selection, on
    # 0.5.23 the engine's (its default 'all' when the pack hands nothing over). Judged without the
    # server arguments, 0.5.23 refuses the hand-over of `init` (only the memory sites, which the
    # engine's probe does not reduce under DP attention with attention-TP 1): nothing is handed
    # over, the launch is refused by rank0_broadcast, and the report alone would compare 'all'.
    for side in ("installed", "sources"):
        states = {(release, sel): row(table, release, side, DSV41_SPEC_TP_SYNC=sel, DSV41_TP_DIVERGENCE="1")
                  ["states"]["tp_divergence"] for release in ("0.5.18", "0.5.23") for sel in (None, "all", "off", "init")}
        assert states == {("0.5.18", None): "refused", ("0.5.18", "all"): "applied", ("0.5.18", "off"): "refused",
                          ("0.5.18", "init"): "refused", ("0.5.23", None): "applied", ("0.5.23", "all"): "applied",
                          ("0.5.23", "off"): "applied", ("0.5.23", "init"): "applied"}, side
        init23 = row(table, "0.5.23", side, DSV41_SPEC_TP_SYNC="init", DSV41_TP_DIVERGENCE="1")
        assert init23["states"]["rank0_broadcast"] == "refused" and init23["launch_refused"] and init23["doctor_failed"]
        assert "DSV41_GROUP_MIN_MEM=1" in init23["reasons"]["rank0_broadcast"]
    # 0.5.16 cannot cover the folded draft: "all" is refused, naming the way out.
    assert "all,-dspark-draft" in row(table, "0.5.16", "sources", DSV41_SPEC_TP_SYNC="all")["reasons"]["rank0_broadcast"]
