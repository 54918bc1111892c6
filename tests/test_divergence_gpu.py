"""tp_divergence on a GPU: a broadcast site inside a captured CUDA graph counts on every
replay, with no host synchronisation (sglang 0.5.23 `SpecTpSync`, and the pack's own
broadcast that serves 0.5.16 - 0.5.18).

A single process, a world of one: the TP group is a stand-in for rank 1's, whose
"broadcast" writes rank 0's value as this rank's own plus `skew`, a device tensor the test
sets before each replay (a device op, no host sync). So a replay diverges exactly when the
skew is nonzero, by exactly the elements it covers. The counters are read only after
the replays; the replay loop runs under torch.cuda.set_sync_debug_mode("error"), so any
host synchronisation there raises. The real TP2 run over NCCL is tests/test_tp_nccl.py's.

With the kernel library (DSV41_ADAPTERS_SNAPSHOT_KERNEL, built by
bench/gpu/divergence.sh) the pack's broadcast packs several tensors into one block with one
launch and the report compares with one fused launch per site call; the counts equal the
torch ops' (the library switched off) inside and outside graphs, and the block keeps every
field's values, dtype and shape.

With DSV41_TP_DIVERGENCE=abort, eager calls start a read every call and look at
the landed one without waiting (sync debug mode "error"), and stop at the diverging call or
a later one once the copy lands; captured replays never stop (no Python runs), the next eager
calls do, naming the replay's call and both values recorded on the device.

Skipped without CUDA. On the GPU machine, with the pack and the sglang 0.5.23 sources on
PYTHONPATH: `python3 -m pytest tests/test_divergence_gpu.py -q -rA`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang_dsv41_adapters.folded_fence import accept_snapshot  # also offers the kernel library, as a rank's registry does
from sglang_dsv41_adapters.tp_divergence import divergence
from sglang_dsv41_adapters.framework import runtime
from sglang_dsv41_adapters import tp_divergence as t

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the counters must advance on CUDA graph replays"
)

BS, REPLAYS = 64, 40
SKEWED = frozenset(range(3, REPLAYS, 7))  # k = 6 of n = 40 replays


class SkewedGroup:
    """Rank 1's TP group in a world of one: rank 0's value is this rank's own (`own`, or
    without it what the tensor holds) plus `skew`, written over the tensor the broadcast is
    given, as a collective writes it (the engine's sync with the report on hands it a tensor
    of its own to receive into)."""

    world_size, rank_in_group = 2, 1

    def __init__(self, skew, own=None):
        self.skew, self.own = skew, own

    def broadcast(self, tensor, src=0):
        # on the device, where a captured broadcast writes; a tensor unlike `own` (a packed
        # block) is skewed in place
        own = self.own if self.own is not None and (tensor.shape, tensor.dtype) == (self.own.shape, self.own.dtype) \
            else tensor
        torch.add(own, self.skew, out=tensor)
        return tensor


@pytest.fixture
def report_on(monkeypatch):
    """The report switched on through the runtime, as every rank does (the installed engine
    judged without the plugin-delivery check: the pack may sit on PYTHONPATH here)."""
    from harness.doctored import DoctoredEngine

    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)  # the engine's default: all
    decision = runtime.decide({t.FLAG: "1", t.EVERY_FLAG: "8"}, DoctoredEngine({}), names=(t.NAME,))
    runtime.apply(decision)
    yield decision
    runtime.revert()
    divergence.reset()


def replay(graph, skew, steps=REPLAYS):
    """Replay `steps` times, the skew set on the device before each; no host sync allowed."""
    ones, zeros = torch.ones_like(skew), torch.zeros_like(skew)
    calls = divergence.calls()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            skew.copy_(ones if i in SKEWED else zeros)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert divergence.calls() == calls  # the replays ran no Python: the graph counts alone
    torch.cuda.synchronize()


def capture_and_replay(region, skew) -> None:
    """As sglang does: one eager warm-up (it makes the counters), then the region captured
    into a graph on a side stream, the counters zeroed, and the graph replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        region()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    divergence.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        region()
    replay(graph, skew)



