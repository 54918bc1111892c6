"""The pack's lines (adapter.framework.log): each names its process's rank, JSON mode has a timestamp,
and a scheduler is labelled with its rank as the engine places it (0.5.18: the Scheduler's
arguments; 0.5.23: the engine's published parallel context)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from sglang_dsv41_adapters.framework import log
from harness.engines import ROOT, engine_env, python
from harness import zygote


@pytest.fixture
def label(monkeypatch):
    log.reset()


def test_text_and_json_lines(label, monkeypatch, capsys):
    monkeypatch.delenv(log.LOG_FORMAT, raising=False)
    assert log.emit("hello", site="x") == f"[sglang-adapters] pid={os.getpid()} rank=launcher hello"
    log.set_process_label(3)
    monkeypatch.setenv(log.LOG_FORMAT, "json")
    line = log.emit("hello", site="x")
    text, json_line = capsys.readouterr().err.splitlines()
    assert re.fullmatch(rf"\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\] \[sglang-adapters\] pid={os.getpid()} rank=launcher hello",
                        text), text
    assert json_line == line  # the object alone: it has its own time
    found = json.loads(line)
    assert {k: found[k] for k in ("pack", "pid", "rank", "message", "site")} == {
        "pack": "sglang-adapters", "pid": os.getpid(), "rank": "3", "message": "hello", "site": "x"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", found["time"])
    assert list(found)[:2] == ["pack", "time"]


def _bound_init(scheduler_class):
    return scheduler_class.__init__.__get__(object.__new__(scheduler_class))


def test_a_0_5_23_scheduler_is_labelled_from_the_engines_parallel_context(label):
    """0.5.21+ build Scheduler(server_args, port_args) after publishing the rank: the label
    comes from the engine's own get_parallel()."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_parallel

    init = _bound_init(Scheduler)
    with get_parallel().override(tp_rank=2, pp_rank=0, dp_rank=None):
        assert log.label_scheduler(init, (None, None), {}) == "2" == log.process_label()
    with get_parallel().override(tp_rank=1, pp_rank=1, dp_rank=3):
        assert log.label_scheduler(init, (), {"server_args": None, "port_args": None}) == "dp3-pp1-1"


def test_a_scheduler_that_cannot_be_placed_is_still_no_launcher(label):
    from sglang.srt.managers.scheduler import Scheduler

    assert log.label_scheduler(_bound_init(Scheduler), (None, None), {}) in ("scheduler", "0")
    assert log.label_scheduler(lambda: None, (1, 2, 3), {}) == "scheduler"


