"""Progress lines: a step a person waits on says so on stderr once it has run a second, then
about every 10 s, and never after it ended; doctor and the wrapper's checks say theirs."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import time

from sglang_dsv41_adapters.framework import progress
from harness.engines import ROOT, engine_env, python
from tests.test_cli import run_cli

LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \[sglang-adapters\] pid=\d+ rank=launcher progress: (.*) \((\d+) s\)")


def test_a_step_says_it_runs_then_keeps_saying_and_stops_when_it_ends(capsys):
    with progress.step("waiting on purpose", first=0.2, every=0.3):
        time.sleep(1.0)
    time.sleep(0.5)  # nothing more once the step ended
    said = [LINE.fullmatch(line) for line in capsys.readouterr().err.splitlines()]
    assert all(said) and [m[1] for m in said] == ["waiting on purpose"] * len(said), said
    assert 3 <= len(said) <= 4, said
    with progress.step("quick"):
        pass
    assert capsys.readouterr().err == ""  # a step that ends within a second is not waited on


def test_doctor_and_the_wrapper_say_what_they_are_doing_on_stderr():
    doctor = run_cli("doctor", "--json")
    # a plain process, as a container starts: the engine imported cold (a warm zygote checks within a second)
    env = {**engine_env("0.5.23", DSV41_FOLDED_FENCE="1"), "PATH": f"{pathlib.Path(python()).parent}{os.pathsep}{os.environ['PATH']}"}
    wrapper = subprocess.run([python(), "entrypoint.py", "--", "python3", "-c", "print('ran')"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=240)
    assert doctor.returncode == wrapper.returncode == 0, doctor.stderr[-2000:] + wrapper.stderr[-2000:]
    said = [LINE.fullmatch(line) for line in doctor.stderr.splitlines() if " progress: " in line]
    assert all(said) and any(m[1].startswith("doctor: judging 5 adapters and the ranks' plugin loading on the engine at ")
                             for m in said), doctor.stderr[-2000:]
    assert doctor.stdout.lstrip().startswith("{")  # stdout stays the report alone
    said = [LINE.fullmatch(line) for line in wrapper.stderr.splitlines() if " progress: " in line]
    assert all(said) and "checking the flags and the engine before running python3" in [m[1] for m in said], wrapper.stderr[-2000:]
