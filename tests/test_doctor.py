"""`entrypoint.py doctor` against the real engines (0.5.23 in the venv, 0.5.18 beside it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from sglang_dsv41_adapters import ADAPTERS, cli, load
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.framework.plan import Plan
from sglang_dsv41_adapters.spectpsync.sites import spans
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from harness.engines import ENGINE_PATHS, ROOT, engine_env, python
from tests.test_cli import schema_errors

sys.path.insert(0, str(ROOT / "tools"))
import doctor_sample  # noqa: E402
from harness import zygote
from tests.log_lines import untimed


def doctor(release: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return zygote.run([python(), "entrypoint.py", "doctor", *args], cwd=ROOT, env=engine_env(release, **env),
                          capture_output=True, text=True, timeout=300)


def test_doctor_json_on_0_5_23_with_the_fence_on():
    done = doctor("0.5.23", "--json", "--strict", DSV41_FOLDED_FENCE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["engine"]["version"] == "0.5.23"
    assert (report["ranks"]["checked"], report["ranks"]["problems"]) == (True, [])
    # What the engine's own loader would run under the pack's name: the pack's entry point.
    entry = report["ranks"]["entry_point"]
    assert (entry["name"], entry["value"]) == ("dsv41_adapters", "sglang_dsv41_adapters.framework.plugin:register")
    assert entry["distribution"].startswith("sglang-dsv41-adapters 0.1.0 (")
    fence = next(a for a in report["adapters"] if a["adapter"] == "folded_fence")
    assert (fence["flag"], fence["value"], fence["outcome"], fence["engine_check"]["outcome"]) == ("DSV41_FOLDED_FENCE", "1", "applied", "applied")
    for route in ("TargetVerifyExecutor.accept_and_finalize", "DsparkSamplingAcceptGraph.run", "DSparkWorkerV2._block_accept_lens"):
        assert route in fence["reason"]
    # doctor decides and reports; it applies nothing, so it prints no per-process line.
    assert not [line for line in untimed(done.stderr) if "[sglang-adapters]" in line]  # progress lines aside


def test_doctor_checks_the_engine_even_with_the_flag_off_on_0_5_18():
    done = doctor("0.5.18", "--json", "--strict")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["engine"]["version"] == "0.5.18"
    fence = next(a for a in report["adapters"] if a["adapter"] == "folded_fence")
    assert (fence["value"], fence["outcome"], fence["engine_check"]["outcome"]) == (None, "off", "applied")
    # 0.5.18 has one escape route only: no sampling-accept graph, no block_accept_lens view.
    assert fence["engine_check"]["reason"].startswith(
        "fenced TargetVerifyExecutor.accept_and_finalize; boundary check at DSparkWorkerV2.forward_batch_generation; "
        "the graph's logits left in place where they leave the worker after a watched start: no code reads ")
    assert fence["engine_check"]["short_reason"] == "fenced 1 escape route; graph logits left in place"
    # The same engine read from its sources (as the compatibility matrix does) agrees with every adapter's import check.
    engine = SourceEngine(ENGINE_PATHS["0.5.18"][0])
    assert engine.version == "0.5.18"
    for row in report["adapters"]:
        assert runtime.engine_check(load(row["adapter"]), engine) == (row["engine_check"]["outcome"], row["engine_check"]["reason"])


def test_doctor_strict_fails_when_ranks_would_skip_the_plugin():
    done = doctor("0.5.23", "--strict", DSV41_FOLDED_FENCE="on", SGLANG_PLUGINS="some_other_plugin")
    assert done.returncode == 69  # refused: ranks would not load the pack
    table = done.stdout
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:] if line.strip() and "  " in line}
    assert rows["adapter"] == ["adapter", "flag", "value", "outcome", "engine", "check"]
    assert rows["folded_fence"] == ["folded_fence", "DSV41_FOLDED_FENCE", "'on'", "applied", "applied"]
    # engine check: the engine's sites handed over, the pack's own 31:pack-dflash-draft-greedy patched beside them
    assert rows["rank0_broadcast"] == ["rank0_broadcast", "DSV41_SPEC_TP_SYNC", "<unset>", "off", "applied"]
    assert "SGLANG_PLUGINS='some_other_plugin' does not list the pack's plugin 'dsv41_adapters'" in table


# --- the report a person reads: one line per adapter, the proofs on request ----------------------

# The recipe's deployment with every flag on, as the README's samples show it (tools/doctor_sample.py).
EVERY_FLAG = doctor_sample.flags()
SERVER = ["--", "python3", "-m", "sglang.launch_server", *doctor_sample.recipe_lines("server.args")]
TP1_BATCHES = ["--", "python3", "-m", "sglang.launch_server", "--model-path", "/models/m", "--tp-size", "4",
               "--enable-dp-attention", "--dp-size", "4", "--speculative-algorithm", "DSPARK"]
SOURCES_0_5_16 = str(ROOT / ".engines" / "src" / "0.5.16")


def summary_block(text: str) -> list[str]:
    """The lines between the table and the ranks: the one line per adapter, then the pointer."""
    paragraphs = text.split("\n\n")
    return paragraphs[3].splitlines()


def paragraphs(report: dict) -> list[str]:
    """Each adapter's full reasons as doctor printed them before it had one line per adapter."""
    lines = []
    for a in report["adapters"]:
        lines += [cli.wrapped(f"{a['adapter']}: {a['summary']}", ""), cli.wrapped(f"outcome: {a['reason']}")]
        if a["engine_check"]["reason"] != a["reason"]:
            lines.append(cli.wrapped(f"engine check: {a['engine_check']['reason']}"))
        if a["machine"]:
            lines.append(cli.wrapped(f"this machine: {a['machine']}"))
    return lines