def skewed_eager_calls(call, skew) -> None:
    """`call` REPLAYS times eagerly, rank 0's value skewed on the SKEWED calls, under sync debug
    mode "error" (an eager site call, its report included, must not wait for the device)."""
    ones, zeros = torch.ones_like(skew), torch.zeros_like(skew)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(REPLAYS):
            skew.copy_(ones if i in SKEWED else zeros)
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")

def target_site_ready(skew):
    """0.5.23's SpecTpSync for rank 1 over a SkewedGroup, its counters made by one eager call
    at site 11 and zeroed: (the SpecTpSync, the values rank 0's are `skew` away from)."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    values = torch.arange(BS, device="cuda")
    tp_sync = SpecTpSync(SkewedGroup(skew, values))
    tp_sync.sync(S.DSPARK_TARGET, values.clone())  # makes the counters
    torch.cuda.synchronize()
    divergence.reset()
    return tp_sync, values


def test_spec_tp_sync_site_counts_every_replay(report_on, capsys):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    assert report_on.outcomes[0].state == runtime.APPLIED
    device = torch.device("cuda")
    skew = torch.zeros((), dtype=torch.int64, device=device)
    source = torch.arange(BS, device=device)
    skewed, steady = SpecTpSync(SkewedGroup(skew, source)), SpecTpSync(SkewedGroup(torch.zeros_like(skew), source))
    accept, draft = torch.empty_like(source), torch.empty_like(source)

    def region():  # as DsparkVerifyEpilogue._accept and the folded draft sync inside their graphs
        accept.copy_(source)
        skewed.sync(S.DSPARK_ACCEPT_GRAPH, accept)
        draft.copy_(source)
        steady.sync(S.DSPARK_DRAFT, draft)

    capture_and_replay(region, skew)

    totals = divergence.totals()
    k = len(SKEWED)
    assert totals == {"10:dspark-accept-graph": [REPLAYS, k, k * BS], "17:dspark-draft": [REPLAYS, 0, 0]}
    assert torch.equal(accept, source)  # the last replay was not skewed: rank 0's value is ours
    lines = divergence.flush()
    assert len(lines) == 1 and "site=10:dspark-accept-graph" in lines[0]
    assert f"calls={REPLAYS} diverged_calls={k} diverged_elements={k * BS}" in lines[0]
    assert lines[0] in capsys.readouterr().err


def test_eager_calls_make_no_host_sync(report_on, capsys):
    """Eager site calls, reports included (every 8 calls: a copy to pinned memory, printed
    once it has landed), under sync debug mode "error"."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite as S

    skew = torch.zeros((), dtype=torch.int64, device="cuda")
    tp_sync, values = target_site_ready(skew)
    skewed_eager_calls(lambda: tp_sync.sync(S.DSPARK_TARGET, values.clone()), skew)
    divergence.flush()
    printed = [line for line in capsys.readouterr().err.splitlines() if "tp_divergence" in line]
    diverged = sum(int(line.split("diverged_calls=")[1].split()[0]) for line in printed)
    assert diverged == len(SKEWED) and len(printed) > 1
    assert divergence.totals() == {"11:dspark-target": [REPLAYS, len(SKEWED), len(SKEWED) * BS]}


