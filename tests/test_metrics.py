"""The pack's state on the engine's own /metrics: several real processes record into one
PROMETHEUS_MULTIPROC_DIR, as the ranks of a server started with --enable-metrics do, and the
engine's own metrics route (sglang.srt.utils.common.add_prometheus_middleware) serves it."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess

import pytest

from sglang_dsv41_adapters import ADAPTERS
from sglang_dsv41_adapters.framework import metrics, runtime
from harness import zygote
from harness.engines import metric_samples, served_metrics
from tests.test_cli import pack_lines, run_cli
from tests.test_plugin import spawn_rank

ROUTE = "DSparkWorkerV2Output.next_draft_input.accept_lens <- DsparkVerifyEpilogue.commit_lens_buf"
SERVED_ROUTE = "SimpleNamespace.next_draft_input.accept_lens <- SimpleNamespace.commit_lens_buf"  # what rank_process copies
RANKS = 3
PATCHED = ["folded_fence:_block_accept_lens", "folded_fence:accept_and_finalize",
           "folded_fence:forward_batch_generation", "folded_fence:run"]  # a rank's, fence on (the guard aside)


def ranked(rank, **labels) -> tuple:
    """A sample's labels: its own, the engine's rank labels and the deprecated `rank`."""
    ranks = {"tp_rank": str(rank), "pp_rank": "0", "dp_rank": ""} if str(rank).isdigit() else \
        {"tp_rank": "", "pp_rank": "", "dp_rank": ""}
    return tuple(sorted({**labels, **ranks, "rank": str(rank)}.items()))


def rank_process(rank: int) -> None:
    """One rank: the label the plugin gives it, the decision and the apply every rank takes
    (runtime.apply_once, which records the outcomes), then what the fence records as it runs."""
    from sglang_dsv41_adapters.framework import log

    log.set_process_label(rank)
    decision = runtime.apply_once(os.environ)
    assert not decision.refused, decision.reasons
    metrics.copy_mode("one-launch" if rank else "clones")
    import types

    # an engine series made as SchedulerMetricsCollector makes it (whose constructor needs the engine's
    # published runtime context): its name, mode and the labels it gives a scheduler without a DP controller
    import prometheus_client

    labels = {"model_name": "m", "engine_type": "unified", "tp_rank": rank, "pp_rank": 0, "moe_ep_rank": 0}
    prometheus_client.Gauge("sglang:num_running_reqs", "The number of running requests.", labelnames=labels.keys(),
                            multiprocess_mode="mostrecent").labels(**labels).set(10 + rank)

    import torch

    from sglang_dsv41_adapters.folded_fence import fence_boundary

    # rank r hands r results holding a view of a verify buffer to the fence's boundary check
    epilogue = types.SimpleNamespace(commit_lens_buf=torch.zeros(8, dtype=torch.int32))
    for _ in range(rank):
        result = types.SimpleNamespace(next_draft_input=types.SimpleNamespace(accept_lens=epilogue.commit_lens_buf[:4]))
        _, routes = fence_boundary.detach_escapes(result, epilogue)
        assert routes == [SERVED_ROUTE]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    context = multiprocessing.get_context("spawn")  # the engine's start method for its ranks
    saved = dict(os.environ)
    os.environ.update(PROMETHEUS_MULTIPROC_DIR=str(folder), DSV41_FOLDED_FENCE="1", DSV41_SPEC_TP_SYNC="all")
    try:
        children = [context.Process(target=rank_process, args=(rank,)) for rank in range(RANKS)]
        with zygote.warm_spawn(context):  # one warm parent for the three (harness.zygote)
            for child in children:
                child.start()
        for child in children:
            child.join(timeout=240)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert [child.exitcode for child in children] == [0] * RANKS
    return served_metrics(folder)


def test_each_ranks_adapter_outcomes_are_served(served):
    samples = metric_samples(served, "sglang_adapters:adapter_outcome")
    want = {"folded_fence": ("DSV41_FOLDED_FENCE", "applied"), "rank0_broadcast": ("DSV41_SPEC_TP_SYNC", "superseded"),
            "group_min_memory": ("DSV41_GROUP_MIN_MEM", "off"), "tp_divergence": ("DSV41_TP_DIVERGENCE", "off"),
            "known_bad_config": ("DSV41_KNOWN_BAD_CONFIG", "off")}
    assert sorted(want) == sorted(ADAPTERS)
    expected = {("sglang_adapters:adapter_outcome", ranked(rank, adapter=name, flag=flag, outcome=outcome)): 1.0
                for rank in range(RANKS) for name, (flag, outcome) in want.items()}
    assert samples == expected
    # what `curl /metrics` shows, line for line
    assert ('sglang_adapters:adapter_outcome{adapter="folded_fence",dp_rank="",flag="DSV41_FOLDED_FENCE",'
            'outcome="applied",pp_rank="0",rank="2",tp_rank="2"} 1.0') in served.splitlines()


def test_the_packs_series_join_the_engines_by_its_own_rank_labels(served):
    """`sglang:num_running_reqs * on(tp_rank, pp_rank, dp_rank) group_left sglang_adapters:adapter_outcome`,
    as PromQL joins them (a label a series lacks matches as ""): one pair per rank, no label_replace."""
    engine = metric_samples(served, "sglang:num_running_reqs")
    pack = metric_samples(served, "sglang_adapters:adapter_outcome")
    on = ("tp_rank", "pp_rank", "dp_rank")

    def key(labels):
        return tuple(dict(labels).get(name, "") for name in on)

    fence = {key(labels): dict(labels)["outcome"] for (_, labels), _ in pack.items() if dict(labels)["adapter"] == "folded_fence"}
    joined = {key(labels): (value, fence.get(key(labels))) for (_, labels), value in engine.items()}
    assert joined == {(str(r), "0", ""): (10.0 + r, "applied") for r in range(RANKS)}, (engine, fence)
    assert all("dp_rank" not in dict(labels) for (_, labels) in engine)  # the engine's own: no DP controller here


def test_the_fences_copy_and_boundary_copies_are_served(served):
    assert metric_samples(served, "sglang_adapters:fence_copy_mode") == {
        ("sglang_adapters:fence_copy_mode", ranked(0, mode="clones")): 1.0,
        ("sglang_adapters:fence_copy_mode", ranked(1, mode="one-launch")): 1.0,
        ("sglang_adapters:fence_copy_mode", ranked(2, mode="one-launch")): 1.0}
    copies = metric_samples(served, "sglang_adapters:fence_boundary_copies_total")
    assert copies == {("sglang_adapters:fence_boundary_copies_total", ranked(r, route=SERVED_ROUTE)): float(r)
                      for r in (1, 2)}


def test_nothing_is_recorded_without_the_engines_metrics(monkeypatch):
    monkeypatch.delenv(metrics.FOLDER, raising=False)
    metrics.reset()
    metrics.copy_mode("clones")
    metrics.count_boundary_copy(ROUTE)
    metrics.outcomes(runtime.decide({}), {})
    assert metrics.made() == []  # no metric made, nothing written


def test_whether_metrics_are_on_follows_the_environment_as_os_environ_reads_it(monkeypatch, tmp_path):
    """enabled() reads os.environ's own dict (a step's count asks it): set, replaced, deleted,
    cleared and set again, monkeypatched, and a mapping passed in, it answers as `in` does."""
    monkeypatch.delenv(metrics.FOLDER, raising=False)
    metrics.reset()
    seen = []
    for change in (lambda: os.environ.__setitem__(metrics.FOLDER, str(tmp_path)),
                   lambda: os.environ.update({metrics.FOLDER: "/elsewhere"}),
                   lambda: os.environ.pop(metrics.FOLDER),
                   lambda: monkeypatch.setenv(metrics.FOLDER, str(tmp_path)),
                   lambda: monkeypatch.delenv(metrics.FOLDER),
                   lambda: os.environ.setdefault(metrics.FOLDER, str(tmp_path))):
        change()
        seen.append(metrics.enabled())
        assert seen[-1] is (metrics.FOLDER in os.environ)
        assert metrics.enabled({}) is False and metrics.enabled({metrics.FOLDER: "x"}) is True
    assert seen == [True, True, False, True, False, True]
    saved = dict(os.environ)
    try:
        os.environ.clear()
        assert metrics.enabled() is False
    finally:
        os.environ.update(saved)
    assert metrics.enabled() is True
    metrics._stop("a test")  # stopped: off whatever the environment says
    assert metrics.enabled() is False and metrics.enabled({metrics.FOLDER: "x"}) is False
    metrics.reset()
    os.environ.pop(metrics.FOLDER)


# --- a folder the pack cannot write: one line, never a crash; the whole pack off: nothing --------

def as_file(folder):
    folder.write_text("not a folder\n")


def missing(folder):
    pass


def under_a_file(folder):
    folder.parent.rmdir()
    folder.parent.write_text("not a folder\n")  # the path's parent is a file


@contextlib.contextmanager
def read_only(folder):
    """A folder root cannot write in either: the file system's immutable attribute (chattr +i),
    which root's permission override does not pass (a mode of 0o500 would not stop root)."""
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable attribute (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


UNWRITABLE = {"a file": as_file, "a missing folder": missing, "a path under a file": under_a_file,
              "a read-only folder": read_only}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One path for every case, so one warm parent serves them all (harness.zygote): the
    cases change what lies there."""
    return tmp_path_factory.mktemp("metrics-cases") / "parent" / "prometheus"


def emptied(folder):
    """`folder`'s parent as a new empty folder, whatever an earlier case left there."""
    if folder.parent.is_file():
        folder.parent.unlink()
    shutil.rmtree(folder.parent, ignore_errors=True)
    folder.parent.mkdir(parents=True)


@contextlib.contextmanager
def laid_out(folder, case):
    """`folder` as `case` makes it, checked to refuse a file even to root."""
    emptied(folder)
    made = UNWRITABLE[case](folder)
    with made if made is not None else contextlib.nullcontext():
        with pytest.raises(OSError):
            open(folder / "probe.db", "a+b")  # what prometheus_client does first in the folder
        yield


def metric_lines(stderr: str) -> list[str]:
    return [line for line in pack_lines(stderr) if "metrics" in line or metrics.FOLDER in line]


@pytest.mark.parametrize("off", [False, True], ids=["pack on", "DSV41_ADAPTERS=off"])
@pytest.mark.parametrize("case", sorted(UNWRITABLE))
def test_the_wrapper_with_a_folder_it_cannot_write_says_so_once_and_runs_the_command(folder, case, off):
    with laid_out(folder, case):
        before = folder.read_bytes() if folder.is_file() else None
        done = run_cli("python", "-c", "raise SystemExit(7)", PROMETHEUS_MULTIPROC_DIR=str(folder),
                       DSV41_FOLDED_FENCE="1", **({"DSV41_ADAPTERS": "off"} if off else {}))
        assert done.returncode == 7 and "Traceback" not in done.stderr, done.stderr[-3000:]  # the command's status
        if off:  # the rollback: one line, the master switch's, and nothing about metrics
            assert [line.split(" ", 3)[3] for line in pack_lines(done.stderr)] == [
                "DSV41_ADAPTERS='off': OFF - the whole pack is off: no adapter is decided or applied in this process "
                "(sglang 0.5.23)"]
        else:
            assert "folded_fence DSV41_FOLDED_FENCE='1': APPLIED" in done.stderr
            (line,) = metric_lines(done.stderr)
            assert f"metrics: none from the pack in this process: {metrics.FOLDER}='{folder}' cannot be written (" in line
        if before is not None:
            assert folder.read_bytes() == before
        assert not folder.is_dir() or os.listdir(folder) == []


@pytest.mark.parametrize("off", [False, True], ids=["pack on", "DSV41_ADAPTERS=off"])
def test_the_wrapper_records_into_a_good_folder_and_nothing_when_the_pack_is_off(folder, off):
    emptied(folder)
    folder.mkdir()
    done = run_cli("python", "-c", "import os; print(os.getpid())", PROMETHEUS_MULTIPROC_DIR=str(folder),
                   DSV41_FOLDED_FENCE="1", **({"DSV41_ADAPTERS": "off"} if off else {}))
    assert done.returncode == 0 and metric_lines(done.stderr) == [], done.stderr[-3000:]
    if off:
        assert os.listdir(folder) == []  # not a file: the rollback writes nothing there
    else:
        assert os.listdir(folder) == [f"gauge_mostrecent_{done.stdout.strip()}.db"]  # exec: the same pid
        samples = metric_samples(served_metrics(folder), "sglang_adapters:adapter_outcome")
        assert samples[("sglang_adapters:adapter_outcome", ranked("launcher", adapter="folded_fence",
                                                                  flag="DSV41_FOLDED_FENCE", outcome="applied"))] == 1.0


def rank_then_folder_removed(folder: str) -> None:
    """A rank that recorded its outcomes at start-up, whose folder is then removed (a
    cleanup job, a restarted sidecar): the fence's boundary check counts its first copy on
    the decode path, where prometheus_client makes the counter's file."""
    import shutil
    import types

    import torch

    from sglang_dsv41_adapters.folded_fence import fence_boundary
    from sglang_dsv41_adapters.framework import log

    log.set_process_label(1)
    assert not runtime.apply_once(os.environ).refused
    assert [name.split("_")[0] for name in os.listdir(folder)] == ["gauge"]
    shutil.rmtree(folder)
    epilogue = types.SimpleNamespace(commit_lens_buf=torch.zeros(8, dtype=torch.int32))
    for step in range(3):  # three decode steps: each copy is made, the line said once
        result = types.SimpleNamespace(next_draft_input=types.SimpleNamespace(accept_lens=epilogue.commit_lens_buf[:4]))
        copied, routes = fence_boundary.detach_escapes(result, epilogue)
        assert routes == [SERVED_ROUTE]
        assert copied.next_draft_input.accept_lens.data_ptr() != epilogue.commit_lens_buf.data_ptr()
    assert metrics.stopped().startswith(f"{metrics.FOLDER}={folder!r} cannot be written (FileNotFoundError: ")


def test_a_counter_first_made_after_the_folder_is_gone_stops_the_metrics_not_the_step(folder, monkeypatch, capfd):
    emptied(folder)
    folder.mkdir()
    monkeypatch.setenv(metrics.FOLDER, str(folder))
    monkeypatch.setenv("DSV41_FOLDED_FENCE", "1")
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=rank_then_folder_removed, args=(str(folder),))
    with zygote.warm_spawn(context):
        child.start()
    child.join(timeout=240)
    assert child.exitcode == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    (line,) = metric_lines(err)
    assert " rank=1 metrics: none from the pack in this process: " in line and "counter_" in line


