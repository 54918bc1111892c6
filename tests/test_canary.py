"""`sglang-adapters canary` against stand-in servers on loopback (tests/standin_server.py: the
engine's exposition of several TP ranks, its OpenAI request and response models, scripted
answers), each case the exact verdict and reason; and against the engine's own metric
collectors and /metrics route (tests/engine_metrics_server.py).

A real engine cannot serve a model on this machine (no GPU, no weights): the test against
running servers takes their URLs from CANARY_TEST_BASELINE and CANARY_TEST_CANARY and is
skipped without them."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest

from sglang_dsv41_adapters import cli
from sglang_dsv41_adapters.rollout import identifiers, outputs
from harness import zygote
from harness.engines import ROOT, engine_env, python
from tests.standin_server import Server, echo, metrics, token_id, tokens

SCHEMA = json.loads((ROOT / "docs" / "canary-verdict.schema.json").read_text())
FAST = ["--window", "1", "--interval", "0.2", "--stall", "0.5"]
SMALL = ["--identifiers", "100", "--long", "2"]  # 5 identifier prompts of 20, 2 long generations


def canary(capsys, *args):
    """The command in this process: its exit status, stdout and stderr."""
    try:
        code = cli.main(["canary", *args])
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def verdict_json(capsys, *args):
    code, out, err = canary(capsys, *args, "--json")
    verdict = json.loads(out)
    assert schema_errors(verdict) == [], err
    return code, verdict, err


def schema_errors(value, schema=SCHEMA) -> list:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return sorted(f"{error.json_path}: {error.message}" for error in validator.iter_errors(value))


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def fails(verdict: dict, check: str) -> list:
    return [(f["server"], f["rank"], f["message"]) for f in verdict["findings"]
            if f["check"] == check and f["status"] == "fail"]


def verdict_line(out: str) -> str:
    """The verdict's line: after the FAIL and INCONCLUSIVE lines, before the notes and `ok` lines."""
    (line,) = [line for line in out.splitlines() if re.match(r"canary (PASS|FAIL|INCONCLUSIVE|UNREACHABLE)\b", line)]
    return line


def in_order(out: str) -> bool:
    """The problems first, then the verdict line, then the rest."""
    lines = out.splitlines()
    at = lines.index(verdict_line(out))
    return (all(re.match(r"\w+: (FAIL|INCONCLUSIVE) ", line) for line in lines[:at])
            and not any(re.match(r"\w+: (FAIL|INCONCLUSIVE) ", line) for line in lines[at + 1:]))


def read_between(server: Server, stamp: str, n: int) -> bool:
    """The finding's time is that of the n-th read: asked after read n-1 was answered, before read n was."""
    return server.served[n - 2] - 0.002 <= epoch(stamp) <= server.served[n - 1]


# --- a healthy canary ------------------------------------------------------------------------------

def test_a_healthy_canary_passes_with_every_check_said(servers, capsys):
    base, new = servers(metrics=metrics()), servers(metrics=metrics())
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST)
    assert code == 0, out + err
    lines = out.splitlines()
    # the verdict first, with what it rests on: every prompt, identifier and token of both canary runs
    compared = 2 * sum(len(tokens(echo(p.text, 1))[:p.max_tokens]) for p in outputs.prompt_set(3000, 20, 4, 512, 0))
    assert re.fullmatch(rf"canary PASS: compared 154 prompts and 3000 identifiers in each of the canary's 2 runs, "
                        rf"{compared} tokens in all; \d+ reads of /metrics each", lines[0]), lines[0]
    assert lines[1] == "canary: ok 4 of 4 ranks export every series, none lost in the window (0, 1, 2, 3)"
    assert re.fullmatch(r"canary: ok accept length 3\.600 \(server-wide: \d+ tokens / \d+ verify steps\), floor 3\.00 "
                        r"\(reference 3\.51\)", lines[2])
    assert [line.split(":")[1] for line in lines[3:7]] == [" ok rank 0", " ok rank 1", " ok rank 2", " ok rank 3"]
    assert lines[7].startswith("canary: ok against the baseline: accept length 3.600 vs 3.600 (min 0.98x), tokens/s ")
    assert lines[8:] == [
        "baseline: ok its 2 runs answer all 154 prompts alike (by token ids)",
        "canary: ok all 154 prompts on which the baseline's runs agree are answered as the baseline's in each of the "
        "canary's 2 runs (compared by token ids)",
        "canary: ok 0 edits beyond the baseline's over 3000 identifiers in each of the canary's 2 runs (the canary's "
        "runs: 0, 0 edits; the baseline's: 0, 0; the baseline's runs differ on 0 identifiers)"]
    # 3000 identifiers, 20 a prompt, and 4 long generations; twice to each server, at temperature 0 with the seed
    for server in (base, new):
        assert len(server.requests) == 2 * 154
        assert {(r["temperature"], r["seed"], r["return_token_ids"], r["stream"]) for r in server.requests} == {
            (0, 0, True, False)}
        assert sorted({r["max_completion_tokens"] for r in server.requests}) == [
            512, 20 * outputs.TOKENS_PER_IDENTIFIER + 16]
    # while it watches: a line per read, and the answers' rounds
    assert re.search(r"^canary: \d+/1 s( \(the answers are still coming\))?: canary 2 reads, 4 ranks, \+360 generated tokens, \+2000 decode tokens, "
                     r"accept length 3\.60; baseline 2 reads", err, re.M), err
    assert "outputs: round 2 of 2: 308/308 answers" in err


