"""The fence's host (Python) cost per verify step on the CPU, before and after a change, in one run.

    .venv/bin/python bench/fence_host_cost.py [--before REV] [--kernel SO] [--bs 8 64 256] [--calls 20000] [--reps 5]

`before` is the pack's adapter/ module as of REV (read with `git show`, or from a folder
holding that tree, loaded beside the tree's), `after` the working tree's Python walk,
`native` the working tree's check with the native scan of the fence's kernel file (--kernel,
else $SGLANG_ADAPTERS_SNAPSHOT_KERNEL; any arch: the scan is host code; its rows are left out,
with the reason printed, where the file is missing or does not load). Variants, interleaved
within each repetition:

  boundary_*            fence_boundary.detach_escapes on a realistic DSpark decode result: the
                        real sglang GenerationBatchResult (managers.utils) holding a
                        LogitsProcessorOutput and the DFlashDraftInputV2 make_draft_input_v2
                        builds, filled as the 0.5.23 worker fills it, all tensors fresh (the
                        steady state: the fence already copied the accept), against a real
                        DsparkVerifyEpilogue on the CPU
  boundary_*_state      the same, an attribute of the epilogue rebound before every call (the
                        engine's begin_step/begin_static_step do that when the batch changes)
  boundary_*_logprobs   a result that also holds top-logprob lists (2 x bs x stride tensors),
                        as compute_spec_logprobs leaves them when a request asks for them
  boundary_*_captured   the plain result against an epilogue whose static_io holds what graph
                        capture leaves (StaticVerifyIO views for CAPTURED batch sizes) and which
                        holds a commit context with a draft model: the map of its memory the check
                        tests at each step is that much larger
  cheap_*               the fence's cheap form on the real folded accept_and_finalize, trusted,
                        with the copy itself stubbed out: the Python path only (the copy is
                        one kernel launch on a GPU, measured by bench/fence_cost.py); cheap_before
                        REV's (its flat adapter/folded_fence.py up to b108675, its fence_forms.py
                        after), cheap_after the working tree's with its views tested in Python,
                        cheap_native with them tested by the kernel file's C form (as on a GPU)
  unfenced              the engine's folded accept_and_finalize, called directly

Host time per call in microseconds, median of --reps repetitions of --calls calls. Figures
move between runs on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_dsv41_adapters.folded_fence import accept_snapshot, fence_boundary
from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime  # noqa: E402

STRIDE = 4
CAPTURED = list(range(1, 9)) + list(range(16, 257, 8))  # batch sizes a decode graph capture may cover


def module_at(rev: str, path: str):
    """The pack's module `path` as of `rev` (a git revision, or a folder holding the old
    tree, where git is not at hand), loaded under a name of its own inside the adapter
    package (its relative imports get the tree's modules)."""
    if pathlib.Path(rev).is_dir():
        text = (pathlib.Path(rev) / path).read_text()
    else:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    # adapter/ is the package sglang_dsv41_adapters: a module in one of its folders imports its siblings there
    package = ".".join(("sglang_dsv41_adapters",) + pathlib.Path(path).parent.parts[1:])
    module = types.ModuleType(f"{package}._{pathlib.Path(path).stem}_before")
    module.__package__ = package
    exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def dspark(max_bs: int):
    """A real 0.5.23 DsparkVerifyEpilogue on the CPU and a TargetVerifyExecutor reading it."""
    from sglang.srt.speculative.dspark_components import dspark_verify as verify
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    epilogue = verify.DsparkVerifyEpilogue(max_bs=max_bs, verify_num_draft_tokens=STRIDE, device="cpu", tp_sync=tp_sync)
    executor = object.__new__(verify.TargetVerifyExecutor)  # the folded path reads only verify_epilogue
    executor.verify_epilogue = epilogue
    return verify, epilogue, executor


def decode_result(bs: int, logprobs: bool = False, device="cpu"):
    """A DSpark decode step's GenerationBatchResult, as dspark_worker_v2 (0.5.23) builds it."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    ints = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
    logits = LogitsProcessorOutput(next_token_logits=torch.zeros(bs * STRIDE, 32, device=device),
                                   hidden_states=torch.zeros(bs * STRIDE, 16, device=device))
    if logprobs:  # compute_spec_logprobs: per-row views of the top-k values and indices
        top = torch.zeros(bs * STRIDE, 5, device=device)
        logits.next_token_logprobs = torch.zeros(bs, STRIDE, device=device)
        logits.next_token_top_logprobs_val = [top[i][:5] for i in range(bs * STRIDE)]
        logits.next_token_top_logprobs_idx = [top[i][:5] for i in range(bs * STRIDE)]
    return GenerationBatchResult(
        logits_output=logits, next_token_ids=ints(bs * STRIDE), accept_lens=ints(bs), block_accept_lens=ints(bs),
        cap_lens=None, can_run_cuda_graph=True, speculative_num_draft_tokens=STRIDE, new_seq_lens=ints(bs),
        next_draft_input=make_draft_input_v2(bonus_tokens=ints(bs), new_seq_lens=ints(bs)),
    )


def rebuilt(result, logits=None):
    """A new GenerationBatchResult over `result`'s tensors, built as a step builds one: new holders
    whose instance attributes nothing has read yet (reading a __dict__ makes it, once per object);
    its next_token_logits `logits` where given."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    output, draft = result.logits_output, result.next_draft_input
    return GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=output.next_token_logits if logits is None else logits,
                                            hidden_states=output.hidden_states),
        next_token_ids=result.next_token_ids, accept_lens=result.accept_lens, block_accept_lens=result.block_accept_lens,
        cap_lens=None, can_run_cuda_graph=True, speculative_num_draft_tokens=STRIDE, new_seq_lens=result.new_seq_lens,
        next_draft_input=make_draft_input_v2(bonus_tokens=draft.bonus_tokens, new_seq_lens=draft.new_seq_lens),
    )