@pytest.fixture(scope="module")
def every_flag_on() -> dict:
    """doctor for the recipe's deployment with every flag on: the default, --verbose and --json."""
    runs = {form: doctor("0.5.23", *args, *SERVER, **EVERY_FLAG)
            for form, args in (("default", ()), ("verbose", ("--verbose",)), ("json", ("--json",)))}
    for form, done in runs.items():
        assert done.returncode == 0, (form, done.stderr[-3000:])
    return {form: done.stdout if form != "json" else json.loads(done.stdout) for form, done in runs.items()}


def test_the_default_is_the_table_then_one_line_per_adapter(every_flag_on):
    text, report = every_flag_on["default"], every_flag_on["json"]
    *lines, pointer = summary_block(text)
    assert pointer == cli.DETAILS
    assert [line.split(":")[0] for line in lines] == list(ADAPTERS)
    assert lines == [f"{a['adapter']}: {a['outcome']} - {a['short_reason']}" for a in report["adapters"]]
    for line in lines:
        assert len(line) <= runtime.DOCTOR_LINE_LIMIT and "..." not in line, line  # this deployment's fit whole
    line = dict(zip(ADAPTERS, lines))
    # applied: the routes the fence covers and what it does with the graph's logits; superseded: the engine's
    # own class, and what was handed to it
    assert line["folded_fence"] == "folded_fence: applied - fenced 3 escape routes; graph logits left in place"
    assert line["rank0_broadcast"] == ("rank0_broadcast: superseded - the engine's SpecTpSync broadcasts sites 1,7-17; "
                                       "handed to SGLANG_SPEC_TP_SYNC='all'")
    assert line["group_min_memory"].startswith("group_min_memory: superseded - the engine's SpecTpSync reduces sites 1,12")
    assert line["tp_divergence"] == ("tp_divergence: applied - compares sites 7-11,13-17 (SpecTpSync.sync), 30 (decode "
                                     "graph key); reports every 1000 calls")
    assert "  outcome: " not in text and "  engine check: " not in text
    assert text.startswith("verdict: ok (exit 0)\n\n")


