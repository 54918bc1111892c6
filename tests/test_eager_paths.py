"""The eager decode path's kernel library calls, on the CPU: which path packs a site's tensors
and which compares them for the divergence report, told by the host-side logic the GPU runs
through.

The kernel library's CUDA code cannot run here (tests/test_snapshot_kernel.py loads a real
build and checks that it declines CPU tensors; tests/test_divergence_gpu.py and
tests/test_tp_nccl.py run it on GPUs). Here a tensor labelled CUDA (`on_cuda`: a CPU tensor
whose is_cuda says True) takes the CUDA branches, and the library is stood in by
`StandInLibrary`, whose pack lays the block out as the kernel does (int32 words, each field
16-byte aligned) with torch ops, so what broadcast() and observe() make of its results is
checked with values.
"""

from __future__ import annotations

import types

import pytest
import torch
import wrapt

from sglang_dsv41_adapters.folded_fence import accept_snapshot
from sglang_dsv41_adapters.spectpsync import broadcast as b
from sglang_dsv41_adapters.spectpsync.sites import Site
from sglang_dsv41_adapters.tp_divergence import before_0_5_19, divergence
from tests.log_lines import untimed

KERNEL = "/opt/k/dsv41_accept_snapshot.so"


class CudaLabelled(torch.Tensor):
    """A CPU tensor that says it is on CUDA: it takes the CUDA branches of the host logic."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


def on_cuda(t):
    return torch.Tensor._make_subclass(CudaLabelled, t)  # not a view of t (as_subclass makes one)


class InvertingGroup:
    """Rank 1's group in a world of one: "rank 0's value" is every bit of ours inverted, so
    a result that came through the broadcast is told from one that did not. Ours is what the
    tensor holds, or for a tensor like DRAFT (a site of one tensor, which the report has
    received apart) DRAFT's value."""

    world_size, rank_in_group = 2, 1

    def __init__(self):
        self.sent = []

    def broadcast(self, tensor, src=0):
        self.sent.append(tensor)
        if tensor.shape == DRAFT.shape and tensor.dtype == DRAFT.dtype:
            tensor.copy_(DRAFT)
        tensor.view(torch.uint8).bitwise_not_()
        return tensor


DRAFT = torch.arange(8)


class StandInLibrary:
    """The kernel library's pack / snapshot / receive / count_pair / count_divergence, made of torch ops
    (its report_sync, the C form of tp_divergence's wrapper, hands every call to the Python form)."""

    def __init__(self, packs=True, compares=True):
        self.packs, self.compares, self.calls = packs, compares, []

    def pack(self, tensors):
        self.calls.append(("pack", len(tensors)))
        if not self.packs:
            return []
        starts, words = [], 0
        for t in tensors:
            starts.append(words)
            words += -(-t.numel() * t.element_size() // 16) * 4
        block = torch.zeros(max(words, 1), dtype=torch.int32)
        out = [block]
        for t, start in zip(tensors, starts):
            n = t.numel() * t.element_size() // 4
            block[start:start + n].copy_(t.reshape(-1).view(torch.int32))
            out.append(block[start:start + n].view(t.dtype).view(t.shape))
        return [on_cuda(t) for t in out]  # the library's results are on the fields' GPU

    def snapshot(self, tensors):
        self.calls.append(("snapshot", len(tensors)))
        return [on_cuda(t.clone()) for t in tensors]  # the library's copies are on the fields' GPU

    def report_sync(self, around_sync, state, library, after, every):
        return around_sync  # the C form takes real CUDA tensors only: here every call is around_sync's

    def receive(self, like):
        self.calls.append(("receive",))
        return on_cuda(torch.empty_like(like))

    def count_pair(self, mine, theirs, counts, row, settle):
        return self.count_divergence([mine], [theirs], counts, row, settle, name="count_pair")

    def count_divergence(self, mine, theirs, counts, row, settle, name="count_divergence"):
        self.calls.append((name, len(mine), row) + (("settle",) if settle else ()))
        if not self.compares:
            return False
        e = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).view(-1, a.element_size()).any(1).sum())
                for a, b in zip(mine, theirs))
        counts[row] += torch.tensor([1, min(e, 1), e])
        if settle:
            for a, b in zip(mine, theirs):
                a.copy_(b)
        return True