def test_the_identifiers_are_opaque_distinct_and_the_same_for_a_seed():
    made = identifiers.make(3000, 0)
    assert made == identifiers.make(3000, 0) and made != identifiers.make(3000, 1)
    assert len(set(made)) == 3000 and not any(re.search(r"[\s`'\"]", i) for i in made)
    assert any(re.fullmatch(r"[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", i) for i in made)  # UUIDs
    assert any(re.search(r"[a-z]_[a-z]", i) for i in made) and any(re.search(r"[a-z][A-Z]", i) for i in made)
    assert any(c in i for i in made for c in "./-")


@pytest.mark.parametrize("answer,edits", [
    ("1. abc_Def9\n2. x-y.z", [0, 0]),
    ("Here they are:\n1) `abc_Def9`\n2: **x-y.z**", [0, 0]),  # wrappers and other numbering
    ("1. abc_Dcf9\n2. x-yz", [1, 1]),
    ("1. abc_Def9", [0, 5]),  # the second never came back: its whole length
    ("2. x-y.z\n1. abc_Def9\n1. other", [0, 0]),  # by number, the first line of each
])
def test_each_identifier_is_read_back_by_number_and_its_edits_counted(answer, edits):
    asked = ["abc_Def9", "x-y.z"]
    back = identifiers.read_back(answer, 2)
    assert [identifiers.edits(a, b) for a, b in zip(asked, back)] == edits


# --- what the metrics show ------------------------------------------------------------------------

def test_a_server_that_restarted_during_the_window_fails_naming_each_rank_and_the_time(servers, capsys):
    """The counters start again from 0 at the 4th read: a last-minus-first comparison would not see it."""
    new = servers(metrics=metrics(restart_at=4))
    code, verdict, err = verdict_json(capsys, "--canary", new.url, *FAST)
    assert (code, verdict["verdict"]) == (1, "fail")
    restarts = [f for f in verdict["findings"] if f["check"] == "restart"]
    assert [f["rank"] for f in restarts] == ["0", "1", "2", "3", "-"]
    for finding in restarts:
        assert read_between(new, finding["time"], 4), (finding, new.served[:4])
        whose = "server-wide sglang:generation_tokens_total" if finding["rank"] == "-" else \
            f'rank {finding["rank"]}: sglang:realtime_tokens_total{{mode="decode"}}'
        assert re.fullmatch(re.escape(whose) + r" went down from [\d.e+]+ to [\d.e+]+ between \d\d:\d\d:\d\dZ and "
                            r"\d\d:\d\d:\d\dZ \(\d+ s into the window\): the server restarted \(its counters started "
                            r"again from 0\)", finding["message"]), finding["message"]
    assert verdict["findings"][0]["server"] == "canary"


def test_a_baseline_that_restarted_fails_too(servers, capsys):
    code, verdict, err = verdict_json(capsys, "--baseline", servers(metrics=metrics(restart_at=3)).url, "--canary",
                                      servers(metrics=metrics()).url, "--no-outputs", *FAST)
    assert code == 1
    assert {(server, rank) for server, rank, _ in fails(verdict, "restart")} == {("baseline", r) for r in "0123-"}


@pytest.mark.parametrize("from_read", [1, 3])
def test_a_rank_whose_accept_length_is_nan_fails_naming_the_rank_and_the_time(servers, capsys, from_read):
    nan_on_2 = lambda rank, n: math.nan if rank == 2 and n >= from_read else 3.6  # noqa: E731
    new = servers(metrics=metrics(rank_accept=nan_on_2))
    code, verdict, err = verdict_json(capsys, "--canary", new.url, *FAST)
    assert code == 1
    ((server, rank, message),) = fails(verdict, "number")
    assert (server, rank) == ("canary", "2")
    assert re.fullmatch(r"rank 2: sglang:spec_accept_length is NaN at \d\d:\d\d:\d\dZ \(\d+ s into the window\): not a "
                        r"number", message)
    (finding,) = [f for f in verdict["findings"] if f["check"] == "number"]
    if from_read == 1:
        assert abs(epoch(finding["time"]) - epoch(verdict["started"])) < 1
        # and no number to compare with rank 0's
        assert [r for _, r, m in fails(verdict, "alike")] == ["2"]
        assert "mean spec_accept_length none that is a number (rank 0: " in fails(verdict, "alike")[0][2]
    else:
        assert read_between(new, finding["time"], from_read)
        assert fails(verdict, "alike") == []  # the reads that are numbers agree
    assert verdict["metrics"]["canary"]["ranks"]["2"]["mean_accept_length"] == (None if from_read == 1 else 3.6)