def test_verbose_is_the_full_report(every_flag_on):
    """--verbose is the default with each line replaced by the adapter's every proof, site and caller."""
    text, verbose, report = every_flag_on["default"], every_flag_on["verbose"], every_flag_on["json"]
    full = paragraphs(report)
    assert any(line.startswith("  engine check: ") for line in full)  # the reasons differ somewhere: not vacuous
    assert verbose == text.replace("\n".join(summary_block(text)), "\n".join(full))
    for line in "\n".join(full).splitlines():  # wrapped: only a word longer than a line (a path) stands alone
        assert len(line) <= cli.WRAP or len(line.split()) == 1, line
    for a in report["adapters"]:
        assert " ".join(a["reason"].split()) in " ".join(verbose.split())  # whole, wrapped
        assert f"{a['adapter']}: {a['outcome']} - " not in verbose


def test_a_refusal_names_the_release_the_symbol_and_the_adapter():
    on = doctor("0.5.23", "--strict", "--engine", SOURCES_0_5_16, DSV41_SPEC_TP_SYNC="all")
    off = doctor("0.5.23", "--strict", "--require", "all", "--engine", SOURCES_0_5_16)
    unasked = doctor("0.5.23", "--strict", "--engine", SOURCES_0_5_16)  # printed, not failed on: nobody asked for it
    assert unasked.returncode == 0 and unasked.stdout.startswith("verdict: ok (exit 0)\n"), unasked.stdout[:500]
    assert on.returncode == off.returncode == cli.EXIT_REFUSED, on.stderr[-3000:] + off.stderr[-3000:]
    lines = dict(zip(ADAPTERS, summary_block(on.stdout)))
    # the outcome and the fix whole, then the reason, cut where it must be
    assert lines["rank0_broadcast"].startswith("rank0_broadcast: refused - fix: drop dspark-draft from the flag, e.g. "
                                               "all,-dspark-draft; sglang 0.5.16: dspark_draft_sampler: is missing")
    assert lines["folded_fence"] == "folded_fence: off - DSV41_FOLDED_FENCE is off"
    # off, but its engine check refuses (what --require all fails on): the line says that refusal
    assert summary_block(off.stdout)[1].startswith(
        "rank0_broadcast: off; engine check refused - fix: drop dspark-draft from the flag, e.g. all,-dspark-draft; "
        "sglang 0.5.16: dspark_draft_sampler")
    for line in summary_block(on.stdout) + summary_block(off.stdout):
        assert len(line) <= runtime.DOCTOR_LINE_LIMIT, line
    # a refusal of the deployment: one rank runs each batch under DP attention with attention-TP 1
    tp1 = doctor("0.5.23", "--strict", *TP1_BATCHES, DSV41_TP_DIVERGENCE="1")
    assert tp1.returncode == cli.EXIT_REFUSED
    assert dict(zip(ADAPTERS, summary_block(tp1.stdout)))["tp_divergence"].startswith(
        "tp_divergence: refused - fix: unset DSV41_TP_DIVERGENCE; sglang 0.5.23: DSV41_TP_DIVERGENCE: one rank runs "
        "each batch for TP 4, DP attention 4 x")


def test_doctor_adapter_is_the_full_report_of_just_those(every_flag_on):
    # by name or by flag, options before or after them; the pack's order, whatever the order asked
    done = doctor("0.5.23", "DSV41_TP_DIVERGENCE", "--json", "rank0_broadcast", *SERVER, **EVERY_FLAG)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [a["adapter"] for a in report["adapters"]] == ["rank0_broadcast", "tp_divergence"]
    assert report["adapters"] == [a for a in every_flag_on["json"]["adapters"]
                                  if a["adapter"] in ("rank0_broadcast", "tp_divergence")]
    assert report["verdict"] == every_flag_on["json"]["verdict"] and schema_errors(report) == []
    text = doctor("0.5.23", "tp_divergence", "rank0_broadcast", *SERVER, **EVERY_FLAG).stdout
    table = text.split("\n\n")[2].splitlines()
    assert [row.split()[0] for row in table] == ["adapter", "rank0_broadcast", "tp_divergence"]
    assert summary_block(text) == "\n".join(paragraphs(report)).splitlines()
    assert "folded_fence" not in text and "group_min_memory:" not in text
    assert text.startswith("verdict: ok (exit 0); of every adapter, not only those shown\n")