@pytest.mark.parametrize("off", [False, True], ids=["pack on", "DSV41_ADAPTERS=off"])
@pytest.mark.parametrize("good", [False, True], ids=["a file", "a good folder"])
def test_a_rank_loading_the_pack_through_the_plugin_gets_as_far_as_without_metrics(folder, good, off, monkeypatch,
                                                                                   tmp_path, capfd):
    """The engine's own plugin loader, then Scheduler(...) (tests.test_plugin): with the
    adapters applied at its start, the engine's own constructor runs, as far as it goes on
    placeholder arguments (its own error, not one of the pack's)."""
    monkeypatch.setenv(metrics.FOLDER, str(folder))
    if off:
        monkeypatch.setenv("DSV41_ADAPTERS", "off")
    emptied(folder)
    if good:
        folder.mkdir()
    else:
        as_file(folder)
    code, found = spawn_rank(monkeypatch, "1", tmp_path)
    assert code == 0 and found["patched"] == ([] if off else PATCHED) and found["guarded"], found
    assert found["constructor"] == "ValueError"  # the engine's own: "config namespace 'device' not published"
    lines = metric_lines(capfd.readouterr().err)
    if good:
        assert lines == [] and len(os.listdir(folder)) == (0 if off else 1)
    else:
        assert folder.read_text() == "not a folder\n" and len(lines) == (0 if off else 1), lines