@pytest.fixture(autouse=True)
def no_capture(monkeypatch):
    """No GPU here: the labelled tensors are never being captured."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def library(monkeypatch):
    """The stand-in served as the kernel library of this process; the decisions made anew."""
    lib = StandInLibrary()
    monkeypatch.setattr(accept_snapshot, "extension", lambda: lib)
    monkeypatch.setenv(accept_snapshot.PATH_ENV, KERNEL)
    yield lib
    reset()


@pytest.fixture
def no_library(monkeypatch):
    monkeypatch.setattr(accept_snapshot, "extension", lambda: None)
    monkeypatch.setattr(accept_snapshot, "copy_mode", lambda: ("clones", f"kernel not built ({KERNEL} missing)"))
    yield
    reset()


def reset():
    b.reset()
    b.use_kernel(True)
    divergence.use_kernel(True)
    divergence.forget()
    divergence.reset()


def triple(bs=5):
    """The accept triple as the engine returns it (int32, int64, int32), and a 2-D float field."""
    return [torch.arange(bs, dtype=torch.int32) + 7, torch.arange(bs, dtype=torch.int64) * (1 << 40) - 3,
            torch.arange(bs, dtype=torch.int32) - 2, torch.linspace(-1, 1, 2 * bs).view(2, bs).clone()]


def lines(capsys, what):
    return [line for line in untimed(capsys.readouterr().err) if what in line]


# --- packing ---------------------------------------------------------------------------------

def test_cuda_fields_go_in_one_block_made_by_the_library(library, capsys):
    group = InvertingGroup()
    b.bind_group(b.DSPARK, group)
    for _ in range(3):
        fields = [on_cuda(t) for t in triple()]
        kept = [t.clone() for t in fields]
        got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)
        # rank 0's values, in each field's own dtype and shape; the inputs as they were
        assert [(g.dtype, g.shape) for g in got] == [(t.dtype, t.shape) for t in kept]
        for g, t in zip(got, kept):
            assert torch.equal(g.view(torch.uint8), t.view(torch.uint8).bitwise_not())
        assert all(torch.equal(f, t) for f, t in zip(fields, kept))
    assert library.calls == [("pack", 4)] * 3
    assert [t.dtype for t in group.sent] == [torch.int32] * 3 and b.COUNTS[Site.DSPARK_ACCEPT_GRAPH] == 3
    assert lines(capsys, "packing") == [lines_for("one-launch block", KERNEL)]


def lines_for(mode, detail):
    import os

    return f"[sglang-adapters] pid={os.getpid()} rank=launcher rank0_broadcast packing: {mode} - {detail}"


def test_a_view_takes_rank_0s_values_in_place(library):
    b.bind_group(b.DSPARK, InvertingGroup())
    state = on_cuda(torch.arange(12, dtype=torch.int64))
    field = state[4:8]
    assert field._base is not None and not b.keeps_inputs([field, on_cuda(torch.ones(3, dtype=torch.int32))])
    got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, field, on_cuda(torch.ones(3, dtype=torch.int32)))
    assert got[0] is field and torch.equal(state[4:8], ~torch.arange(4, 8))


def test_fields_the_library_declines_go_by_concatenation_said_once_per_site(library, capsys):
    library.packs = False
    b.bind_group(b.DSPARK, InvertingGroup())
    for site in (Site.DSPARK_ACCEPT_GRAPH, Site.DSPARK_ACCEPT_GRAPH, Site.DFLASH_ACCEPT_SAMPLE):
        fields = [on_cuda(torch.tensor([True, False, True])), on_cuda(torch.arange(3, dtype=torch.int32))]
        got = b.broadcast(b.DSPARK, site, *fields)
        assert got[0].dtype == torch.bool and torch.equal(got[0].view(torch.uint8), ~torch.tensor([1, 0, 1], dtype=torch.uint8))
        assert torch.equal(got[1], ~torch.arange(3, dtype=torch.int32))
    said = lines(capsys, "rank0_broadcast packing")
    assert len(said) == 3 and said[0].endswith(f"one-launch block - {KERNEL}")
    assert [s.split("packing: ")[1].split(" -")[0] for s in said[1:]] == ["site 10 by concatenation",
                                                                       "site 14 by concatenation"]
    assert "not torch.bool, torch.int32" in said[1]


def test_without_the_kernel_file_concatenation_says_why(no_library, capsys):
    b.bind_group(b.DSPARK, InvertingGroup())
    fields = [on_cuda(t) for t in triple()]
    got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)
    assert torch.equal(got[1], ~triple()[1]) and torch.equal(fields[1], triple()[1]) and torch.equal(fields[3], triple()[3])
    assert lines(capsys, "packing") == [lines_for("concatenation", f"kernel not built ({KERNEL} missing)")]


def test_switched_off_for_a_comparison(library, capsys):
    b.use_kernel(False)
    b.bind_group(b.DSPARK, InvertingGroup())
    got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *[on_cuda(t) for t in triple()])
    assert torch.equal(got[0], ~triple()[0]) and library.calls == []
    assert lines(capsys, "packing") == [lines_for("concatenation", "switched off by use_kernel(False)")]


def test_cpu_tensors_pack_by_concatenation_without_a_probe(monkeypatch, capsys):
    monkeypatch.setattr(accept_snapshot, "extension", lambda: pytest.fail("probed for CPU tensors"))
    b.bind_group(b.DSPARK, InvertingGroup())
    try:
        got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *triple())
        assert [torch.equal(g, ~t) for g, t in zip(got[:3], triple())] == [True] * 3
        assert lines(capsys, "packing") == []
    finally:
        reset()


@pytest.mark.parametrize("fields, keeps", [
    (lambda: triple(), True),
    (lambda: triple()[:1], False),  # one tensor: broadcast in place
    (lambda: [torch.arange(6).view(2, 3).t(), torch.ones(2)], False),  # not contiguous: each in place
    (lambda: [torch.arange(6)[2:], torch.ones(2)], False),  # a view: takes the result in place
])
def test_which_broadcasts_leave_their_inputs_as_they_were(fields, keeps):
    assert b.keeps_inputs(fields()) is keeps


# --- the divergence report ---------------------------------------------------------------------

def compared(every=1000):
    return wrapt.FunctionWrapper(b.broadcast, before_0_5_19.compare_broadcast(every))


def test_a_packed_site_is_compared_in_one_fused_call_without_a_copy(library, capsys):
    b.bind_group(b.DSPARK, InvertingGroup())
    fields = [on_cuda(t) for t in triple()]
    for _ in range(4):
        compared()(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)
    # every element of the four fields differs from "rank 0's" (bits inverted)
    assert divergence.totals() == {"10:dspark-accept-graph": [4, 4, 4 * 25]}
    assert library.calls == [("pack", 4), ("count_divergence", 4, 10)] * 4  # no snapshot: the inputs are mine
    assert lines(capsys, "tp_divergence compare") == [
        lines_for("", "").replace("rank0_broadcast packing:  - ", f"tp_divergence compare: fused kernel - {KERNEL}")]


def test_an_in_place_site_is_received_apart_and_settled_in_one_call(library):
    b.bind_group(b.DSPARK, InvertingGroup())
    draft = on_cuda(DRAFT.clone())
    compared()(b.DSPARK, Site.DSPARK_DRAFT, draft)
    # rank 0's value received apart: no copy of ours first, and one call writes it over ours
    assert library.calls == [("receive",), ("count_pair", 1, 17, "settle")]
    assert divergence.totals() == {"17:dspark-draft": [1, 1, 8]} and torch.equal(draft, ~DRAFT)


def test_values_the_fused_kernel_declines_are_compared_with_torch_ops_said_once(library, capsys):
    library.compares = False
    b.bind_group(b.DSPARK, InvertingGroup())
    for _ in range(3):
        compared()(b.DSPARK, Site.DSPARK_DRAFT, on_cuda(DRAFT.clone()))
    assert divergence.totals() == {"17:dspark-draft": [3, 3, 24]}
    said = lines(capsys, "tp_divergence compare")
    assert len(said) == 2 and said[1].split("compare: ")[1].startswith("site 17:dspark-draft with torch ops")


def test_the_torch_path_counts_what_the_fused_one_counts(library):
    """The same calls through both paths: equal counters (the stand-in compares bits as the kernel does)."""
    b.bind_group(b.DSPARK, InvertingGroup())
    totals = []
    for fused in (True, False):
        divergence.use_kernel(fused)
        divergence.forget()
        fields = [on_cuda(t) for t in triple()]
        for _ in range(3):
            compared()(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)
            compared()(b.DSPARK, Site.DSPARK_DRAFT, on_cuda(DRAFT.clone()))
        totals.append(divergence.totals())
    assert totals[0] == totals[1] == {"10:dspark-accept-graph": [3, 3, 75], "17:dspark-draft": [3, 3, 24]}


def test_without_the_kernel_file_torch_ops_compare_and_clones_copy(no_library, capsys):
    b.bind_group(b.DSPARK, InvertingGroup())
    compared()(b.DSPARK, Site.DSPARK_DRAFT, on_cuda(DRAFT.clone()))
    assert divergence.totals() == {"17:dspark-draft": [1, 1, 8]}
    said = lines(capsys, "tp_divergence compare")
    assert len(said) == 1 and said[0].endswith(f"compare: torch ops - kernel not built ({KERNEL} missing)")


def test_eager_calls_ask_about_capture_only_when_a_read_is_due(library, monkeypatch):
    """torch's capture query costs host time: asked at the counters' creation and at each read."""
    asked = []
    real = divergence._capturing
    monkeypatch.setattr(divergence, "_capturing", lambda t: asked.append(1) or real(t))
    b.bind_group(b.DSPARK, InvertingGroup())
    for _ in range(25):
        compared(every=10)(b.DSPARK, Site.DSPARK_DRAFT, on_cuda(DRAFT.clone()))
    assert divergence.totals() == {"17:dspark-draft": [25, 25, 200]}
    assert 3 <= len(asked) <= 5, len(asked)  # creation, reads at 10 and 20 (and a landed read's print)


def test_where_no_loader_was_offered_the_torch_paths_say_so(monkeypatch):
    """The registry imports folded_fence in every rank, which offers the library; without it, said."""
    from sglang_dsv41_adapters.spectpsync import library

    monkeypatch.setattr(library, "_loader", None)
    why = "its loader (folded_fence.accept_snapshot) is not imported in this process"
    assert b.packing_mode() == ("concatenation", why) and divergence.compare_mode() == ("torch ops", why)
    monkeypatch.undo()
    assert library._loader is accept_snapshot._offered  # importing accept_snapshot offered it


# --- the engine's SpecTpSync.sync (0.5.19+): rank 0's value received apart -----------------

class Rank0Group:
    """A TP group of two seen from rank `rank`: the broadcast writes rank 0's value (`rank0`)
    over a receiving rank's tensor, as a collective does, and leaves rank 0's own as it is."""

    world_size = 2

    def __init__(self, rank, rank0):
        self.rank_in_group, self.rank0, self.received = rank, rank0, []

    def broadcast(self, tensor, src=0):
        assert src == 0
        if self.rank_in_group:
            self.received.append(tensor)
            tensor.copy_(self.rank0)
        return tensor


@pytest.fixture
def report_on(monkeypatch):
    """The report switched on through the runtime, as every rank does (0.5.23's SpecTpSync.sync wrapped)."""
    from harness.doctored import DoctoredEngine
    from sglang_dsv41_adapters import tp_divergence as t
    from sglang_dsv41_adapters.framework import runtime

    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)  # the engine's default: all
    decision = runtime.decide({t.FLAG: "1"}, DoctoredEngine({}), names=(t.NAME,))
    assert decision.outcomes[0].state == runtime.APPLIED
    runtime.apply(decision)
    yield
    runtime.revert()