def test_a_missing_rank_fails_naming_it(servers, capsys):
    code, out, err = canary(capsys, "--canary", servers(metrics=metrics(ranks=3)).url, *FAST)
    assert code == 1 and verdict_line(out).startswith("canary FAIL: ") and in_order(out)
    assert re.search(r"^canary: FAIL rank 3 exports no series in \d+ reads \(3 of 4 ranks do: 0, 1, 2; every rank "
                     r"exports its own with --enable-metrics-for-all-schedulers\)$", out, re.M), out


def test_a_series_that_goes_missing_fails_naming_the_rank_and_the_read(servers, capsys):
    gone = lambda rank, series, n: rank == 1 and series == "sglang:spec_accept_length" and n >= 3  # noqa: E731
    new = servers(metrics=metrics(hide=gone))
    code, verdict, err = verdict_json(capsys, "--canary", new.url, *FAST)
    assert code == 1
    ((server, rank, message),) = fails(verdict, "ranks")
    assert rank == "1" and re.fullmatch(r"rank 1: sglang:spec_accept_length missing from the read at \d\d:\d\d:\d\dZ "
                                        r"\(\d+ s into the window\) \(there since \d\d:\d\d:\d\dZ\)", message), message
    (finding,) = [f for f in verdict["findings"] if f["check"] == "ranks"]
    assert read_between(new, finding["time"], 3)


def test_a_series_a_rank_never_exports_fails(servers, capsys):
    never = lambda rank, series, n: rank == 0 and series == "sglang:num_queue_reqs"  # noqa: E731
    code, verdict, err = verdict_json(capsys, "--canary", servers(metrics=metrics(hide=never)).url, *FAST)
    assert fails(verdict, "ranks") == [("canary", "0", "rank 0 exports no sglang:num_queue_reqs (its other series are "
                                                        "there)")]


def test_a_baseline_without_traffic_is_inconclusive_saying_what_to_change(servers, capsys):
    base, new = servers(metrics=metrics(verify_step=0, accept=0)), servers(metrics=metrics())
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert code == 3, out + err
    assert out.splitlines()[0] == (
        "baseline: INCONCLUSIVE no traffic over the window (0 generated tokens, 0 verify steps in "
        + re.search(r"verify steps in (\d+) s", out)[1] + " s): the canary's accept length and rate are not compared "
        "with it; send both servers the same traffic (the prompt set does, without --no-outputs) and check the "
        "baseline runs speculative decoding with --enable-metrics")
    assert verdict_line(out).startswith("canary INCONCLUSIVE: compared 7 prompts and 100 identifiers") and in_order(out)
    assert "against the baseline" not in out


def test_metrics_that_stop_answering_mid_window_fail(servers, capsys):
    new = servers(metrics=lambda n: metrics()(n) if n < 3 else None)  # 503 from the 3rd read on
    code, out, err = canary(capsys, "--canary", new.url, *FAST)
    assert code == 1
    assert re.search(r"^canary: FAIL /metrics not read at \d\d:\d\d:\d\dZ \(\d+ s into the window\) and \d+ more of \d+ "
                     rf"reads: HTTP 503 from {new.url}/metrics: $", out, re.M), out


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("which", ["canary", "baseline"])
def test_a_server_that_does_not_answer_at_the_start_is_exit_75(servers, capsys, which):
    down, up = closed_port_url(), servers(metrics=metrics()).url
    urls = {"canary": down, "baseline": up} if which == "canary" else {"canary": up, "baseline": down}
    code, verdict, err = verdict_json(capsys, "--baseline", urls["baseline"], "--canary", urls["canary"], *FAST)
    assert (code, verdict["verdict"], verdict["metrics"]) == (75, "unreachable", None)
    ((server, _, message),) = fails(verdict, "answered")
    assert server == which and message.startswith(f"no answer from {down}/metrics: ")
    code, out, err = canary(capsys, "--canary", down, *FAST)
    assert code == 75 and verdict_line(out) == "canary UNREACHABLE (nothing judged)" and in_order(out)
    assert "nothing judged (exit 75)" in err


# the canary's checks of its own, from the recipe's canary.sh, carried over
@pytest.mark.parametrize("case,server,finding", [
    ("below the floor", dict(accept=2.9), "canary: FAIL accept length 2.900"),
    ("a rank accepts differently", dict(rank_accept=lambda r, n: 3.2 if r == 2 else 3.6), "canary: FAIL rank 2: "),
    ("a rank decodes fewer tokens", dict(decode=lambda r, n: 450 * n if r == 1 else 500 * n), "canary: FAIL rank 1: "),
    ("a rank stands still while requests run", dict(decode=lambda r, n: 500 * min(n, 2) if r == 3 else 500 * n),
     "canary: FAIL rank 3 decoded nothing for "),
    ("no rank moves while requests are queued", dict(running=0, queued=3, decode=lambda r, n: 1000),
     "canary: FAIL rank 0 decoded nothing for "),
    ("no speculative steps", dict(verify_step=0), "canary: FAIL no speculative verify steps counted"),
])
def test_a_canary_fails_on_what_a_divergence_breaks(servers, capsys, case, server, finding):
    code, out, err = canary(capsys, "--canary", servers(metrics=metrics(**server)).url, *FAST)
    assert code == 1, out + err
    assert verdict_line(out).startswith("canary FAIL: ") and finding in out and in_order(out), out


