"""The folded-result fence on a GPU, with real CUDA streams (sglang 0.5.23 `dspark_verify`).

The race of upstream #42465, replayed deterministically: step N's accept lands in the
verify epilogue's persistent buffers on a forward stream and the folded
`accept_and_finalize` hands it out; the readback is queued the way the scheduler does
it (`copy_stream.wait_stream(forward_stream)`, then sglang's own `async_d2h`: a pinned
host tensor, a `non_blocking` copy and `record_stream`) on a copy stream that a spin
kernel keeps busy, standing in for a copy engine behind a long write-through; then the
forward stream runs further verify steps, each rewriting the buffers and calling the
(fenced or not) accept again, while the copy stream is still stalled. The test checks
that the copy stream really was still stalled when the forward stream finished.

Unfenced the host must read a later step (if it does not, the hazard did not
reproduce and the test fails rather than pass). Fenced, it must read step N in all
six fields, over many trials, at bs 1, 8, 64 and 256, for both ways the fence copies
(one launch into a fresh block, and the plain clones it falls back to).

The one-launch copy comes from the prebuilt kernel file ($DSV41_ADAPTERS_SNAPSHOT_KERNEL, built
with `sglang-adapters build-kernel`, as the image does); without it those tests
fail with copy_mode()'s reason. Skipped without CUDA. Run on a GPU machine:
`python -m pytest tests/test_fence_gpu.py -q`.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from sglang_dsv41_adapters.folded_fence import accept_snapshot
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime

from harness.fence import STRIDE, fence_on, folded_kwargs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the race is between real CUDA streams"
)


FIELDS = folded_fence.FIELDS
MAX_BS = 256
BATCH_SIZES = (1, 8, 64, 256)
FURTHER_STEPS = 8  # verify steps run on the forward stream while the readback is stalled
# Spin cycles on the copy stream (~2 GHz: 30M cycles is about 15 ms); checked below.
STALL_CYCLES = int(os.environ.get("FENCE_GPU_STALL_CYCLES", "30000000"))
TRIALS = {"unfenced": 4, "one_launch": 32, "clones": 8}
DTYPES = {"cap_trim_lens": torch.int32, "commit_lens": torch.int32}


class Step:
    """One verify step's accept, on the device; values unique per (trial, step, field, row)."""

    def __init__(self, trial: int, step: int, bs: int, device):
        self.values = {}
        for k, name in enumerate(FIELDS):
            shape = (bs, STRIDE) if name == "out_tokens" else (bs,)
            base = ((trial * 16 + step) * 8 + k) * 2048
            values = torch.arange(base, base + bs * (STRIDE if name == "out_tokens" else 1), device=device)
            self.values[name] = values.view(shape).to(DTYPES.get(name, torch.int64))

    def write(self, epilogue) -> None:
        """What a verify replay does to the buffers (on the current stream)."""
        for name, value in self.values.items():
            getattr(epilogue, f"{name}_buf")[: value.shape[0]].copy_(value)

    def matches(self, host: dict) -> dict:
        return {name: torch.equal(host[name], value.cpu()) for name, value in self.values.items()}


def new_epilogue(device):
    """A real 0.5.23 DsparkVerifyEpilogue on `device`, MAX_BS wide."""
    from sglang.srt.speculative.dspark_components import dspark_verify as verify
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    # SpecTpSync only reads world_size and rank_in_group from its group at TP=1.
    tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    return verify.DsparkVerifyEpilogue(max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device=device, tp_sync=tp_sync)


@pytest.fixture(scope="module")
def gpu():
    from sglang.srt.speculative.dspark_components import dspark_verify as verify
    from sglang.srt.utils.common import async_d2h

    device = torch.device("cuda", torch.cuda.current_device())
    epilogue = new_epilogue(device)
    # A TargetVerifyExecutor built minimally (object.__new__): on the folded path
    # accept_and_finalize reads only self.verify_epilogue (note_static_verify, read_accept).
    executor = object.__new__(verify.TargetVerifyExecutor)
    executor.verify_epilogue = epilogue
    runtime.revert()
    yield types.SimpleNamespace(
        module=verify, epilogue=epilogue, executor=executor, device=device, async_d2h=async_d2h,
        forward=torch.cuda.Stream(device), copy=torch.cuda.Stream(device),
    )
    runtime.revert()
    accept_snapshot.use_extension(True)