def skewed_draft(at=(2, 5)):
    mine, rank0 = torch.arange(8), torch.arange(8)
    rank0[list(at)] += 100
    return mine, rank0


@pytest.mark.parametrize("labelled", [True, False], ids=["fused", "torch-ops"])
def test_a_receiving_rank_compares_and_takes_rank0s_value_in_one_call(library, report_on, labelled):
    """No copy before the broadcast: sync receives into a tensor of its own, and one fused
    call (or torch ops) counts the difference and writes rank 0's value into the caller's."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    mine, rank0 = skewed_draft()
    if labelled:
        mine = on_cuda(mine)
    group = Rank0Group(1, rank0)
    assert SpecTpSync(group).sync(S.DSPARK_DRAFT, mine) is mine
    assert torch.equal(mine, rank0) and len(group.received) == 1 and group.received[0] is not mine
    assert library.calls == ([("receive",), ("count_pair", 1, 17, "settle")] if labelled else [])
    assert divergence.totals() == {"17:dspark-draft": [1, 1, 2]}


def test_rank0_sends_its_own_value_and_counts_the_call(library, report_on):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    mine, rank0 = skewed_draft()
    mine, kept = on_cuda(mine), mine.clone()
    group = Rank0Group(0, rank0)
    for _ in range(3):
        assert SpecTpSync(group).sync(S.DSPARK_DRAFT, mine) is mine
    assert torch.equal(mine, kept) and group.received == []
    assert library.calls == [("count_pair", 1, 17)] * 3
    assert divergence.totals() == {"17:dspark-draft": [3, 0, 0]}


def test_the_c_form_of_the_report_hands_what_it_does_not_take_to_the_python_form(sm80):
    """The real kernel file's report_sync (built for sm_80, loaded here): a CPU value, keywords,
    another argument count all go to the Python form with the very arguments, and its
    result or exception comes back. The call it takes itself (a contiguous CUDA value) is
    tests/test_divergence_gpu.py's."""
    kernel = accept_snapshot.load(str(sm80))[0]
    seen = []

    def around_sync(*args):
        seen.append(args)
        if len(args) != 4:
            raise TypeError("four arguments")
        return "python form"

    form = kernel.report_sync(around_sync, vars(divergence), kernel, divergence._after_count, 1000)
    site, values = object(), torch.arange(4)
    for args, kwargs in (((site, values), {}), ((site,), {"values": values}), ((site, values), None)):
        assert form(len, "instance", args, kwargs) == "python form"
        assert seen.pop() == (len, "instance", args, kwargs)
    with pytest.raises(TypeError, match="four arguments"):
        form(len, "instance")
    assert seen.pop() == (len, "instance")