def test_an_idle_canary_is_no_stall(servers, capsys):
    """Decode tokens that stand still while no request runs or waits are no stall."""
    code, out, err = canary(capsys, "--canary", servers(metrics=metrics(running=0, decode=lambda r, n: 500 * min(n, 2))).url,
                            *FAST)
    assert code == 0 and "decoded nothing" not in out, out


def test_the_accept_floor_is_a_setting(servers, capsys):
    code, out, err = canary(capsys, "--canary", servers(metrics=metrics(accept=3.4)).url, "--accept-floor", "3.51", *FAST)
    assert code == 1 and "FAIL accept length 3.400" in out and "floor 3.51" in out


@pytest.mark.parametrize("canary_accept,verdict", [(3.6, "ok"), (3.4, "FAIL")])
def test_a_canary_against_its_baseline(servers, capsys, canary_accept, verdict):
    base, new = servers(metrics=metrics(accept=3.6)), servers(metrics=metrics(accept=canary_accept))
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, "--no-outputs", *FAST)
    assert code == (0 if verdict == "ok" else 1), out + err
    assert f"canary: {verdict} against the baseline: accept length {canary_accept:.3f} vs 3.600 (min 0.98x)" in out
    assert "canary: note answers not checked (--no-outputs)" in out


# --- what the answers show --------------------------------------------------------------------------

def corrupting(identifier: str, into: str):
    """A model that gives `identifier` back as `into`, every time: the wrong token every rank commits alike."""
    return lambda prompt, n: echo(prompt, n).replace(f". {identifier}\n", f". {into}\n")


def test_an_answer_that_differs_in_one_identifier_fails_with_the_first_differing_token(servers, capsys):
    made = identifiers.make(3000, 0)
    wrong = made[1233]  # the 14th of the 62nd prompt
    into = wrong[:3] + ("X" if wrong[3] != "X" else "Y") + wrong[4:]
    base, new = servers(metrics=metrics()), servers(metrics=metrics(), answer=corrupting(wrong, into))
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST)
    assert code == 1, out + err
    asked = outputs.prompt_set(3000, 20, 4, 512, 0)[61]
    assert asked.key == "identifiers-062" and asked.identifiers[13] == wrong
    right, bad = echo(asked.text, 1), corrupting(wrong, into)(asked.text, 1)
    at = next(i for i, (a, b) in enumerate(zip(tokens(right), tokens(bad))) if a != b)
    char = next(i for i, (a, b) in enumerate(zip(right, bad)) if a != b)
    lines = out.splitlines()
    assert lines[:9] == [
        f"canary: FAIL identifiers-062 (run {n}) differs from the baseline at token {at} (baseline id "
        f"{token_id(tokens(right)[at])}, canary id {token_id(tokens(bad)[at])}): baseline {right[char - 20:char + 40]!r}, "
        f"canary {bad[char - 20:char + 40]!r}" for n in (1, 2)] + [
        "canary: FAIL 1 of 154 prompts on which the baseline's runs agree are answered differently in 2 of the "
        "canary's 2 runs (compared by token ids)"] + [
        f"canary: FAIL identifier {wrong!r} (identifiers-062 #14, run {n}) came back {into!r} from the canary (1 edit), "
        f"{wrong!r} from the baseline (at most 0 edits)" for n in (1, 2)] + [
        "canary: FAIL 2 edits beyond the baseline's over 3000 identifiers in each of the canary's 2 runs (the canary's "
        "runs: 1, 1 edits; the baseline's: 0, 0; the baseline's runs differ on 0 identifiers)"] + [
        lines[6]] + lines[7:9]
    assert verdict_line(out) == lines[6] and lines[6].startswith("canary FAIL: compared 154 prompts and 3000 identifiers")
    assert lines[7:9] == ["canary: ok 4 of 4 ranks export every series, none lost in the window (0, 1, 2, 3)",
                          lines[8]] and lines[8].startswith("canary: ok accept length 3.600 ")
    assert in_order(out) and "FAIL" not in "".join(lines[7:])