def worker_of(epilogue, step, checked: bool = True):
    """A worker whose forward_batch_generation is `step` (self, batch) -> result, wrapped with
    check_results as the plan wraps DSparkWorkerV2's where `checked` (through the runtime's patching,
    so bound as the check serves: wrapt's binding, or the kernel file's once its scan is bound); its
    epilogue `epilogue`. Recorded for "bench", which the runtime's revert leaves alone."""
    from sglang_dsv41_adapters.framework import patching
    from sglang_dsv41_adapters.framework.plan import Patch

    worker = type("Worker", (), {"_verify_epilogue": epilogue, "forward_batch_generation": step})
    if checked:
        patching.apply(Patch(worker, "forward_batch_generation", fence_boundary.check_results), "bench")
    return worker()


def folded_kwargs(bs: int) -> dict:
    ids = torch.zeros(bs, STRIDE, dtype=torch.int64)
    return dict(folded_accept=True, bs=bs, verify_ids_2d=ids, target_logits=None, draft_block=None, sampling_info=None,
                draft_input=None, layout=None, prefix_lens=torch.zeros(bs, dtype=torch.int64), draft_tokens=ids[:, 1:])


def own_copy(module):
    """A second instance of a pack module (its own caches and switches), beside the first."""
    copy = types.ModuleType(f"{module.__name__}_copy")
    copy.__package__ = module.__package__
    exec(compile(pathlib.Path(module.__file__).read_text(), module.__file__, "exec"), copy.__dict__)
    return copy


def native_boundary(path):
    """fence_boundary with the native scan of the kernel file at `path`, or (None, why not)."""
    if not path:
        return None, f"no kernel file given (--kernel or ${accept_snapshot.PATH_ENV})"
    try:
        kernel = accept_snapshot.load(path)[0]
    except Exception as exc:  # noqa: BLE001 - the rows are left out, the reason printed
        return None, f"{path} does not load: {type(exc).__name__}: {exc}"
    module = own_copy(fence_boundary)
    module.use_native(kernel)
    return module, path


def captured(epilogue) -> None:
    """static_io as graph capture leaves it (per batch size, views of the runner's persistent
    inputs), and the commit context the worker gives the epilogue (its draft model: here four
    linear layers)."""
    from sglang.srt.speculative.dspark_components.dspark_verify import CommitInjectCtx, StaticVerifyIO

    rows, device = epilogue.max_bs * STRIDE, epilogue.bonus_buf.device
    ids, seq_lens = torch.zeros(rows, dtype=torch.int64, device=device), torch.zeros(epilogue.max_bs, dtype=torch.int64, device=device)
    logits, hidden = torch.zeros(rows, 32, device=device), torch.zeros(rows, 16, device=device)
    for bs in [b for b in CAPTURED if b <= epilogue.max_bs]:
        n = bs * STRIDE
        epilogue.static_io[bs] = StaticVerifyIO(candidates=ids[:n].view(bs, STRIDE), logits=logits[:n], hidden=hidden[:n],
                                                seq_lens=seq_lens[:bs], req_pool_indices=seq_lens[:bs], out_cache_loc=ids[:n],
                                                positions=ids[:n])
    draft = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]).to(device)
    epilogue.commit_ctx = CommitInjectCtx(draft_model=draft, block_pos_offsets=torch.arange(STRIDE, device=device),
                                          resolve_pool=lambda: None, resolve_req_to_token=lambda: None)


def boundary_variants(boundaries: dict, bs: int, max_bs: int) -> dict:
    table = {}
    for label, module in boundaries.items():
        epilogue, full = dspark(max_bs)[1], dspark(max_bs)[1]
        captured(full)
        plain, with_logprobs = decode_result(bs), decode_result(bs, logprobs=True)

        def rebound(m=module, e=epilogue, r=plain):
            e._static_step_state = (bs, object())  # a new value, as when the batch changes
            m.detach_escapes(r, e)

        table[f"boundary_{label}"] = lambda m=module, e=epilogue, r=plain: m.detach_escapes(r, e)
        table[f"boundary_{label}_state"] = rebound
        table[f"boundary_{label}_logprobs"] = lambda m=module, e=epilogue, r=with_logprobs: m.detach_escapes(r, e)
        table[f"boundary_{label}_captured"] = lambda m=module, e=full, r=plain: m.detach_escapes(r, e)
    return table