def test_a_receiving_rank_holds_rank0s_value_after_sync_in_graphs_and_eagerly(report_on):
    """The report on, the engine's sync receives rank 0's value into a tensor of its own and
    one launch compares it with the caller's and writes it there: the caller's tensor holds
    rank 0's value after every call, eagerly and on every replay, skewed or not."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    skew = torch.zeros((), dtype=torch.int64, device="cuda")
    own = torch.arange(BS, device="cuda")
    tp_sync = SpecTpSync(SkewedGroup(skew, own))
    mine = torch.empty_like(own)

    def region():
        mine.copy_(own)
        assert tp_sync.sync(S.DSPARK_TARGET, mine) is mine

    for value in (3, 0, 5):
        skew.fill_(value)
        region()
        assert torch.equal(mine, own + value)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        region()
    for value in (7, 0, 2):
        skew.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(mine, own + value)
    # 3 eager calls and 3 replays (the capture itself runs nothing), 2 of each skewed
    assert divergence.totals() == {"11:dspark-target": [6, 4, 4 * BS]}


def test_pack_broadcast_counts_every_replay():
    """The pack's broadcast (0.5.16 - 0.5.18), the accept triple packed into one collective,
    with tp_divergence's wrapper as its plan installs it there."""
    import wrapt

    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.spectpsync.sites import Site

    device = torch.device("cuda")
    skew = torch.zeros((), dtype=torch.int64, device=device)
    b.bind_group(b.DSPARK, SkewedGroup(skew))
    compared = wrapt.FunctionWrapper(b.broadcast, t.before_0_5_19.compare_broadcast(1000))
    source = torch.arange(3 * BS, device=device).view(3, BS)
    triple = [torch.empty(BS, dtype=torch.int64, device=device) for _ in range(3)]

    def region():  # as rank0_broadcast's wrapper on accept_greedy_triton inside the verify graph
        for row, t_ in zip(source, triple):
            t_.copy_(row)
        compared(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *triple)

    try:
        capture_and_replay(region, skew)
        k = len(SKEWED)
        assert divergence.totals() == {"10:dspark-accept-graph": [REPLAYS, k, k * 3 * BS]}
    finally:
        b.reset()
        divergence.reset()