def test_the_readmes_sample_is_the_canarys_output(servers, capsys):
    """README's "Rollout, canary, rollback" shows a run whose canary corrupted one identifier in its second run only:
    every line that holds no timing (the reads, tokens/s) is what the canary prints for that case today."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("the canary having corrupted one identifier in its second run only:")
    sample = [line.strip() for line in readme[start:readme.index("   ```\n\n", start)].split("```")[1].splitlines()
              if line.strip()]
    wrong = identifiers.make(3000, 0)[1233]
    into = wrong[:3] + "X" + wrong[4:]
    edit = corrupting(wrong, into)
    base, new = servers(metrics=metrics()), servers(metrics=metrics(), answer=lambda p, n: edit(p, n) if n == 2 else
                                                   echo(p, n))
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST)
    assert code == 1
    timed = re.compile(r"tokens/s|reads of /metrics|verify steps\)|decode tokens|^\.\.\. ranks")
    lines = [line for line in out.splitlines() if not re.match(r"canary: ok rank [123]:", line)]
    assert [line for line in sample if not timed.search(line)] == [line for line in lines if not timed.search(line)]
    assert sample[4].split("; ")[0] == verdict_line(out).split("; ")[0]  # the verdict after the four FAIL lines


NOISY_IDENTIFIER = identifiers.make(100, 0)[6]  # the 7th of the first prompt


def noisy_baseline(prompt, n):
    """A baseline whose second answers differ: long-2 entirely, and one identifier by one character (batch
    composition moving a low bit, as a real server at temperature 0 can)."""
    text = echo(prompt, n)
    if n == 2 and prompt == outputs.LONG_PROMPTS[1]:
        return "a different story " + text
    return text.replace(f". {NOISY_IDENTIFIER}\n", f". {NOISY_IDENTIFIER}x\n") if n == 2 else text


def test_a_nondeterministic_baseline_is_measured_and_the_canary_judged_beyond_it(servers, capsys):
    """The canary answers as the baseline's second run: differing from its first on exactly its noise."""
    base = servers(metrics=metrics(), answer=noisy_baseline)
    new = servers(metrics=metrics(), answer=lambda prompt, n: noisy_baseline(prompt, 2))
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL,
                                      "--noise-max", "0.5")
    assert code == 0, verdict["findings"]
    said = {(f["server"], f["check"]): (f["status"], f["message"]) for f in verdict["findings"]}
    assert said[("baseline", "noise")] == ("note", "its 2 runs differ on 2 of 7 prompts (by token ids): identifiers-1, "
                                                   "long-2; their tokens are not compared, their identifiers are (beyond "
                                                   "the baseline's own edits)")
    assert said[("canary", "outputs")] == ("ok", "all 5 prompts on which the baseline's runs agree are answered as the "
                                                 "baseline's in each of the canary's 2 runs (compared by token ids)")
    assert said[("canary", "identifiers")] == (
        "ok", "0 edits beyond the baseline's over 100 identifiers in each of the canary's 2 runs (the canary's runs: 1, "
              "1 edits; the baseline's: 0, 1; the baseline's runs differ on 1 identifier)")
    assert verdict["outputs"]["compared"] == {"runs": 2, "prompts": 5, "answers": 10, "identifiers": 100,
                                              "tokens": verdict["outputs"]["compared"]["tokens"]}
    assert verdict["outputs"]["baseline_noise"] == ["identifiers-1", "long-2"]
    assert verdict["outputs"]["identifiers"]["baseline_run_to_run"] == {"identifiers": 1, "edits": 1}
    assert verdict["outputs"]["identifiers"]["edits"] == {"baseline_run_1": 0, "baseline_run_2": 1, "canary_run_1": 1,
                                                          "canary_run_2": 1}


def test_a_canary_that_differs_beyond_a_noisy_baseline_fails_on_that_prompt_alone(servers, capsys):
    def differs_on_long_1(prompt, n):
        return ("another answer " if prompt == outputs.LONG_PROMPTS[0] else "") + noisy_baseline(prompt, 2)
    base, new = servers(metrics=metrics(), answer=noisy_baseline), servers(metrics=metrics(), answer=differs_on_long_1)
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL,
                                      "--noise-max", "0.5")
    assert code == 1
    assert [(d["prompt"], d["run"]) for d in verdict["outputs"]["differing"]] == [("long-1", 1), ("long-1", 2)]
    difference = verdict["outputs"]["differing"][0]["first_difference"]
    assert (difference["token"], difference["char"]) == (0, 0)
    assert difference["canary_token"] == token_id("another") and difference["canary_text"].startswith("another answer ")
    assert [m for _, _, m in fails(verdict, "outputs")] == [
        f"long-1 (run {n}) differs from the baseline at token 0 (baseline id {difference['baseline_token']}, canary id "
        f"{token_id('another')}): baseline {difference['baseline_text']!r}, canary {difference['canary_text']!r}"
        for n in (1, 2)] + [
        "1 of 5 prompts on which the baseline's runs agree are answered differently in 2 of the canary's 2 runs "
        "(compared by token ids)"]


def edited_in(runs: dict):
    """A canary that edits identifier number i (of the 100 SMALL asks) in the runs runs[i] gives: intermittent,
    as the hazard is."""
    made = identifiers.make(100, 0)

    def answer(prompt, n):
        text = echo(prompt, n)
        for i, in_runs in runs.items():
            if n in in_runs:
                text = text.replace(f". {made[i]}\n", f". {made[i][:-1]}#\n")
        return text
    return answer