def test_doctor_adapter_keeps_the_whole_packs_verdict():
    """doctor fails on any refusal of a flag that is set, shown or not, and says which first."""
    done = doctor("0.5.23", "--strict", "folded_fence", "--engine", SOURCES_0_5_16, DSV41_SPEC_TP_SYNC="all")
    assert done.returncode == cli.EXIT_REFUSED
    verdict, reason, *_ = done.stdout.splitlines()
    assert verdict == "verdict: refused (exit 69); of every adapter, not only those shown"
    assert reason.startswith("  refused: rank0_broadcast DSV41_SPEC_TP_SYNC='all': fix: drop dspark-draft from the flag")
    assert "sglang 0.5.16: dspark_draft_sampler" in reason
    table = done.stdout.split("\n\n")[2].splitlines()
    assert [row.split()[0] for row in table] == ["adapter", "folded_fence"]


@pytest.mark.parametrize("name,says", [
    ("folded_fenc", "did you mean folded_fence?"),
    ("python3", "a command to judge goes after --"),
])
def test_a_name_that_is_no_adapter_is_one_line_and_78(name, says):
    done = doctor("0.5.23", "--strict", name, "--", "python3", "-m", "sglang.launch_server")
    assert done.returncode == cli.EXIT_FLAGS and done.stdout == ""
    (line,) = untimed(done.stderr.strip())
    assert line.startswith(f"{runtime.PREFIX} pid=") and f"doctor {name}: no adapter of this pack has that name or flag" in line
    assert says in line and line.endswith(f"(exit {cli.EXIT_FLAGS})")


def test_a_plan_without_a_short_reason_is_refused_not_shortened():
    """An adapter must say its deciding reason: a plan without one is a defect of the pack, said and fail-closed."""
    fence = load("folded_fence")
    silent = dataclasses.replace(fence, check=lambda engine, setting, context: Plan("applied", "fenced something"))
    state, reason, short = runtime.engine_verdict(silent, SourceEngine(SOURCES_0_5_16))
    assert state == runtime.REFUSED
    assert reason == "folded_fence refused on sglang 0.5.16: check failed: ValueError: its applied plan gives no short reason"
    assert short == "sglang 0.5.16: check failed: ValueError: its applied plan gives no short reason"


def test_site_numbers_in_short():
    assert spans([17, 1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]) == "1,7-17"
    assert (spans([8, 9, 14]), spans([3]), spans([])) == ("8,9,14", "3", "none")


def test_outcomes_per_layout_are_one_line_each_too():
    """Without a command: each layout's outcome in one line; the JSON keeps both reasons per layout."""
    text = doctor("0.5.23", **EVERY_FLAG).stdout
    report = json.loads(doctor("0.5.23", "--json", **EVERY_FLAG).stdout)
    assert schema_errors(report) == [] and sorted(report["by_layout"]) == ["group_min_memory", "tp_divergence"]
    per_layout = report["by_layout"]["tp_divergence"]["dp-attention-tp1"]
    assert per_layout["outcome"] == runtime.REFUSED and per_layout["reason"].startswith("tp_divergence refused on sglang 0.5.23: ")
    assert per_layout["short_reason"].startswith("fix: unset DSV41_TP_DIVERGENCE; sglang 0.5.23: DSV41_TP_DIVERGENCE: "
                                                 "one rank runs each batch")
    layout_lines = [line for line in text.splitlines() if line.startswith("    TP 4, ")]
    assert len(layout_lines) == 6  # two adapters, three layouts
    assert all(len(line) <= runtime.DOCTOR_LINE_LIMIT for line in layout_lines), layout_lines
    assert ("    TP 4, DP attention 4 x attention-TP 1: refused - fix: unset DSV41_TP_DIVERGENCE; sglang 0.5.23: "
            "DSV41_TP_DIVERGENCE: one rank runs") in text