def folded_result(gpu, kwargs) -> dict:
    """What the worker hands the scheduler, from the folded accept (known route, fenced or not)."""
    outs = gpu.executor.accept_and_finalize(**kwargs)
    # GenerationBatchResult: next_token_ids = out_tokens.reshape(-1), accept_lens = commit_lens, ...
    result = {name: getattr(outs, name) for name in FIELDS}
    result["out_tokens"] = result["out_tokens"].reshape(-1)
    return result


def race(gpu, bs: int, trial: int, hand_out=folded_result):
    """Step N handed out and its readback stalled; FURTHER_STEPS verify steps run meanwhile.
    Returns the host copies, the steps, and whether the copy was still stalled at the end."""
    steps = [Step(trial, j, bs, gpu.device) for j in range(1 + FURTHER_STEPS)]
    kwargs = folded_kwargs(bs, gpu.device)
    block_words = sum(v.numel() * v.element_size() // 4 + 4 for v in steps[0].values.values())
    torch.cuda.synchronize()
    with torch.cuda.stream(gpu.forward):
        steps[0].write(gpu.epilogue)
        result = hand_out(gpu, kwargs)
    # Scheduler._copy_result_to_cpu: the copy stream waits for the forward stream, never the reverse.
    gpu.copy.wait_stream(gpu.forward)
    with torch.cuda.stream(gpu.copy):
        torch.cuda._sleep(STALL_CYCLES)  # a copy engine busy with a long write-through
        host = {name: gpu.async_d2h(t) for name, t in result.items()}
        copy_done = torch.cuda.Event()
        copy_done.record()
    # copy_to_cpu replaces the result's device tensors with the host copies.
    del result
    with torch.cuda.stream(gpu.forward):
        for step in steps[1:]:
            step.write(gpu.epilogue)  # the next verify replay rewrites the buffers
            later = gpu.executor.accept_and_finalize(**kwargs)
            # Memory churn of a real step: blocks of the snapshot's size are asked for
            # again; a block still being read back must not be among them.
            junk = torch.full((block_words,), -1, dtype=torch.int32, device=gpu.device)
            del later, junk
        forward_done = torch.cuda.Event()
        forward_done.record()
    forward_done.synchronize()
    stalled = not copy_done.query()
    copy_done.synchronize()
    host["out_tokens"] = host["out_tokens"].view(bs, STRIDE)
    return host, steps, stalled


def warm_up(gpu, bs: int) -> None:
    """One untimed, unchecked round first: the first pinned-host and device allocations of
    a size call into the CUDA runtime, which must not stand between the two streams."""
    race(gpu, bs, 5_000)


def _require_stall(stalled: bool, bs: int) -> None:
    if not stalled:
        pytest.fail(
            f"bs={bs}: the copy stream finished before the forward stream's {FURTHER_STEPS} further steps; "
            f"the interleaving was not forced (raise FENCE_GPU_STALL_CYCLES, now {STALL_CYCLES})"
        )


def require_one_launch() -> None:
    accept_snapshot.use_extension(True)
    mode = accept_snapshot.copy_mode()
    if mode[0] != "one-launch":
        pytest.fail(f"the one-launch snapshot is not available on this machine: {mode}")


def test_copy_mode_is_the_prebuilt_kernel_file():
    """The fence loads the kernel file by path (no compiler, no cache) and says so."""
    require_one_launch()
    assert accept_snapshot.copy_mode() == ("one-launch", accept_snapshot.kernel_path())
    assert accept_snapshot.extension().__file__ == accept_snapshot.kernel_path()


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_unfenced_readback_reads_a_later_step(gpu, bs):
    runtime.revert()
    warm_up(gpu, bs)
    for trial in range(TRIALS["unfenced"]):
        host, steps, stalled = race(gpu, bs, trial)
        _require_stall(stalled, bs)
        step_n = steps[0].matches(host)
        last = steps[-1].matches(host)
        if any(step_n.values()) or not all(last.values()):
            pytest.fail(
                f"bs={bs} trial {trial}: the hazard did not reproduce: without the fence the host should read "
                f"step N+{FURTHER_STEPS} in every field; reads step N: {step_n}, reads the last step: {last}"
            )


@pytest.mark.parametrize("mechanism", ["one_launch", "clones"])
@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_fenced_readback_reads_step_n(gpu, bs, mechanism):
    if mechanism == "one_launch":
        require_one_launch()
    accept_snapshot.use_extension(mechanism == "one_launch")
    assert fence_on().state == "applied"
    try:
        warm_up(gpu, bs)
        # trusted in the warm-up: the kernel file's fenced_method serves (with clones it hands each call to the form)
        assert type(vars(type(gpu.executor))["accept_and_finalize"]).__name__ == "fenced_method"
        for trial in range(TRIALS[mechanism]):
            host, steps, stalled = race(gpu, bs, 1000 + trial)
            _require_stall(stalled, bs)
            got = steps[0].matches(host)
            assert got == {name: True for name in FIELDS}, (
                f"bs={bs} trial {trial} ({mechanism}): fenced readback did not read step N: {got}"
            )
    finally:
        runtime.revert()
        accept_snapshot.use_extension(True)


def test_fenced_call_is_one_launch_and_detached(gpu):
    """The fenced folded call launches one kernel, returns the engine's AcceptOuts type
    with the buffers' dtypes and shapes, and aliases none of the buffers."""
    from torch.profiler import ProfilerActivity, profile

    require_one_launch()
    fence_on()
    try:
        kwargs = folded_kwargs(64, gpu.device)
        for _ in range(3):
            gpu.executor.accept_and_finalize(**kwargs)
        # trusted after its proofs: the call below is the kernel file's fenced_method, in wrapt's place
        assert type(vars(type(gpu.executor))["accept_and_finalize"]).__name__ == "fenced_method"
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outs = gpu.executor.accept_and_finalize(**kwargs)
            torch.cuda.synchronize()
        events = prof.events()
        launches = [e.name for e in events if any(k in e.name for k in ("LaunchKernel", "GraphLaunch", "cudaMemcpy", "cudaMemset"))]
        kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(launches) == 1 and len(kernels) == 1, (launches, kernels)
        views = gpu.epilogue.read_accept(64)
        assert type(outs) is gpu.module.AcceptOuts
        for name in FIELDS:
            mine, theirs = getattr(outs, name), getattr(views, name)
            assert (mine.dtype, mine.shape, mine.is_contiguous()) == (theirs.dtype, theirs.shape, True), name
            assert torch.equal(mine, theirs), name
            buffer = getattr(gpu.epilogue, f"{name}_buf")
            assert mine.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr(), name
    finally:
        runtime.revert()


# --- the boundary guarantee: a route the fence's checks do not know -----------------------

ESCAPE = (
    "    def accept_and_finalize(\n",
    "    def peek_accept(self, bs):\n"
    "        # a new route: the buffers read directly, no epilogue reader called\n"
    "        e = self.verify_epilogue\n"
    "        return AcceptOuts(correct_len=e.correct_len_buf[:bs], bonus=e.bonus_buf[:bs],\n"
    "                          cap_trim_lens=e.cap_trim_lens_buf[:bs], commit_lens=e.commit_lens_buf[:bs],\n"
    "                          new_seq_lens=e.new_seq_lens_buf[:bs], out_tokens=e.out_tokens_buf[:bs])\n\n"
    "    def accept_and_finalize(\n",
)


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_boundary_keeps_step_n_for_a_route_the_fence_does_not_know(gpu, bs, tmp_path, monkeypatch):
    """The fence on, then its known routes switched off: only the check where results leave
    the worker (the wrapper the plan puts on DSparkWorkerV2.forward_batch_generation) is in
    place. The results come from an escape route added in a doctored copy of dspark_verify;
    the host must still read step N in every field. Before each, a clean step (the real
    decode result, fresh tensors) leaves the worker too: the kernel file's native scan must
    serve it (no Python walk), and must leave each escaping step to the walk, which copies."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang_dsv41_adapters.folded_fence import fence_boundary
    from sglang_dsv41_adapters.framework import patching
    from bench.fence_host_cost import decode_result
    from harness.doctored import doctored_module

    doctored = doctored_module(folded_fence.VERIFY, ESCAPE, directory=tmp_path)
    executor = object.__new__(doctored.TargetVerifyExecutor)
    executor.verify_epilogue = gpu.epilogue
    worker = types.SimpleNamespace(_verify_epilogue=gpu.epilogue)
    fence_on()
    for saved in patching.applied():
        if saved.name != "forward_batch_generation":
            patching.revert(saved.owner, saved.name)  # the known routes off
    boundary = next(s.patch.wrapper for s in patching.applied() if s.name == "forward_batch_generation")
    fence_boundary.use_native()  # as a rank finds it: probed at its first check on this GPU
    walked, copied, handed = [], [], []  # the results the Python walk saw, those copied from the scan's finds; the steps handed out
    walk, copy = fence_boundary._walk, fence_boundary._copied
    monkeypatch.setattr(fence_boundary, "_walk", lambda result, epilogue: walked.append(type(result)) or walk(result, epilogue))
    monkeypatch.setattr(fence_boundary, "_copied",
                        lambda result, found, epilogue: copied.append(type(result)) or copy(result, found, epilogue))

    def through_boundary(gpu, kwargs):
        clean = decode_result(kwargs["bs"], device=gpu.device)
        assert boundary(lambda _worker, bs: clean, worker, (worker, kwargs["bs"]), {}) is clean
        handed.append(kwargs["bs"])

        def worker_step(_worker, bs):  # the worker's return, built from the escaping views
            outs = executor.peek_accept(bs)
            return GenerationBatchResult(
                next_token_ids=outs.out_tokens.reshape(-1), accept_lens=outs.commit_lens,
                new_seq_lens=outs.new_seq_lens, cap_lens=outs.cap_trim_lens,
                next_draft_input=types.SimpleNamespace(bonus_tokens=outs.bonus, correct_len=outs.correct_len))
        result = boundary(worker_step, worker, (worker, kwargs["bs"]), {})
        return {"out_tokens": result.next_token_ids, "commit_lens": result.accept_lens,
                "new_seq_lens": result.new_seq_lens, "cap_trim_lens": result.cap_lens,
                "bonus": result.next_draft_input.bonus_tokens, "correct_len": result.next_draft_input.correct_len}

    try:
        assert boundary is fence_boundary.check_results
        race(gpu, bs, 6_000, through_boundary)  # warm-up: first allocations of each size, the walk meets the types
        assert fence_boundary.check_mode() == "native", \
            f"the boundary's native scan does not serve on this machine: {accept_snapshot.copy_mode()}"
        walked.clear()
        copied.clear()
        handed.clear()
        for trial in range(TRIALS["clones"]):
            host, steps, stalled = race(gpu, bs, 2000 + trial, through_boundary)
            _require_stall(stalled, bs)
            got = steps[0].matches(host)
            assert got == {name: True for name in FIELDS}, f"bs={bs} trial {trial}: the boundary let a later step through: {got}"
        # every escaping step was copied from what the scan found, without the walk; no clean step was (the scan served)
        assert len(handed) == TRIALS["clones"] and copied == [GenerationBatchResult] * len(handed) and walked == [], \
            (copied, walked)
    finally:
        runtime.revert()
        fence_boundary.use_native()


@pytest.mark.parametrize("how", ["set_", ".data =", "resize_", "a new object"])
def test_a_buffer_repointed_in_place_is_copied_from_its_new_memory(how, tmp_path, monkeypatch):
    """tests/test_fence_memory.py's re-pointed buffers on CUDA, as a rank meets them: the cheap
    form's one-launch copy and the kernel file's views check (set_, .data =, a resize_ that
    changes the shape, a new object; twice), every call the engine's own values, fresh memory."""
    from tests.test_fence_memory import through_repointings

    mode = accept_snapshot.copy_mode()
    assert mode[0] == "one-launch", f"the kernel file does not serve this GPU: {mode}"
    accept_snapshot.use_checks(accept_snapshot.extension())  # as the probe leaves it in a rank
    try:
        through_repointings(how, tmp_path, monkeypatch, torch.device("cuda", torch.cuda.current_device()))
    finally:
        runtime.revert()


def test_dense_copy_is_clone_for_what_it_copies_and_clone_for_the_rest():
    """The kernel file's copy of a found tensor (the C check's, each step) gives what
    tensor.clone() gives: the same values, dtype, shape, strides and device, in fresh memory;
    a tensor it does not copy itself (not one dense block) is cloned."""
    mode = accept_snapshot.copy_mode()
    assert mode[0] == "one-launch", f"the kernel file does not serve this GPU: {mode}"
    library = accept_snapshot.extension()
    device = torch.device("cuda", torch.cuda.current_device())
    wide = torch.randn(8 * STRIDE, 129280, device=device)
    cases = {
        "logits as the graph returns them": wide[: 4 * STRIDE],
        "int64 ids": torch.arange(1000, device=device),
        "bfloat16": torch.randn(33, 7, device=device).to(torch.bfloat16),
        "empty": torch.zeros(0, 5, device=device),
        "a size-1 dimension's own stride": torch.arange(5.0, device=device).as_strided((1, 5), (1, 1)),
        "transposed (not contiguous)": wide[:16, :64].t(),
        "strided rows": wide[::2, :100],
    }
    for name, tensor in cases.items():
        copy, clone = library.dense_copy(tensor), tensor.clone()
        torch.cuda.synchronize()
        assert (copy.dtype, copy.shape, copy.stride(), copy.device) == (clone.dtype, clone.shape, clone.stride(), clone.device), name
        assert torch.equal(copy, tensor), name
        assert tensor.numel() == 0 or copy.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(), name


def test_the_served_graph_steps_logits_are_copied_by_the_c_check_and_keep_their_step(monkeypatch):
    """Where the proof does not hold (logits_readers.decide(None)): 0.5.23's default decode graph hands
    out its logits as a slice of the graph's output, which the epilogue's static_io[bs].logits holds,
    and the boundary copies them where they leave the worker. The first step's copy is made in Python
    (finding the keys down to them); each later step's, at every batch size, by the C check
    (dense_copy). Each step's handed-out logits keep that step's values while the next "replays"
    rewrite the graph's output, over 16 steps per batch size."""
    from sglang_dsv41_adapters.folded_fence import fence_boundary, logits_readers
    from bench.fence_host_cost import captured, decode_result, rebuilt, worker_of

    device = torch.device("cuda", torch.cuda.current_device())
    epilogue = new_epilogue(device)
    captured(epilogue)  # static_io as capture leaves it: per batch size, views of the runner's buffers
    fence_boundary.reset()
    fence_boundary.use_native()
    logits_readers.decide(None)
    python_copies = []
    copied = fence_boundary._copied
    monkeypatch.setattr(fence_boundary, "_copied",
                        lambda result, found, held: python_copies.append(type(result).__name__) or copied(result, found, held))
    try:
        for bs in (1, 8, 64, 256):
            output = epilogue.static_io[bs].logits
            result = decode_result(bs, device=device)
            worker = worker_of(epilogue, lambda self, batch: rebuilt(result, logits=output[: bs * STRIDE]))
            python_copies.clear()
            handed = []
            forward = torch.cuda.Stream(device)
            with torch.cuda.stream(forward):
                for step in range(16):
                    output.copy_(torch.full_like(output, float(bs * 100 + step)))  # the step's replay
                    logits = worker.forward_batch_generation(None).logits_output.next_token_logits
                    assert logits.untyped_storage().data_ptr() != output.untyped_storage().data_ptr(), (bs, step)
                    handed.append(logits)
            torch.cuda.synchronize()
            assert fence_boundary.check_mode() == "native"
            # the first step found the keys in Python; every other, at every batch size (the same
            # types down the route, the same storage), was the C check's copy
            assert python_copies == (["GenerationBatchResult"] if bs == 1 else []), (bs, python_copies)
            for step, logits in enumerate(handed):
                assert torch.equal(logits, torch.full_like(logits, float(bs * 100 + step))), (bs, step)
            # each step after the first ran the kernel file's method: its class holds it in wrapt's place
            assert type(vars(type(worker))["forward_batch_generation"]).__name__ == "boundary_checked_method"
    finally:
        logits_readers.decide()
        fence_boundary.reset()
        fence_boundary.use_native()


LEFT_STEPS = 8  # served steps after the watch, per batch size


def served_steps(device, bs: int, steps: int, late_logits: bool = False) -> list:
    """A served rank's decode steps on the graph path, each as the worker makes it: the replay writes
    the graph's output (a pattern of the step's own), a grammar mask is applied to it in place, the
    request's logprobs and top-2 logprobs are computed from it (the engine's compute_spec_logprobs), and
    the result leaves the worker through the boundary check; then the scheduler's readback
    (GenerationBatchResult.copy_to_cpu on a copy stream that waits for the forward stream, stalled by
    a spin kernel) while the next steps run. With `late_logits`, the readback also reads the handed-out
    logits (a consumer the engine does not have). Returns per step: (whether the logits were handed out
    in the graph's own memory, what the host read, what it should read)."""
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs
    from sglang.srt.utils.common import async_d2h
    from bench.fence_host_cost import captured, decode_result, rebuilt, worker_of

    epilogue = new_epilogue(device)
    captured(epilogue)
    output = epilogue.static_io[bs].logits
    rows, vocab = bs * STRIDE, output.shape[1]
    batch = types.SimpleNamespace(seq_lens=torch.zeros(bs, device=device), top_logprobs_nums=[2] * bs,
                                  token_ids_logprobs=None, sampling_info=types.SimpleNamespace(is_all_greedy=True))
    masked = torch.arange(vocab, device=device) % 5 == 0  # the grammar's forbidden tokens
    result = decode_result(bs, device=device)
    made = {}

    def verify(self, batch_):
        rebuilt_ = rebuilt(result, logits=output[:rows])
        output[:rows].masked_fill_(masked, float("-inf"))  # grammar_mask.apply, in place on the graph's output
        predict = torch.argmax(output[:rows], dim=-1)
        compute_spec_logprobs(batch, rebuilt_.logits_output, predict, chain_stride=STRIDE)
        made["predict"] = predict
        return rebuilt_

    worker = worker_of(epilogue, verify)
    forward, copy = torch.cuda.Stream(device), torch.cuda.Stream(device)
    found = []
    for step in range(steps):
        with torch.cuda.stream(forward):
            pattern = torch.arange(rows * vocab, device=device, dtype=torch.float32).view(rows, vocab)
            output[:rows].copy_(torch.sin(pattern * (0.001 * (step + 1))) * (step + 1))  # the step's replay
            expected_logits = output[:rows].masked_fill(masked, float("-inf"))
            expected = torch.log_softmax(expected_logits, dim=-1)
            handed = worker.forward_batch_generation(None)
            want = expected.gather(1, made["predict"].view(-1, 1)).view(bs, STRIDE)
            top = expected.topk(2, dim=-1).values
        copy.wait_stream(forward)
        with torch.cuda.stream(copy):
            torch.cuda._sleep(STALL_CYCLES)  # longer than the host takes to queue the next replay
            in_place = handed.logits_output.__dict__["next_token_logits"].untyped_storage().data_ptr() == \
                output.untyped_storage().data_ptr()
            late = async_d2h(handed.logits_output.next_token_logits) if late_logits else None
            handed.copy_done = torch.cuda.Event()  # Scheduler.run_batch sets it before the readback
            handed.copy_to_cpu(return_logprob=True, return_hidden_states=False)
        found.append((in_place, (handed, late), (want, top, expected_logits)))
    torch.cuda.synchronize()
    return [(in_place, (h.logits_output.next_token_logprobs, h.logits_output.next_token_top_logprobs_val, late),
             (want.cpu(), top.cpu(), logits.cpu())) for in_place, (h, late), (want, top, logits) in found]


@pytest.mark.parametrize("bs", (8, 64, 256))
def test_the_served_graph_steps_logits_are_left_after_the_watch_and_logprobs_keep_their_step(bs):
    """The installed engine's proof holds (nothing reads the logits after the worker returns): the
    first WATCH_STEPS results' logits are copied while watched, every later one is left in the
    graph's memory, which the next replay rewrites, and the native check serves. Every step's
    logprobs and top logprobs, asked for by the request and computed before the worker returns,
    read back as that step's, grammar mask included."""
    from sglang_dsv41_adapters.folded_fence import fence_boundary, logits_readers

    device = torch.device("cuda", torch.cuda.current_device())
    fence_boundary.reset()
    fence_boundary.use_native()
    logits_readers.decide()
    try:
        assert logits_readers.decision() is not None, "the proof does not hold on the installed engine"
        steps = served_steps(device, bs, logits_readers.WATCH_STEPS + LEFT_STEPS)
        assert [in_place for in_place, _, _ in steps] == [False] * logits_readers.WATCH_STEPS + [True] * LEFT_STEPS
        assert logits_readers.leaving() is not None and fence_boundary.check_mode() == "native"
        for step, (_, (logprobs, top, _), (want, want_top, _)) in enumerate(steps):
            assert torch.allclose(logprobs, want), (bs, step)
            assert torch.allclose(torch.stack(top), want_top), (bs, step)
    finally:
        logits_readers.decide()
        fence_boundary.reset()
        fence_boundary.use_native()


def test_a_copy_of_the_engine_that_reads_the_logits_late_gets_the_copy_back(tmp_path):
    """A doctored 0.5.23 whose result processing reads the logits after the worker returns: its proof
    does not hold, the rank copies them at every step, and a late reader (here the readback itself)
    reads each step's logits while the next replays rewrite the graph's output. The same late read
    with the logits left shows what the copy prevents: a later step's values."""
    from sglang_dsv41_adapters.folded_fence import fence_boundary, logits_readers
    from tests.test_graph_logits import AFTER_DECODE, BATCH_RESULTS, doctored

    def checked_run(**kwargs):
        """served_steps after an untimed round of the same: the readback's pinned host blocks then
        come from the allocator's cache, not cudaHostAlloc, which would wait for the stalled stream."""
        served_steps(device, 64, 8, late_logits=True)
        torch.cuda.synchronize()
        return served_steps(device, 64, 8, late_logits=True)

    engine = doctored(tmp_path, BATCH_RESULTS, AFTER_DECODE,
                      AFTER_DECODE + "        result.logits_output.next_token_logits.sum()\n")
    found = logits_readers.verdict(engine)
    assert not found.unread and "reads logits_output.next_token_logits after the worker returns" in found.why
    device = torch.device("cuda", torch.cuda.current_device())
    fence_boundary.reset()
    fence_boundary.use_native()
    try:
        logits_readers.decide(None)  # what the doctored engine's proof gives a rank
        for in_place, (logprobs, _, late), (want, _, logits) in checked_run():
            assert not in_place and torch.equal(late, logits) and torch.allclose(logprobs, want)
        logits_readers.decide(logits_readers._running((logits_readers.RESULT, logits_readers.LOGITS)))
        logits_readers.watched_for(0)
        stale = [not torch.equal(late, logits) for in_place, (_, _, late), (_, _, logits) in checked_run()]
        assert any(stale), "left in place, a late reader still read each step's logits: the stall did not hold"
    finally:
        logits_readers.decide()
        fence_boundary.reset()
        fence_boundary.use_native()