@pytest.mark.parametrize("runs,rounds", [({30: (2,)}, 2), ({30: (1,), 50: (2,)}, 2), ({30: (3,)}, 3)])
def test_an_edit_in_any_run_of_the_canary_fails_naming_the_run(servers, capsys, runs, rounds):
    """The baseline's runs agree exactly; the canary edits an identifier in one run only."""
    base, new = servers(metrics=metrics()), servers(metrics=metrics(), answer=edited_in(runs))
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL,
                                      "--rounds", str(rounds))
    assert (code, verdict["verdict"], verdict["exit_status"]) == (1, "fail", 1)
    made = identifiers.make(100, 0)
    edited = verdict["outputs"]["identifiers"]["edited"]
    assert [(e["identifier"], e["run"], e["canary_edits"], e["baseline_edits"]) for e in edited] == [
        (made[i], n, 1, 0) for i, in_runs in runs.items() for n in in_runs]
    per_run = {f"canary_run_{n}": sum(n in in_runs for in_runs in runs.values()) for n in range(1, rounds + 1)}
    assert verdict["outputs"]["identifiers"]["beyond_baseline_per_run"] == per_run
    # every run is compared by tokens too: the prompt holding each edit, in the run that made it
    assert [(d["run"], d["prompt"]) for d in verdict["outputs"]["differing"]] == sorted(
        (n, f"identifiers-{i // 20 + 1}") for i, in_runs in runs.items() for n in in_runs)
    assert verdict["outputs"]["compared"]["runs"] == rounds and len(new.requests) == rounds * 7
    assert sorted(verdict["outputs"]["identifiers"]["edits"]) == sorted(
        [f"baseline_run_{n}" for n in range(1, rounds + 1)] + list(per_run))


def unlike_itself(prompt, n):
    """A baseline whose second and later runs start every answer with a line more: every prompt differs by tokens,
    no identifier does."""
    return ("Sure.\n" if n > 1 else "") + echo(prompt, n)


def test_a_baseline_unlike_itself_on_every_prompt_is_inconclusive_not_a_pass(servers, capsys):
    base, new = servers(metrics=metrics(), answer=unlike_itself), servers(metrics=metrics())
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert code == 3, out + err
    assert out.splitlines()[0] == (
        "canary: INCONCLUSIVE the baseline's runs differ on 7 of 7 prompts (100.0 %, more than --noise-max 0.05): 0 "
        "prompts compared by tokens; start both servers with --enable-deterministic-inference where the release "
        "supports it for the model, or raise --noise-max if this run-to-run difference is expected")
    assert out.splitlines()[1].startswith("canary INCONCLUSIVE: compared 0 prompts and 100 identifiers in each of the "
                                          "canary's 2 runs, 0 tokens in all; ")
    assert in_order(out)


def test_an_edit_is_counted_where_the_baseline_is_unlike_itself(servers, capsys):
    """Its identifiers are still compared, each against the most edits a baseline run made of it: the edit fails."""
    base, new = servers(metrics=metrics(), answer=unlike_itself), servers(metrics=metrics(),
                                                                          answer=edited_in({30: (2,)}))
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert (code, verdict["verdict"]) == (1, "fail")
    assert verdict["outputs"]["identifiers"]["beyond_baseline"] == 1 and verdict["outputs"]["compared"]["prompts"] == 0
    assert [f["status"] for f in verdict["findings"] if f["check"] == "compared"] == ["inconclusive"]


def test_a_baseline_that_answers_nothing_is_inconclusive(servers, capsys):
    def refuses(prompt, n):
        raise ValueError("the model is still loading")
    base, new = servers(metrics=metrics(), answer=refuses), servers(metrics=metrics())
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert (code, verdict["verdict"], verdict["exit_status"]) == (3, "inconclusive", 3)
    finding, identifiers_said = [f for f in verdict["findings"] if f["status"] == "inconclusive"]
    assert finding["server"] == "baseline" and finding["message"].startswith("14 of 14 requests got no answer (first: ")
    assert finding["message"].endswith("those prompts are not compared: check the baseline and run again")
    assert identifiers_said["message"] == "no identifier was compared: all 5 identifier prompts got no answer"
    assert verdict["outputs"]["compared"] == {"runs": 2, "prompts": 0, "answers": 0, "characters": 0, "identifiers": 0}


@pytest.mark.parametrize("case,pids", [
    ("every rank from two processes", lambda rank: [f"41{rank}0", f"41{rank}1"]),
    ("rank 0 with a stale process file more", lambda rank: ["4000", "4001"] if rank == 0 else [f"41{rank}1"]),
])
def test_gauges_served_per_process_are_read_per_process_never_summed(servers, capsys, case, pids):
    """prometheus_client's multiprocess mode `all` serves a gauge once per process file (a pid label), a dead
    process's too: spec_accept_length is a mean, so two processes at 3.6 are 3.6, never 7.2."""
    code, verdict, err = verdict_json(capsys, "--canary", servers(metrics=metrics(pids=pids)).url, *FAST)
    assert (code, verdict["verdict"]) == (0, "pass"), [f["message"] for f in verdict["findings"] if f["status"] != "ok"]
    assert {r: f["mean_accept_length"] for r, f in verdict["metrics"]["canary"]["ranks"].items()} == dict.fromkeys(
        "0123", 3.6)
    notes = [f["message"] for f in verdict["findings"] if f["check"] == "processes"]
    assert (f"rank 0: sglang:num_queue_reqs served per process (2 pids: {', '.join(pids(0))}; multiprocess mode all): "
            "summed, as livesum serves it") in notes
    assert (f"rank 0: sglang:spec_accept_length served per process (2 pids: {', '.join(pids(0))}; multiprocess mode "
            "all): their mean judged, never their sum") in notes


