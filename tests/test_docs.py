"""What the README and the recipe tell deployers, checked against the code and the
compatibility matrix: the release table, the exit statuses, the contributors' commands,
the release claims on 0.5.16, and the recipe's scripts run for real (docker and the two
servers' metrics stood in for)."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading

import pytest

import entrypoint
from adapter import runtime
from adapter.source_engine import SourceEngine
from tests.engines import ROOT, release_sources

sys.path.insert(0, str(ROOT / "tools"))
import release_table  # noqa: E402

README = (ROOT / "README.md").read_text()
RECIPE = ROOT / "recipes" / "dsv41-flash-tp4-dspark"


def test_release_tables_are_generated_from_the_matrix():
    assert release_table.main(["--check"]) == 0
    matrix = release_table.MATRIX.read_text()
    want = release_table.table(matrix)
    # judged without the server arguments: the memory probe is the pack's where DP attention may leave it per rank
    assert "| 0.5.19 - 0.5.23 | `DSV41_FOLDED_FENCE`, `DSV41_GROUP_MIN_MEM` | `DSV41_SPEC_TP_SYNC` | - |" in want
    # A matrix change shows up as a stale table.
    changed = matrix.replace("| 0.5.23 | applied |", "| 0.5.23 | refused |")
    assert changed != matrix and release_table.table(changed) != want
    assert "| 0.5.23 | `DSV41_GROUP_MIN_MEM` | `DSV41_SPEC_TP_SYNC` | `DSV41_FOLDED_FENCE` |" in release_table.table(changed)


def test_the_0_5_16_claim_holds_on_its_sources():
    engine = SourceEngine(release_sources("0.5.16"))
    outcome = lambda value: runtime.decide({"DSV41_SPEC_TP_SYNC": value}, engine, names=("rank0_broadcast",)).outcomes[0].state
    assert (outcome("all"), outcome("all,-dspark-draft")) == (runtime.REFUSED, runtime.APPLIED)
    recipe = (RECIPE / "README.md").read_text()
    assert "on 0.5.16 `DSV41_SPEC_TP_SYNC=all` is refused, use\n`all,-dspark-draft` there" in recipe
    assert "On 0.5.16 `DSV41_SPEC_TP_SYNC=all` is refused" in README


def test_readme_exit_statuses_are_the_commands():
    block = README[README.index("<!-- exit-statuses"):README.index("<!-- /exit-statuses -->")]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", block, re.M)
    assert [(int(code), meaning) for code, meaning in rows] == list(entrypoint.EXIT_STATUSES)


def test_readme_is_for_deployers_first_and_keeps_the_contributors_two_commands():
    sections = re.findall(r"^## (.+)$", README, re.M)
    assert sections[:3] == ["Do you need it?", "Quick start (Docker)", "Checking a running container"]
    assert sections.index("For contributors: the two commands") > sections.index("Rollout, canary, rollback")
    assert "bash scripts/setup.sh && .venv/bin/python entrypoint.py doctor    #" in README
    assert "\nbash scripts/test.sh   " in README
    assert (ROOT / "scripts" / "setup.sh").exists() and (ROOT / "scripts" / "test.sh").exists()


# --- run.sh with docker stood in for -------------------------------------------------------

def run_recipe(tmp_path, **env) -> list[list[str]]:
    """run.sh with a `docker` on PATH that records each call's arguments, one per line."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\necho "--" >> {calls}\n')
    fake.chmod(0o755)
    environ = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "MODEL_DIR": "/srv/m"} | env
    done = subprocess.run(["bash", str(RECIPE / "run.sh"), "--log-level=info"], env=environ, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = calls.read_text()
    return [call.strip("\n").split("\n") for call in text.split("--\n") if call.strip()]


def test_run_sh_removes_the_old_container_and_takes_four_gpus(tmp_path):
    remove, run = run_recipe(tmp_path)
    assert remove == ["rm", "-f", "dsv41-flash-tp4-dspark"]
    assert run[run.index("--gpus") + 1] == '"device=0,1,2,3"'
    assert run[run.index("--env-file") + 1] == str(RECIPE / "adapters.env")
    assert "/srv/m:/models/DeepSeek-V4.1-Flash:ro" in run and run[-1] == "--log-level=info"
    assert not any("draft" in arg for arg in run)


def test_run_sh_mounts_a_draft_model_and_takes_extra_env(tmp_path):
    _, run = run_recipe(tmp_path, DRAFT_DIR="/srv/draft", EXTRA_ENV="-e DSV41_ADAPTERS=off", GPUS="device=4,5,6,7")
    assert "/srv/draft:/models/draft:ro" in run and "--speculative-draft-model-path=/models/draft" in run
    assert run[run.index("--gpus") + 1] == '"device=4,5,6,7"'
    assert run[run.index("DSV41_ADAPTERS=off") - 1] == "-e"


# --- canary.sh against two metrics endpoints ---------------------------------------------------

def metrics_server(accept: float, tokens_per_read: int):
    """An endpoint in the engine's exposition format: the accept-length gauge per TP rank, and a
    token counter that grows with every read."""
    state = {"tokens": 1000}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            state["tokens"] += tokens_per_read
            labels = 'model_name="deepseek-v4.1-flash",engine_type="unified"'
            body = "".join(f'sglang:spec_accept_length{{{labels},tp_rank="{r}"}} {accept}\n' for r in range(4))
            body += f'sglang:spec_accept_length_other{{{labels}}} 99\n'
            body += f'sglang:generation_tokens_total{{{labels},is_streaming="true"}} {state["tokens"]}.0\n'
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("canary_accept,canary_tokens,verdict", [(3.0, 500, "PASS"), (2.9, 500, "FAIL"), (3.0, 400, "FAIL")])
def test_canary_sh_compares_the_engines_metrics(canary_accept, canary_tokens, verdict):
    base, canary = metrics_server(3.0, 500), metrics_server(canary_accept, canary_tokens)
    try:
        done = subprocess.run(["bash", str(RECIPE / "canary.sh"), f"http://127.0.0.1:{base.server_port}",
                               f"http://127.0.0.1:{canary.server_port}"],
                              env={**os.environ, "DURATION": "2", "INTERVAL": "1"}, capture_output=True, text=True,
                              timeout=60)
    finally:
        base.shutdown()
        canary.shutdown()
    assert done.returncode == (0 if verdict == "PASS" else 1), done.stdout + done.stderr
    assert done.stdout.startswith(f"canary {verdict}: spec_accept_length {canary_accept:.3f} vs 3.000 (min 0.98x)")
