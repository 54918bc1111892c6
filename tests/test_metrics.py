"""The pack's state on the engine's own /metrics: several real processes record into one
PROMETHEUS_MULTIPROC_DIR, as the ranks of a server started with --enable-metrics do, and the
engine's own metrics route (sglang.srt.utils.common.add_prometheus_middleware) serves it."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from sglang_dsv41_adapters import ADAPTERS
from sglang_dsv41_adapters.framework import metrics, runtime
from harness import zygote
from harness.engines import metric_samples, served_metrics

ROUTE = "DSparkWorkerV2Output.next_draft_input.accept_lens <- DsparkVerifyEpilogue.commit_lens_buf"
SERVED_ROUTE = "SimpleNamespace.next_draft_input.accept_lens <- SimpleNamespace.commit_lens_buf"  # what rank_process copies
RANKS = 3


def rank_process(rank: int) -> None:
    """One rank: the label the plugin gives it, the decision and the apply every rank takes
    (runtime.apply_once, which records the outcomes), then what the fence records as it runs."""
    from sglang_dsv41_adapters.framework import log

    log.set_process_label(rank)
    decision = runtime.apply_once(os.environ)
    assert not decision.refused, decision.reasons
    metrics.copy_mode("one-launch" if rank else "clones")
    import types

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
            "group_min_memory": ("DSV41_GROUP_MIN_MEM", "off"), "tp_divergence": ("DSV41_TP_DIVERGENCE", "off")}
    assert sorted(want) == sorted(ADAPTERS)
    expected = {("sglang_adapters:adapter_outcome",
                 (("adapter", name), ("flag", flag), ("outcome", outcome), ("rank", str(rank)))): 1.0
                for rank in range(RANKS) for name, (flag, outcome) in want.items()}
    assert samples == expected
    # what `curl /metrics` shows, line for line
    assert ('sglang_adapters:adapter_outcome{adapter="folded_fence",flag="DSV41_FOLDED_FENCE",outcome="applied",'
            'rank="2"} 1.0') in served.splitlines()


def test_the_fences_copy_and_boundary_copies_are_served(served):
    assert metric_samples(served, "sglang_adapters:fence_copy_mode") == {
        ("sglang_adapters:fence_copy_mode", (("mode", "clones"), ("rank", "0"))): 1.0,
        ("sglang_adapters:fence_copy_mode", (("mode", "one-launch"), ("rank", "1"))): 1.0,
        ("sglang_adapters:fence_copy_mode", (("mode", "one-launch"), ("rank", "2"))): 1.0}
    copies = metric_samples(served, "sglang_adapters:fence_boundary_copies_total")
    assert copies == {("sglang_adapters:fence_boundary_copies_total", (("rank", str(r)), ("route", SERVED_ROUTE))): float(r)
                      for r in (1, 2)}


def test_nothing_is_recorded_without_the_engines_metrics(monkeypatch):
    monkeypatch.delenv(metrics.FOLDER, raising=False)
    metrics.reset()
    metrics.copy_mode("clones")
    metrics.count_boundary_copy(ROUTE)
    metrics.outcomes(runtime.decide({}), {})
    assert metrics.made() == []  # no metric made, nothing written