def test_answers_without_token_ids_are_compared_by_characters(servers, capsys):
    """sglang 0.5.16 returns no token ids."""
    base = servers(metrics=metrics(), token_ids=False)
    new = servers(metrics=metrics(), token_ids=False,
                  answer=lambda prompt, n: echo(prompt, n).replace(" verifies ", " verified ", 1))
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert code == 1 and verdict["outputs"]["basis"] == "characters"
    first = verdict["outputs"]["differing"][0]
    assert first["prompt"] == "long-1" and first["first_difference"]["token"] is None
    assert fails(verdict, "outputs")[0][2].startswith("long-1 (run 1) differs from the baseline at character ")
    assert fails(verdict, "outputs")[-1][2].endswith("(compared by characters (a server returned no token ids))")


def test_the_completions_api_and_extra_fields(servers, capsys):
    base, new = servers(metrics=metrics()), servers(metrics=metrics())
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, "--api", "completions", "--extra-body",
                            '{"top_k": 1}', "--model", "m", "--seed", "7", *FAST, *SMALL)
    assert code == 0, out + err
    assert {(r["model"], r["top_k"], r["seed"], "prompt" in r) for r in new.requests} == {("m", 1, 7, True)}
    assert "canary: ok 0 edits beyond the baseline's over 100 identifiers in each of the canary's 2 runs" in out


def test_requests_that_get_no_answer_fail_and_are_not_compared(servers, capsys):
    def refuses_long_2(prompt, n):
        if prompt == outputs.LONG_PROMPTS[1]:
            raise ValueError("context length exceeded")
        return echo(prompt, n)
    base, new = servers(metrics=metrics()), servers(metrics=metrics(), answer=refuses_long_2)
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert code == 1
    ((server, _, message),) = fails(verdict, "answers")
    assert server == "canary" and message.startswith(f"2 of 14 requests got no answer (first: long-2, run 1: HTTP 400 "
                                                     f"from {new.url}/v1/chat/completions: ")
    assert "context length exceeded" in message and verdict["outputs"]["judged_prompts"] == 6


def test_servers_of_different_models_are_not_compared(servers, capsys):
    base, new = servers(metrics=metrics(), model="a"), servers(metrics=metrics(), model="b")
    code, out, err = canary(capsys, "--baseline", base.url, "--canary", new.url, *FAST)
    assert code == 1 and "canary: FAIL the baseline serves 'a', the canary 'b': answers not compared" in out
    assert new.requests == []


def test_without_a_baseline_the_answers_are_not_checked_and_it_says_so(servers, capsys):
    new = servers(metrics=metrics())
    code, out, err = canary(capsys, "--canary", new.url, *FAST)
    assert code == 0 and "canary: note answers not checked: they are judged against a baseline (--baseline URL)" in out
    assert new.requests == [] and "still coming" not in err  # no answers are asked, so none are awaited
    assert re.fullmatch(r"canary PASS: compared \d+ reads of /metrics", verdict_line(out))


# --- the command line and the JSON verdict ----------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--canary", "localhost:30000"], "argument --canary: 'localhost:30000' is not a server's base URL"),
    (["--canary", "http://h:1", "--window", "0"], "argument --window: '0' is not a positive number"),
    (["--canary", "http://h:1", "--interval", "nan"], "argument --interval: 'nan' is not a positive number"),
    (["--canary", "http://h:1", "--long", "7"], "argument --long: '7' is not a whole number 0 to 6"),
    (["--canary", "http://h:1", "--extra-body", "[1]"], "argument --extra-body: not a JSON object"),
    (["--canary", "http://h:1", "--no-metrics"], "--no-metrics leaves nothing to judge without the answers"),
    (["--baseline", "http://h:1", "--canary", "http://h:2", "--identifiers", "0", "--long", "0"],
     "--identifiers 0 --long 0 is an empty prompt set: say --no-outputs"),
    (["--baseline", "http://h:1"], "the following arguments are required: --canary"),
])
def test_a_bad_invocation_is_exit_64_saying_what(capsys, args, message):
    code, out, err = canary(capsys, *args)
    assert code == cli.EXIT_USAGE == 64 and message in err and err.startswith("usage: sglang-adapters canary"), err


def test_the_schema_is_a_schema_and_its_check_can_fail():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    errors = schema_errors({"schema_version": 1, "verdict": "maybe", "findings": [{"status": "bad"}]})
    assert "$: 'outputs' is a required property" in errors
    assert "$.verdict: 'maybe' is not one of ['pass', 'fail', 'inconclusive', 'unreachable']" in errors
    assert "$.findings[0].status: 'bad' is not one of ['ok', 'fail', 'inconclusive', 'note']" in errors


def test_a_passing_verdict_in_json_names_every_figure(servers, capsys):
    base, new = servers(metrics=metrics()), servers(metrics=metrics())
    code, verdict, err = verdict_json(capsys, "--baseline", base.url, "--canary", new.url, *FAST, *SMALL)
    assert (code, verdict["verdict"], verdict["exit_status"]) == (0, "pass", 0), verdict["findings"]
    assert (verdict["canary"], verdict["baseline"]) == (new.url, base.url)
    assert verdict["metrics"]["canary"]["accept_length"] == pytest.approx(3.6)
    assert sorted(verdict["metrics"]["canary"]["ranks"]) == ["0", "1", "2", "3"]
    assert verdict["outputs"]["identifiers"]["count"] == 100 and verdict["outputs"]["basis"] == "tokens"
    assert [f["status"] for f in verdict["findings"]] == ["ok"] * len(verdict["findings"])
    assert not err.startswith("{") and "canary PASS" not in err  # stdout holds the JSON alone


