"""`entrypoint.py doctor` against the real engines (0.5.23 in the venv, 0.5.18 beside it)."""

from __future__ import annotations

import json
import subprocess

from sglang_dsv41_adapters import load
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters.engine.source_engine import SourceEngine
from harness.engines import ENGINE_PATHS, ROOT, engine_env, python
from harness import zygote


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
    assert "[sglang-adapters]" not in done.stderr


def test_doctor_checks_the_engine_even_with_the_flag_off_on_0_5_18():
    done = doctor("0.5.18", "--json", "--strict")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["engine"]["version"] == "0.5.18"
    fence = next(a for a in report["adapters"] if a["adapter"] == "folded_fence")
    assert (fence["value"], fence["outcome"], fence["engine_check"]["outcome"]) == (None, "off", "applied")
    # 0.5.18 has one escape route only: no sampling-accept graph, no block_accept_lens view.
    assert fence["engine_check"]["reason"] == ("fenced TargetVerifyExecutor.accept_and_finalize; "
                                              "boundary check at DSparkWorkerV2.forward_batch_generation")
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
