"""Cost of the folded-result fence per verify step on a GPU, side by side in one run.

    python bench/fence_cost.py [--json OUT] [--bs 8 64 256] [--calls 3000] [--reps 7]

Host time per call (microseconds; the median of --reps repetitions of --calls calls,
the variants and batch sizes interleaved within each repetition, the GPU idle at the start of each, each
variant set up and called SETTLE times untimed before its calls: the state a served rank has)
of the folded `TargetVerifyExecutor.accept_and_finalize` of the real sglang 0.5.23
`dspark_verify` module (a real `DsparkVerifyEpilogue` on the GPU):

  empty_launch     one empty kernel launch through a compiled extension (the yardstick)
  sleep0_launch    torch.cuda._sleep(0): one near-empty kernel launched through torch
  unfenced         the engine's folded call, unpatched (returns views of the buffers)
  clones6          unfenced call + six per-field clones (what the upstream fix does)
  fence            the pack's fence as the runtime applies it: on 0.5.23 the cheap form (the
                   folded branch done by the fence: note_static_verify, read_accept's [:bs]
                   views cached per batch size, one-launch snapshot into one fresh block),
                   trusted after its proofs (the first calls per batch size, in the warm-up)
  fence_general    the general form: the unfenced call, its result's storage compared with
                   the epilogue's buffers, then copied (one launch) into a copy of its type
  fence_clones     the cheap form with the fallback copy (plain clones)
  wrapped_noop     a wrapt wrapper that only calls through (wrapt's own cost)
  boundary         unfenced call + the fence's boundary check on a worker result of fresh
                   tensors, as the runtime runs it: a worker method wrapped (wrapt) with
                   fence_boundary.check_results, returning the real GenerationBatchResult,
                   LogitsProcessorOutput and DFlashDraftInputV2 (what every step pays for it);
                   the native scan serves where the kernel file loaded (fence_boundary.check_mode)
  boundary_python  the same with the Python walk forced (fence_boundary.use_native(None)): before the scan
  boundary_captured  boundary, against an epilogue whose static_io holds what graph capture leaves
                   and which holds a commit context with a draft model (fence_host_cost.captured:
                   StaticVerifyIO views for 39 batch sizes): the map of its memory that the check
                   tests at each step is that much larger
  fence_boundary   fence + boundary check: the fence's whole cost per verify step
  fence_boundary_captured  the same against the served-looking epilogue of boundary_captured:
                   the fence's whole cost per verify step as a served engine pays it
  step_floor       the unfenced call and a worker returning a new result at each step, as the
                   engine's does (fence_host_cost.rebuilt: new holders over the same tensors), unwrapped
  fence_boundary_step  fence + boundary check against the served-looking epilogue, the worker
                   returning a new result at each step; over step_floor, not the unfenced call (the
                   rows above hand one result back, whose holders' __dict__s a first read made)
  fence_boundary_graph  the same with the result's logits as 0.5.23's default decode graph backend
                   returns them: a slice of the graph's output, which static_io[bs].logits holds
                   since capture. They share the epilogue's memory; the check leaves them in place
                   as a served rank does once its watch is over, where logits_readers shows from the
                   installed engine's code that nothing reads them after the worker returns (the
                   bench fails where it does not); over graph_floor
  fence_boundary_graph_copied  the same with the logits copied at each step (logits_readers.decide(None):
                   what a rank does where the proof does not hold, and every rank did before it)
  graph_floor      step_floor with the worker returning the graph's logits slice (the engine's own slice at
                   each step), unwrapped: the floor of the two graph rows
  fence_boundary_graph_nocopy  the same step with logits of the same size and layout over memory the epilogue
                   does not hold: the check finds nothing to copy. What the graph step would cost where the
                   copy is not needed (nothing reads the logits after the worker returns); over graph_floor
  fence_wrapt, fence_boundary_step_wrapt  fence and fence_boundary_step with both bindings wrapt's
                   (the fence's form and check_results called through wrapt, as before the kernel
                   file's fenced_method and boundary_method stood in for them once trusted)

Ideas measured earlier and dropped (figures in docs/performance-history.md, 2026-11-29):
ring_replay (a captured copy into preallocated slots: a slot a stalled reader could
still hold), cat_bytes (torch.cat of byte views: nine launches' worth of host time).

The host moves between speeds for seconds at a time (the unfenced call took 13 us in some
repetitions of one run and 23 us in others), so each figure over the unfenced call is taken within
a repetition: per repetition, (variant - unfenced) / empty_launch of that same repetition, and the
median of those is printed (L); the difference of the medians is kept in the JSON beside it.

Also the launches each variant makes per call (CUDA runtime launch/copy calls, and
kernels on the device), from the PyTorch profiler. Figures move between runs on a
shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary, fence_forms, logits_readers
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import patching, runtime  # noqa: E402
from sglang_dsv41_adapters.framework.plan import Patch  # noqa: E402
from bench.fence_host_cost import captured, decode_result, rebuilt, worker_of  # noqa: E402  (the realistic worker result, static_io)
# the worker's arguments, as the GPU test passes them, and the fence switched on as a rank does
from harness.fence import STRIDE, fence_on, folded_kwargs  # noqa: E402


FIELDS = folded_fence.FIELDS


def call_through(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def build(max_bs: int):
    from sglang.srt.speculative.dspark_components import dspark_verify as verify
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    device = torch.device("cuda", torch.cuda.current_device())
    tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    epilogue = verify.DsparkVerifyEpilogue(
        max_bs=max_bs, verify_num_draft_tokens=STRIDE, device=device, tp_sync=tp_sync
    )
    for name in FIELDS:
        buf = getattr(epilogue, f"{name}_buf")
        buf.copy_(torch.randint_like(buf, 0, 1 << 20))
    # On the folded path accept_and_finalize reads only self.verify_epilogue.
    executor = object.__new__(verify.TargetVerifyExecutor)
    executor.verify_epilogue = epilogue
    runtime.revert()
    return verify, epilogue, executor, device


ORIGINAL = "accept_and_finalize"


def check_detached(verify, epilogue, outs, bs: int) -> None:
    """A variant's result has the engine's type, the buffers' values, dtypes and shapes,
    and owns its memory (no buffer aliased)."""
    views = epilogue.read_accept(bs)
    assert type(outs) is verify.AcceptOuts, type(outs)
    for name in FIELDS:
        mine, theirs = getattr(outs, name), getattr(views, name)
        assert (mine.dtype, mine.shape, mine.is_contiguous()) == (theirs.dtype, theirs.shape, True), name
        assert torch.equal(mine, theirs), name
        buf = getattr(epilogue, f"{name}_buf").untyped_storage()
        assert mine.untyped_storage().data_ptr() != buf.data_ptr(), name


def variants(verify, epilogue, executor, device, bs: int, original, full) -> dict:
    """name -> (setup, call): setup puts the module in the variant's state (untimed)."""
    kw = folded_kwargs(bs, device)
    ext = accept_snapshot.extension()
    TVE = verify.TargetVerifyExecutor
    result = decode_result(bs, device=device)

    def unpatched():
        runtime.revert()
        setattr(TVE, ORIGINAL, original)
        accept_snapshot.use_extension(True)
        fence_boundary.use_native()  # what the runtime finds: the native scan where the kernel file loaded

    def wrapped(wrapper):
        def setup():
            unpatched()
            patching.apply(Patch(TVE, ORIGINAL, wrapper), folded_fence.NAME)
        return setup

    logits_readers.decide()
    served_logits = logits_readers.decision()  # the installed engine's proof, as a rank makes it
    assert served_logits is not None, "the proof does not hold on this engine: the graph's logits are copied"

    def fenced(one_launch: bool, logits: str = "left"):
        """The fence and the boundary check as a served rank has them; the graph's logits `left` in
        place as the proof decided (the rank's watch over), or `copied`."""
        def setup():
            unpatched()
            logits_readers.decide(served_logits if logits == "left" else None)
            logits_readers.watched_for(0)
            fence_on()
            accept_snapshot.use_extension(one_launch)
            form = next(s.patch.wrapper for s in patching.applied() if s.name == ORIGINAL)
            if isinstance(form, fence_forms.CheapForm) and form.trusted:  # trusted before a by_wrapt row unbound it
                form._bind_in_c()
        return setup

    def clones6():
        outs = executor.accept_and_finalize(**kw)
        return verify.AcceptOuts(**{name: getattr(outs, name).clone() for name in FIELDS})

    # DSparkWorkerV2's return, wrapped as the plan wraps forward_batch_generation: the same result at
    # each step, against the bench's epilogue and the served-looking one; then a new result at each
    # step as the engine's worker returns, against the served-looking epilogue, and unwrapped (the
    # floor of the step rows)
    same, new = (lambda self, batch: result), (lambda self, batch: rebuilt(result))
    worker, after_capture = worker_of(epilogue, same), worker_of(full, same)
    served, bare = worker_of(full, new), worker_of(full, new, checked=False)
    # The result as 0.5.23's default (FULL) decode graph backend returns it: its logits a slice of
    # the graph's output, which static_io[bs].logits holds since capture (the check copies them)
    graph_logits = full.static_io[bs].logits
    from_graph = worker_of(full, lambda self, batch: rebuilt(result, logits=graph_logits[: bs * STRIDE]))
    unshared_logits = torch.empty_like(graph_logits)  # the graph's output's size and layout, not the epilogue's memory
    not_copied = worker_of(full, lambda self, batch: rebuilt(result, logits=unshared_logits[: bs * STRIDE]))
    graph_bare = worker_of(full, lambda self, batch: rebuilt(result, logits=graph_logits[: bs * STRIDE]), checked=False)

    def with_boundary(worker=worker):
        outs = executor.accept_and_finalize(**kw)
        worker.forward_batch_generation(None)
        return outs

    def by_wrapt(call_):
        """fenced(True), trusted, then both bindings wrapt's again (the fence's form and check_results
        called through wrapt, check_results' C form inside it): the step as bound before the kernel
        file's methods stood in for them (2026-12-02), beside those methods in the same run."""
        def setup():
            fenced(True)()
            for _ in range(fence_forms.PROOF_CALLS + 1):
                call_()
            form = next(s.patch.wrapper for s in patching.applied() if s.name == ORIGINAL)
            patching.bind_faster(form)
            patching.bind_faster(fence_boundary.check_results)
        return setup

    def walked(setup):
        def python_walk():
            setup()
            fence_boundary.use_native(None)
        return python_walk

    call = lambda: executor.accept_and_finalize(**kw)  # noqa: E731
    table = {
        "sleep0_launch": (unpatched, lambda: torch.cuda._sleep(0)),
        "unfenced": (unpatched, call),
        "clones6": (unpatched, clones6),
        "wrapped_noop": (wrapped(call_through), call),
        "fence_general": (wrapped(folded_fence.GENERAL_FOLDED), call),
        "fence": (fenced(True), call),
        "fence_clones": (fenced(False), call),
        "boundary": (unpatched, with_boundary),
        "boundary_python": (walked(unpatched), with_boundary),
        "boundary_captured": (unpatched, lambda: with_boundary(after_capture)),
        "fence_boundary": (fenced(True), with_boundary),
        "fence_boundary_captured": (fenced(True), lambda: with_boundary(after_capture)),
        "step_floor": (unpatched, lambda: with_boundary(bare)),
        "fence_boundary_step": (fenced(True), lambda: with_boundary(served)),
        "graph_floor": (unpatched, lambda: with_boundary(graph_bare)),
        "fence_boundary_graph": (fenced(True), lambda: with_boundary(from_graph)),
        "fence_boundary_graph_copied": (fenced(True, "copied"), lambda: with_boundary(from_graph)),
        "fence_boundary_graph_nocopy": (fenced(True), lambda: with_boundary(not_copied)),
        "fence_wrapt": (by_wrapt(call), call),
        "fence_boundary_step_wrapt": (by_wrapt(lambda: with_boundary(served)), lambda: with_boundary(served)),
    }
    if ext is not None:
        table = {"empty_launch": (unpatched, ext.empty_launch), **table}
    else:
        for name in ("fence", "fence_general", "fence_boundary", "fence_boundary_captured", "fence_boundary_step",
                     "fence_boundary_graph", "fence_boundary_graph_copied", "fence_boundary_graph_nocopy", "fence_wrapt",
                     "fence_boundary_step_wrapt"):
            table.pop(name)
    # Every fenced variant returns detached copies of the right values (checked untimed),
    # and the fence is the cheap form where the engine allows it.
    for name in ("fence", "fence_general", "fence_clones"):
        if name in table:
            table[name][0]()
            for _ in range(fence_forms.PROOF_CALLS + 1):  # past the proofs: the trusted call's own results
                table[name][1]()
            first, second = table[name][1](), table[name][1]()
            check_detached(verify, epilogue, first, bs)
            assert first.correct_len.data_ptr() != second.correct_len.data_ptr(), f"{name}: memory reused"
            print(f"bs={bs}: {name}: accept_and_finalize bound as {type(vars(TVE)[ORIGINAL]).__name__}", flush=True)
    fenced(True)()
    wrapper = next(s.patch.wrapper for s in patching.applied() if s.name == ORIGINAL)
    form = getattr(wrapper, "func", wrapper)
    print(f"bs={bs}: the fence on accept_and_finalize is {getattr(form, '__name__', type(form).__name__)}", flush=True)
    # The boundary rows check fresh tensors: nothing to copy, and the check that serves them is said.
    assert worker.forward_batch_generation(None) is result and fence_boundary.detach_escapes(result, epilogue)[1] == []
    assert after_capture.forward_batch_generation(None) is result and fence_boundary.detach_escapes(result, full)[1] == []
    fresh = served.forward_batch_generation(None)
    assert fresh is not result and fresh.accept_lens is result.accept_lens, "a new result over the same tensors, unchanged"
    left = from_graph.forward_batch_generation(None).logits_output.next_token_logits
    assert left.untyped_storage().data_ptr() == graph_logits.untyped_storage().data_ptr(), "the graph's logits copied"
    table["fence_boundary_graph_copied"][0]()
    copied = from_graph.forward_batch_generation(None).logits_output.next_token_logits
    assert copied.untyped_storage().data_ptr() != graph_logits.untyped_storage().data_ptr(), "the graph's logits left uncopied"
    fenced(True)()
    kept = not_copied.forward_batch_generation(None).logits_output.next_token_logits
    assert kept.untyped_storage().data_ptr() == unshared_logits.untyped_storage().data_ptr(), "logits copied that share nothing"
    print(f"bs={bs}: the boundary check is {fence_boundary.check_mode()}, the worker's method bound as "
          f"{type(vars(type(served))['forward_batch_generation']).__name__}", flush=True)
    unpatched()
    return table