def test_the_console_script_and_the_recipes_caller_exit_with_the_verdict(servers, tmp_path):
    """canary.sh is a thin caller: the old environment names become the flags, more flags after --; its status is
    the verdict's, INCONCLUSIVE's too (not 0: a pipeline reads it as no pass)."""
    recipe = ROOT / "recipes" / "dsv41-flash-tp4-dspark" / "canary.sh"
    new = servers(metrics=metrics(accept=3.4))
    env = {**os.environ, "SGLANG_ADAPTERS": f"{sys.executable} {ROOT / 'entrypoint.py'}", "DURATION": "1",
           "INTERVAL": "0.2", "ACCEPT_FLOOR": "3.5", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(recipe), new.url, "--", "--json"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["settings"]["accept_floor"] == 3.5 and verdict["settings"]["window_s"] == 1
    assert "accept length 3.400 (server-wide: " in fails(verdict, "accept")[0][2]
    idle = servers(metrics=metrics(verify_step=0, accept=0))  # a baseline without traffic
    done = subprocess.run(["bash", str(recipe), idle.url, servers(metrics=metrics()).url, "--", "--no-outputs"],
                          capture_output=True, text=True, env={**env, "ACCEPT_FLOOR": "3.0"}, timeout=120)
    assert done.returncode == 3 and verdict_line(done.stdout).startswith("canary INCONCLUSIVE: "), done.stdout


# --- the engine's own metrics (its collectors and route), and a real engine --------------------------------------------------------

@pytest.fixture
def engine_metrics(tmp_path):
    """start(*args) runs tests/engine_metrics_server.py (the engine's own collectors and /metrics route, four
    TP ranks) and gives its URL; stopped after the test."""
    started = []

    def start(*args):
        n = len(started)
        folder, model, log = tmp_path / f"prometheus-{n}", tmp_path / f"model-{n}", tmp_path / f"server-{n}.log"
        folder.mkdir(), model.mkdir()
        with open(log, "w") as err:
            # from a warm parent (harness.zygote); stdin a pipe: this test reads the port line itself
            child = zygote.popen([python(), str(ROOT / "tests" / "engine_metrics_server.py"), str(model), *args],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                 env=engine_env("0.5.23", PROMETHEUS_MULTIPROC_DIR=str(folder)))
        started.append(child)
        line = child.stdout.readline()  # "port N" once it listens; nothing if it died
        assert line.startswith("port "), log.read_text()[-3000:]
        return f"http://127.0.0.1:{int(line.split()[1])}"

    yield start
    for child in started:
        child.terminate()
        child.wait(timeout=30)
        child.stdin.close(), child.stdout.close()


def test_the_engines_own_metrics_pass(engine_metrics, capsys):
    code, out, err = canary(capsys, "--canary", engine_metrics(), *FAST)
    assert code == 0, out + err
    lines = out.splitlines()
    assert re.fullmatch(r"canary PASS: compared \d+ reads of /metrics", lines[0]), lines[0]
    assert lines[1] == "canary: ok 4 of 4 ranks export every series, none lost in the window (0, 1, 2, 3)"
    assert re.fullmatch(r"canary: ok accept length 3\.600 \(server-wide: \d+ tokens / \d+ verify steps\), floor 3\.00 "
                        r"\(reference 3\.51\)", lines[2]), lines[2]
    assert sum(line.startswith("canary: ok rank ") for line in out.splitlines()) == 4


def test_a_nan_in_the_engines_own_metrics_fails_naming_the_rank(engine_metrics, capsys):
    code, verdict, err = verdict_json(capsys, "--canary", engine_metrics("--nan-rank", "2", "--nan-from", "3"), *FAST)
    assert code == 1
    ((server, rank, message),) = fails(verdict, "number")
    assert (server, rank) == ("canary", "2") and message.startswith("rank 2: sglang:spec_accept_length is NaN at ")
    assert [f["check"] for f in verdict["findings"] if f["status"] == "fail"] == ["number"]


@pytest.mark.skipif(not (os.environ.get("CANARY_TEST_BASELINE") and os.environ.get("CANARY_TEST_CANARY")),
                    reason="no engine can serve a model on this machine (no GPU, no model weights): set "
                           "CANARY_TEST_BASELINE and CANARY_TEST_CANARY to two running servers (the pack off, the pack "
                           "on) to run the canary against them")
def test_against_running_servers(capsys):
    code, verdict, err = verdict_json(capsys, "--baseline", os.environ["CANARY_TEST_BASELINE"], "--canary",
                                      os.environ["CANARY_TEST_CANARY"], "--window", "120", "--interval", "5")
    assert verdict["outputs"]["identifiers"]["count"] == 3000
    assert (code, verdict["verdict"]) == (0, "pass"), [f["message"] for f in verdict["findings"] if f["status"] == "fail"]