def test_first_call_inside_capture_is_refused():
    """A counter made inside capture would be zeroed by every replay: refused, naming the site."""
    from sglang_dsv41_adapters.spectpsync.sites import Site

    divergence.forget()
    values = torch.arange(BS, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="10:dspark-accept-graph first ran inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            divergence.observe(int(Site.DSPARK_ACCEPT_GRAPH), "dspark-accept-graph", [values.clone()], [values], 8)


# --- the kernel library's block and fused comparison (one launch each) ---------------------

# A kernel file named by the environment must serve (the scripts build it and name it); the
# default path is used where it is there.
needs_kernel = pytest.mark.skipif(
    not (os.environ.get(accept_snapshot.PATH_ENV) or os.path.isfile(accept_snapshot.kernel_path())),
    reason=f"no kernel file: {accept_snapshot.PATH_ENV} unset and nothing at {accept_snapshot.DEFAULT_PATH} "
           "(bench/gpu/divergence.sh and tp_nccl.sh build one and name it)")


def paths(kernel: bool) -> None:
    """Both paths: the kernel library's on, or off (concatenation, torch ops)."""
    from sglang_dsv41_adapters.spectpsync import broadcast as b

    b.use_kernel(kernel)
    divergence.use_kernel(kernel)


@needs_kernel
def test_the_kernel_library_serves_packing_and_comparing():
    from sglang_dsv41_adapters.spectpsync import broadcast as b

    assert b.packing_mode() == ("one-launch block", accept_snapshot.kernel_path())
    assert divergence.compare_mode() == ("fused kernel", accept_snapshot.kernel_path())


@needs_kernel
def test_the_c_form_serves_eager_calls_with_no_python_of_the_packs(report_on):
    """Once the first call labelled the site and made the counters, an eager sync call runs
    the C form (the kernel library's report_sync): the only frame of the pack's is the
    dispatcher; rank 0's value lands in the caller's tensor and the call is counted."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite as S

    skew = torch.zeros((), dtype=torch.int64, device="cuda")
    tp_sync, values = target_site_ready(skew)
    mine = values.clone()
    tp_sync.sync(S.DSPARK_TARGET, mine)  # binds the C form, if target_site_ready's call did not
    skew.fill_(1)
    frames = []
    sys.setprofile(lambda frame, event, arg: event == "call" and frames.append(
        (frame.f_globals.get("__name__", ""), frame.f_code.co_name)))
    try:
        assert tp_sync.sync(S.DSPARK_TARGET, mine) is mine
    finally:
        sys.setprofile(None)
    torch.cuda.synchronize()
    assert [name for module, name in frames if module.startswith("sglang_dsv41_adapters")] == ["around_sync_in_c"]
    assert torch.equal(mine, values + 1)
    assert divergence.totals() == {"11:dspark-target": [2, 1, BS]}


@needs_kernel
def test_a_receiving_rank_receives_into_one_kept_block_per_stream_fresh_under_capture():
    """The report's receive tensor: eagerly one block per stream, kept from call to call and
    grown as needed (the stream orders each call's read before the next call's broadcast); a
    call like the stream's last gets the same tensor back; inside graph capture a fresh tensor
    each call, never the eager block."""
    kernel = accept_snapshot.probed_extension()
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    like = torch.arange(BS, device="cuda")
    first, small = kernel.receive(like), kernel.receive(like[:7].to(torch.int32))
    assert (first.shape, first.dtype, first.is_contiguous(), first.device) == (like.shape, like.dtype, True, like.device)
    assert (small.shape, small.dtype) == ((7,), torch.int32) and storage(small) == storage(first)
    grown = kernel.receive(torch.zeros(4 * BS, 3, device="cuda"))
    assert grown.shape == (4 * BS, 3) and grown.untyped_storage().nbytes() >= 4 * BS * 3 * 4
    again = kernel.receive(like)
    assert storage(again) == storage(grown) and kernel.receive(like) is again  # the last one, not a new tensor
    assert kernel.receive(like.view(8, BS // 8)) is not again and kernel.receive(like.to(torch.int32)) is not again
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = kernel.receive(like)
    assert storage(on_side) != storage(grown)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = [kernel.receive(like), kernel.receive(like)]
    assert len({storage(c) for c in captured} | {storage(on_side), storage(grown)}) == 4
    assert [(c.shape, c.dtype) for c in captured] == [(like.shape, like.dtype)] * 2


@needs_kernel
def test_the_block_keeps_values_dtypes_and_shapes():
    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.spectpsync.sites import Site

    device = torch.device("cuda")
    b.bind_group(b.DSPARK, SkewedGroup(torch.zeros((), dtype=torch.int64, device=device)))
    try:
        for bs in (0, 1, 7, 64):
            fields = [torch.arange(bs, dtype=torch.int32, device=device) - 5,
                      torch.arange(bs, dtype=torch.int64, device=device) * (1 << 40) + 3,
                      torch.arange(bs, dtype=torch.int32, device=device) + 9,
                      torch.randn(2, bs, device=device), torch.arange(3, dtype=torch.int64, device=device)]
            kept = [f.clone() for f in fields]
            got = b.broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *fields)
            assert [(g.dtype, g.shape) for g in got] == [(f.dtype, f.shape) for f in kept]
            assert all(torch.equal(g, f) for g, f in zip(got, kept)), bs
            assert len({g.untyped_storage().data_ptr() for g in got}) == 1  # one block
            assert not {g.untyped_storage().data_ptr() for g in got} & {f.untyped_storage().data_ptr() for f in fields}
        # a bool field: the kernel does not take it, the concatenation does, same values
        flags = [torch.tensor([True, False, True], device=device), torch.arange(3, dtype=torch.int32, device=device)]
        got = b.broadcast(b.DSPARK, Site.DFLASH_ACCEPT_SAMPLE, *flags)
        assert torch.equal(got[0], flags[0]) and torch.equal(got[1], flags[1])
        assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
        assert b.COUNTS == {Site.DSPARK_ACCEPT_GRAPH: 4, Site.DFLASH_ACCEPT_SAMPLE: 1}
    finally:
        b.reset()


@needs_kernel
def test_fused_counts_equal_the_torch_ops_counts_in_graphs_and_eagerly():
    """The pack's packed triple (site 10: no copy of mine) and a draft broadcast in place
    (17: one snapshot), rank 0's value skewed in k of n calls: the same counters through
    the library and through torch ops, replayed in a graph and called eagerly."""
    import wrapt

    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.spectpsync.sites import Site

    device = torch.device("cuda")
    skew = torch.zeros((), dtype=torch.int64, device=device)
    source = torch.arange(BS, device=device)
    b.bind_group(b.DSPARK, SkewedGroup(skew, source))  # the draft's own is the source; the block skewed in place
    compared = wrapt.FunctionWrapper(b.broadcast, t.before_0_5_19.compare_broadcast(1000))
    triple = [torch.empty(BS, dtype=torch.int32, device=device), torch.empty(BS, dtype=torch.int64, device=device),
              torch.empty(BS, dtype=torch.int32, device=device)]
    draft = torch.empty_like(source)

    def region():  # as rank0_broadcast's wrappers on the accept and the draft
        for i, field in enumerate(triple):
            field.copy_(source + i)
        compared(b.DSPARK, Site.DSPARK_ACCEPT_GRAPH, *triple)
        draft.copy_(source)
        compared(b.DSPARK, Site.DSPARK_DRAFT, draft)

    k = len(SKEWED)
    # a skewed call adds 1 to every int32 word of the block (each field's every element) and to the draft
    expected = {"10:dspark-accept-graph": [REPLAYS, k, k * 3 * BS], "17:dspark-draft": [REPLAYS, k, k * BS]}
    got = {}
    try:
        for kernel in (True, False):
            paths(kernel)
            capture_and_replay(region, skew)
            got[("graph", kernel)] = divergence.totals()
            divergence.reset()
            skewed_eager_calls(region, skew)
            got[("eager", kernel)] = divergence.totals()
            divergence.reset()
    finally:
        paths(True)
        b.reset()
        divergence.reset()
    assert got == {key: expected for key in got}, got


# --- DSV41_TP_DIVERGENCE=abort: stop at the first diverging call ----------------------------

@pytest.fixture
def abort_on(monkeypatch):
    from harness.doctored import DoctoredEngine

    monkeypatch.delenv("SGLANG_SPEC_TP_SYNC", raising=False)
    decision = runtime.decide({t.FLAG: "abort"}, DoctoredEngine({}), names=(t.NAME,))
    runtime.apply(decision)
    yield decision
    runtime.revert()
    divergence.reset()


def calls_until_stopped(call, limit=8) -> tuple[int, str]:
    """Eager calls, each under sync debug mode "error", until one raises Diverged: (its index, its line)."""
    for i in range(limit):
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except divergence.Diverged as stopped:
            return i, str(stopped)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the test's, not the pack's: lets the started read land
    raise AssertionError(f"no Diverged within {limit} eager calls")


def test_abort_eager_stops_without_a_host_sync(abort_on):
    """Eager calls read the counters every call without waiting; a skew at call j stops the
    rank at call j or, where the copy has not landed yet, a later one, naming call j + 1."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite as S

    skew = torch.zeros((), dtype=torch.int64, device="cuda")
    tp_sync, values = target_site_ready(skew)
    torch.cuda.set_sync_debug_mode("error")
    try:  # REPLAYS calls that agree: a read started and the landed one looked at in each, no wait
        for _ in range(REPLAYS):
            tp_sync.sync(S.DSPARK_TARGET, values.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    skew.fill_(1)  # from the site's call REPLAYS + 1 on, rank 0's value is one more than ours
    at, line = calls_until_stopped(lambda: tp_sync.sync(S.DSPARK_TARGET, values.clone()))
    print(f"stopped {at} eager call(s) after the diverging one")
    assert "site=11:dspark-target rank=" in line and f"step={REPLAYS + 1} mine=0 rank0=1 element=0 " in line


def test_abort_captured_stops_at_the_next_eager_call(abort_on):
    """A captured site replays without Python: the replays never stop the rank; the next
    eager call(s) see the landed copy and stop it, naming the replay's call and both values."""
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    skew = torch.zeros((), dtype=torch.int64, device="cuda")
    source = torch.arange(BS, device="cuda") + 5
    skewed = SpecTpSync(SkewedGroup(skew, source))
    accept = torch.empty_like(source)

    def region():
        accept.copy_(source)
        skewed.sync(S.DSPARK_ACCEPT_GRAPH, accept)

    capture_and_replay(region, skew)  # SKEWED replays diverge; no host sync, no exception
    first = min(SKEWED) + 1  # the site's call number of the first skewed replay
    assert divergence.totals()["10:dspark-accept-graph"][:2] == [REPLAYS, len(SKEWED)]
    skew.zero_()
    at, line = calls_until_stopped(region)
    print(f"stopped at eager call {at} after the replays")
    assert "site=10:dspark-accept-graph rank=" in line and f"step={first} mine=5 rank0=6 element=0 " in line