def test_a_0_5_18_scheduler_is_labelled_from_its_arguments():
    """0.5.16-0.5.20: Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank,
    attn_cp_rank, moe_dp_rank, dp_rank), as run_scheduler_process calls it."""
    code = ("from sglang.srt.managers.scheduler import Scheduler; from sglang_dsv41_adapters.framework import log; "
            "init = Scheduler.__init__.__get__(object.__new__(Scheduler)); "
            "print(log.label_scheduler(init, (None, None, 3, 3, 0, 0, 0, 0, None), {})); "
            "print(log.label_scheduler(init, (None, None, 1, 1, 0, 1, 0, 0, 2), {}))")
    done = zygote.run([python(), "-c", code], cwd=ROOT, env=engine_env("0.5.18"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["3", "dp2-pp1-1"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_stderr_that_cannot_be_written_loses_the_lines_not_the_process():
    """stderr on a full disk (/dev/full fails every write with ENOSPC): the wrapper's lines are
    lost, and it still runs the command, whose status is its own."""
    path = f"{os.path.dirname(python())}{os.pathsep}{os.environ['PATH']}"
    with open("/dev/full", "w") as full:
        done = zygote.run([python(), "entrypoint.py", "python", "-c", "print('ran'); raise SystemExit(7)"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=full, text=True, timeout=240,
                          env=engine_env("0.5.23", PATH=path, DSV41_FOLDED_FENCE="1"))
    assert (done.returncode, done.stdout) == (7, "ran\n")


def test_lines_take_the_engines_format_and_level_where_it_configured_logging():
    """In a scheduler the engine's configure_logger runs before Scheduler(...): the pack's lines
    then read as the engine's, `[time TP2] [sglang-adapters] ...`, and follow its --log-level."""
    code = ("import types; from sglang.srt.utils.common import configure_logger; "
            "from sglang_dsv41_adapters.framework import log; "
            "configure_logger(types.SimpleNamespace(log_level='{level}'), prefix=' TP2'); "
            "log.set_process_label(2); log.emit('an outcome'); log.emit('a refusal', fatal=True)")
    seen = {}
    for level in ("info", "warning"):
        done = zygote.run([python(), "-c", code.format(level=level)], cwd=ROOT, env=engine_env("0.5.23"),
                          capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[level] = [line for line in done.stderr.splitlines() if "[sglang-adapters]" in line]
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP2\] \[sglang-adapters\] pid=\d+ rank=2 "
    assert [re.fullmatch(stamp + r"(.*)", line)[1] for line in seen["info"]] == ["an outcome", "a refusal"], seen
    assert [re.fullmatch(stamp + r"(.*)", line)[1] for line in seen["warning"]] == ["a refusal"], seen


def test_the_packs_lines_go_through_pythons_logging(label, monkeypatch, capsys):
    import logging

    monkeypatch.delenv(log.LOG_FORMAT, raising=False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.logger.addHandler(handler)
    try:
        log.emit("through logging")
    finally:
        log.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [f"[sglang-adapters] pid={os.getpid()} rank=launcher through logging"]
    assert records[0].name == "sglang_dsv41_adapters" and records[0].levelno == logging.INFO
    assert capsys.readouterr().err.endswith("] [sglang-adapters] pid=%d rank=launcher through logging\n" % os.getpid())


def test_a_reason_too_long_for_its_line_keeps_its_fix_whole_and_cuts_at_a_word():
    from sglang_dsv41_adapters.framework import oneline

    refused = ("sglang 0.5.16: before_0_5_19:DRAFT_SAMPLER: is missing: the graph-folded draft path is not covered "
               "(drop dspark-draft from the flag, e.g. all,-dspark-draft)")
    assert oneline.fit(refused, 110) == ("fix: drop dspark-draft from the flag, e.g. all,-dspark-draft; sglang 0.5.16: "
                                         "before_0_5_19:DRAFT_SAMPLER...")
    assert oneline.fit(refused, 500) == refused  # what fits is left whole
    bad = "a window 5 exceeds 4 (pad 4); safe: --block-size 3 or lower; other targets: switch X off there"
    assert oneline.fit(bad, 60) == "safe: --block-size 3 or lower; a window 5 exceeds 4..."
    assert oneline.fit("one two three four five six seven", 20) == "one two three..."  # never mid-word
    assert oneline.cut("fenced TargetVerifyExecutor.accept_and_finalize; fenced", 40) == "fenced TargetVerifyExecutor..."


def test_a_line_said_while_another_thread_imports_torch_distributed_is_the_launchers(label, monkeypatch, capsys):
    """A progress line fires from its own thread while the main thread imports the engine: torch.distributed
    may sit in sys.modules half initialised then (seen under load: `partially initialized module
    'torch.distributed' has no attribute 'is_initialized'`), and the line must still be said."""
    import sys
    import types

    from sglang_dsv41_adapters.framework import progress

    half = types.ModuleType("torch.distributed")
    half.is_available = lambda: True  # is_initialized not defined yet: the import is under way
    monkeypatch.setitem(sys.modules, "torch.distributed", half)
    assert log.process_label() == log.LAUNCHER
    with progress.step("importing", first=0.05, every=10):
        import time
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "rank=launcher progress: importing (0 s)" in err and "Traceback" not in err, err