SETTLE = 5  # untimed calls after a variant's setup


def settle(setup, call) -> None:
    """The variant's state as a served rank has it after its first steps: set up, then called
    SETTLE times untimed. A setup switches the patches, which drops the boundary check's map of
    the epilogue and the fence's proofs; the first call maps the epilogue again (about 0.5 ms for
    the served-looking one), the next ones compile its test and prove the views. Timed, those
    calls were spread over the repetition's calls (+1 to 2 us at 500 calls, before 2026-12-02)."""
    setup()
    for _ in range(SETTLE):
        call()


def host_us(call, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def launches(call) -> dict:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    api = [e.name for e in events if any(k in e.name for k in ("LaunchKernel", "GraphLaunch", "cudaMemcpy", "cudaMemset"))]
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"launch_calls": len(api), "device_kernels": len(kernels)}


# A row over a floor of its own (else over the unfenced call): the whole fenced steps with a new
# result each step, over the unpatched call and the same worker unwrapped.
FLOORS = {"fence_boundary_step": "step_floor", "fence_boundary_graph": "graph_floor",
          "fence_boundary_graph_copied": "graph_floor", "fence_boundary_graph_nocopy": "graph_floor",
          "fence_boundary_step_wrapt": "step_floor"}


def over_unfenced(row: dict, yard: str) -> dict:
    """Each variant over its floor (the unfenced call, or FLOORS'): per repetition against that
    repetition's floor and yardstick (paired), the median of those; and the difference of the medians."""
    launch = row[yard]
    summary = {}
    for name, v in row.items():
        if name in ("empty_launch", "sleep0_launch", "unfenced", *FLOORS.values()) or FLOORS.get(name, "unfenced") not in row:
            continue
        base = row[FLOORS.get(name, "unfenced")]
        paired = [(mine - theirs) for mine, theirs in zip(v["samples_us"], base["samples_us"])]
        in_launches = [d / unit for d, unit in zip(paired, launch["samples_us"])]
        summary[name] = {
            "over_unfenced_us": round(statistics.median(paired), 2),
            "over_in_launches": round(statistics.median(in_launches), 2),
            "over_in_launches_spread": [round(x, 2) for x in quartiles(in_launches)],
            "medians_over_unfenced_us": round(v["median_us"] - base["median_us"], 2),
            "medians_over_in_launches": round((v["median_us"] - base["median_us"]) / launch["median_us"], 2),
        }
    return summary