def exists_at(rev: str, path: str) -> bool:
    if pathlib.Path(rev).is_dir():
        return (pathlib.Path(rev) / path).is_file()
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True).returncode == 0


def cheap_before_module(rev: str):
    """REV's module holding its cheap form (fence_forms.py, or the flat folded_fence.py up to
    b108675, where it was a function), or (None, why not)."""
    path = next((p for p in ("adapter/folded_fence/fence_forms.py", "adapter/folded_fence.py") if exists_at(rev, p)), None)
    try:
        return module_at(rev, path), None
    except Exception as exc:  # noqa: BLE001 - the row is left out, the reason printed
        return None, f"{rev}:{path} does not load beside this tree ({type(exc).__name__}: {exc})"


def cheap_variants(before, kernel, bs: int, max_bs: int) -> dict:
    """The cheap form before (REV's) and after (the CheapForm the runtime applies, its views
    tested in Python, and with `kernel`'s C form), each trusted after its proofs, around the
    engine's bound method."""
    verify, epilogue, executor = dspark(max_bs)
    wrapped, kwargs = verify.TargetVerifyExecutor.accept_and_finalize.__get__(executor), folded_kwargs(bs)
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    form = next(p.wrapper for p in decision.plans[folded_fence.NAME].patches if p.name == "accept_and_finalize")
    buffers = tuple(f"{name}_buf" for name in folded_fence.FIELDS)
    if before is None:
        old = None
    elif hasattr(before, "CheapForm"):
        old = before.CheapForm(form.fields, buffers, form.notes, form.accept_outs, form.folded, form.read)
    else:
        old = before._folded_snapshot_for(True, buffers, verify.AcceptOuts)
    for _ in range(3):  # the proofs
        form(wrapped, executor, (), kwargs)
        if old is not None:
            old(wrapped, executor, (), kwargs)
    assert bs in form.trusted and (not hasattr(old, "trusted") or bs in old.trusted), "not trusted after the proofs"

    def native():
        return form(wrapped, executor, (), kwargs)

    native.checks = kernel  # host_us tests the views with the kernel file's C form around its calls
    return {"unfenced": lambda: wrapped(**kwargs),
            **({"cheap_before": lambda: old(wrapped, executor, (), kwargs)} if old is not None else {}),
            "cheap_after": lambda: form(wrapped, executor, (), kwargs), **({"cheap_native": native} if kernel else {})}


def host_us(call, calls: int) -> float:
    accept_snapshot.use_checks(getattr(call, "checks", None))
    try:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls * 1e6
    finally:
        accept_snapshot.use_checks(None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="ecc20f7",
                        help="the revision (or a folder holding that tree) whose adapter/ modules are 'before'")
    parser.add_argument("--kernel", default=os.environ.get(accept_snapshot.PATH_ENV),
                        help=f"the fence's kernel file, for the native scan's rows (default ${accept_snapshot.PATH_ENV})")
    parser.add_argument("--bs", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    # REV's layout: adapter/folded_fence/ (from 599e189), or the flat adapter/ before it (up to b108675)
    boundary_path = next(p for p in ("adapter/folded_fence/fence_boundary.py", "adapter/fence_boundary.py") if exists_at(args.before, p))
    boundaries = {"before": module_at(args.before, boundary_path), "after": fence_boundary}
    fence_boundary.use_native(None)  # `after`: the working tree's Python walk
    native, source = native_boundary(args.kernel)
    kernel = None
    if native is not None:
        boundaries["native"], kernel = native, native._native
    before_fence, why = cheap_before_module(args.before)
    copy = accept_snapshot.snapshot
    accept_snapshot.snapshot = lambda views: views  # the cheap form's copy stubbed: its Python path alone
    print(f"fence host cost: us per call, median of {args.reps} x {args.calls} calls (CPU, torch {torch.__version__}); "
          f"before = {args.before}, after = the working tree's Python walk, native = its native scan "
          + (f"({source})" if native is not None else f"LEFT OUT: {source}"), flush=True)
    if why:
        print(f"cheap_before LEFT OUT: {why}", flush=True)
    rows = {}
    try:
        for bs in args.bs:
            table = {**cheap_variants(before_fence, kernel, bs, max(args.bs)), **boundary_variants(boundaries, bs, max(args.bs))}
            for call in table.values():  # warm-up
                host_us(call, 200)
            samples = {name: [] for name in table}
            for _ in range(args.reps):
                for name, call in table.items():
                    samples[name].append(host_us(call, args.calls))
            rows[bs] = {name: statistics.median(values) for name, values in samples.items()}
    finally:
        accept_snapshot.snapshot = copy
    print(f"{'variant':<26}" + "".join(f"{'bs=' + str(bs):>10}" for bs in args.bs))
    for name in rows[args.bs[0]]:
        print(f"{name:<26}" + "".join(f"{rows[bs][name]:>10.2f}" for bs in args.bs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
