"""Cost of the divergence report (DSV41_TP_DIVERGENCE), with the report on and off in one run.

    python bench/divergence_cost.py [--json OUT] [--reps 7] [--steps 200] [--cpu]

CPU (no CUDA, or --cpu): two processes joined by a real gloo group (tests/ranks.py), each
with the real sglang 0.5.23 GroupCoordinator and SpecTpSync. Host time per decode step
(microseconds, median of --reps repetitions of --steps steps, the variants interleaved in
each repetition), for gamma 3 and 7 and bs 1 and 64:
  engine   one 0.5.23 decode step: gamma draft syncs (site 17), the plan (7) and the accept
           triple through the real dspark_verify.build_accept_outs (8): gamma + 4 broadcasts
  pack     one step through the pack's broadcast (0.5.16 - 0.5.18): gamma draft broadcasts
           and the accept triple packed into one
each with the report off, on (DSV41_TP_DIVERGENCE_EVERY at its default), on with a
read every call (EVERY=1: what one read of the counters costs) and abort
(DSV41_TP_DIVERGENCE=abort: the first diverging call recorded with torch ops, a read started
and the landed one looked at every call); and, in the same ranks,
per_call_no_collective: host time per SpecTpSync.sync call over a stand-in group whose
broadcast is one in-place add (what the comparison itself adds, without gloo's latency).

GPU (CUDA present): one process, the 0.5.23 SpecTpSync over a stand-in group whose
broadcast is one in-place add on the device (standing in for the collective's launch; the
real NCCL figures are bench/tp_nccl_cost.py's). Per site call, bs 1 / 64 / 256: eager host
time, and the GPU time per call of a captured graph of 32 site calls, report off, on (the
kernel library's fused comparison and one-launch copy of mine; the line printed first says
whether it serves), on_torch (torch ops, the library switched off) and abort (on, plus the
first diverging call recorded with torch ops; eagerly also a read every call).
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sglang_dsv41_adapters.tp_divergence import divergence
from sglang_dsv41_adapters.folded_fence import accept_snapshot  # also offers the kernel library, as a rank's registry does
from sglang_dsv41_adapters.framework import runtime  # noqa: E402
from sglang_dsv41_adapters import tp_divergence as t  # noqa: E402

VARIANTS = ("off", "on", "on_read_every_call", "abort")


def report_env(variant: str) -> dict:
    if variant == "off":
        return {}
    return {t.FLAG: "abort" if variant == "abort" else "1",
            t.EVERY_FLAG: "1" if variant == "on_read_every_call" else str(t.DEFAULT_EVERY)}


def switch(variant: str) -> None:
    """Bring this process to `variant` through the runtime, as a rank does (the installed engine
    judged without the plugin-delivery check: the pack may sit on PYTHONPATH, not installed)."""
    from harness.doctored import DoctoredEngine

    runtime.apply(runtime.decide(report_env(variant), DoctoredEngine({}), names=(t.NAME,)))


def pack_broadcast(variant: str):
    """The pack's broadcast as tp_divergence's plan wraps it on 0.5.16 - 0.5.18."""
    import wrapt

    from sglang_dsv41_adapters.spectpsync import broadcast as b

    if variant == "off":
        return b.broadcast
    every = int(report_env(variant)[t.EVERY_FLAG])
    return wrapt.FunctionWrapper(b.broadcast, t.before_0_5_19.compare_broadcast(every, variant == "abort"))


def timed(run, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        run(i)
    return (time.perf_counter() - start) / steps * 1e6


# ---------------------------------------------------------------- CPU, 2 gloo ranks


def cpu_rank(rank, world_size, reps, steps, gammas, sizes):
    import contextlib
    import io

    from sglang.srt.speculative.dspark_components.dspark_verify import build_accept_outs
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    from sglang_dsv41_adapters.spectpsync import broadcast as b
    from sglang_dsv41_adapters.spectpsync.sites import Site
    from harness.nccl import make_group

    os.environ.pop("SGLANG_SPEC_TP_SYNC", None)
    group, _ = make_group(rank, world_size, nccl=False)
    tp_sync = SpecTpSync(group)
    b.bind_group(b.DSPARK, group)

    def engine_step(gamma, bs):
        tokens, plan = torch.arange(bs), torch.ones(bs, dtype=torch.int32)
        draft_tokens = torch.arange(bs * gamma).view(bs, gamma)

        def step(i):
            for _ in range(gamma):
                tp_sync.sync(S.DSPARK_DRAFT, tokens)
            tp_sync.sync(S.DSPARK_PLAN, plan)
            build_accept_outs(correct_len=torch.full((bs,), 2), bonus=tokens + 1, cap_trim_lens=torch.zeros(bs, dtype=torch.int32),
                              prefix_lens=tokens + 10, draft_tokens=draft_tokens, gamma=gamma,
                              verify_num_draft_tokens=gamma + 1, tp_sync=tp_sync, sync_site=S.DSPARK_ACCEPT_GREEDY)
        return step

    def pack_step(gamma, bs, broadcast):
        tokens = torch.arange(bs)
        triple = [torch.full((bs,), 2), tokens + 1, torch.zeros(bs, dtype=torch.int32)]

        def step(i):
            for _ in range(gamma):
                broadcast(b.DSPARK, Site.DSPARK_DRAFT, tokens)
            broadcast(b.DSPARK, Site.DSPARK_ACCEPT_GREEDY, *triple)
        return step

    results = {}
    stand_in = StandInGroup()
    local = SpecTpSync(stand_in)  # no collective: what the comparison itself adds per call
    with contextlib.redirect_stderr(io.StringIO()):  # no divergence here: nothing is printed anyway
        for bs in sizes:
            values, times = torch.arange(bs), {v: [] for v in VARIANTS}
            stand_in.rank0 = values.clone()
            for _ in range(reps):
                for variant in VARIANTS:
                    switch(variant)
                    times[variant].append(timed(lambda i: local.sync(S.DSPARK_ACCEPT_GRAPH, values), 20 * steps))
            results[f"per_call_no_collective/bs{bs}"] = {f"engine/{k}": statistics.median(v) for k, v in times.items()}
        for gamma in gammas:
            for bs in sizes:
                times = {f"{path}/{v}": [] for path in ("engine", "pack") for v in VARIANTS}
                for _ in range(reps):
                    for variant in VARIANTS:  # interleaved, same order on every rank
                        switch(variant)
                        times[f"engine/{variant}"].append(timed(engine_step(gamma, bs), steps))
                        times[f"pack/{variant}"].append(timed(pack_step(gamma, bs, pack_broadcast(variant)), steps))
                results[f"gamma{gamma}/bs{bs}"] = {k: statistics.median(v) for k, v in times.items()}
        switch("off")
    results["diverged"] = {k: v for k, v in divergence.totals().items() if v[1]}  # no skew: must stay empty
    return results


def run_cpu(opts) -> dict:
    from harness.ranks import run_ranks

    ranks = run_ranks(2, "bench.divergence_cost:cpu_rank", release="0.5.23", timeout=1800,
                      kwargs={"reps": opts.reps, "steps": opts.steps, "gammas": [3, 7], "sizes": [1, 64]})
    lines = ["host time per decode step (per_call_no_collective: per site call, a stand-in group), us (median), "
             "2 gloo ranks on this CPU; + over off",
             f"{'case':<28}{'rank':>5}" + "".join(f"{v:>26}" for v in ("engine " + x for x in VARIANTS))
             + "".join(f"{v:>24}" for v in ("pack " + x for x in VARIANTS))]
    per_path = len(VARIANTS)
    for case in ranks[0]:
        if case == "diverged":
            continue
        for rank, result in enumerate(ranks):
            row = result[case]
            cells = []
            for path in ("engine", "pack"):
                if f"{path}/off" not in row:
                    continue
                off = row[f"{path}/off"]
                cells += [f"{off:.1f}"] + [f"{row[f'{path}/{v}']:.1f} (+{row[f'{path}/{v}'] - off:.1f})" for v in VARIANTS[1:]]
            lines.append(f"{case:<28}{rank:>5}" + "".join(f"{c:>26}" for c in cells[:per_path])
                         + "".join(f"{c:>24}" for c in cells[per_path:]))
    print("\n".join(lines))
    assert all(not r["diverged"] for r in ranks), [r["diverged"] for r in ranks]
    return {"mode": "cpu-gloo-2", "ranks": ranks}


# ---------------------------------------------------------------- GPU, one process


class StandInGroup:
    """A world of one standing in for rank 1 of a TP group: the broadcast is one device op
    that writes rank 0's value (`rank0`, set per case: equal to the caller's) over the
    tensor it is given, as a collective does. The report on, sync hands it a tensor of its
    own to receive into (tp_divergence.compare_sync); off, the caller's."""

    world_size, rank_in_group = 2, 1
    rank0 = None

    def broadcast(self, tensor, src=0):
        tensor.copy_(self.rank0)
        return tensor


