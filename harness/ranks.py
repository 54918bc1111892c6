"""Run one function in N real processes joined by a torch.distributed gloo group.

Each rank is a fresh interpreter (like the engine's spawned TP ranks) that can import
a chosen engine release. Every run has a timeout, so a rank that hangs in a
collective fails the test instead of stalling CI.

    results = run_ranks(2, "tests.sites:draft_case", release="0.5.18", kwargs={...})

The target is called as target(rank, world_size, **kwargs) after
`torch.distributed.init_process_group("gloo")`; it returns something JSON can carry.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

from . import zygote
from .engines import ROOT, engine_env, python

RESULT = "RANK-RESULT:"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, target: str, *, release: str = "0.5.23", kwargs: dict | None = None,
              env: dict[str, str] | None = None, timeout: float = 240, with_stderr: bool = False,
              warm: bool = True) -> list:
    """Each rank's result; with `with_stderr`, (result, what the rank wrote to stderr) pairs.
    `warm=False`: interpreters that import their engine themselves, for an environment used once
    (a tree's: a warm parent kept for it would cost its start and its memory for one command)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        child_env = engine_env(release, **(env or {}))
        child_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append((zygote.popen if warm else zygote.popen_once)(
            [python(), "-m", "harness._rank_main", target, json.dumps(kwargs or {})],
            cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs = finish(procs, target, timeout)
    results = []
    for rank, (code, out, err) in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith(RESULT)]
        if code != 0 or not lines:
            raise AssertionError(f"rank {rank} of {target} failed (exit {code}):\n{err[-4000:]}")
        result = json.loads(lines[-1][len(RESULT):])
        results.append((result, err) if with_stderr else result)
    return results


def finish(procs, target: str, timeout: float) -> list:
    """Each rank's (exit status, stdout, stderr), all within `timeout`; a rank still running
    then fails the test (and every rank is killed)."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{target} did not finish within {timeout}s on {len(procs)} ranks (a hang in a collective?)")
    finally:
        for proc in procs:
            proc.kill()
    return outputs
