"""The alert rules and the dashboard of monitoring/: promtool's own check and unit tests of the
rules (Debian's promtool, which scripts/setup.sh unpacks into .tools/), every dashboard query
parsed by promtool, and every metric and label a query or an alert names is one the pack or the
engine serves: the pack's metrics recorded by its own functions and the engine's by its own
collectors into one PROMETHEUS_MULTIPROC_DIR, read back through the engine's metrics route."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request

import pytest
import yaml

from harness import zygote
from harness.engines import ROOT, engine_env, python, served_metrics

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "sglang-adapters.rules.yaml"
RULE_TESTS = MONITORING / "sglang-adapters.rules.test.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
SCRAPE_LABELS = {"job", "instance"}  # what Prometheus adds to every scraped series
NAME = re.compile(r"\b(sglang(?:_adapters)?:[A-Za-z0-9_:]+)\s*(\{[^}]*\})?")


def promtool():
    found = sorted(ROOT.glob(".tools/prometheus-*/usr/bin/promtool")) or [shutil.which("promtool")]
    if not found[-1]:
        pytest.skip("promtool not found: scripts/setup.sh unpacks Debian's prometheus package's promtool into .tools/ "
                    "where apt can fetch it (Debian or Ubuntu with a package list); or put promtool on PATH")
    return str(found[-1])


def run(*args, cwd=MONITORING):
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_promtool_checks_the_rules_and_passes_their_unit_tests():
    checked = run("check", "rules", RULES.name)
    assert checked.returncode == 0 and "SUCCESS: 5 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = run("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


@pytest.mark.parametrize("edit", [
    # an alert the rule would no longer raise: the rank whose outcome differs from rank 0's
    lambda rules: rules.replace('rank!~"0|launcher"', 'rank!~"0|1|launcher"'),
    # the expected route no longer recognised: every copy would alert
    lambda rules: rules.replace(r"static_io\[[0-9]+\]", r"static_io\[[0-9]\]"),
    # an annotation that names another label
    lambda rules: rules.replace("rank {{ $labels.rank }} diverged", "rank {{ $labels.tp_rank }} diverged"),
])
def test_the_rule_tests_fail_on_a_changed_rule(tmp_path, edit):
    changed = edit(RULES.read_text())
    assert changed != RULES.read_text()
    (tmp_path / RULES.name).write_text(changed)
    shutil.copy(RULE_TESTS, tmp_path)
    tested = run("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert tested.returncode == 1 and "FAILED" in tested.stdout + tested.stderr, tested.stdout


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) of every query of the dashboard: its panels' targets and its variables."""
    board = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in board["panels"] for t in p["targets"]]
    found += [(f"variable {v['name']}", re.sub(r"^label_values\((.+), \w+\)$", r"\1", v["query"]["query"]))
              for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each query as a recording rule: promtool parses it as Prometheus would (Grafana's $instance is a string)."""
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{n}", "expr": expr}
                                                        for n, (_, expr) in enumerate(dashboard_queries())]}]}
    (tmp_path / "dashboard.rules.yaml").write_text(yaml.safe_dump(rules))
    checked = run("check", "rules", "dashboard.rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "broken.rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum by (rank (sglang:spec_accept_length)"}]}]}))
    assert run("check", "rules", "broken.rules.yaml", cwd=tmp_path).returncode == 1


# --- what is served --------------------------------------------------------------------------------

RECORD = """
import torch
from sglang_dsv41_adapters.framework import log, metrics, runtime
from sglang_dsv41_adapters.tp_divergence import divergence

log.set_process_label(1)
metrics.outcomes(runtime.decide({"DSV41_FOLDED_FENCE": "1"}))
metrics.copy_mode("clones")
metrics.count_boundary_copy("GenerationBatchResult.logits_output.next_token_logits <- "
                            "DsparkVerifyEpilogue.static_io[12].logits")
divergence._export(torch.tensor([[4, 1, 2]]))  # one site: 4 calls, 1 diverged, 2 elements
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Metric name -> the label names it is served with: the pack's, recorded by a process labelled rank 1,
    and the engine's (tests/engine_metrics_server.py: its own collectors, four TP ranks), one folder."""
    folder = tmp_path_factory.mktemp("prometheus")
    model = tmp_path_factory.mktemp("model")
    env = engine_env("0.5.23", PROMETHEUS_MULTIPROC_DIR=str(folder))
    # both from a warm parent (harness.zygote); the server's stdin a pipe: this fixture reads its port line itself
    recorded = zygote.run([python(), "-c", RECORD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    engine = zygote.popen([python(), str(ROOT / "tests" / "engine_metrics_server.py"), str(model)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    try:
        line = engine.stdout.readline()
        assert line.startswith("port "), "the engine's metrics server did not start"
        with urllib.request.urlopen(f"http://127.0.0.1:{int(line.split()[1])}/metrics", timeout=120) as response:
            response.read()  # one read: the engine's collectors record a step first
    finally:
        engine.terminate()
        engine.wait(timeout=30)
        engine.stdin.close(), engine.stdout.close()
    from prometheus_client.parser import text_string_to_metric_families

    labels: dict = {}
    for family in text_string_to_metric_families(served_metrics(folder)):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def named(text: str) -> list[tuple[str, set, set]]:
    """(metric, labels its selector names, labels the expression groups or matches on) of each metric in `text`."""
    grouped = {label.strip() for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", text)
               for label in group.split(",") if label.strip()}
    return [(name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector or "")), grouped)
            for name, selector in NAME.findall(text)]


def unknown(text: str, also: set, served: dict) -> list[str]:
    found = []
    metrics = named(text)
    if not metrics:
        return ["names no metric of the pack or the engine"]
    for name, selected, grouped in metrics:
        if name not in served:
            found.append(f"{name} is not served")
            continue
        found += [f"{name} has no label {label}" for label in sorted(selected - served[name] - SCRAPE_LABELS)]
    # a label grouped on, or shown, must be one every metric of the expression carries
    for label in sorted((metrics[0][2] | also) - SCRAPE_LABELS):
        found += [f"{name} has no label {label}" for name, _, _ in metrics if name in served and label not in served[name]]
    return found


def test_the_pack_and_the_engine_serve_what_the_queries_name(served):
    engine = {"tp_rank", "pp_rank", "dp_rank"}  # the engine's labels, beside the pack's rank (kept for one release)
    assert served["sglang_adapters:adapter_outcome"] == {"adapter", "flag", "outcome", "rank"} | engine
    assert served["sglang_adapters:tp_divergence_diverged_calls_total"] == {"rank", "site"} | engine
    assert {"tp_rank", "model_name"} <= served["sglang:spec_accept_length"] and "sglang:gen_throughput" in served


def test_every_dashboard_query_names_metrics_and_labels_that_are_served(served):
    board = json.loads(DASHBOARD.read_text())
    legends = {t["expr"]: set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]))
               for p in board["panels"] for t in p["targets"]}
    wrong = {where: unknown(expr, legends.get(expr, set()), served) for where, expr in dashboard_queries()}
    assert {where: found for where, found in wrong.items() if found} == {}
    panels = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for metric in ("sglang_adapters:adapter_outcome", "sglang_adapters:fence_copy_mode",
                   "sglang_adapters:fence_boundary_copies_total", "sglang_adapters:tp_divergence_diverged_calls_total",
                   "sglang:spec_accept_length", "sglang:gen_throughput"):
        assert metric in panels


def test_every_alert_names_metrics_and_labels_that_are_served(served):
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    wrong = {}
    for rule in rules:
        shown = {label for text in rule["annotations"].values() for label in re.findall(r"\$labels\.(\w+)", text)}
        wrong[rule["alert"]] = unknown(rule["expr"], shown, served)
    assert {alert: found for alert, found in wrong.items() if found} == {}


def test_the_label_check_can_fail(served):
    assert unknown('sglang_adapters:adapter_outcome{attn_rank="0"}', set(), served) == [
        "sglang_adapters:adapter_outcome has no label attn_rank"]
    assert unknown("sum by (site) (sglang_adapters:fence_copy_mode)", set(), served) == [
        "sglang_adapters:fence_copy_mode has no label site"]
    assert unknown("sglang_adapters:fence_copies_total", {"rank"}, served) == ["sglang_adapters:fence_copies_total is "
                                                                                 "not served"]
    assert unknown("vector(1)", set(), served) == ["names no metric of the pack or the engine"]