def quartiles(values: list) -> tuple:
    ordered = sorted(values)
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here as JSON")
    parser.add_argument("--bs", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-profile", action="store_true", help="skip counting launches with the profiler")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fence_cost: needs a CUDA GPU", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    copy_mode = accept_snapshot.copy_mode()  # loads the prebuilt kernel file, compiles nothing
    load_s = time.perf_counter() - t0
    print(f"accept_snapshot.copy_mode(): {copy_mode} ({load_s:.2f} s)", flush=True)
    verify, epilogue, executor, device = build(max(args.bs))
    full = build(max(args.bs))[1]
    captured(full)
    original = vars(verify.TargetVerifyExecutor)[ORIGINAL]  # the engine's own (build() unpatched it)
    tables = {bs: variants(verify, epilogue, executor, device, bs, original, full) for bs in args.bs}
    samples = {bs: {name: [] for name in table} for bs, table in tables.items()}
    for table in tables.values():  # warm-up
        for name, (setup, call) in table.items():
            setup()
            for _ in range(200):
                call()
    # Every batch size in every repetition, so each meets the host as the others do (it moves between
    # speeds for seconds at a time). Measured one after the other, bs 8 (the first) had come out 0.1
    # to 0.8 L above bs 64 and 256 in the boundary and step rows of every full run, for the same host work.
    for _ in range(args.reps):
        for bs, table in tables.items():
            for name, (setup, call) in table.items():
                settle(setup, call)
                samples[bs][name].append(host_us(call, args.calls))
    results = {}
    for bs, table in tables.items():
        counts = {}
        if not args.no_profile:
            for name, (setup, call) in table.items():
                settle(setup, call)
                counts[name] = launches(call)
        runtime.revert()
        setattr(verify.TargetVerifyExecutor, ORIGINAL, original)
        accept_snapshot.use_extension(True)
        fence_boundary.use_native()
        results[bs] = {
            name: {
                "median_us": statistics.median(values),
                "min_us": min(values),
                "max_us": max(values),
                "samples_us": values,
                **counts.get(name, {}),
            }
            for name, values in samples[bs].items()
        }

    yard = "empty_launch" if "empty_launch" in results[args.bs[0]] else "sleep0_launch"
    summary = {bs: over_unfenced(row, yard) for bs, row in results.items()}

    names = list(results[args.bs[0]])
    print(f"\nfence cost: host us per call, median of {args.reps} x {args.calls} calls "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__}); "
          f"'+' = over unfenced ({', '.join(f'{n}: over {f}' for n, f in FLOORS.items())}) and 'L' = that in units of {yard}, both within each "
          "repetition (the median)")
    header = f"{'variant':<24}" + "".join(f"{'bs=' + str(bs):>26}" for bs in args.bs) + f"{'launches':>10}"
    print(header)
    for name in names:
        cells = []
        for bs in args.bs:
            v = results[bs][name]
            extra = summary[bs].get(name)
            cell = f"{v['median_us']:.1f}" + (f" (+{extra['over_unfenced_us']:.1f}, {extra['over_in_launches']:.2f}L)" if extra else "")
            cells.append(f"{cell:>26}")
        c = results[args.bs[0]][name]
        launch_txt = f"{c['launch_calls']}/{c['device_kernels']}" if "launch_calls" in c else "-"
        print(f"{name:<24}" + "".join(cells) + f"{launch_txt:>10}")
    print("launches = CUDA runtime launch/copy calls / kernels on the device, per call")
    print(f"spread: the quartiles of L over the {args.reps} repetitions")
    for name in [n for n in names if n in summary[args.bs[0]]]:
        print(f"{name:<24}" + "".join(f"{'%.2f..%.2f L' % tuple(summary[bs][name]['over_in_launches_spread']):>26}"
                                      for bs in args.bs))
    print(f"accept_snapshot.copy_mode(): {copy_mode} (first call {load_s:.2f} s); boundary check: {fence_boundary.check_mode()}")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "what": "host time per folded accept_and_finalize call (us), sglang 0.5.23 dspark_verify",
            "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "calls": args.calls, "reps": args.reps, "stride": STRIDE, "yardstick": yard,
            "copy_mode": list(copy_mode), "copy_mode_first_call_s": round(load_s, 3),
            "boundary_check": fence_boundary.check_mode(),
            "results": {str(bs): row for bs, row in results.items()},
            "over_unfenced": {str(bs): row for bs, row in summary.items()},
        }, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