def run_gpu(opts) -> dict:
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite as S

    os.environ.pop("SGLANG_SPEC_TP_SYNC", None)
    device = torch.device("cuda")
    stand_in = StandInGroup()
    tp_sync = SpecTpSync(stand_in)
    per_graph = 32
    out = {}
    gpu_variants = ("off", "on", "on_torch", "abort")

    def switch_gpu(variant):
        switch(variant.replace("_torch", ""))
        divergence.use_kernel(not variant.endswith("_torch"))

    kernel = accept_snapshot.probed_extension()
    for bs in (1, 64, 256):
        values = torch.arange(bs, device=device)
        stand_in.rank0 = values.clone()
        times = {f"{kind}/{v}": [] for kind in ("eager", "captured") for v in gpu_variants}
        graphs = {}
        for variant in gpu_variants:
            switch_gpu(variant)
            tp_sync.sync(S.DSPARK_ACCEPT_GRAPH, values)  # warm-up outside capture (makes the counters)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(per_graph):
                    tp_sync.sync(S.DSPARK_ACCEPT_GRAPH, values)
            graphs[variant] = graph
        torch.cuda.synchronize()
        times["eager/empty_launch"] = []
        for _ in range(opts.reps):
            if kernel is not None:  # the yardstick, timed the same way in the same repetition
                times["eager/empty_launch"].append(timed(lambda i: kernel.empty_launch(), opts.calls))
            for variant in gpu_variants:
                switch_gpu(variant)
                torch.cuda.synchronize()
                times[f"eager/{variant}"].append(timed(lambda i: tp_sync.sync(S.DSPARK_ACCEPT_GRAPH, values), opts.calls))
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(opts.replays):
                    graphs[variant].replay()
                end.record()
                end.synchronize()
                times[f"captured/{variant}"].append(start.elapsed_time(end) * 1e3 / (opts.replays * per_graph))
        out[f"bs{bs}"] = {k: statistics.median(v) for k, v in times.items() if v}
    switch_gpu("off")
    print(f"per site call, us (median): eager = host time, captured = GPU time per call in a graph of 32; "
          f"on = {' - '.join(divergence.compare_mode())}, on_torch = torch ops, abort = on + the first diverging "
          "call recorded with torch ops (+ a read every eager call)")
    print(f"{'bs':<8}{'eager off':>12}{'eager on':>18}{'eager on_torch':>20}{'eager abort':>20}{'captured off':>15}"
          f"{'captured on':>18}{'captured on_torch':>20}{'captured abort':>20}")
    for case, row in out.items():
        cells = []
        for kind, width in (("eager", 12), ("captured", 15)):
            off = row[f"{kind}/off"]
            cells.append(f"{off:>{width}.2f}" + "".join(
                f"{row[f'{kind}/{v}']:>{w}.2f} ({row[f'{kind}/{v}'] - off:+.2f})"
                for v, w in (("on", 9), ("on_torch", 11), ("abort", 11))))
        print(f"{case:<8}" + "".join(cells))
    for case, row in out.items():
        if "eager/empty_launch" in row:
            launch, added = row["eager/empty_launch"], row["eager/on"] - row["eager/off"]
            print(f"{case}: the report adds {added:.2f} us per eager call = {added / launch:.2f} empty kernel launches "
                  f"({launch:.2f} us each, timed alike in the same repetitions)")
    return {"mode": "cuda-one-process", "device": torch.cuda.get_device_name(), "compare": divergence.compare_mode(),
            "results": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200, help="CPU: decode steps per repetition")
    parser.add_argument("--calls", type=int, default=3000, help="GPU: eager calls per repetition")
    parser.add_argument("--replays", type=int, default=300, help="GPU: graph replays per repetition")
    parser.add_argument("--cpu", action="store_true", help="the gloo benchmark even when CUDA is present")
    opts = parser.parse_args(argv)
    found = run_cpu(opts) if opts.cpu or not torch.cuda.is_available() else run_gpu(opts)
    found |= {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:]}
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
